"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and is stored clean.

The kernel is this interpreter (the venv with espo installed), not whatever a machine happens to
register as "python3": the kernelspec is installed into a temporary prefix and JUPYTER_PATH puts
it first. Notebooks need espo alone: in the kernel torch and transformers (the test extras) fail
to import, as on a machine without them.
"""

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")
jupyter_kernelspec = pytest.importorskip("jupyter_client.kernelspec")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "python3"
# quickstart and router_replay take ~30 s on 2 CPU cores, zero_variance a few seconds, one cell a
# few seconds. The trainer cell of training compiles the whole pipeline: ~100-140 s on 2 loaded
# cores.
CELL_TIMEOUT_S = 300
BLOCKED_MODULES = ("torch", "transformers")  # notebooks run without the test extras


def test_notebooks_exist():
    assert NOTEBOOKS, f"no *.ipynb in {NOTEBOOK_DIR}"


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch):
    """The "python3" kernel, bound to sys.executable whatever else is installed, without torch
    and transformers."""
    kernelspec.install(kernel_name=KERNEL_NAME, prefix=str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    blocked = tmp_path / "blocked"  # first on the kernel's path: `import torch` raises
    for name in BLOCKED_MODULES:
        (blocked / name).mkdir(parents=True)
        message = f"{name} is blocked: notebooks must run without the test extras"
        (blocked / name / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r})\n")
    path = [str(blocked), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    spec = jupyter_kernelspec.KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    assert spec.argv[0] == sys.executable, (spec.argv, sys.executable)
    return KERNEL_NAME


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, venv_kernel):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=venv_kernel,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError (with the cell's traceback) on any cell error
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    # Outputs make diffs large and stale; clear them before committing.
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts"
