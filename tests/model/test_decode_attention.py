"""Decode attention over the filled cache only (`layers.decode_attention`), block by block."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import model, sampler, scheduling
from espo.model import gpu_attention, layers


def _softmax_attention(q, keys, values, mask):
    """The whole-buffer attention in float64: q [B, N, G, Dh], keys / values [B, N, S, Dh],
    mask [B, S] (one query a row)."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    s = np.einsum("bngd,bnsd->bngs", q, keys) / np.sqrt(q.shape[-1])
    s = np.where(np.asarray(mask)[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bngs,bnsd->bngd", p / p.sum(-1, keepdims=True), values)


@pytest.mark.parametrize(("block", "filled"), [(8, 37), (8, 40), (16, 37), (12, 40)])
def test_blocks_of_the_filled_slots_equal_the_whole_buffer_softmax(block, filled):
    """S = 40 slots; slots past `filled` hold garbage that must not be read
    (the blocked path never visits them); row 0's first 11 slots are left padding (a whole
    masked block at block 8). Block 12: the last block starts at 28, not 36, and the slots it
    shares with the block before count once."""
    B, N, G, S, Dh = 2, 2, 3, 40, 4
    ks = jax.random.split(jax.random.key(block + filled), 3)
    q = jax.random.normal(ks[0], (B, N, G, Dh))
    cache_k, cache_v = (jax.random.normal(k, (B, N, S, Dh)) for k in ks[1:])
    slot = np.arange(S)
    mask = (slot < filled)[None].repeat(B, 0)
    mask[0, :11] = False
    mask[1, 5] = False
    # Garbage past the filled slots: NaN keys would poison any softmax that read them.
    cache_k = cache_k.at[:, :, filled:].set(jnp.nan)
    want = _softmax_attention(q, cache_k, cache_v, mask)
    with mock.patch.object(layers, "DECODE_BLOCK", block):
        got = layers.decode_attention(  # eager: a jit would cache the first block size's trace
            q.reshape(B, N, G, Dh), cache_k, cache_v, jnp.asarray(mask)[:, None],
            filled=jnp.int32(filled), dtype=jnp.float32,
        )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _random_cache(seed, *, B, S, Dh, dtype=jnp.float32, q_scale=1.0):
    """q [B, 2, 3, Dh] (2 kv heads, 3 query heads each), cache k / v [B, 2, S, Dh] in `dtype`."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = (q_scale * jax.random.normal(ks[0], (B, 2, 3, Dh))).astype(dtype)
    cache_k, cache_v = (jax.random.normal(k, (B, 2, S, Dh)).astype(dtype) for k in ks[1:])
    return q, cache_k, cache_v


def _blocked(q, cache_k, cache_v, mask, *, filled, block, dtype):
    """`layers.decode_attention` in blocks of `block` slots (eager: the block is read when
    traced), mask [B, S]."""
    with mock.patch.object(layers, "DECODE_BLOCK", block):
        return layers.decode_attention(
            q, cache_k, cache_v, jnp.asarray(mask)[:, None], filled=jnp.int32(filled),
            dtype=dtype,
        )  # fmt: skip


def _kernel(q, cache_k, cache_v, mask, *, filled, dtype):
    return gpu_attention.decode_attention(
        q, cache_k, cache_v, jnp.asarray(mask)[:, None], filled=jnp.int32(filled), dtype=dtype,
        interpret=True,
    )  # fmt: skip


@pytest.mark.parametrize("filled", [7, 8, 9, 16, 17, 20])
def test_blocks_one_short_of_at_and_one_past_a_block_boundary(filled):
    """Blocks of 8 over S = 20 slots (no multiple of 8: the third block starts at 12, its
    first 4 slots already counted): filled one short of a block, at it, one past it (the new
    block holds one slot), at the buffer's end. Slots past `filled` hold NaN keys."""
    S = 20
    q, cache_k, cache_v = _random_cache(filled, B=2, S=S, Dh=4)
    mask = (np.arange(S) < filled)[None].repeat(2, 0)
    mask[1, 2] = False  # a hole
    cache_k = cache_k.at[:, :, filled:].set(jnp.nan)
    want = _softmax_attention(q, cache_k, cache_v, mask)
    got = _blocked(q, cache_k, cache_v, mask, filled=filled, block=8, dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _cancelling_cache(S, *, filled, block, dtype):
    """Zero queries and keys (every visible slot weighs 1) over values 256 in slot 0, 2^-5 in
    slots 1 .. block-1, -256 in slot `block` (the first of the second block): the output is
    (block - 1) / 32 / filled, while a block sum kept in bf16 (256 + 7/32 -> 256) loses it."""
    v = np.zeros((1, 1, S, 16), np.float32)
    v[:, :, 0], v[:, :, 1:block], v[:, :, block] = 256.0, 2.0**-5, -256.0
    zeros = jnp.zeros((1, 1, S, 16), dtype)
    mask = (np.arange(S) < filled)[None]
    want = np.full((1, 1, 1, 16), (block - 1) / 32 / filled)
    return jnp.zeros((1, 1, 1, 16), dtype), zeros, jnp.asarray(v, dtype), mask, want


def test_bf16_blocks_combine_in_float32():
    """bf16 queries, keys and values: against the float64 softmax of the same values (within
    bf16 rounding of the output), and values that cancel across two blocks exactly."""
    S, block = 20, 8
    q, cache_k, cache_v = _random_cache(3, B=2, S=S, Dh=16, dtype=jnp.bfloat16, q_scale=2.0)
    for filled in (9, 17):
        mask = (np.arange(S) < filled)[None].repeat(2, 0)
        want = _softmax_attention(q, cache_k, cache_v, mask)
        got = _blocked(q, cache_k, cache_v, mask, filled=filled, block=block, dtype=jnp.bfloat16)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2)
    *inputs, mask, want = _cancelling_cache(S, filled=9, block=block, dtype=jnp.bfloat16)
    got = _blocked(*inputs, mask, filled=9, block=block, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(jnp.bfloat16))


def test_bf16_logits_stay_float32():
    """bf16 queries and keys whose scaled logits reach ~+-30: each block's softmax sees the
    matmul's float32 logits, not logits rounded to bf16 (an error of ~0.06 at 30)."""
    S, filled = 64, 50
    q, cache_k, cache_v = _random_cache(7, B=1, S=S, Dh=16, dtype=jnp.bfloat16, q_scale=9.0)
    mask = (np.arange(S) < filled)[None]
    logits = np.einsum("bngd,bnsd->bngs", *(np.asarray(a, np.float64) for a in (q, cache_k)))
    assert np.abs(logits[..., :filled]).max() / 4 > 20
    want = _softmax_attention(q, cache_k, cache_v, mask)
    got = _blocked(q, cache_k, cache_v, mask, filled=filled, block=16, dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2**-7, rtol=2**-7)


def test_blocked_decode_is_one_token_a_row_on_a_long_cache_where_a_loop_runs():
    """CPU: one token a row over two blocks or more. GPU: the same where the Triton kernel
    runs (the flag on, by default; a head width it takes, at least one of its blocks of slots,
    rows the mesh splits evenly), else the dense form. TPU: never (attention.attend)."""
    cache = lambda S, B=2, Dh=16: (B, 2, S, Dh)  # noqa: E731  # [B, N, S, Dh]
    with mock.patch.object(layers, "DECODE_BLOCK", 8):
        assert layers.blocked_decode(1, cache(16)) and not layers.blocked_decode(1, cache(15))
        assert not layers.blocked_decode(2, cache(64))  # a prefill or a continuation chunk
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            assert layers.GPU_BLOCKED_DECODE  # the Triton kernel by default (docs/gpu run 8)
            assert layers.blocked_decode(1, cache(64)) and not layers.blocked_decode(2, cache(64))
            assert not layers.blocked_decode(1, cache(64, Dh=24))  # no power of two
            assert not layers.blocked_decode(1, cache(16))  # under one kernel block (64)
            with mock.patch.object(layers.attention, "row_shards", lambda: 4):
                assert not layers.blocked_decode(1, cache(64, B=2))  # 2 rows over 4 shards
                assert layers.blocked_decode(1, cache(64, B=8))
            with mock.patch.object(layers, "GPU_BLOCKED_DECODE", False):
                assert not layers.blocked_decode(1, cache(64))
        with mock.patch.object(jax, "default_backend", lambda: "tpu"):
            assert not layers.blocked_decode(1, cache(64))  # a TPU's decode takes attend


@pytest.mark.slow
@pytest.mark.parametrize(("slots", "filled", "batch"), [(200, 137, 2), (200, 200, 1), (192, 70, 3)])
def test_gpu_kernel_over_the_filled_slots_equals_the_whole_buffer_softmax(slots, filled, batch):
    """`gpu_attention`'s Triton kernel (interpret mode here): S = 200 slots is no multiple of
    its 64-slot blocks (the last block starts at 136 and masks what it shares); row 0's first 70
    slots are left padding (a whole masked block), row 1 has a hole; slots past `filled` hold
    NaN keys; 3 query heads per kv head padded to 16; the rows split over 16-64 programs, most
    with no block to visit, combined after."""
    B, N, G, S, Dh = batch, 2, 3, slots, 16
    ks = jax.random.split(jax.random.key(slots + filled), 3)
    q = jax.random.normal(ks[0], (B, N, G, Dh))
    cache_k, cache_v = (jax.random.normal(k, (B, N, S, Dh)) for k in ks[1:])
    mask = (np.arange(S) < filled)[None].repeat(B, 0)
    mask[0, : min(70, filled - 1)] = False
    mask[B - 1, 5] = False
    cache_k = cache_k.at[:, :, filled:].set(jnp.nan)
    want = _softmax_attention(q, cache_k, cache_v, mask)
    got = gpu_attention.decode_attention(
        q, cache_k, cache_v, jnp.asarray(mask)[:, None], filled=jnp.int32(filled),
        dtype=jnp.float32, interpret=True,
    )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("slots", "filled"), [(100, 63), (100, 64), (100, 65), (128, 65)])
def test_gpu_kernel_one_short_of_at_and_one_past_a_block(slots, filled):
    """The kernel's 64-slot blocks: filled one short of a block, at it, one past it (the second
    block holds one slot; at S = 100 it starts at 36, its first 28 slots already counted); 3 kv
    heads' worth of rows split over 16 programs each, one or two of them with a block."""
    q, cache_k, cache_v = _random_cache(slots + filled, B=1, S=slots, Dh=16)
    mask = (np.arange(slots) < filled)[None]
    cache_k = cache_k.at[:, :, filled:].set(jnp.nan)
    want = _softmax_attention(q, cache_k, cache_v, mask)
    got = _kernel(q, cache_k, cache_v, mask, filled=filled, dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gpu_kernel_in_bf16_combines_its_programs_in_float32():
    """bf16 inputs (S = 100, filled = 65: two programs with a block each): against the float64
    softmax of the same values within bf16 rounding; values that cancel between the two
    programs' blocks exactly (their partial sums combined in float32); and one key in each
    program's block at scaled logits 256 and 257 (no bf16 number: each program's maximum and
    normalizer kept in bf16 would weigh the two keys equally). Pallas' interpret mode computes
    a bf16 dot without rounding its result: logits left in bf16 inside the kernel pass here."""
    S, filled = 100, 65
    q, cache_k, cache_v = _random_cache(5, B=1, S=S, Dh=16, dtype=jnp.bfloat16, q_scale=2.0)
    mask = (np.arange(S) < filled)[None]
    got = _kernel(q, cache_k, cache_v, mask, filled=filled, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    want = _softmax_attention(q, cache_k, cache_v, mask)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2)
    *inputs, mask, want = _cancelling_cache(S, filled=filled, block=64, dtype=jnp.bfloat16)
    got = _kernel(*inputs, mask, filled=filled, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(jnp.bfloat16))
    q = np.zeros((1, 1, 1, 16), np.float32)
    q[..., :2] = 32.0, 4.0
    cache_k, cache_v = np.zeros((2, 1, 1, S, 16), np.float32)
    cache_k[..., 0, 0], cache_k[..., 64, :2], cache_v[..., 64, :] = 32.0, (32.0, 1.0), 1.0
    mask = np.isin(np.arange(S), [0, 64])[None]  # slot 0 (block 0) and slot 64 (block 1)
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got = _kernel(bf16(q), bf16(cache_k), bf16(cache_v), mask, filled=filled, dtype=jnp.bfloat16)
    want = 1 / (1 + np.exp(-1.0))  # softmax([256, 257]) . [0, 1]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8)


# Defined on a GPU only (CI counts a skip as a failure): the kernel compiled by Triton.
if jax.default_backend() == "gpu":

    @pytest.mark.gpu
    def test_compiled_gpu_kernel_equals_the_whole_buffer_softmax():
        B, N, G, S, Dh, filled = 3, 2, 4, 300, 64, 211
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (B, N, G, Dh), jnp.bfloat16)
        cache_k, cache_v = (jax.random.normal(k, (B, N, S, Dh), jnp.bfloat16) for k in ks[1:])
        mask = (np.arange(S) < filled)[None].repeat(B, 0)
        mask[0, :70] = False
        got = gpu_attention.decode_attention(
            q, cache_k, cache_v, jnp.asarray(mask)[:, None], filled=jnp.int32(filled),
            dtype=jnp.bfloat16, interpret=False,
        )  # fmt: skip
        want = _softmax_attention(q, cache_k, cache_v, mask)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-2, rtol=3e-2)


def test_gpu_kernel_lowers_for_cuda_without_a_gpu():
    """The kernel through Pallas' Triton lowering for CUDA (what a GPU compiles), at a decode
    shape of the bench model (B=8, 4 kv heads, 4 query heads each, Dh=128, 4112 slots, bf16)."""
    q = jnp.zeros((8, 4, 4, 128), jnp.bfloat16)
    cache = jnp.zeros((8, 4, 4112, 128), jnp.bfloat16)
    fn = functools.partial(gpu_attention.decode_attention, dtype=jnp.bfloat16, interpret=False)
    lowered = jax.jit(fn).trace(q, cache, cache, jnp.ones((8, 1, 4112), bool), filled=jnp.int32(9))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1


@pytest.mark.slow
def test_cached_decode_over_block_boundaries_equals_the_full_forward():
    """The tiny model, DECODE_BLOCK = 8 over a 20-slot cache (blocked from the first decode
    step): 7 prompt tokens, then 13 decode steps, among them filled 8 (a whole block), 9 (the
    step's own key the first slot of a new block), 17 and 20 (the last block clamped to start
    at 12): the logits and routes of one full forward."""
    cfg = model.ModelConfig.tiny()
    params = model.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    with mock.patch.object(layers, "DECODE_BLOCK", 8):
        assert layers.blocked_decode(1, (2, cfg.num_kv_heads, 20, cfg.head_dim))
        forward = jax.jit(functools.partial(model.forward, cfg))  # traced with blocks of 8
        full = forward(params, tokens)
        out = forward(params, tokens[:, :7], cache=model.init_cache(cfg, batch=2, max_length=20))
        logits, ids = [out.logits], [out.router.expert_ids]
        for t in range(7, 20):
            out = forward(params, tokens[:, t : t + 1], cache=out.cache)
            logits.append(out.logits)
            ids.append(out.router.expert_ids)
    np.testing.assert_allclose(jnp.concatenate(logits, 1), full.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(jnp.concatenate(ids, 2), full.router.expert_ids)


def _sample(block_size: int):
    """The tiny model's sampler over a 64-slot cache (16-token prompts, 48 new tokens), decode
    attention in blocks of `block_size` slots (64: the whole buffer, one block)."""
    cfg = model.ModelConfig.tiny()
    params = model.init(cfg, jax.random.key(0))
    prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (3, 9))
    with mock.patch.object(layers, "DECODE_BLOCK", block_size):
        jax.clear_caches()  # the block size is read while tracing
        return sampler.sample(
            cfg, params, prompts, np.array([9, 4, 6]), key=jax.random.key(1),
            num_samples=2, max_new_tokens=40, stop_ids=(1,), pad_id=0,
            buckets=scheduling.LengthBuckets(prompt_buckets=(16,), generation_buckets=(48,)),
        )  # fmt: skip


@pytest.fixture(scope="module")
def whole_buffer():
    """The reference run, attention over the whole buffer: sampled once for both block sizes
    (it is the same program and the same samples for each)."""
    return _sample(64)


@pytest.mark.slow
@pytest.mark.parametrize("block", [16, 24])
def test_the_sampler_on_blocked_decode_samples_what_the_whole_buffer_does(whole_buffer, block):
    """A 64-slot cache (16-token prompts, 48 new tokens): blocks of 16 (4 of them) and 24 (the
    last one clamped to start at 40) give the same tokens, routing and, to rounding, log-probs
    and entropies as attention over the whole buffer (DECODE_BLOCK above the cache)."""
    whole, blocked = whole_buffer, _sample(block)
    assert int(whole.lengths.max()) > 2 * block - 16  # decoding went past a block boundary
    np.testing.assert_array_equal(blocked.tokens, whole.tokens)
    np.testing.assert_array_equal(blocked.router.expert_ids, whole.router.expert_ids)
    np.testing.assert_allclose(blocked.logps, whole.logps, atol=1e-5)
    np.testing.assert_allclose(blocked.entropies, whole.entropies, atol=1e-5)
