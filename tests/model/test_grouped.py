"""The grouped matmul's custom VJP against XLA's ragged_dot and the per-expert loop; the Triton
kernel in Pallas' interpret mode here and compiled on a GPU; the Mosaic GPU kernels on a Hopper
GPU only: those tests exist only there (experiments/gpu_check.sh runs this file on a lent GPU)."""

import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from espo.model import experts, grouped
from espo.testing import raises_invalid

R, K, N, G = 40, 64, 128, 6
GROUPS = {
    "uneven": [7, 0, 13, 2, 0, 11],  # empty groups, 7 rows past the groups
    "one group": [0, 0, 40, 0, 0, 0],
    "all rows": [5, 5, 10, 10, 5, 5],
}


def _inputs(sizes, dtype=jnp.float32, *, k=K, n=N):
    """Rows x [R, k], weights w [G, k, n] and an output cotangent dy [R, n] (each group's
    matrix at 1/8 scale), the sizes as int32."""
    keys = jax.random.split(jax.random.key(sum(sizes)), 3)
    x = jax.random.normal(keys[0], (R, k), dtype)
    w = (jax.random.normal(keys[1], (G, k, n)) / 8).astype(dtype)
    dy = jax.random.normal(keys[2], (R, n), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _loop(x, w, sizes):
    """Row r of group g times w[g]; rows past the groups 0 (a plain loop over the groups)."""
    out, start = np.zeros((x.shape[0], w.shape[2]), np.float64), 0
    for g, n in enumerate(np.asarray(sizes)):
        out[start : start + n] = np.asarray(x[start : start + n], np.float64) @ np.asarray(
            w[g], np.float64
        )
        start += n
    return out


def _check(kernels, x, w, sizes, dy, tol):
    f = lambda x, w: grouped.gmm(x, w, sizes, kernels)  # noqa: E731
    y, vjp = jax.vjp(jax.jit(f), x, w)
    dx, dw = vjp(dy)
    # The reference gradients: the loop's, written out (dx = dy w[g]^T, dw[g] = x[g]^T dy[g]).
    want_dx = _loop(dy, jnp.swapaxes(w, 1, 2), sizes)
    want_dw = np.zeros(w.shape)
    ends = np.cumsum(np.asarray(sizes))
    for g in range(w.shape[0]):
        rows = slice(ends[g] - sizes[g], ends[g])
        want_dw[g] = np.asarray(x[rows], np.float64).T @ np.asarray(dy[rows], np.float64)
    for got, want in ((y, _loop(x, w, sizes)), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("groups", GROUPS)
def test_reference_kernels_value_and_gradients_equal_the_group_loop(groups):
    _check("reference", *_inputs(GROUPS[groups]), tol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("groups", GROUPS)
def test_triton_kernel_value_and_gradients_equal_the_group_loop(groups):
    # Off a GPU the kernel runs in Pallas' interpret mode: the same program per (group, column
    # block, row block), row blocks that start inside another group, masked stores.
    _check("triton", *_inputs(GROUPS[groups]), tol=1e-4)


@pytest.mark.parametrize("groups", ["uneven", "one group"])
def test_triton_kernel_reads_fp8_values_and_scales_each_group(groups):
    """scaled_gmm(x, values, scale) is the loop over values * scale[g] (FP8 values converted
    in the kernel: the pallas_call's operand is the FP8 array itself), rows past the groups 0."""
    x, w, sizes, _ = _inputs(GROUPS[groups])
    values = (w * 8).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(jax.random.key(7), (G, N), jnp.float32, 0.01, 0.2)
    got = jax.jit(grouped.scaled_gmm)(x, values, scale, sizes)
    want = _loop(x, values.astype(jnp.float32) * scale[:, None, :], sizes)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-4, rtol=1e-4)
    jaxpr = jax.make_jaxpr(grouped.scaled_gmm)(x, values, scale, sizes).jaxpr
    kernel = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [v.aval.dtype for v in kernel[0].invars].count(jnp.float8_e4m3fn) == 1


@pytest.mark.parametrize("groups", ["uneven", "one group"])
def test_triton_kernel_split_contraction_equals_the_group_loop(groups):
    # K=64 in blocks of 16 split 4 ways: each program one block of the contraction, the four
    # parts summed; values and gradients (dx runs the kernel too, on w transposed).
    with mock.patch.dict(grouped.TRITON_TILES, block_k=16, split_k=4):
        _check("triton", *_inputs(GROUPS[groups]), tol=1e-4)


# (contraction K, output width N, block_k, split_k): the forward contracts K, dx contracts N.
SPLITS = {
    # Parts of 2 blocks each (forward) and of 3 (dx: N=96 in 2 parts of 48): a part's blocks
    # are consecutive, each read once.
    "parts of several blocks": (128, 96, 16, 4),
    # 96 = 3 blocks of 32 (the widest power of two dividing 96): no whole number of blocks per
    # part for 2 parts, so the contraction runs unsplit, all 3 blocks (also dx: N=80, 5 of 16).
    "blocks do not divide into parts": (96, 80, 64, 2),
    # 80 = 5 blocks of 16, split 4: no whole part either (dx: N=48, 3 blocks of 16).
    "five blocks, four parts": (80, 48, 16, 4),
    # K=72 is no multiple of 16: padded to 80 (5 blocks of 16, 5 parts of one block).
    "padded contraction": (72, 64, 16, 5),
}


@pytest.mark.parametrize("shape", SPLITS)
def test_triton_kernel_split_contraction_at_uneven_widths_equals_the_group_loop(shape):
    k, n, block_k, split_k = SPLITS[shape]
    with mock.patch.dict(grouped.TRITON_TILES, block_k=block_k, split_k=split_k):
        _check("triton", *_inputs(GROUPS["uneven"], k=k, n=n), tol=1e-4)


@pytest.mark.parametrize("split_k", [1, 4])
def test_triton_kernel_bf16_sums_its_parts_in_float32(split_k):
    """bf16 rows and weights against the float64 product of the same (bf16) values: each
    output within one bf16 rounding of it (2^-8 relative), which holds only if every block's
    product and every part of a split contraction is summed in float32 and rounded once (a
    part stored in bf16 adds a rounding of its own size, and parts of opposite sign cancel)."""
    x, w, sizes, _ = _inputs(GROUPS["uneven"], jnp.bfloat16, k=256)
    with mock.patch.dict(grouped.TRITON_TILES, block_k=32, split_k=split_k):
        got = jax.jit(lambda *a: grouped.gmm(*a, "triton"))(x, w, sizes)
    assert got.dtype == jnp.bfloat16
    want = _loop(x, w, sizes)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= 2**-8 * np.abs(want) + 1e-6).all(), err.max()


def test_triton_kernel_split_parts_that_cancel_sum_exactly():
    """Parts 257 (no bf16 number: 256 once a part is rounded to bf16) and -256, the two halves
    of every column's contraction: exactly 1 in bf16, only if the parts add in float32."""
    ones = jnp.ones((16, 64), jnp.bfloat16)
    w = jnp.zeros((1, 64, 32)).at[0, 0].set(256.0).at[0, 1].set(1.0).at[0, 32].set(-256.0)
    with mock.patch.dict(grouped.TRITON_TILES, block_k=16, split_k=2):
        y = grouped._triton_ragged(ones, w.astype(jnp.bfloat16), jnp.asarray([16], jnp.int32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), 1.0)


def test_triton_kernel_fp8_rows_times_fp8_weights_equal_the_quantized_loop():
    """fp8_operand "float8": each row quantized to e4m3 by its own max |x| (-> 448), FP8 x FP8
    products, the row's and the column's scales on the product: the loop over the dequantized
    rows and weights (the rows quantized here with ml_dtypes, not by the kernel's code)."""
    x, w, sizes, _ = _inputs(GROUPS["uneven"])
    values = (w * 8).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(jax.random.key(7), (G, N), jnp.float32, 0.01, 0.2)
    xn = np.asarray(x, np.float32)
    row_scale = np.abs(xn).max(axis=1) / np.float32(448.0)
    xq = (xn / row_scale[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with mock.patch.dict(grouped.TRITON_TILES, fp8_operand="float8"):  # a fresh trace
        got = jax.jit(lambda *a: grouped.scaled_gmm(*a))(x, values, scale, sizes)
    want = _loop(xq * row_scale[:, None], values.astype(jnp.float32) * scale[:, None, :], sizes)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-4, rtol=1e-4)
    # Against the unquantized rows: e4m3's rounding (3 mantissa bits), no more.
    exact = _loop(x, values.astype(jnp.float32) * scale[:, None, :], sizes)
    assert 0 < np.abs(np.asarray(got) - exact).max() < 0.05 * np.abs(exact).max()


def test_triton_kernel_refuses_an_unknown_fp8_operand():
    x, w, sizes, _ = _inputs(GROUPS["uneven"])
    with mock.patch.dict(grouped.TRITON_TILES, fp8_operand="int8"), raises_invalid("fp8_operand"):
        grouped.scaled_gmm(x, w.astype(jnp.float8_e4m3fn), jnp.ones((G, N)), sizes)


def test_triton_kernel_programs_store_only_their_own_groups_rows():
    """A row block that runs past its group (group 0's second block holds 4 of its rows and 12
    of group 2's; group 2's last block runs past every group) stores only its group's rows: on
    a GPU the blocks run concurrently, so a wider store would race. Interpret mode fills the
    output with NaN first, so rows no program owns stay NaN."""
    x, w = jnp.ones((40, 64)), jnp.ones((3, 64, 32))
    y = grouped._triton_ragged(x, w, jnp.asarray([20, 0, 15], jnp.int32), interpret=True)
    np.testing.assert_array_equal(y[:35], 64.0)
    assert np.isnan(np.asarray(y[35:])).all()


def test_triton_kernel_lowers_for_cuda_without_a_gpu():
    """The kernel goes through Pallas' Triton lowering for the CUDA platform here (what a GPU
    compiles): bf16 rows on bf16 and FP8 weights, plain and transposed, at the bench model's
    widths (F=1408: column and contraction blocks that are not the widest)."""
    x = jnp.zeros((16, 2048), jnp.bfloat16)
    sizes = jnp.zeros((16,), jnp.int32)
    fp8, fp8_scale = jnp.zeros((16, 2048, 1408), jnp.float8_e4m3fn), jnp.ones((16, 1408))
    for w, kw, tiles in (
        (jnp.zeros((16, 2048, 1408), jnp.bfloat16), {}, {}),
        (jnp.zeros((16, 1408, 2048), jnp.bfloat16), {"transpose_rhs": True}, {}),
        (jnp.zeros((16, 2048, 1408), jnp.bfloat16), {}, {"split_k": 4}),
        (fp8, {"scale": fp8_scale}, {}),
        (fp8, {"scale": fp8_scale}, {"fp8_operand": "float16"}),
        (fp8, {"scale": fp8_scale}, {"fp8_operand": "float8", "split_k": 2}),
    ):
        fn = functools.partial(grouped._triton_ragged, interpret=False, **kw)
        with mock.patch.dict(grouped.TRITON_TILES, tiles):
            lowered = jax.jit(fn).trace(x, w, sizes).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("custom_call @__gpu$xla.gpu.triton") == 1, (kw, tiles)


@pytest.mark.slow
@pytest.mark.parametrize("groups", GROUPS)
def test_megablox_kernels_value_and_gradients_equal_the_group_loop(groups):
    # Off a TPU the megablox kernels (gmm forward and dx, tgmm dw) run in Pallas' interpret
    # mode: 48-row tiles here (40 rows padded), empty groups, rows past the groups.
    _check("megablox", *_inputs(GROUPS[groups]), tol=1e-4)


def test_megablox_kernels_lower_for_tpu_without_a_tpu():
    """`experts.expert_ffn(impl="megablox")` and its VJP go through Pallas' Mosaic TPU lowering here
    (what a TPU compiles) at the bench model's widths in bf16: per matmul of the SwiGLU three
    kernels (gmm forward and dx, tgmm dw; the kernel functions, called once each, are shared
    between calls of the same shape), and no dense dot."""
    x, sizes = jnp.zeros((8192, 2048), jnp.bfloat16), jnp.zeros((16,), jnp.int32)
    w_in = jnp.zeros((16, 2048, 1408), jnp.bfloat16)
    w_out = jnp.zeros((16, 1408, 2048), jnp.bfloat16)

    def loss(x, *w):
        y = experts.expert_ffn(x, sizes, *w, impl="megablox")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with mock.patch.object(jax, "default_backend", lambda: "tpu"):  # compiled, not interpreted
        lowered = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(x, w_in, w_in, w_out)
    text = lowered.lower(lowering_platforms=("tpu",)).as_text()
    calls = re.findall(r"call @(t?gmm)(?:_\d+)?\(", text)
    assert (calls.count("gmm"), calls.count("tgmm")) == (6, 3)
    assert "custom_call @tpu_custom_call" in text
    assert "dot_general" not in text


@pytest.mark.slow
def test_swiglu_experts_equal_xla_ragged_dispatch_and_refuse_unknown_kernels():
    sizes = jnp.asarray([9, 0, 14, 3], jnp.int32)
    k = jax.random.split(jax.random.key(3), 4)
    xs = jax.random.normal(k[0], (30, K))
    w_gate, w_up = (jax.random.normal(k[i], (4, K, N)) / 8 for i in (1, 2))
    w_down = jax.random.normal(k[3], (4, N, K)) / 8

    def loss(ffn, *a):
        return jnp.sum(jnp.sin(ffn(*a)))

    ours = lambda *a: grouped.swiglu_experts(*a, kernels="reference")  # noqa: E731
    ragged = lambda *a: experts.expert_ffn(*a, impl="ragged")  # noqa: E731
    args = (xs, sizes, w_gate, w_up, w_down)
    np.testing.assert_allclose(ours(*args), ragged(*args), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(ours(*args)[26:], 0)  # rows past the groups
    got = jax.grad(lambda *a: loss(ours, *a), (0, 2, 3, 4))(*args)
    want = jax.grad(lambda *a: loss(ragged, *a), (0, 2, 3, 4))(*args)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
    with raises_invalid("kernels"):
        grouped.swiglu_experts(*args, kernels="cutlass")


# Defined on a Hopper GPU only (not skipped elsewhere: CI counts a skip as a failure).
if grouped.hopper():

    @pytest.mark.gpu
    @pytest.mark.parametrize("groups", GROUPS)
    def test_mosaic_gpu_kernels_value_and_gradients_equal_the_group_loop(groups):
        _check("mosaic_gpu", *_inputs(GROUPS[groups], jnp.bfloat16), tol=5e-2)


# Defined on a GPU only, likewise.
if jax.default_backend() == "gpu":

    @pytest.mark.gpu
    @pytest.mark.parametrize("groups", GROUPS)
    def test_compiled_triton_kernel_equals_the_group_loop(groups):
        x, w, sizes, _ = _inputs(GROUPS[groups], jnp.bfloat16)
        values, scale = (w * 8).astype(jnp.float8_e4m3fn), jnp.full((G, N), 0.125, jnp.float32)
        want = _loop(x, values.astype(jnp.float32) * 0.125, sizes)
        # The tiles tried by bench_moe.py --only tiles: a split contraction, FP8 x FP8 rows
        # (whose rounding of the rows the looser tolerance takes).
        for tiles, tol in (({}, 5e-2), ({"split_k": 2}, 5e-2), ({"fp8_operand": "float8"}, 0.3)):
            with mock.patch.dict(grouped.TRITON_TILES, block_k=16, **tiles):
                _check("triton", *_inputs(GROUPS[groups], jnp.bfloat16), tol=5e-2)
                got = jax.jit(lambda *a: grouped.scaled_gmm(*a))(x, values, scale, sizes)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
