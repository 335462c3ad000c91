"""Shared pytest configuration.

- float32 matmuls at full precision on every backend, so tolerances mean the same everywhere;
- a persistent compilation cache, fresh per session (repeated tiny trainer runs compile once);
- hypothesis: no deadline (jit compiles make the first example slow) and a bounded example count;
- in CI (`CI=true`) a skipped test is a failure: a missing install or a wrongly guarded test
  shows up red instead of hiding as a skip. Locally skips stay skips.
"""

import atexit
import os
import shutil
import tempfile

import hypothesis
import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# A persistent compilation cache for this session: the many trainer runs of the tiny configs
# (and other tests that build the same programs with new jit objects) compile once. Fresh per
# session, so a run's timings never depend on an earlier one.
_CACHE_DIR = tempfile.mkdtemp(prefix="espo_jax_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

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


@pytest.fixture
def in_memory_compiles():
    """For tests that count compilations by a jit's cache size: with the persistent cache on,
    an executable found there may not be entered in the jit's in-memory cache (seen in the full
    suite only), so such a test compiles without it."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax.clear_caches()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
