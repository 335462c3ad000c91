"""Dropless MoE dispatch: the grouped expert FFN per backend, and its expert-parallel form.

The routing (`espo.model.moe`) hands over (token, expert) assignments and their weights.
Dispatch computes only the experts each token is routed to. Assignments (token, expert) are
sorted by expert and handed to `expert_ffn`, a grouped matmul over contiguous expert groups:
  * "capacity" (the CPU default): rows j < C of group e go to slot (e, j) of an [E, C, D] array
    and one batched matmul `[E, C, D] x [E, D, F]` reads every expert's weights once, in place,
    whatever the number of experts; rows past C (groups above capacity) go through an exact
    `while_loop` over tiles of one expert each, skipped when every group fits. C is static,
    `capacity_for(M*K, E)`: ~1.25x the mean group, so decode (M*K ~ E), prefill and the update
    (M*K >> E) each get their own. Its gradient is einsums into [E, D, F] plus the same loop.
    On CPU, capacities up to SMALL_GROUP_ROWS (decode with many experts) run each matmul as a
    fused multiply-and-reduce (`_streamed`) instead of the batched GEMM: 1.27x faster decode at
    E=128.
  * "mosaic_gpu" (the default on Hopper GPUs above DENSE_ROWS rows, for bf16 / f16 widths in
    multiples of 64): JAX's Mosaic GPU grouped-matmul kernels behind one custom VJP
    (`espo.model.grouped`); its CPU form runs the same VJP with reference matmuls. On an H100
    (bench_moe.py, D=2048, F=1408, E=16, K=2): forward + backward at 8192 rows 1.80 ms,
    capacity 2.2-3.9, ragged 11.8.
  * "triton" (the default on GPUs up to DENSE_ROWS rows: decode): a Pallas Triton grouped
    matmul (`espo.model.grouped`) whose programs exist only for the touched experts' rows, FP8
    weights read as FP8; interpret mode off a GPU.
  * "megablox" (the default on TPUs above DENSE_ROWS rows, bf16 / float32): JAX's megablox
    kernels behind the same custom VJP (`espo.model.grouped`), as MaxText trains its MoEs;
    interpret mode off a TPU.
  * "ragged": `jax.lax.ragged_dot`. XLA lowers it to a dense matmul over every expert on CPU
    and on NVIDIA GPUs (the optimized HLO's FLOPs are E times the useful ones at decode rows);
    on a TPU to grouped kernels for the forward and dx but a dense product over every expert
    for dw (6.0x the useful FLOPs forward + backward at E=16, compiled for a v5e); the TPU
    default at decode rows.
  * "blocked": each expert's group is padded to a multiple of a block size and every block is
    multiplied by its expert's weights, gathered per block: at small groups (decode, many
    experts) the gathers copy more than all expert weights per matmul. Kept for comparison.
`expert_ffn` sees only sorted rows, group sizes and the local expert weights, so
`expert_parallel_dispatch` wraps `dispatch` in a `shard_map` over the mesh's expert axes
(`ModelConfig.expert_axes`; each device its E / n experts, the tokens exchanged by all-to-all)
without touching the routing code.
`moe.moe_reference` is the plain per-expert loop that the tests hold every path against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from espo import errors, quant, sharding
from espo.model import config as config_lib
from espo.model import grouped

DISPATCH_IMPLS = config_lib.MOE_IMPLS  # "auto", then `expert_ffn`'s paths
# Up to this many rows (tokens x K) "auto" takes the Triton grouped matmul on a GPU (decode;
# XLA's dense ragged_dot where its widths do not fit). On an H100 at D=2048, F=1408, E=16
# (bench_moe.py), alone: Triton 0.20 / 0.24 ms at 16 / 128 rows, ragged 0.22-0.28 / 0.26-0.29,
# capacity 0.28-0.40 / 0.27-0.39, Mosaic GPU 0.26-0.33 / 0.23-0.27; in the decode loop (B=8)
# Triton 3,953-3,968 tokens/s, ragged 3,209-3,452, Mosaic GPU 2,777. Forward + backward at 8192
# rows: Mosaic GPU 1.8-2.0 ms, Triton 9.1, ragged 11.4-11.8.
DENSE_ROWS = 128


def swiglu_rows(h_gate, h_up):
    return jax.nn.silu(h_gate) * h_up


def _swiglu_with(matmul, xs, w_gate, w_up, w_down):
    """SwiGLU experts over rows with `matmul(x, w)` one of the paths' grouped matmuls."""
    return matmul(swiglu_rows(matmul(xs, w_gate), matmul(xs, w_up)), w_down)  # [R, D]


def _ffn(xs, w_gate, w_up, w_down):
    """One expert's SwiGLU on rows: [..., D] with [D, F], [D, F], [F, D] -> [..., D]."""
    return swiglu_rows(xs @ w_gate, xs @ w_up) @ w_down


def expert_ffn(
    xs: Float[Array, "R D"],
    group_sizes: Int[Array, " E"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    *,
    impl: str,
    capacity: int | None = None,
) -> Float[Array, "R D"]:
    """SwiGLU experts over rows sorted by expert (group e holds `group_sizes[e]` rows).

    Rows past `sum(group_sizes)` belong to no expert and come back as zeros. `capacity` (static,
    "capacity" only): rows per expert of the batched matmul; `capacity_for(R, E)` by default.
    The weights may be `quant.ScaledWeight`s (FP8 rollouts): "ragged" applies each row's
    expert's scales to its products, the other paths multiply them into the weights first.
    """
    scaled = [isinstance(w, quant.ScaledWeight) for w in (w_gate, w_up, w_down)]
    if impl == "triton":
        return _triton_ffn(xs, group_sizes, w_gate, w_up, w_down)
    if impl == "ragged" and any(scaled):
        return _scaled_ragged_ffn(xs, group_sizes, w_gate, w_up, w_down)
    if any(scaled):
        w_gate, w_up, w_down = (
            w.dense() if s else w for w, s in zip((w_gate, w_up, w_down), scaled, strict=True)
        )
    if impl == "ragged":
        ragged = lambda x, w: jax.lax.ragged_dot(x, w, group_sizes)  # noqa: E731
        return _swiglu_with(ragged, xs, w_gate, w_up, w_down)
    if impl == "capacity":
        R, E = xs.shape[0], w_gate.shape[0]
        C = capacity_for(R, E) if capacity is None else capacity
        return _capacity_ffn(xs, group_sizes, w_gate, w_up, w_down, capacity=C)
    if impl == "blocked":
        return _blocked_ffn(xs, group_sizes, w_gate, w_up, w_down)
    if impl in ("mosaic_gpu", "megablox"):
        kernels = "auto" if impl == "mosaic_gpu" else impl
        return grouped.swiglu_experts(xs, group_sizes, w_gate, w_up, w_down, kernels=kernels)
    raise errors.InvalidValue("dispatch", "impl", impl, f"one of {DISPATCH_IMPLS[1:]}")


def _scaled_ragged_ffn(xs, group_sizes, w_gate, w_up, w_down):
    """The "ragged" path on `quant.ScaledWeight`s: ragged dots on the values (float32
    accumulation), each row times its expert's output scales."""
    row_expert = jnp.repeat(  # rows past the groups: the last expert's scales times zeros
        jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=xs.shape[0]
    )

    def matmul(x, w):
        if not isinstance(w, quant.ScaledWeight):
            return jax.lax.ragged_dot(x, w, group_sizes)
        y = jax.lax.ragged_dot(x, w.operand(), group_sizes, preferred_element_type=jnp.float32)
        return (y * w.scale[row_expert]).astype(xs.dtype)

    return _swiglu_with(matmul, xs, w_gate, w_up, w_down)


def _triton_ffn(xs, group_sizes, w_gate, w_up, w_down):
    """The "triton" path: `grouped.gmm(kernels="triton")`; `quant.ScaledWeight`s go in as FP8
    with their scales (`grouped.scaled_gmm`, forward only: FP8 weights are the sampler's)."""

    def matmul(x, w):
        if isinstance(w, quant.ScaledWeight):
            return grouped.scaled_gmm(x, w.values, w.scale, group_sizes)
        return grouped.gmm(x, w, group_sizes, "triton")

    return _swiglu_with(matmul, xs, w_gate, w_up, w_down)


def capacity_for(rows: int, experts: int) -> int:
    """Rows per expert of the "capacity" path: 1.25x the mean group, rounded up to 4, >= 4.

    Measured on a 2-core CPU (D=256, F=128, E=8..128): 1.0-1.25x the mean is fastest for
    prefill and the update (a few groups overflow by a few rows, cheaper than padding every
    group), and at decode (mean 2..32) the rounding to 4 gives the headroom. Groups above it
    stay exact (`_overflow_ffn`); they only cost a loop iteration per tile.
    """
    c = -(-5 * rows // (4 * experts))  # ceil(1.25 * rows / experts)
    return 4 * max(1, -(-c // 4))


def _capacity_ffn(xs, group_sizes, w_gate, w_up, w_down, *, capacity):
    """Capacity-padded batched matmul `[E, C, D] x [E, D, F]` + an exact overflow loop.

    Row j of group e sits at slot (e, j) when j < C: one batched SwiGLU reads every expert's
    weights once, in place (no gather, so its gradient is three einsums straight into [E, D, F]);
    rows at rank >= C go through `_overflow_ffn`. Costs E*C rows of compute (the default C:
    ~1.25x the real rows, up to 2x at decode from the rounding) and reads all E experts, touched
    or not; the weight read is the same for any C.
    """
    R, D = xs.shape
    E, C = w_gate.shape[0], capacity
    ends = jnp.cumsum(group_sizes)  # [E]
    starts = ends - group_sizes  # [E]
    slot_row = starts[:, None] + jnp.arange(C)  # [E, C] sorted row of slot (e, c)
    slot_mask = jnp.arange(C) < group_sizes[:, None]  # [E, C]
    xe = jnp.where(slot_mask[..., None], xs[jnp.minimum(slot_row, R - 1)], 0)  # [E, C, D]
    mm = _grouped_matmul if C > SMALL_GROUP_ROWS or jax.default_backend() != "cpu" else _streamed
    h = swiglu_rows(mm(xe, w_gate), mm(xe, w_up))  # [E, C, F]
    ye = mm(h, w_down).reshape(E * C, D)  # [E*C, D]
    row_expert = jnp.searchsorted(ends, jnp.arange(R), side="right")  # [R]; E past the groups
    in_group = row_expert < E  # [R]
    row_expert = jnp.minimum(row_expert, E - 1)
    rank = jnp.arange(R) - starts[row_expert]  # [R]
    main = in_group & (rank < C)  # [R]
    y_main = ye[row_expert * C + jnp.minimum(rank, C - 1)]  # [R, D]
    if R <= C:  # no group can exceed the capacity
        return jnp.where(main[:, None], y_main, 0)
    y_over = _overflow_ffn(xs, group_sizes, w_gate, w_up, w_down, C, _overflow_tile(C))  # [R, D]
    return jnp.where(main[:, None], y_main, jnp.where(in_group[:, None], y_over, 0))


# Capacities up to this take `_streamed` on CPU. Measured on 2 cores, whole decode (B=64, 4
# layers, F=128; streamed vs GEMM): d256 E128 (C=4) 2.48k vs 1.96k tok/s, d256 E32 (C=12) 5.54k
# vs 4.86k; d128 E16 (C=20) 13.1k vs 13.7k and d256 E8 (C=40) 7.4k vs 7.5k favour the GEMM,
# as prefill and the update (C in the hundreds) do by far.
SMALL_GROUP_ROWS = 16


def _grouped_matmul(x, w):
    """[E, C, K] x [E, K, N] -> [E, C, N], a batched GEMM."""
    return jnp.einsum("eck,ekn->ecn", x, w)


@jax.custom_vjp
def _streamed(x, w):
    """`_grouped_matmul` as one fused multiply-and-reduce over K, accumulated in float32.

    At decode's few rows per expert XLA:CPU's batched GEMM runs each expert's [C, K] x [K, N]
    as a tiny, badly vectorised dot; the fused reduction streams every expert's weights once
    faster (`SMALL_GROUP_ROWS`). Its gradient is the GEMM's (two einsums), so the
    backward never holds the [E, C, K, N] product.
    """
    prod = x.astype(jnp.float32)[..., None] * w.astype(jnp.float32)[:, None]  # [E, C, K, N]
    return jnp.sum(prod, axis=2).astype(jnp.result_type(x, w))


def _streamed_fwd(x, w):
    return _streamed(x, w), (x, w)


def _streamed_bwd(res, g):
    x, w = res
    return jnp.einsum("ecn,ekn->eck", g, w).astype(x.dtype), jnp.einsum(
        "eck,ecn->ekn", x, g
    ).astype(w.dtype)


_streamed.defvjp(_streamed_fwd, _streamed_bwd)


def _overflow_tile(capacity: int) -> int:
    """Rows per overflow tile: each tile reads one expert's weights, so not too few rows."""
    return min(64, max(8, capacity))


def _overflow_layout(group_sizes, *, capacity, tile):
    """(number of tiles, tile i -> (expert, first sorted row, row mask [tile])) of the rows
    past `capacity` in each group, `tile` rows of one expert per tile."""
    E = group_sizes.shape[0]
    over = jnp.maximum(group_sizes - capacity, 0)  # [E]
    num = -(-over // tile)  # [E] tiles per expert
    tile_ends = jnp.cumsum(num)  # [E]
    starts = jnp.cumsum(group_sizes) - group_sizes  # [E]

    def tile_at(i):
        e = jnp.minimum(jnp.searchsorted(tile_ends, i, side="right"), E - 1)
        t = i - (tile_ends[e] - num[e])  # tile number within expert e
        first = starts[e] + capacity + t * tile
        return e, first, jnp.arange(tile) < over[e] - t * tile

    return tile_ends[-1], tile_at


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _overflow_ffn(xs, group_sizes, w_gate, w_up, w_down, capacity, tile):
    """The rows at rank >= `capacity` of each group (zeros elsewhere), one tile at a time.

    A `while_loop` over the tiles that exist: none when every group fits, so its static [R, D]
    shape costs nothing then; a skewed group costs its rows plus one expert's weights per tile.
    Reverse mode is the same loop (`_overflow_bwd`) adding each tile's weight gradient into its
    expert's slot of one [E, D, F] accumulator: no per-tile weight copy is kept.
    """
    return _overflow_fwd(xs, group_sizes, w_gate, w_up, w_down, capacity, tile)[0]


def _overflow_fwd(xs, group_sizes, w_gate, w_up, w_down, capacity, tile):
    R = xs.shape[0]
    total, tile_at = _overflow_layout(group_sizes, capacity=capacity, tile=tile)
    xs_pad = jnp.pad(xs, ((0, tile), (0, 0)))  # [R + tile, D]: no slice start gets clamped

    def body(i, ys):
        e, first, mask = tile_at(i)
        xt = jax.lax.dynamic_slice_in_dim(xs_pad, first, tile)  # [tile, D]
        yt = _ffn(xt, w_gate[e], w_up[e], w_down[e])  # [tile, D]
        yt = jnp.where(mask[:, None], yt, jax.lax.dynamic_slice_in_dim(ys, first, tile))
        return jax.lax.dynamic_update_slice_in_dim(ys, yt, first, 0)

    ys = jax.lax.fori_loop(0, total, body, jnp.zeros_like(xs_pad))[:R]  # [R, D]
    return ys, (xs, group_sizes, w_gate, w_up, w_down)


def _overflow_bwd(capacity, tile, res, dys):
    xs, group_sizes, w_gate, w_up, w_down = res
    R = xs.shape[0]
    total, tile_at = _overflow_layout(group_sizes, capacity=capacity, tile=tile)
    xs_pad = jnp.pad(xs, ((0, tile), (0, 0)))  # [R + tile, D]
    dys_pad = jnp.pad(dys, ((0, tile), (0, 0)))  # [R + tile, D]

    def body(i, acc):
        dxs, d_gate, d_up, d_down = acc
        e, first, mask = tile_at(i)
        xt = jax.lax.dynamic_slice_in_dim(xs_pad, first, tile)  # [tile, D]
        dyt = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(dys_pad, first, tile), 0)
        _, vjp = jax.vjp(_ffn, xt, w_gate[e], w_up[e], w_down[e])
        dxt, dg, du, dd = vjp(dyt)  # [tile, D], [D, F], [D, F], [F, D]
        dxt = jnp.where(mask[:, None], dxt, jax.lax.dynamic_slice_in_dim(dxs, first, tile))
        dxs = jax.lax.dynamic_update_slice_in_dim(dxs, dxt, first, 0)
        return dxs, d_gate.at[e].add(dg), d_up.at[e].add(du), d_down.at[e].add(dd)

    zeros = tuple(jnp.zeros_like(a) for a in (xs_pad, w_gate, w_up, w_down))
    dxs, d_gate, d_up, d_down = jax.lax.fori_loop(0, total, body, zeros)
    no_grad = np.zeros(group_sizes.shape, jax.dtypes.float0)  # integer input
    return dxs[:R], no_grad, d_gate, d_up, d_down


_overflow_ffn.defvjp(_overflow_fwd, _overflow_bwd)


def _blocked_ffn(xs, group_sizes, w_gate, w_up, w_down):
    """Each group padded to a multiple of a block; every block gathers its expert's weights.

    Kept for comparison (`bench_rollout.py --only moe`): the per-block gathers copy NB x D x F
    weights per matmul (more than all experts at small groups), and its gradient keeps them.
    """
    R, D = xs.shape
    E = w_gate.shape[0]
    block = _block_size(R, E)
    num_blocks = -(-(R + E * (block - 1)) // block)
    padded_sizes = -(-group_sizes // block) * block  # [E]
    padded_end = jnp.cumsum(padded_sizes)  # [E]
    group_start = jnp.cumsum(group_sizes) - group_sizes  # [E]
    # Row r of expert e (rank j in its group) goes to padded slot padded_start[e] + j.
    row_expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(R), side="right")  # [R]
    in_group = row_expert < E
    row_expert_c = jnp.minimum(row_expert, E - 1)
    dest = (padded_end - padded_sizes)[row_expert_c] + jnp.arange(R) - group_start[row_expert_c]
    dest = jnp.where(in_group, dest, num_blocks * block)  # out of range: dropped
    xp = jnp.zeros((num_blocks * block, D), xs.dtype).at[dest].set(xs, mode="drop")
    xp = xp.reshape(num_blocks, block, D)  # [NB, b, D]
    block_start = jnp.arange(num_blocks) * block
    block_expert = jnp.searchsorted(padded_end, block_start, side="right")  # [NB]
    block_expert = jnp.minimum(block_expert, E - 1)  # trailing all-padding blocks: zeros anyway
    h = swiglu_rows(
        jnp.einsum("nbd,ndf->nbf", xp, w_gate[block_expert]),
        jnp.einsum("nbd,ndf->nbf", xp, w_up[block_expert]),
    )  # [NB, b, F]
    yp = jnp.einsum("nbf,nfd->nbd", h, w_down[block_expert]).reshape(num_blocks * block, D)
    return jnp.where(in_group[:, None], yp[jnp.minimum(dest, num_blocks * block - 1)], 0)


def _block_size(rows: int, experts: int) -> int:
    """A power of two near half the mean group size, in [8, 128]: padding <= ~50% of rows."""
    mean = max(1, rows // experts)
    block = 8
    while block * 2 <= max(8, mean // 2) and block < 128:
        block *= 2
    return block


def default_impl(dtype=None, d: int = 0, f: int = 0, rows: int = 0) -> str:
    """The dispatch path of "auto" for `rows` rows [rows, d] and experts of width f in `dtype`:
    capacity on CPU. On a TPU up to DENSE_ROWS rows XLA's ragged_dot (grouped kernels forward),
    above them (prefill, the update: ragged_dot's dw is dense there) megablox for bf16 / float32
    (not yet timed on a TPU: the choice is from the compiled HLO, docs/gpu). On a GPU (measured
    on an H100, docs/gpu): up to DENSE_ROWS rows (decode) the Triton grouped matmul where it
    fits (one bf16 / f16 operand type, d and f multiples of 16: `grouped.triton_supported`;
    float32 would multiply in TF32): 1.18-1.23x
    XLA's dense ragged_dot's decode tokens/s at B=8, 1.0-1.09x at B=64; else ragged. Above
    DENSE_ROWS the Mosaic GPU kernels where they run (Hopper, bf16 / f16, d and f multiples of
    64; prefill and the update), else capacity."""
    backend = jax.default_backend()
    if backend == "cpu":
        return "capacity"
    if backend == "tpu":
        big = rows > DENSE_ROWS and dtype is not None and grouped.megablox_supported(dtype)
        return "megablox" if big else "ragged"
    if backend != "gpu":
        return "ragged"
    if rows <= DENSE_ROWS:
        fits = dtype in grouped.DTYPES and grouped.triton_supported(d, f)
        return "triton" if fits and grouped.triton_supported(f, d) else "ragged"
    if dtype is not None and grouped.experts_supported(dtype, d, f):
        return "mosaic_gpu"
    return "capacity"


def dispatch(
    x: Float[Array, "M D"],
    ids: Int[Array, "M K"],
    weights: Float[Array, "M K"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    *,
    impl: str = "auto",
    capacity: int | None = None,
) -> Float[Array, "M D"]:
    """sum_k weights[m, k] * expert_{ids[m, k]}(x[m]), computing only the chosen experts.

    Ids of -1 (unrecorded) contribute nothing. `impl` and `capacity` are static (`expert_ffn`).
    """
    M, K = ids.shape
    E, D, F = w_gate.shape
    same = x.dtype == w_gate.dtype == w_down.dtype  # the kernels take one operand type
    impl = default_impl(x.dtype if same else None, D, F, M * K) if impl == "auto" else impl
    order, sizes = _group_order(ids.reshape(M * K), E)  # unrecorded (-1) assignments last
    token_of_row = order // K  # [M*K]
    group_sizes = sizes[:E].astype(jnp.int32)  # [E]
    ys = expert_ffn(
        x[token_of_row], group_sizes, w_gate, w_up, w_down, impl=impl, capacity=capacity
    )  # [M*K, D]
    row_weights = weights.reshape(M * K)[order].astype(ys.dtype)  # [M*K]
    return jnp.zeros_like(x).at[token_of_row].add(ys * row_weights[:, None])  # [M, D]


def _group_order(group: Int[Array, " A"], num_groups: int):
    """(order [A]: the rows sorted by group, stable; sizes [num_groups + 1]) of rows in groups
    0 .. num_groups - 1, a negative group counting as the last, num_groups (nowhere)."""
    key = jnp.where(group >= 0, group, num_groups)
    return jnp.argsort(key, stable=True), jnp.bincount(key, length=num_groups + 1)


# The expert-parallel paths: the modes of `expert_parallel_dispatch` (all_to_all falls back to
# the exact all_gather where a send buffer would overflow), in the order of the counts of the
# path each block took (`MoeExtras.expert_parallel`, summed over layers).
EP_PATHS = ("all_to_all", "all_gather")


def expert_parallel_dispatch(
    x: Float[Array, "M D"],
    ids: Int[Array, "M K"],
    weights: Float[Array, "M K"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
    *,
    impl: str = "auto",
    mode: str = "all_to_all",
    send_capacity: int | None = None,
    axes: tuple[str, ...] = ("expert",),
) -> tuple[Float[Array, "M D"], Int[Array, " 2"]]:
    """`dispatch`, with the experts split over the context mesh's `axes` (`jax.set_mesh`;
    `ModelConfig.expert_axes`: "expert" as trained, every axis in the rollout's "experts_all"
    layout) when their sizes multiply to n > 1; plain `dispatch` otherwise. Returns the output
    and which path ran: counts [all_to_all, all_gather] (zeros without expert parallelism).

    Inside a `jax.shard_map` each device holds E / n experts and M / (data x fsdp x expert) of
    the tokens (batches are sharded along every mesh axis, `sharding.BATCH_AXES`); "over the
    axes" below means over the devices that share the other axes' indices:
      * "all_to_all" (the default `mode`, when the tokens split evenly): each device sorts its
        (token, expert) assignments by the expert shard that owns them into a send buffer of
        `send_capacity` rows per destination, one `all_to_all` over the axes delivers them, the
        owner runs `dispatch` on its local experts, a second `all_to_all` returns the outputs
        and the sender combines them with its routing weights. (`ragged_all_to_all` would avoid
        the padding, but XLA:CPU does not implement it.) When any sender has more assignments
        for one destination than fit (the pmax'd check is the same on every device), the block
        takes the all-gather path instead, so the result stays exact whatever the routing.
      * "all_gather": every device gathers the tokens of its expert group, runs its own
        experts on them (assignments to other shards become -1, which contribute nothing) and
        a `psum_scatter` over the axes sums the partial outputs and hands each device its rows.
    Tokens that do not split evenly are replicated over the mesh and reduced by a `psum`
    (counted as all_gather). Replayed ids pass through unchanged; both paths are exact and
    differentiable, and `moe_reference` is what the tests hold them against.
    """
    if mode not in EP_PATHS:
        raise ValueError(f"expert-parallel mode {mode!r}: expected one of {EP_PATHS}")
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in axes if a in mesh.axis_names)  # absent: size 1
    n = math.prod(mesh.shape[a] for a in axes) if axes else 0
    if n <= 1:
        y = dispatch(x, ids, weights, w_gate, w_up, w_down, impl=impl)
        return y, jnp.zeros((len(EP_PATHS),), jnp.int32)
    E, (M, K) = w_gate.shape[0], ids.shape
    if E % n:
        raise ValueError(f"{E} experts do not split over the mesh's axes {axes} of size {n}")
    shards = sharding.batch_shards(mesh)  # data x fsdp x expert
    sharded = M % shards == 0
    m = M // shards if sharded else M  # tokens per device (all of them when replicated)
    local_experts = E // n
    capacity = capacity_for(max(1, m * K), local_experts)  # each device's ~1/n of n*m*K
    if send_capacity is None:
        send_capacity = capacity_for(m * K, n)  # rows per destination: ~1.25x the mean
    a2a = sharded and mode == "all_to_all"
    tokens = jax.sharding.PartitionSpec(sharding.BATCH_AXES if sharded else None)
    experts = jax.sharding.PartitionSpec(axes)
    ffn = functools.partial(dispatch, impl=impl, capacity=capacity)

    def local(x, ids, weights, w_gate, w_up, w_down):
        # Weights are the same on every batch shard; what `dispatch` computes from them and the
        # tokens varies over every axis (its loops' carries must say so; the transposes of
        # these casts sum the gradients over the shards).
        vary = lambda t, axes: jax.lax.pcast(t, axes, to="varying") if axes else t
        w = (w_gate, w_up, w_down)
        if not sharded:  # tokens the same everywhere, weights on every batch shard
            x, ids, weights = vary((x, ids, weights), axes)
            return jax.lax.psum(_own_experts(ffn, x, ids, weights, w, axes), axes), _path(1)
        w = vary(w, tuple(a for a in sharding.BATCH_AXES if a not in axes))
        gathered = lambda: _all_gather_path(ffn, x, ids, weights, w, axes)
        if not a2a:
            return gathered(), _path(1)
        layout, counts = _send_layout(ids, local_experts, n, send_capacity)
        overflow = jnp.any(counts > send_capacity).astype(jnp.int32)
        overflow = jax.lax.pmax(overflow, tuple(mesh.axis_names))  # the same on every device
        return jax.lax.cond(
            overflow > 0,
            lambda: (gathered(), _path(1)),
            lambda: (
                _all_to_all_path(ffn, x, weights, w, layout, n * send_capacity, axes),
                _path(0),
            ),
        )

    y, path = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, experts, experts, experts),
        out_specs=(tokens, jax.sharding.PartitionSpec()),
        check_vma=False,  # megablox's pallas_call states no varying axes of its output (TPU)
    )(x, ids, weights, w_gate, w_up, w_down)
    return y, path


def dispatch_in_chunks(
    x: Float[Array, "B T D"],
    ids: Int[Array, "B T K"],
    weights: Float[Array, "B T K"],
    w_gate,
    w_up,
    w_down,
    *,
    chunk: int,
    impl: str = "auto",
    axes: tuple[str, ...] = ("expert",),
) -> tuple[Float[Array, "B T D"], Int[Array, " 2"]]:
    """`expert_parallel_dispatch` on `chunk` tokens of every row at a time (0, or rows no
    longer than it: all at once). The rows are padded to whole chunks with unrecorded
    assignments (-1: nothing) and each chunk's dispatch is recomputed in the backward
    (`jax.checkpoint` in a `lax.map`): the per-(token, expert) buffers (1 GiB each at 32k tokens
    x 8 experts x 2048 in bf16) exist one chunk at a time. A chunk takes `chunk` tokens of every
    row, so rows sharded over a mesh stay put. The weights' gradient is summed over chunks in
    their compute dtype. The path is all_gather's if any chunk took it."""
    B, T, D = x.shape
    if not chunk or chunk >= T:
        y, path = expert_parallel_dispatch(
            x.reshape(B * T, D), ids.reshape(B * T, -1), weights.reshape(B * T, -1),
            w_gate, w_up, w_down, impl=impl, axes=axes,
        )  # fmt: skip
        return y.reshape(B, T, D), path
    n = -(-T // chunk)

    def chunks(a, fill):  # [B, T, .] -> [n, B, chunk, .]
        a = jnp.pad(a, ((0, 0), (0, n * chunk - T), (0, 0)), constant_values=fill)
        return a.reshape(B, n, chunk, a.shape[-1]).swapaxes(0, 1)

    @jax.checkpoint
    def one(xs):
        xc, ic, wc = (a.reshape(B * chunk, a.shape[-1]) for a in xs)
        y, path = expert_parallel_dispatch(xc, ic, wc, w_gate, w_up, w_down, impl=impl, axes=axes)
        return y.reshape(B, chunk, D), path

    ys, paths = jax.lax.map(one, (chunks(x, 0), chunks(ids, -1), chunks(weights, 0)))
    y = ys.swapaxes(0, 1).reshape(B, n * chunk, D)[:, :T]
    return y, jnp.where(paths[:, 1].sum() > 0, _path(1), _path(0))


def _path(i: int) -> Int[Array, " 2"]:
    return jnp.zeros((len(EP_PATHS),), jnp.int32).at[i].set(1)


def _own_experts(ffn, x, ids, weights, w, axes):
    """The partial output of this device's E / n experts (others' assignments become -1)."""
    local_experts = w[0].shape[0]
    first = jax.lax.axis_index(axes) * local_experts
    mine = (ids >= first) & (ids < first + local_experts)
    return ffn(x, jnp.where(mine, ids - first, -1), weights, *w)


def _all_gather_path(ffn, x, ids, weights, w, axes):
    gather = lambda t: jax.lax.all_gather(t, axes, axis=0, tiled=True)  # [n*m, ...]
    y = _own_experts(ffn, gather(x), gather(ids), gather(weights), w, axes)
    return jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)  # [m, D]


def _send_layout(ids, local_experts, n, send_capacity):
    """Where this device's (token, expert) assignments go, sorted by destination shard: (slot
    in the [n * C] send buffer (n * C for none or past capacity), its token, its expert on the
    destination, its flat index), and the per-destination counts [n]."""
    m, K = ids.shape
    flat = ids.reshape(m * K)
    dest = jnp.where(flat >= 0, flat // local_experts, n)  # n: no expert (unrecorded)
    order, counts = _group_order(dest, n)
    starts = jnp.cumsum(counts) - counts
    dest = dest[order]
    pos = jnp.arange(m * K) - starts[dest]  # rank within its destination
    fits = (dest < n) & (pos < send_capacity)
    slot = jnp.where(fits, dest * send_capacity + pos, n * send_capacity)
    return (slot, order // K, flat[order] % local_experts, order), counts[:n]


def _all_to_all_path(ffn, x, weights, w, layout, rows, axes):
    """Send each assignment in `layout` (`_send_layout`) to its expert's shard, run the local
    experts there, bring the outputs back and combine them with the routing weights."""
    slot, token, local_id, order = layout
    send_x = jnp.zeros((rows + 1, x.shape[-1]), x.dtype).at[slot].set(x[token])[:rows]
    send_id = jnp.full((rows + 1,), -1, jnp.int32).at[slot].set(local_id)[:rows]
    # Block j of the buffer goes to expert shard j; block i of what arrives came from shard i.
    exchange = lambda t: jax.lax.all_to_all(t, axes, 0, 0, tiled=True)
    recv_x, recv_id = exchange(send_x), exchange(send_id)  # [n*C, D], [n*C]
    y = ffn(recv_x, recv_id[:, None], jnp.ones((rows, 1), weights.dtype), *w)  # [n*C, D]
    back = jnp.concatenate([exchange(y), jnp.zeros((1, y.shape[-1]), y.dtype)])  # [n*C + 1, D]
    row_weights = weights.reshape(-1)[order].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(back[slot] * row_weights[:, None])  # [m, D]
