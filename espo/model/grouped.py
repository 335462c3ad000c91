"""Grouped matmuls on Hopper GPUs: JAX's Mosaic GPU kernels behind one custom VJP.

`gmm(x, w, group_sizes)` multiplies rows sorted by group, [R, K], by their group's matrix of
`w` [G, K, N], computing only the rows' own group (a grouped GEMM). On NVIDIA GPUs XLA rewrites
`jax.lax.ragged_dot` into a dense matmul over every group (`experiments/bench_moe.py`: 16x the
useful FLOPs at decode rows, 5.9-6.5x the time of this path forward + backward at update rows
on an H100), so `experts.expert_ffn(impl="mosaic_gpu")` runs the experts through this module
instead:
  * forward and dx: `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (dx with
    `transpose_rhs`, i.e. dy [R, N] x w[g]^T);
  * dw: `transposed_ragged_dot_mgpu.transposed_ragged_dot`, x[group]^T dy[group] per group
    (an empty group gets zeros).
`kernels="triton"` is a grouped matmul for decode-sized row counts in Pallas' Triton backend
(`_triton_ragged`): one program per (group, column block, row block) that holds rows, so an
expert no row is routed to is never read, and FP8 weights are read as FP8 and converted in
registers, their per-column scales applied to the product (`scaled_gmm`). Its dw is the
reference's (decode needs no gradient); off a GPU it runs in Pallas' interpret mode, the form
the suite checks. `kernels="reference"` runs the same VJP with `jax.lax.ragged_dot` and a
masked einsum in place of the kernels: the CPU-checkable form the suite tests against
`moe.moe_reference` (the Mosaic GPU kernels have no interpret mode; tests/model/test_grouped.py
checks them on a GPU).
`kernels="megablox"` is the TPU form: JAX's megablox kernels (`jax.experimental.pallas.ops.tpu.
megablox`, MaxText's grouped matmul), `gmm` for the forward and dx and `tgmm` for dw. On a TPU
XLA's ragged_dot runs the forward and dx as grouped kernels but its weight gradient as a dense
product over every group (the optimized HLO compiled for a v5e, `experiments/bench_moe.py
--tpu`: a convolution per dw, 6.0x the useful FLOPs of forward + backward at E=16); off a TPU
the kernels run in Pallas' interpret mode, the form the suite checks.
Rows past sum(group_sizes) belong to no group: their outputs and gradients are 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from espo import errors

KERNELS = ("mosaic_gpu", "triton", "megablox", "reference")
DTYPES = (jnp.bfloat16, jnp.float16)  # the kernels' wgmma operand types (no float32)
TILE = 64  # block_m and block_k of the kernels: K and N must be multiples of it
# The Triton kernel's widest column and contraction blocks, warps per program, pipeline stages,
# contraction parts per output block (split_k). fp8_operand: the type FP8 weights (and the rows)
# are multiplied in: the rows' own, float16 (e4m3 -> f16 is one conversion on Hopper; rows
# outside f16's range would overflow) or float8 (rows quantized per row: FP8 x FP8 products).
# Read when a function is traced: a function already jitted keeps the tiles it was traced with.
# Measured on an H100 (bench_moe.py --only tiles, D=2048, F=1408, E=16): these the fastest bf16
# forward at 128 rows (0.21 ms against 0.22-0.30), within the spread at 16; float16 operands for
# FP8 are faster alone (0.17 against 0.19-0.23 ms at 16 rows) and equal in the decode loop.
FP8_OPERANDS = ("rows", "float16", "float8")
TRITON_TILES = dict(
    block_n=128, block_k=64, num_warps=4, num_stages=4, split_k=1, fp8_operand="rows"
)


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


def megablox_supported(dtype) -> bool:
    """Whether `gmm(kernels="megablox")` takes this operand type (megablox: bf16, float32)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _megablox():
    import importlib  # the module, not the package's `gmm` (its custom VJP: ours is `gmm`)

    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_tiling(rows: int, k: int, n: int) -> tuple[tuple[int, int, int], int]:
    """(tm, tk, tn) and the rows to pad: 128-row tiles (fewer rows: one tile, a multiple of 16),
    contraction and column tiles the widest of 512, 256, 128 that divides the width (a whole
    width otherwise: TPU tiles are lane multiples or the full dimension)."""
    tm = 128 if rows >= 128 else -(-rows // 16) * 16
    lane = lambda w: next((b for b in (512, 256, 128) if w % b == 0), w)  # noqa: E731
    return (tm, lane(k), lane(n)), -rows % tm


def _tiles(n: int) -> dict:
    # Measured on an H100 at D=2048, F=1408 (bench_moe.py): these tiles for every shape there.
    block_n = 128 if n % 128 == 0 else TILE
    return dict(block_m=TILE, block_n=block_n, block_k=TILE, max_concurrent_steps=4, grid_block_n=1)


def _block(n: int, widest: int = 128) -> int:
    """The widest power of two <= `widest` (and >= 16, Triton's smallest dot) dividing n."""
    b = widest
    while b > 16 and n % b:
        b //= 2
    return b


def triton_supported(k: int, n: int) -> bool:
    """Whether `gmm(kernels="triton")` takes [., k] x [G, k, n] as they are (widths multiples
    of 16); other widths are padded to them, a copy of the weights per call."""
    return k % 16 == 0 and n % 16 == 0


def _gmm_kernel(sizes_ref, starts_ref, x_ref, w_ref, *refs, bm, bn, bk, steps, splits, cfg):
    """Program (g, j, m * splits + s): rows m*bm.. of group g times columns j*bn.. of w[g], over
    the s-th of `splits` equal parts of the contraction, if group g has rows there."""
    from jax.experimental.pallas import triton as plgpu

    transpose_rhs, operand, scaled, row_scaled = cfg
    *in_refs, o_ref = refs
    scale_ref = in_refs.pop(0) if scaled else None
    row_scale_ref = in_refs.pop(0) if row_scaled else None
    g, j, ms = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, s = ms // splits, ms % splits
    left = sizes_ref[g] - m * bm  # rows of group g from this block on

    @pl.when(left > 0)
    def _():
        rows, cols = pl.ds(starts_ref[g] + m * bm, bm), pl.ds(j * bn, bn)

        def body(i, acc):
            ks = pl.ds(pl.multiple_of((s * steps + i) * bk, bk), bk)
            w = w_ref[g, cols, ks] if transpose_rhs else w_ref[g, ks, cols]
            a = x_ref[rows, ks].astype(operand)
            dims = (((1,), (1 if transpose_rhs else 0,)), ((), ()))
            return acc + jax.lax.dot_general(
                a, w.astype(operand), dims, preferred_element_type=jnp.float32
            )

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        if scale_ref is not None:
            acc = acc * scale_ref[g, cols][None, :]
        if row_scale_ref is not None:
            acc = acc * row_scale_ref[rows][:, None]
        mask = (jnp.arange(bm) < left)[:, None]
        plgpu.store(o_ref.at[s, rows, cols], acc.astype(o_ref.dtype), mask=mask)


def _fp8_rows(x):
    """x [R, K] as e4m3 values and float32 per-row scales (max |x| of the row -> 448)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (x.astype(jnp.float32) / scale[:, None]).astype(jnp.float8_e4m3fn), scale


def _triton_ragged(x, w, group_sizes, *, transpose_rhs=False, scale=None, interpret=None):
    """x [R, K] (rows sorted by group) x w[g] -> [R, N]; rows past the groups are garbage.

    The rows are padded by one block so every program's row block is in bounds; a program
    stores only its own group's rows. `scale` [G, N] (float32) multiplies group g's products.
    TRITON_TILES' split_k > 1 gives each program a part of the contraction (more programs at
    decode's few rows), the parts summed in float32; fp8_operand "float8" quantizes FP8
    weights' rows per row and multiplies FP8 x FP8 (the rows' scales on the product)."""
    R, K = x.shape
    N = w.shape[1] if transpose_rhs else w.shape[2]
    if not triton_supported(K, N):  # widths to multiples of 16: a padded copy of w
        k16, n16 = -K % 16, -N % 16
        x = jnp.pad(x, ((0, 0), (0, k16)))
        w = jnp.pad(
            w, ((0, 0), (0, n16), (0, k16)) if transpose_rhs else ((0, 0), (0, k16), (0, n16))
        )
        scale = None if scale is None else jnp.pad(scale, ((0, 0), (0, n16)))
        return _triton_ragged(
            x, w, group_sizes, transpose_rhs=transpose_rhs, scale=scale, interpret=interpret
        )[:, :N]
    bm, bn, bk = 16, _block(N, TRITON_TILES["block_n"]), _block(K, TRITON_TILES["block_k"])
    splits = TRITON_TILES.get("split_k", 1)
    splits = splits if K % (bk * splits) == 0 else 1
    starts = (jnp.cumsum(group_sizes) - group_sizes).astype(jnp.int32)
    out_dtype, operand, extra_in = x.dtype, x.dtype, []
    if scale is not None:
        extra_in.append(scale.astype(jnp.float32))
    form = TRITON_TILES["fp8_operand"]
    if form not in FP8_OPERANDS:
        raise errors.InvalidValue("TRITON_TILES", "fp8_operand", form, f"one of {FP8_OPERANDS}")
    row_scaled = jnp.dtype(w.dtype).itemsize == 1 and form == "float8"
    if jnp.dtype(w.dtype).itemsize == 1 and form == "float16":
        operand = jnp.float16
    if row_scaled:
        x, row_scale = _fp8_rows(x)
        operand = x.dtype
        extra_in.append(jnp.pad(row_scale, (0, bm)))
    cfg = (transpose_rhs, operand, scale is not None, row_scaled)
    kernel = functools.partial(
        _gmm_kernel, bm=bm, bn=bn, bk=bk, steps=K // bk // splits, splits=splits, cfg=cfg
    )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    extra = {} if interpret else {"compiler_params": _triton_params()}
    part_dtype = out_dtype if splits == 1 else jnp.float32
    y = pl.pallas_call(
        kernel,
        grid=(w.shape[0], N // bn, pl.cdiv(R, bm) * splits),
        out_shape=jax.ShapeDtypeStruct((splits, R + bm, N), part_dtype),
        interpret=interpret,
        **extra,
    )(group_sizes.astype(jnp.int32), starts, jnp.pad(x, ((0, bm), (0, 0))), w, *extra_in)
    return (y[0] if splits == 1 else jnp.sum(y, axis=0).astype(out_dtype))[:R]


def _triton_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(
        num_warps=TRITON_TILES["num_warps"], num_stages=TRITON_TILES["num_stages"]
    )


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
    if kernels == "triton":
        return _triton_ragged(x, w, group_sizes, transpose_rhs=transpose_rhs)
    if kernels == "megablox":
        n = w.shape[1] if transpose_rhs else w.shape[2]
        tiling, pad = _megablox_tiling(x.shape[0], x.shape[1], n)
        y = _megablox().gmm(
            jnp.pad(x, ((0, pad), (0, 0))), w, group_sizes.astype(jnp.int32), x.dtype, tiling,
            transpose_rhs=transpose_rhs, interpret=jax.default_backend() != "tpu",
        )  # fmt: skip
        return y[: x.shape[0]]
    return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, group_sizes)


def _per_group_outer(x, dy, group_sizes, *, kernels: str):
    """sum over the rows r of group g of x[r]^T dy[r]: [R, K], [R, N] -> [G, K, N]."""
    if kernels == "mosaic_gpu":  # "triton": the reference (its rows are decode's few)
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            x, dy, group_sizes=group_sizes, **_tiles(dy.shape[1])
        )
    if kernels == "megablox":
        tiling, pad = _megablox_tiling(*x.shape, dy.shape[1])
        rows = ((0, pad), (0, 0))
        return _megablox().tgmm(
            jnp.pad(x, rows).T, jnp.pad(dy, rows), group_sizes.astype(jnp.int32), jnp.float32,
            tiling, interpret=jax.default_backend() != "tpu",
        )  # fmt: skip
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


def scaled_gmm(
    x: Float[Array, "R K"],
    values: Float[Array, "G K N"],
    scale: Float[Array, "G N"],
    group_sizes: Int[Array, " G"],
) -> Float[Array, "R N"]:
    """`gmm(x, values * scale[:, None, :])` on the Triton kernel, the (FP8) values converted in
    registers and each group's scales applied to its products; forward only."""
    y = _triton_ragged(x, values, group_sizes, scale=scale)
    return jnp.where(_valid_rows(x.shape[0], group_sizes), y, 0)


def swiglu_experts(
    xs: Float[Array, "R D"],
    group_sizes: Int[Array, " E"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    *,
    kernels: str = "auto",
) -> Float[Array, "R D"]:
    """`experts.expert_ffn`'s SwiGLU experts over `gmm`; kernels "auto": Mosaic GPU where they run
    (`supported`), the reference elsewhere."""
    if kernels == "auto":
        fits = experts_supported(xs.dtype, *w_gate.shape[1:])
        kernels = "mosaic_gpu" if fits else "reference"
    if kernels not in KERNELS:
        raise errors.InvalidValue("grouped", "kernels", kernels, f"one of {KERNELS}")
    h = jax.nn.silu(gmm(xs, w_gate, group_sizes, kernels)) * gmm(xs, w_up, group_sizes, kernels)
    return gmm(h, w_down, group_sizes, kernels)
