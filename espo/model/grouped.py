"""Grouped matmuls on Hopper GPUs: JAX's Mosaic GPU kernels behind one custom VJP.

`gmm(x, w, group_sizes)` multiplies rows sorted by group, [R, K], by their group's matrix of
`w` [G, K, N], computing only the rows' own group (a grouped GEMM). On NVIDIA GPUs XLA rewrites
`jax.lax.ragged_dot` into a dense matmul over every group (`experiments/bench_moe.py`: 16x the
useful FLOPs at decode rows, 5.9-6.5x the time of this path forward + backward at update rows
on an H100), so `moe.expert_ffn(impl="mosaic_gpu")` runs the experts through this module instead:
  * forward and dx: `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (dx with
    `transpose_rhs`, i.e. dy [R, N] x w[g]^T);
  * dw: `transposed_ragged_dot_mgpu.transposed_ragged_dot`, x[group]^T dy[group] per group
    (an empty group gets zeros).
`kernels="reference"` runs the same VJP with `jax.lax.ragged_dot` and a masked einsum in place
of the kernels: the CPU-checkable form the suite tests against `moe.moe_reference` (the Mosaic
GPU kernels themselves have no interpret mode; tests/model/test_grouped.py checks them on a GPU).
Rows past sum(group_sizes) belong to no group: their outputs and gradients are 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from espo import errors

KERNELS = ("mosaic_gpu", "reference")
DTYPES = (jnp.bfloat16, jnp.float16)  # the kernels' wgmma operand types (no float32)
TILE = 64  # block_m and block_k of the kernels: K and N must be multiples of it


def hopper() -> bool:
    """A Hopper (sm_90) GPU: the Mosaic GPU kernels' target."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")) in ("9.0", "9.0a")


def supported(dtype, k: int, n: int) -> bool:
    """Whether `gmm` with the Mosaic GPU kernels runs [., k] x [G, k, n] on this device."""
    return hopper() and jnp.dtype(dtype) in DTYPES and k % TILE == 0 and n % TILE == 0


def experts_supported(dtype, d: int, f: int) -> bool:
    """Whether `swiglu_experts` with widths d (model) and f (expert) runs on the kernels."""
    return supported(dtype, d, f) and supported(dtype, f, d)


def _tiles(n: int) -> dict:
    # Measured on an H100 at D=2048, F=1408 (bench_moe.py): these tiles for every shape there.
    block_n = 128 if n % 128 == 0 else TILE
    return dict(block_m=TILE, block_n=block_n, block_k=TILE, max_concurrent_steps=4, grid_block_n=1)


def _valid_rows(rows: int, group_sizes) -> jax.Array:
    return (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]


def _ragged(x, w, group_sizes, *, kernels: str, transpose_rhs: bool = False):
    """x [R, K] x w[g] ([G, K, N]; with transpose_rhs [G, N, K], read transposed) -> [R, N]."""
    if kernels == "mosaic_gpu":
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        n = w.shape[1] if transpose_rhs else w.shape[2]
        return ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **_tiles(n)
        )
    return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, group_sizes)


def _per_group_outer(x, dy, group_sizes, *, kernels: str):
    """sum over the rows r of group g of x[r]^T dy[r]: [R, K], [R, N] -> [G, K, N]."""
    if kernels == "mosaic_gpu":
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            x, dy, group_sizes=group_sizes, **_tiles(dy.shape[1])
        )
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")  # G: past the groups
    one_hot = jax.nn.one_hot(group, group_sizes.shape[0], dtype=x.dtype)  # [R, G]
    return jnp.einsum("rg,rk,rn->gkn", one_hot, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(
    x: Float[Array, "R K"],
    w: Float[Array, "G K N"],
    group_sizes: Int[Array, " G"],
    kernels: str = "mosaic_gpu",
) -> Float[Array, "R N"]:
    """Rows of group g times w[g]; rows past sum(group_sizes) give 0."""
    y = _ragged(x, w, group_sizes, kernels=kernels)
    return jnp.where(_valid_rows(x.shape[0], group_sizes), y, 0)


def _gmm_fwd(x, w, group_sizes, kernels):
    return gmm(x, w, group_sizes, kernels), (x, w, group_sizes)


def _gmm_bwd(kernels, res, dy):
    x, w, group_sizes = res
    valid = _valid_rows(x.shape[0], group_sizes)
    dy = jnp.where(valid, dy, 0).astype(x.dtype)
    dx = jnp.where(valid, _ragged(dy, w, group_sizes, kernels=kernels, transpose_rhs=True), 0)
    dw = _per_group_outer(x, dy, group_sizes, kernels=kernels)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def swiglu_experts(
    xs: Float[Array, "R D"],
    group_sizes: Int[Array, " E"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    *,
    kernels: str = "auto",
) -> Float[Array, "R D"]:
    """`moe.expert_ffn`'s SwiGLU experts over `gmm`; kernels "auto": Mosaic GPU where they run
    (`supported`), the reference elsewhere."""
    if kernels == "auto":
        fits = experts_supported(xs.dtype, *w_gate.shape[1:])
        kernels = "mosaic_gpu" if fits else "reference"
    if kernels not in KERNELS:
        raise errors.InvalidValue("grouped", "kernels", kernels, f"one of {KERNELS}")
    h = jax.nn.silu(gmm(xs, w_gate, group_sizes, kernels)) * gmm(xs, w_up, group_sizes, kernels)
    return gmm(h, w_down, group_sizes, kernels)
