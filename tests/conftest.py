"""Shared pytest configuration.

- float32 matmuls at full precision on every backend, so tolerances mean the same everywhere;
- no persistent compilation cache, also where the environment names one (why: at
  `jax_enable_compilation_cache` below);
- XLA's CPU backend at optimisation level 0 and with its older elemental emitters for fusions
  (`--xla_cpu_use_fusion_emitters=false`): the tiny test programs spend most of their time
  compiling; LLVM's optimisation passes are a third of that (the 8-device sharded steps:
  44 s -> 29 s for the single-device reference), and the MLIR fusion emitters most of what is
  left (a train step of test_update's MoE: XLA compile 7.4 s -> 2.3 s on a loaded 2-core box);
  subprocesses inherit both through XLA_FLAGS;
- no Python traceback in the lowered ops' locations (lowering ~4% faster);
- the trainer's end-of-run plots (`espo.plots.plot_run`) lay out every run's metrics for real
  but draw no pixels, except in tests/test_plots.py, tests marked `draws_plots` and the
  module-scoped runs set up before any test's patch (see `_plots_without_pixels`);
- hypothesis: no deadline (jit compiles make the first example slow) and a bounded example count;
- in CI (`CI=true`) a skipped test is a failure: a missing install or a wrongly guarded test
  shows up red instead of hiding as a skip. Locally skips stay skips.
"""

import gc
import importlib.metadata
import os

import hypothesis
import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# Read when the CPU backend starts (the first computation), so setting it here is in time; tests
# that start a subprocess with more flags append theirs (`testing.emulated_devices_env`).
# Not with an accelerator plugin installed: its jaxlib may not know a CPU flag, and XLA exits
# on an unknown flag at the first computation, inside pytest's output capture (no message).
_ACCELERATOR = any(
    (d.metadata["Name"] or "")
    .lower()
    .replace("_", "-")
    .startswith(("jax-cuda", "jax-rocm", "libtpu"))
    for d in importlib.metadata.distributions()
)
for _FAST_COMPILE in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if not _ACCELERATOR and _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
# No persistent compilation cache: one shared by the workers and subprocesses saved 46 s of
# compiling over the whole suite (86 hits) and spent 64 s serialising and writing its 462
# entries (counted with jax.monitoring's cache events, 2026-11-30); and stop 68's CI lost a worker
# to an abort inside `executable.serialize()` while writing one. Off in subprocesses too.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
jax.config.update("jax_enable_compilation_cache", False)
# No Python traceback in each lowered op's location (JAX keeps 10 frames by default): lowering
# the tests' many small programs is ~4% faster, and no test reads an op's source line.
os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"
jax.config.update("jax_traceback_in_locations_limit", 0)

# Python's collector less often: a test process holds millions of objects (traced programs,
# jaxprs) that every full collection walks; the default thresholds spent ~5% of a test file's
# time there (measured with gc.callbacks on tests/test_update.py).
gc.set_threshold(100_000, 50, 100)

hypothesis.settings.register_profile(
    "espo", deadline=None, max_examples=40, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile("espo")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_skip(report) -> None:
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true turns skips into failures): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.fixture(autouse=True)
def _plots_without_pixels(request, monkeypatch):
    """The trainer ends every run with `plots.plot_run`: ~100 matplotlib panels, a quarter
    of a tiny run, in the ~50 runs of the suite, of which only tests/test_trainer.py's `straight`
    run (module-scoped, so set up before this patch) looks at the pictures. Here `_draw` reads
    each panel's series and writes an empty file: which panels and files a run's metrics make
    (`layout`, `collect_series`) is still computed for every run; the pixels are tested in
    tests/test_plots.py (unpatched) and on the `straight` run. Subprocesses are not patched
    (those that read no picture run `tests/run_without_pixels.py`, which patches the same)."""
    if request.node.get_closest_marker("draws_plots") or request.path.name == "test_plots.py":
        return
    from espo import plots, testing

    monkeypatch.setattr(plots, "_draw", testing.draw_without_pixels)


@pytest.fixture
def in_memory_compiles():
    """For tests that count compilations by a jit's `_cache_size()`: that is the jit's share of
    jax.jit's global C++ dispatch cache (8192 entries, LRU), which a long test process fills
    (the full suite only), after which it reads 0; `jax.clear_caches()` empties it."""
    jax.clear_caches()
