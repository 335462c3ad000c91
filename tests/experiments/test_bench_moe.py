"""bench_moe.py's HLO readings (numbers are reported by the script, not asserted here)."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from espo import testing

PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench_moe.py"


@pytest.fixture(scope="module")
def bench():
    return testing.load_script(PATH)


def _loop(trips: int):
    def body(i, x):
        return jnp.sin(x @ x) + jnp.cos(x).sum()

    return jax.jit(lambda x: jax.lax.fori_loop(0, trips, lambda i, x: body(i, x), x))


def test_kernels_per_iteration_count_inner_loops_by_their_trip_counts(bench):
    x = jnp.ones((8, 8))

    def outer(inner_trips):
        # A decode-like loop whose body runs an inner loop (the layers) `inner_trips` times.
        def step(i, x):
            return _loop(inner_trips)(x) * 2.0

        f = jax.jit(lambda x: jax.lax.fori_loop(0, 5, step, x))
        return bench.loop_kernels(f.lower(x).compile().as_text())["per_iteration"]

    # Trip counts above what XLA unrolls: the inner loop stays a while loop with a known count.
    a, b, c = outer(40), outer(80), outer(120)
    assert c - b == b - a  # linear in the inner loop's trip count,
    # with per inner iteration its body's kernels (the dot, the fused sin / cos / add) and the
    # condition's compare.
    assert (c - b) // 40 >= 3


@pytest.mark.slow
def test_hlo_summary_sees_xla_cpu_run_ragged_dot_dense_over_the_experts(bench):
    d = f = 64
    experts, top_k = 8, 2
    xs, gs, _ = bench.routed_rows(
        jax.random.key(0), tokens=32, d=d, experts=experts, top_k=top_k, dtype=jnp.float32
    )
    w = bench.expert_weights(jax.random.key(1), d=d, f=f, experts=experts, dtype=jnp.float32)
    useful = 2.0 * xs.shape[0] * d * f * 3
    ratio = {}
    for impl in ("ragged", "capacity"):
        compiled = jax.jit(bench.ffn_of(impl)).lower(xs, gs, *w).compile()
        ratio[impl] = bench.hlo_summary(compiled, useful)["flops_over_useful"]
    assert experts * 0.9 < ratio["ragged"] < experts * 1.2  # every row times every expert
    assert ratio["capacity"] < 3


@pytest.mark.slow
def test_fp8_forms_compute_the_dequantized_product(bench):
    """Every FP8 matmul form the benchmark times is the product with the dequantized weights
    (FP8 x FP8 up to its activation rounding), so a timing compares like with like."""
    rows = bench.fp8_rows(d=32, n=64, sets=2, rows_list=(4,), peak_gbs=1.0, timed=False)
    err = {r["form"]: r["max_rel_err"] for r in rows}
    assert set(err) == {"bf16", "fp8_dequant", "fp8_scale_after", "fp8_x_fp8"}
    assert err["fp8_dequant"] < 1e-2 and err["fp8_scale_after"] < 1e-2
    assert err["fp8_x_fp8"] < 0.1 and err["bf16"] < 0.1  # activation / weight rounding


def test_decode_runs_parse_and_a_bad_entry_names_the_format(bench):
    assert bench.parse_runs("fp8:per-layer:64:ragged:8,base:scan:8:auto:1") == (
        ("fp8", "per-layer", 64, "ragged", 8),
        ("base", "scan", 8, "auto", 1),
    )
    with pytest.raises(SystemExit, match="weights:layers:batch:impl:steps"):
        bench.parse_runs("bf16:per-layer:8:ragged")
