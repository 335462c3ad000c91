"""Attention of T queries over S keys: the materialised reference and the blocked (flash) form.

Layout (that of `layers.Attention`): queries [B, N, T*G, Dh] with row t*G + g holding query head
n*G + g of token t (grouped-query attention: G query heads share kv head n), keys and values
[B, N, S, Dh] (a full forward's own keys, or the slots of a KV cache).

Visibility comes from positions and segment ids, never from indices (`attention_mask`): a key is
visible to a query when it is a real token (position >= 0) at a position <= the query's, within
the sliding window, and in the query's segment when rows are packed. Both forms compute it from
the same function; the blocked form does so one [B, block_q, block_k] tile at a time.

* "dense": the logits [B, N, T, G, S] and a [B, T, S] mask in float32, softmax, one matmul.
  Fast for short rows; memory quadratic in the sequence.
* "blocked": FlashAttention-2 in XLA. The queries in blocks of `block_q` tokens, each block
  visiting the key blocks with an online softmax (running max, normalizer and output in
  float32), key blocks no query of the block can see skipped (`_block_table`, from the
  positions' and segments' per-block ranges). A custom VJP keeps the output and the
  log-sum-exp of every query and recomputes each tile's probabilities in the backward, so
  neither pass holds more than one [B, N, block_q, G, block_k] tile: memory linear in T and S.
  Exact against "dense" for every query with at least one visible key; a query that sees no
  key (a padding query) gets output 0 and no gradient (the dense form averages the values).
* "auto" (`default_impl`): "blocked" once the keys span two blocks, "dense" below; on a GPU also
  "dense" for one query a row over a cache (a decode step with `layers.GPU_BLOCKED_DECODE` off,
  whose default on takes the Triton kernel over the filled slots instead: its logits [B, N, G, S]
  are smaller than the layer's cache, read once by two batched matmuls).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from espo import errors, sharding
from espo.model import config as config_lib
from espo.model import gpu_attention

IMPLS = config_lib.ATTENTION_IMPLS  # ("auto", "dense", "blocked", "triton", "splash")
# "auto" takes the Triton kernel on a GPU: on an H200, bf16, value + gradient of one row with
# Qwen3's heads, 1.2-2.0x the blocked XLA form from 2k to 32k tokens (bench_attention.py)
GPU_KERNEL = True
BLOCK_Q = 512  # query tokens per block (each holds G rows per kv head)
BLOCK_K = 512  # key slots per block
# Finite mask value of the dense form: a query with no visible key gets a uniform, finite
# distribution instead of NaN (one definition: the GPU decode kernel's).
MASK_VALUE = gpu_attention.MASK_VALUE


def attention_mask(
    *,
    q_positions: Int[Array, "B T"],
    kv_positions: Int[Array, "B S"],
    sliding_window: int | None,
    q_segments: Int[Array, "B T"] | None = None,
    kv_segments: Int[Array, "B S"] | None = None,
) -> Bool[Array, "B T S"]:
    """Visibility of each key slot to each query: real, causal, within the window, and (packed
    rows, `q_segments` / `kv_segments` given) in the query's own segment: block-diagonal.

    Positions restart in every segment, so "causal by position" is causal only within one
    segment; the segment test is what keeps a sequence from reading its row neighbours.
    """
    q = q_positions[:, :, None]  # [B, T, 1]
    k = kv_positions[:, None, :]  # [B, 1, S]
    visible = (k >= 0) & (k <= q)
    if sliding_window is not None:
        visible &= q - k < sliding_window
    if q_segments is not None:
        visible &= q_segments[:, :, None] == kv_segments[:, None, :]  # [B, T, S]
    return visible


def default_impl(
    num_keys: int, *, own_keys: bool = False, sliding_window=None, num_queries: int = 0
) -> str:
    """The form "auto" takes for `num_keys` key slots and `num_queries` query tokens a row:
    dense below two key blocks; above, on a TPU splash attention for a forward's own keys
    (`own_keys`), on a GPU the Pallas Triton kernel where it is on (`GPU_KERNEL`, no sliding
    window) and dense for one query over a cache (a decode step with `layers.GPU_BLOCKED_DECODE`
    off: on an H200 at 16 rows x 32k slots 4.0 ms a step against the blocked loop's 15.1,
    docs/gpu run 8), else blocked (XLA)."""
    backend = jax.default_backend()
    if num_keys < 2 * BLOCK_K or (backend == "gpu" and num_queries == 1 and not own_keys):
        return "dense"
    if own_keys and backend == "tpu":
        return "splash"
    if own_keys and backend == "gpu" and GPU_KERNEL and sliding_window is None:
        return "triton"
    return "blocked"


def attend(
    q: Float[Array, "B N TG Dh"],
    k: Float[Array, "B N S Dh"],
    v: Float[Array, "B N S Dh"],
    *,
    q_positions: Int[Array, "B T"],
    kv_positions: Int[Array, "B S"],
    q_segments: Int[Array, "B T"] | None = None,
    kv_segments: Int[Array, "B S"] | None = None,
    sliding_window: int | None = None,
    dtype=jnp.float32,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    own_keys: bool = False,
) -> Float[Array, "B N TG Dh"]:
    """Softmax attention of `q` over `k` / `v` with position-based visibility (module docstring).

    `dtype` is the compute dtype of the matmuls (softmax statistics are float32); `impl`,
    `block_q`, `block_k` (default BLOCK_Q / BLOCK_K), `sliding_window` and `own_keys` are
    static. `own_keys`: the keys are the queries' own tokens in order (a forward without a
    cache) with positions rising by one per token within a segment, as every espo forward
    builds them; only then does a backend's kernel run ("triton", "splash": masks causal by
    index and by segment), and a forward over a cache takes "dense" or "blocked" instead.
    Under a context mesh (`jax.set_mesh`) a kernel runs in a shard_map over the batch axes,
    each device on its own rows (XLA does not partition a Pallas call); rows the mesh does
    not split evenly take "blocked", which XLA partitions.
    """
    if impl not in IMPLS:
        raise errors.InvalidValue("", "attention_impl", impl, f"one of {IMPLS}")
    if (q_segments is None) != (kv_segments is None):
        raise ValueError("q_segments and kv_segments are given together (packed rows) or not")
    T = q_positions.shape[1]
    if impl == "auto":
        impl = default_impl(
            k.shape[2], own_keys=own_keys, sliding_window=sliding_window, num_queries=T
        )
    if impl in KERNELS and not own_keys:  # a cache's slots: the kernels' masks do not apply
        impl = default_impl(k.shape[2], num_queries=T)
    if impl in KERNELS and q.shape[0] % row_shards():  # rows a mesh cannot split: XLA does
        impl = "blocked"
    if impl in KERNELS:
        real = kv_positions >= 0  # [B, T]: the kernels' segment 0 is padding
        segments = jnp.where(real, 1 if kv_segments is None else kv_segments, 0)
        kernel = on_own_rows(functools.partial(KERNELS[impl], window=sliding_window), rows_in=4)
        return kernel(q, k, v, segments.astype(jnp.int32))
    if impl == "dense":
        mask = attention_mask(
            q_positions=q_positions,
            kv_positions=kv_positions,
            sliding_window=sliding_window,
            q_segments=q_segments,
            kv_segments=kv_segments,
        )  # [B, T, S]
        return _dense(q, k, v, mask, dtype=dtype)
    packed = q_segments is not None
    if not packed:  # one segment everywhere: the same code path, a test that always passes
        q_segments = jnp.zeros_like(q_positions)
        kv_segments = jnp.zeros_like(kv_positions)
    static = _Static(
        window=sliding_window,
        # No longer than the queries: a decode step's one token over a long cache (a TPU's or
        # a GPU's rollout) is a block of one query, not one padded to BLOCK_Q (512x the work).
        block_q=min(block_q or BLOCK_Q, q_positions.shape[1]),
        block_k=block_k or BLOCK_K,
        dtype=jnp.dtype(dtype),
    )
    ints = lambda a: jnp.asarray(a, jnp.int32)
    return _flash(
        static, q, k, v, ints(q_positions), ints(kv_positions), ints(q_segments), ints(kv_segments)
    )


def row_shards() -> int:
    """How many shards the rows split into over the context mesh (`jax.set_mesh`; 1 without)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else sharding.batch_shards(mesh)


def on_own_rows(kernel, *, rows_in: int, replicated_in: int = 0):
    """`kernel` (a Pallas call: XLA does not partition one) on each device's own rows under the
    context mesh: a shard_map over the batch axes of its first `rows_in` inputs and its output,
    the `replicated_in` inputs after them whole on every device; `kernel` itself without a mesh.
    The caller checks that the mesh splits its rows evenly (`row_shards`)."""
    if row_shards() == 1:
        return kernel
    rows, whole = jax.sharding.PartitionSpec(sharding.BATCH_AXES), jax.sharding.PartitionSpec()
    return jax.shard_map(
        kernel, in_specs=(rows,) * rows_in + (whole,) * replicated_in, out_specs=rows,
        check_vma=False,
    )  # fmt: skip  # a pallas_call states no varying mesh axes of its output


def _dense(q, k, v, mask, *, dtype):
    """The materialised form: logits [B, N, T, G, S] in float32 (the matmul's output too, as
    the blocked form's tiles: not rounded to a bf16 `dtype` first), masked, softmax."""
    B, N, TG, Dh = q.shape
    T = mask.shape[1]
    batch_dims = ((0, 1), (0, 1))
    logits = jax.lax.dot_general(
        q, k.astype(dtype), (((3,), (3,)), batch_dims), preferred_element_type=jnp.float32
    )
    logits = logits.reshape(B, N, T, TG // T, -1) * (Dh**-0.5)
    logits = jnp.where(mask[:, None, :, None, :], logits, MASK_VALUE)  # [B, N, T, G, S]
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype).reshape(B, N, TG, -1)
    return jax.lax.dot_general(probs, v.astype(dtype), (((3,), (2,)), batch_dims))


# ---- the blocked form ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static settings of `_flash` (hashable: a nondiff argument of its custom VJP)."""

    window: int | None
    block_q: int
    block_k: int
    dtype: jnp.dtype


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x, size: int, axis: int, value=0):
    """`x` padded with `value` along `axis` to `size`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


class _Padded(NamedTuple):
    """The blocked form's inputs with T and S padded to whole blocks (padded queries and keys
    have position -1: they see nothing and nothing sees them)."""

    q: Array  # [B, N, nq * bq * G, Dh]
    k: Array  # [B, N, nk * bk, Dh]
    v: Array
    qp: Array  # [B, nq * bq]
    kp: Array  # [B, nk * bk]
    qs: Array
    ks: Array


def _pad(st: _Static, q, k, v, qp, kp, qs, ks) -> _Padded:
    T, S, G = qp.shape[1], kp.shape[1], q.shape[2] // qp.shape[1]
    Tp, Sp = _cdiv(T, st.block_q) * st.block_q, _cdiv(S, st.block_k) * st.block_k
    empty = (kp < 0)[:, None, :, None]  # [B, 1, S, 1]: no key here; it may hold anything
    clean = lambda a: _pad_to(jnp.where(empty, jnp.zeros((), a.dtype), a), Sp, 2)
    return _Padded(
        q=_pad_to(q, Tp * G, 2),
        k=clean(k),  # a masked tile entry's p is 0, and 0 * NaN would still be NaN
        v=clean(v),
        qp=_pad_to(qp, Tp, 1, -1),
        kp=_pad_to(kp, Sp, 1, -1),
        qs=_pad_to(qs, Tp, 1, -1),
        ks=_pad_to(ks, Sp, 1, -1),
    )


def _block_table(st: _Static, p: _Padded) -> Bool[Array, "nq nk"]:
    """Whether any query of block i may see any key of block j, in any row: from each block's
    range of positions and segments (conservative: a True tile may still be all masked, a
    False one never holds a visible pair)."""
    B, big = p.qp.shape[0], jnp.iinfo(jnp.int32).max
    blocks = lambda a, n: a.reshape(B, -1, n)
    qp, qs = blocks(p.qp, st.block_q), blocks(p.qs, st.block_q)  # [B, nq, bq]
    kp, ks = blocks(p.kp, st.block_k), blocks(p.ks, st.block_k)  # [B, nk, bk]
    real = kp >= 0
    k_min = jnp.min(jnp.where(real, kp, big), -1)[:, None, :]  # [B, 1, nk]; big: no real key
    k_max = jnp.max(jnp.where(real, kp, -1), -1)[:, None, :]
    ks_min = jnp.min(jnp.where(real, ks, big), -1)[:, None, :]
    ks_max = jnp.max(jnp.where(real, ks, -big), -1)[:, None, :]
    q_min, q_max = jnp.min(qp, -1)[:, :, None], jnp.max(qp, -1)[:, :, None]  # [B, nq, 1]
    ok = (k_min <= q_max) & (ks_min <= jnp.max(qs, -1)[:, :, None])
    ok &= jnp.min(qs, -1)[:, :, None] <= ks_max
    if st.window is not None:
        ok &= q_min - k_max < st.window
    return ok.any(0)  # [nq, nk]


def _tile_logits(st: _Static, q, k, qp, kp, qs, ks) -> Float[Array, "B N R bk"]:
    """Scaled logits of query rows q [B, N, R = bq * G, Dh] against keys k [B, N, bk, Dh] in
    float32, -inf where the key is not visible."""
    B, N, R, Dh = q.shape
    bq, bk = qp.shape[1], kp.shape[1]
    s = jax.lax.dot_general(
        q.astype(st.dtype), k.astype(st.dtype), (((3,), (3,)), ((0, 1), (0, 1))),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    visible = attention_mask(
        q_positions=qp, kv_positions=kp, sliding_window=st.window, q_segments=qs, kv_segments=ks
    )  # [B, bq, bk]
    s = s.reshape(B, N, bq, R // bq, bk) * (Dh**-0.5)
    return jnp.where(visible[:, None, :, None, :], s, -jnp.inf).reshape(B, N, R, bk)


def _dot(a, b, contract, dtype):
    """a . b over axes `contract` with (B, N) batch axes, in `dtype`, accumulated in float32."""
    dims = (contract, ((0, 1), (0, 1)))
    return jax.lax.dot_general(
        a.astype(dtype), b.astype(dtype), dims, preferred_element_type=jnp.float32
    )


def _slice(a, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis)


def _forward(st: _Static, q, k, v, qp, kp, qs, ks):
    """The output [B, N, T*G, Dh] and each query row's log-sum-exp [B, N, T*G] (-inf where no
    key is visible)."""
    B, N, TG, Dh = q.shape
    G, bq, bk = TG // qp.shape[1], st.block_q, st.block_k
    p = _pad(st, q, k, v, qp, kp, qs, ks)
    nq, nk, R = p.qp.shape[1] // bq, p.kp.shape[1] // bk, bq * G
    table = _block_table(st, p)

    def query_block(i):
        qi = _slice(p.q, i * R, R, 2)  # [B, N, R, Dh]
        qpi, qsi = _slice(p.qp, i * bq, bq, 1), _slice(p.qs, i * bq, bq, 1)

        def tile(j, carry):
            m, total, acc = carry  # [B, N, R] running max and normalizer; [B, N, R, Dh]
            kj, vj = _slice(p.k, j * bk, bk, 2), _slice(p.v, j * bk, bk, 2)
            kpj, ksj = _slice(p.kp, j * bk, bk, 1), _slice(p.ks, j * bk, bk, 1)
            s = _tile_logits(st, qi, kj, qpi, kpj, qsi, ksj)  # [B, N, R, bk]
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no visible key yet: p = 0
            probs = jnp.exp(s - m_safe[..., None])  # [B, N, R, bk], 0 where masked
            rescale = jnp.exp(m - m_safe)
            acc = acc * rescale[..., None] + _dot(probs, vj, ((3,), (2,)), st.dtype)
            return m_new, total * rescale + jnp.sum(probs, axis=-1), acc

        def visit(j, carry):
            return jax.lax.cond(table[i, j], functools.partial(tile, j), lambda c: c, carry)

        init = (
            jnp.full((B, N, R), -jnp.inf, jnp.float32),
            jnp.zeros((B, N, R), jnp.float32),
            jnp.zeros((B, N, R, Dh), jnp.float32),
        )
        m, total, acc = jax.lax.fori_loop(0, nk, visit, init)
        out = acc / jnp.where(total > 0, total, 1.0)[..., None]
        lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
        return out.astype(st.dtype), lse

    outs, lses = jax.lax.map(query_block, jnp.arange(nq))  # [nq, B, N, R, ...]
    out = jnp.moveaxis(outs, 0, 2).reshape(B, N, nq * R, Dh)[:, :, :TG]
    lse = jnp.moveaxis(lses, 0, 2).reshape(B, N, nq * R)[:, :, :TG]
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, qp, kp, qs, ks):
    return _forward(st, q, k, v, qp, kp, qs, ks)[0]


def _flash_fwd(st, q, k, v, qp, kp, qs, ks):
    out, lse = _forward(st, q, k, v, qp, kp, qs, ks)
    return out, (q, k, v, qp, kp, qs, ks, out, lse)


def _flash_bwd(st, res, d_out):
    """FlashAttention-2's backward: per key block, the query blocks that may see it, each tile's
    probabilities recomputed from the saved log-sum-exp; dq accumulated in float32."""
    q, k, v, qp, kp, qs, ks, out, lse = res
    B, N, TG, Dh = q.shape
    S, G, bq, bk = k.shape[2], TG // qp.shape[1], st.block_q, st.block_k
    p = _pad(st, q, k, v, qp, kp, qs, ks)
    nq, nk, R = p.qp.shape[1] // bq, p.kp.shape[1] // bk, bq * G
    table = _block_table(st, p)
    rows = nq * R
    d_out = _pad_to(d_out.astype(jnp.float32), rows, 2)  # [B, N, rows, Dh]
    delta = jnp.sum(d_out * _pad_to(out.astype(jnp.float32), rows, 2), axis=-1)  # [B, N, rows]
    lse = _pad_to(lse, rows, 2, -jnp.inf)
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # such rows see no key: every p below is 0
    scale = Dh**-0.5

    def key_block(dq, j):
        kj, vj = _slice(p.k, j * bk, bk, 2), _slice(p.v, j * bk, bk, 2)  # [B, N, bk, Dh]
        kpj, ksj = _slice(p.kp, j * bk, bk, 1), _slice(p.ks, j * bk, bk, 1)

        def tile(i, carry):
            dq, dk, dv = carry
            qi, d_oi = _slice(p.q, i * R, R, 2), _slice(d_out, i * R, R, 2)  # [B, N, R, Dh]
            qpi, qsi = _slice(p.qp, i * bq, bq, 1), _slice(p.qs, i * bq, bq, 1)
            s = _tile_logits(st, qi, kj, qpi, kpj, qsi, ksj)  # [B, N, R, bk]
            probs = jnp.exp(s - _slice(lse, i * R, R, 2)[..., None])  # 0 where masked
            dv = dv + _dot(probs, d_oi, ((2,), (2,)), st.dtype)  # [B, N, bk, Dh]
            dp = _dot(d_oi, vj, ((3,), (3,)), st.dtype)  # [B, N, R, bk]
            ds = probs * (dp - _slice(delta, i * R, R, 2)[..., None]) * scale
            dq_i = _slice(dq, i * R, R, 2) + _dot(ds, kj, ((3,), (2,)), st.dtype)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * R, 2)
            return dq, dk + _dot(ds, qi, ((2,), (2,)), st.dtype), dv

        def visit(i, carry):
            return jax.lax.cond(table[i, j], functools.partial(tile, i), lambda c: c, carry)

        zeros = jnp.zeros((B, N, bk, Dh), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, nq, visit, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dks, dvs) = jax.lax.scan(
        key_block, jnp.zeros((B, N, rows, Dh), jnp.float32), jnp.arange(nk)
    )
    per_key = lambda d: jnp.moveaxis(d, 0, 2).reshape(B, N, nk * bk, Dh)[:, :, :S]
    return (
        dq[:, :, :TG].astype(q.dtype),
        per_key(dks).astype(k.dtype),
        per_key(dvs).astype(v.dtype),
        None, None, None, None,
    )  # fmt: skip


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- backend kernels: causal by index, segments from the positions ------------------------------
# For a forward's own keys (no cache) with positions rising by one per token within a segment,
# "visible" (position-based, above) equals "same segment and key index <= query index" for every
# real query, with padding as segment 0 (a padding query then sees padding keys: its output is
# finite and reaches nothing). A sliding window of W positions is a window of W - 1 indices.
KERNEL_BLOCK = 128  # both kernels take whole blocks of 128 tokens: rows are padded to them


def _interpret(platform: str) -> bool:
    """Pallas' interpret mode off the kernel's own platform (the tests run the kernels on CPU)."""
    return jax.default_backend() != platform


def _heads_layout(q, k, v, segments):
    """[B, N, T*G, Dh] / [B, N, T, Dh] -> [B, T, H, Dh] / [B, T, N, Dh] with T padded to whole
    kernel blocks (segment 0: padding)."""
    B, N, TG, Dh = q.shape
    T = segments.shape[1]
    Tp = _cdiv(T, KERNEL_BLOCK) * KERNEL_BLOCK
    q = q.reshape(B, N, T, TG // T, Dh).transpose(0, 2, 1, 3, 4).reshape(B, T, -1, Dh)
    k, v = (jnp.swapaxes(a, 1, 2) for a in (k, v))  # [B, T, N, Dh]
    pad = lambda a: _pad_to(a, Tp, 1)
    return pad(q), pad(k), pad(v), pad(segments)


def _back(out, like):
    """[B, Tp, H, Dh] -> the layout of `like` [B, N, T*G, Dh]."""
    B, N, TG, Dh = like.shape
    T = TG // (out.shape[2] // N)
    out = out[:, :T].reshape(B, T, N, -1, Dh).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, N, TG, Dh)


def _triton(q, k, v, segments, *, window):
    """JAX's Pallas Triton flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`,
    forward and backward kernels): no grouped-query form, so k / v are repeated per query head;
    no sliding window."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_flash

    if window is not None:
        raise ValueError("attention_impl='triton' has no sliding window: use 'blocked'")
    G, Dh = q.shape[2] // segments.shape[1], q.shape[-1]  # query heads per kv head
    qh, kh, vh, seg = _heads_layout(q, k, v, segments)
    kh, vh = jnp.repeat(kh, G, axis=2), jnp.repeat(vh, G, axis=2)  # [B, Tp, H, Dh]
    out = gpu_flash.mha(
        qh, kh, vh, seg, sm_scale=Dh**-0.5, causal=True, interpret=_interpret("gpu"),
        block_sizes=gpu_flash.BlockSizes.get_default(),
    )  # fmt: skip
    return _back(out, q)


def _splash(q, k, v, segments, *, window):
    """JAX's splash attention for TPUs (`jax.experimental.pallas.ops.tpu.splash_attention`,
    MaxText's): grouped-query heads, segment ids and a causal (or local) mask built in; one
    row at a time (vmap)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    qh, kh, vh, seg = _heads_layout(q, k, v, segments)
    H, Tp, Dh = qh.shape[2], qh.shape[1], qh.shape[-1]
    shape = (Tp, Tp)
    mask = (
        splash.CausalMask(shape) if window is None else splash.LocalMask(shape, (window - 1, 0), 0)
    )
    b = KERNEL_BLOCK
    sizes = splash.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
        block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    kernel = splash.make_splash_mha_single_device(
        splash.MultiHeadMask([mask] * H), block_sizes=sizes, interpret=_interpret("tpu")
    )
    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # [B, heads, Tp, Dh]
    ids = jax.vmap(lambda s: splash.SegmentIds(q=s, kv=s))(seg)
    out = jax.vmap(kernel)(
        heads_first(qh * jnp.asarray(Dh**-0.5, qh.dtype)), heads_first(kh), heads_first(vh),
        segment_ids=ids,
    )  # fmt: skip
    return _back(heads_first(out), q)


KERNELS = {"triton": _triton, "splash": _splash}
