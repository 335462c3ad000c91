"""Decode attention over the filled cache slots on a GPU: one Pallas Triton kernel.

`layers.decode_attention` on CPU loops over the filled blocks of the cache in XLA; on a GPU that
loop's trip count would be read back by the host every layer. Here the loop runs inside one
kernel: program (b, n, s) takes kv head n of row b and visits the blocks s, s + splits, ... of
the first `filled` slots of the layer's cache (in place: the [B, N, S, Dh] buffers are read,
never copied), with an online softmax in float32; the `splits` partial results are
combined in XLA (their maxima, normalizers and outputs). A step's cost grows with the tokens
written so far, not with the buffer. The mask is any [B, S] pattern (left padding, holes);
a block's slots past `filled` are read but masked. The last block starts at S - BLOCK when S is
no multiple of BLOCK; the slots it shares with the block before are masked out. Off a GPU the
same kernel runs in Pallas' interpret mode (tests/model/test_decode_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

BLOCK = 64  # cache slots a program reads at a time
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def supported(head_dim: int, slots: int) -> bool:
    """Whether the kernel takes a cache of `slots` slots of width `head_dim` (Triton: a power of
    two >= 16; at least one block of slots)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and slots >= BLOCK


def _splits(rows: int) -> int:
    """Programs per (row, kv head): enough programs for a GPU's ~132 SMs at small batches."""
    return max(1, min(16, 256 // max(rows, 1)))


def _kernel(filled_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, *, splits):
    b, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slots_total, filled = k_ref.shape[2], filled_ref[0]
    q = q_ref[b, n]  # [Gp, Dh]
    gp, dh = q.shape
    scale = dh**-0.5

    def body(i, carry):
        m, total, acc = carry  # [Gp], [Gp], [Gp, Dh]
        first = (s + i * splits) * BLOCK
        start = jnp.minimum(first, slots_total - BLOCK)
        slots = pl.ds(start, BLOCK)
        k, v = k_ref[b, n, slots, :], v_ref[b, n, slots, :]  # [BLOCK, Dh]
        visible = (mask_ref[b, slots] != 0) & (start + jnp.arange(BLOCK) >= first)
        dims = (((1,), (1,)), ((), ()))
        logits = jax.lax.dot_general(q, k.astype(q.dtype), dims, preferred_element_type=jnp.float32)
        logits = jnp.where(visible[None, :], logits * scale, MASK_VALUE)  # [Gp, BLOCK]
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        p = jnp.exp(logits - m_new[:, None])
        rescale = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(
            p.astype(q.dtype), v.astype(q.dtype), (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return m_new, total * rescale + jnp.sum(p, axis=1), acc * rescale[:, None] + pv

    blocks = (filled + BLOCK - 1) // BLOCK
    trips = jnp.maximum((blocks - s + splits - 1) // splits, 0)
    init = (
        jnp.full((gp,), MASK_VALUE, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        jnp.zeros((gp, dh), jnp.float32),
    )
    m, total, acc = jax.lax.fori_loop(0, trips, body, init)
    o_ref[s, b, n] = acc
    m_ref[s, b, n] = m
    l_ref[s, b, n] = total


def decode_attention(
    q: Float[Array, "B N G Dh"],
    cache_k: Float[Array, "B N S Dh"],
    cache_v: Float[Array, "B N S Dh"],
    mask: Bool[Array, "B 1 S"],
    *,
    filled: Int[Array, " "],
    dtype,
    interpret: bool | None = None,
) -> Float[Array, "B N G Dh"]:
    """One query a row (G query heads per kv head) over the first `filled` visible slots of
    one layer's cache; `layers.decode_attention`'s contract."""
    B, N, G, Dh = q.shape
    gp = max(16, 1 << (G - 1).bit_length())  # Triton's smallest dot: 16 rows
    splits = _splits(B * N)
    q = jnp.pad(q.astype(dtype), ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        extra["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=2)
    partial = jax.ShapeDtypeStruct
    o, m, total = pl.pallas_call(
        functools.partial(_kernel, splits=splits),
        grid=(B, N, splits),
        out_shape=(
            partial((splits, B, N, gp, Dh), jnp.float32),
            partial((splits, B, N, gp), jnp.float32),
            partial((splits, B, N, gp), jnp.float32),
        ),
        interpret=interpret,
        **extra,
    )(
        jnp.asarray(filled, jnp.int32).reshape(1),
        q,
        cache_k,
        cache_v,
        mask[:, 0].astype(jnp.int8),
    )
    weight = jnp.exp(m - jnp.max(m, axis=0))  # [splits, B, N, Gp]
    out = jnp.sum(weight[..., None] * o, axis=0) / jnp.sum(weight * total, axis=0)[..., None]
    return out[:, :, :G].astype(dtype)
