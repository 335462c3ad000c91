"""The documentation stands alone and stays true: README.md and every docs/**/*.md (the pages
written by hand and the results.md files the reproductions write) link only to files in the
repository, name espo objects that exist, every espo module has a docstring, and every name
in a package's `__all__` imports. Fast: imports only, no JAX compilation."""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODULES = sorted((ROOT / "espo").rglob("*.py"))
PACKAGES = ("espo", "espo.model", "espo.data", "espo.rewards")
PATH_ROOTS = ("docs", "espo", "experiments", "configs", "notebooks", "tests")

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")  # markdown link targets: [text](target)
_CODE = re.compile(r"`([^`\n]+)`")  # inline code spans
_PATH = re.compile(rf"^(?:{'|'.join(PATH_ROOTS)})/[\w./*<>-]*")
_DOTTED = re.compile(r"^espo(?:\.\w+)+")  # espo.module.name, possibly followed by a call
_UP = re.compile(r"(?<![\w.])(?:\.\./)+[^\s)`'\"]*")  # a relative path that climbs: ../x, ../../y


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(doc: pathlib.Path) -> str:
    """The text of `doc` without its fenced code blocks (commands and layout trees)."""
    return _FENCE.sub("", doc.read_text())


def _inside_repo(path: pathlib.Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def _links(doc: pathlib.Path) -> list[str]:
    targets = _LINK.findall(doc.read_text())
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:


def _code_paths(doc: pathlib.Path) -> list[str]:
    """Repository paths written in inline code: `espo/losses.py`, `configs/default.py:tiny`..."""
    out = []
    for span in _CODE.findall(_prose(doc)):
        for token in span.split():
            m = _PATH.match(token)
            if m:
                out.append(m.group(0).rstrip(".,;:"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_resolve_inside_the_repository(doc):
    bad = []
    for target in _links(doc):
        path = target.split("#", 1)[0]
        if not path:  # an anchor in the same file
            continue
        resolved = (doc.parent / path).resolve()
        if not _inside_repo(resolved):
            bad.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{_rel(doc)}: broken links: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_code_paths_resolve_inside_the_repository(doc):
    bad = []
    for path in _code_paths(doc):
        if "<" in path:  # a placeholder: configs/<name>.py
            continue
        if ".." in pathlib.PurePosixPath(path).parts:
            bad.append(f"{path} (leaves its directory)")
        elif "*" in path:
            if not list(ROOT.glob(path)):
                bad.append(f"{path} (matches nothing)")
        elif not (ROOT / path).exists():
            bad.append(f"{path} (no such file)")
    assert not bad, f"{_rel(doc)}: paths that do not resolve: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_reference_outside_the_repository(doc):
    text = doc.read_text()
    # A page in a docs/ subfolder may climb to its neighbours (../make_run/results.md), never
    # above the repository's root.
    outside = [p for p in _UP.findall(text) if not _inside_repo(doc.parent / p.split("#", 1)[0])]
    assert not outside, f"{_rel(doc)} refers to something outside the repository: {outside}"
    for name in ("papers.md", "DESIGN.md"):
        assert name not in text, f"{_rel(doc)} refers to {name}, which is not in the repository"


def _resolve(dotted: str):
    """The object `dotted` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_espo_objects_exist(doc):
    names = {m.group(0) for span in _CODE.findall(_prose(doc)) if (m := _DOTTED.match(span))}
    bad = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            bad.append(f"{name} ({type(e).__name__}: {e})")
    assert not bad, f"{_rel(doc)} names espo objects that do not exist: {bad}"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_every_module_has_a_docstring(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{_rel(path)} has no module docstring saying what it owns"


@pytest.mark.parametrize("package", PACKAGES)
def test_package_all_is_importable_and_complete(package):
    pkg = importlib.import_module(package)
    names = list(pkg.__all__)
    assert len(names) == len(set(names)), f"{package}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(pkg, n)]  # hasattr runs the lazy imports
    assert not missing, f"{package}.__all__ names what it cannot import: {missing}"
    directory = pathlib.Path(pkg.__file__).parent
    modules = {p.stem for p in directory.glob("*.py") if not p.stem.startswith("_")}
    modules |= {p.parent.name for p in directory.glob("*/__init__.py")}
    unlisted = sorted(modules - set(names))
    assert not unlisted, f"{package}.__all__ does not list its public modules {unlisted}"


def _espo_imports(path: pathlib.Path) -> set[str]:
    """The espo modules a file imports ("espo.config", "espo.rewards.pool", ...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n == "espo" or n.startswith("espo.")}


def test_only_the_entry_points_import_the_config():
    """docs/architecture.md "Import direction": in the library only the entry points that take
    a run's ConfigDict (espo.trainer, espo.pass_rates) import espo.config, so no module runs
    back up to it; only espo.pass_rates imports espo.trainer."""
    importers = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "espo").rglob("*.py")
        if "espo.config" in _espo_imports(p)
    )
    assert importers == ["espo/pass_rates.py", "espo/trainer.py"]
    on_trainer = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "espo").rglob("*.py")
        if "espo.trainer" in _espo_imports(p)
    ]
    assert on_trainer == ["espo/pass_rates.py"]
