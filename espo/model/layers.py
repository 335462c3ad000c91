"""Norms, rotary embeddings, GQA attention and the explicit KV cache.

Invariants:
  * Attention masks are built from *positions*, not indices: a key is visible to a query when it
    is a real token (`kv_positions >= 0`) at a position <= the query's (and within the sliding
    window). Left padding, right padding and cached decoding therefore share one code path.
    Packed rows (several sequences end to end, `segment_ids`) add one test: the key is in the
    query's segment.
  * The KV cache is a value (`KVCache`) passed in and returned; nothing is stored in the module.
  * Softmax and norms are computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from espo import quant
from espo.model import attention, gpu_attention
from espo.model import config as config_lib

# Finite mask value: a query row with no visible key (a padding query) gets a uniform, finite
# distribution instead of NaN. The GPU decode kernel masks with the same value.
_MASK_VALUE = gpu_attention.MASK_VALUE
attention_mask = attention.attention_mask  # visibility from positions (espo.model.attention)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, written slot by slot.

    Attributes:
      k, v: one buffer per layer, [B, N, S, head_dim] in the compute dtype (heads before slots,
        so attention's dots need no transpose of the cache). Per-layer buffers, not one
        [L, ...] array: a decode step's attention then reads its layer's buffer in place, where
        slicing a layer out of a stacked cache copies it every step on CPU.
      kv_positions: int32 [B, S], the position of the token in each slot, -1 for empty slots and
        padding; attention visibility is derived from it.
      index: int32 [], the next slot to write (all rows write the same slots).
    """

    k: tuple[Float[Array, "B N S Dh"], ...]
    v: tuple[Float[Array, "B N S Dh"], ...]
    kv_positions: Int[Array, "B S"]
    index: Int[Array, " "]

    @property
    def max_length(self) -> int:
        return self.kv_positions.shape[1]

    def repeat(self, n: int) -> KVCache:
        """Each row repeated n times, adjacent (row b -> rows b*n .. b*n + n - 1)."""
        rows = lambda a: jnp.repeat(a, n, axis=0)
        return KVCache(
            k=tuple(map(rows, self.k)),
            v=tuple(map(rows, self.v)),
            kv_positions=rows(self.kv_positions),
            index=self.index,
        )


def init_cache(cfg: config_lib.ModelConfig, *, batch: int, max_length: int) -> KVCache:
    """An empty cache for `batch` rows of at most `max_length` tokens."""
    shape = (batch, cfg.num_kv_heads, max_length, cfg.head_dim)
    empty = lambda: tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
    return KVCache(
        k=empty(),
        v=empty(),
        kv_positions=jnp.full((batch, max_length), -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, statistics in float32 (as Hugging Face)."""

    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def apply_rope(
    x: Float[Array, "B T H Dh"], positions: Int[Array, "B T"], *, theta: float
) -> Float[Array, "B T H Dh"]:
    """Rotary embedding in the rotate-half layout used by Llama, Qwen and Mixtral."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)  # [B, T, 1, half]
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def fuse_qkv(attn: dict) -> dict:
    """One layer's attention params with q/k/v as one `qkv_proj` [D, H + 2N, Dh] (heads
    concatenated), which `Attention` multiplies in one matmul: one launch and one read of the
    activations instead of three in a decode step. FP8 weights concatenate their values and
    per-channel scales; per-block scales only where every weight's width is whole blocks
    (else the params come back as they are)."""
    ws = [attn.get(name) for name in ("q_proj", "k_proj", "v_proj")]
    if any(w is None for w in ws):
        return attn
    rest = {k: v for k, v in attn.items() if k not in ("q_proj", "k_proj", "v_proj")}
    if not any(isinstance(w, quant.Fp8Tensor) for w in ws):
        return {**rest, "qkv_proj": jnp.concatenate(ws, axis=-2)}
    if not all(isinstance(w, quant.Fp8Tensor) and w.values.ndim == 3 for w in ws):
        return attn
    block = ws[0].block
    widths = [w.values.shape[1] * w.values.shape[2] for w in ws]
    if any(w.block != block for w in ws) or (block and any(n % block for n in widths)):
        return attn
    fused = quant.Fp8Tensor(
        values=jnp.concatenate([w.values for w in ws], axis=1),
        scales=jnp.concatenate([w.scales for w in ws], axis=-1),
        num_in_axes=1, num_out_axes=2, block=block,
    )  # fmt: skip
    return {**rest, "qkv_proj": fused}


def _dense_init(fan_in: int):
    return nn.initializers.normal(stddev=fan_in**-0.5)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (Qwen3) and RoPE."""

    cfg: config_lib.ModelConfig

    @nn.compact
    def __call__(
        self,
        x: Float[Array, "B T D"],
        *,
        positions: Int[Array, "B T"],
        kv_positions: Int[Array, "B S"],
        segment_ids: Int[Array, "B T"] | None,
        kv: tuple[Array, Array] | None,
        write_index: Int[Array, " "] | None,
    ) -> tuple[Float[Array, "B T D"], tuple[Array, Array] | None]:
        """kv: this layer's cache (k, v) [B, N, S, Dh], written in place at write_index;
        kv_positions: the position of every key slot (-1: empty or padding), from which
        `espo.model.attention` derives visibility; segment_ids: packed rows (no cache)."""
        cfg = self.cfg
        D, H, N, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd, dt = cfg.jnp_param_dtype, cfg.jnp_dtype
        # quant.project: jnp.einsum(eq, x, w.astype(dt)), an FP8 weight's scales after the dot.
        # The params are made in this order (q, k, v, o): init draws each from the next key.
        if self.has_variable("params", "qkv_proj"):  # decode params (`fuse_qkv`): one matmul
            qkv = self.param("qkv_proj", _dense_init(D), (D, H + 2 * N, Dh), pd)
            qkv = quant.project("btd,dhk->bthk", x, qkv, dt)  # [B, T, H + 2N, Dh]
            q, k, v = qkv[:, :, :H], qkv[:, :, H : H + N], qkv[:, :, H + N :]
        else:
            wq = self.param("q_proj", _dense_init(D), (D, H, Dh), pd)
            wk = self.param("k_proj", _dense_init(D), (D, N, Dh), pd)
            wv = self.param("v_proj", _dense_init(D), (D, N, Dh), pd)
            q = quant.project("btd,dhk->bthk", x, wq, dt)  # [B, T, H, Dh]
            k = quant.project("btd,dnk->btnk", x, wk, dt)  # [B, T, N, Dh]
            v = quant.project("btd,dnk->btnk", x, wv, dt)  # [B, T, N, Dh]
        wo = self.param("o_proj", _dense_init(H * Dh), (H, Dh, D), pd)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_eps, pd, name="q_norm")(q)
            k = RMSNorm(cfg.rms_eps, pd, name="k_norm")(k)
        q = apply_rope(q, positions, theta=cfg.rope_theta)
        k = apply_rope(k, positions, theta=cfg.rope_theta)

        k = jnp.swapaxes(k, 1, 2)  # [B, N, T, Dh]
        v = jnp.swapaxes(v, 1, 2)  # [B, N, T, Dh]
        B, T = x.shape[:2]
        G = H // N  # query heads per kv head (head h = n * G + g, as Hugging Face's repeat_kv)
        # Dots with (B, N) as leading batch dims and the cache in [B, N, S, Dh]: XLA runs them
        # without transposing the cache (3x faster decode on CPU than an einsum over T, G).
        q = q.reshape(B, T, N, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, N, T * G, Dh)
        if kv is None:
            keys, values, new_kv = k, v, None
        else:
            cache_k, cache_v = kv  # this layer's [B, N, S, Dh]
            start = (0, 0, write_index, 0)
            cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), start)
            cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), start)
            new_kv = keys, values = cache_k, cache_v
        if kv is not None and blocked_decode(T, keys.shape):
            mask = attention_mask(
                q_positions=positions, kv_positions=kv_positions, sliding_window=cfg.sliding_window
            )  # [B, 1, S]: one token a row
            out = decode_attention(
                q, *new_kv, mask, filled=write_index + T, dtype=dt
            )  # [B, N, T * G, Dh]
        else:
            out = attention.attend(
                q, keys, values,
                q_positions=positions, kv_positions=kv_positions,
                q_segments=segment_ids, kv_segments=segment_ids,
                sliding_window=cfg.sliding_window, dtype=dt, impl=cfg.attention_impl,
                own_keys=kv is None,
            )  # fmt: skip  # [B, N, T * G, Dh]
        out = out.reshape(B, N, T, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, T, H, Dh)
        return quant.project("bthk,hkd->btd", out, wo, dt), new_kv  # [B, T, D]


# A decode step attends over the filled cache slots only, DECODE_BLOCK slots at a time, once the
# cache holds at least two blocks (`blocked_decode`). On CPU the block loop is XLA's; on a GPU
# (its trip count would be read on the host each layer) it runs inside `gpu_attention`'s Triton
# kernel (GPU_BLOCKED_DECODE). On an H200 (docs/gpu run 8, bench_long_decode.py --attention) the
# kernel's step over 16 rows x 32k tokens took 2.4 ms, the dense softmax over the buffer (what
# `attention.default_impl` takes with this off) 4.0 ms, XLA's blocked loop 15.1 ms.
DECODE_BLOCK = 256
GPU_BLOCKED_DECODE = True


def blocked_decode(query_length: int, cache_shape: tuple[int, ...]) -> bool:
    """Whether a forward of `query_length` tokens over one layer's cache [B, N, S, Dh] takes
    `decode_attention` (one token a row, at least two DECODE_BLOCKs of slots): on CPU always; on
    a GPU with GPU_BLOCKED_DECODE on (the default) where its Triton kernel runs (`supported`,
    rows the mesh splits evenly), else a GPU takes `attention.attend`'s dense form."""
    B, _, S, Dh = cache_shape
    if query_length != 1 or S < 2 * DECODE_BLOCK:
        return False
    backend = jax.default_backend()
    if backend == "gpu":
        return GPU_BLOCKED_DECODE and _gpu_kernel_runs(B, S, Dh)
    return backend == "cpu"


def _gpu_kernel_runs(rows: int, slots: int, head_dim: int) -> bool:
    """Whether `gpu_attention`'s kernel takes this cache: its widths and slots, and rows the
    context mesh splits evenly (each device runs it on its own rows: `attention.on_own_rows`)."""
    return gpu_attention.supported(head_dim, slots) and rows % attention.row_shards() == 0


def decode_attention(
    q: Float[Array, "B N TG Dh"],
    cache_k: Float[Array, "B N S Dh"],
    cache_v: Float[Array, "B N S Dh"],
    mask: Bool[Array, "B T S"],
    *,
    filled: Int[Array, " "],
    dtype,
) -> Float[Array, "B N TG Dh"]:
    """Attention of queries [B, N, T*G, Dh] over the first `filled` slots of one layer's
    cache (every slot past them is empty), DECODE_BLOCK slots at a time with an online softmax
    (running max, normalizer and output in float32): a step's cost grows with the tokens
    written so far, not with the buffer. Exact against the whole-buffer softmax for every query
    with a visible key. The last block starts at S - DECODE_BLOCK when S is no multiple of it;
    the slots it shares with the block before are masked out."""
    block, (B, N, TG, Dh), S = DECODE_BLOCK, q.shape, cache_k.shape[2]
    # Else XLA's loop below (a layer takes the dense form there instead: `blocked_decode`).
    if jax.default_backend() == "gpu" and mask.shape[1] == 1 and _gpu_kernel_runs(B, S, Dh):
        kernel = attention.on_own_rows(
            lambda *a: gpu_attention.decode_attention(*a[:4], filled=a[4], dtype=dtype),
            rows_in=4, replicated_in=1,
        )  # fmt: skip  # under a mesh each device on its own rows
        return kernel(q, cache_k, cache_v, mask, jnp.asarray(filled, jnp.int32))
    T = mask.shape[1]
    G = TG // T
    batch_dims = ((0, 1), (0, 1))

    def body(i, carry):
        m, total, acc = carry  # max, normalizer [B, N, TG]; output [B, N, TG, Dh]
        first = i * block
        start = jnp.minimum(first, S - block)
        window = (B, N, block, Dh)
        k = jax.lax.dynamic_slice(cache_k, (0, 0, start, 0), window)
        v = jax.lax.dynamic_slice(cache_v, (0, 0, start, 0), window)
        visible = jax.lax.dynamic_slice(mask, (0, 0, start), (B, T, block))
        visible &= start + jnp.arange(block) >= first  # not the previous block's slots again
        s = jax.lax.dot_general(
            q, k.astype(dtype), (((3,), (3,)), batch_dims), preferred_element_type=jnp.float32
        )  # float32 logits, as the GPU kernel's (not rounded to a bf16 dtype first)
        s = s.reshape(B, N, T, G, block) * (Dh**-0.5)
        s = jnp.where(visible[:, None, :, None, :], s, _MASK_VALUE).reshape(B, N, TG, block)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(
            p.astype(dtype), v.astype(dtype), (((3,), (2,)), batch_dims),
            preferred_element_type=jnp.float32,
        )  # fmt: skip  # each block's product in float32, as the GPU kernel's
        acc = acc * rescale[..., None] + pv.astype(jnp.float32)
        return m_new, total * rescale + jnp.sum(p, axis=-1), acc

    init = (
        jnp.full((B, N, TG), -jnp.inf, jnp.float32),
        jnp.zeros((B, N, TG), jnp.float32),
        jnp.zeros((B, N, TG, Dh), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, (filled + block - 1) // block, body, init)
    return (acc / total[..., None]).astype(dtype)


class SwiGLU(nn.Module):
    """Dense gated MLP: down(silu(x @ gate) * (x @ up))."""

    cfg: config_lib.ModelConfig
    ffn_dim: int

    @nn.compact
    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        D, F = self.cfg.d_model, self.ffn_dim
        pd, dt = self.cfg.jnp_param_dtype, self.cfg.jnp_dtype
        w_gate = self.param("gate_proj", _dense_init(D), (D, F), pd)
        w_up = self.param("up_proj", _dense_init(D), (D, F), pd)
        w_down = self.param("down_proj", _dense_init(F), (F, D), pd)
        matmul = lambda a, w: quant.project("...d,df->...f", a, w, dt)
        h = jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up)  # [..., F]
        return matmul(h, w_down)  # [..., D]
