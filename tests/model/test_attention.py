"""Attention over a whole sequence (`espo.model.attention`): every form against the dense one.

The dense form is today's materialised softmax; the blocked form (flash, custom VJP) and the
backend kernels (Triton, splash; Pallas interpret mode here) must give its values and gradients
on every real query, for every mask espo builds: left / right padding, packed segments, sliding
window, a KV cache's slots, at lengths one short of, equal to and one past a block.
"""

import pathlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import errors
from espo.model import attention, transformer
from espo.model.config import ModelConfig


def _row_layout(B, T, *, packed, seed=0):
    """Positions / segments of B rows of T tokens: row 0 left-padded, row 1 right-padded (and
    packed: three segments, the boundaries inside blocks of 8)."""
    mask = np.ones((B, T), bool)
    mask[0, : T // 4] = False
    mask[1, T - T // 5 :] = False
    if not packed:
        pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
        return dict(q_positions=pos, kv_positions=np.where(mask, pos, -1)), mask
    seg = np.where(mask, 1, 0)
    seg[1, 5 : T - T // 5] = 2
    seg[1, T // 2 + 3 : T - T // 5] = 3
    pos = np.asarray(transformer.segment_positions(jnp.asarray(seg)))
    kw = dict(q_positions=pos, kv_positions=np.where(mask, pos, -1), q_segments=seg)
    return kw | dict(kv_segments=seg), mask


def _qkvw(B, N, G, T, S, Dh, seed, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, N, T * G, Dh), dtype)
    k, v = (jax.random.normal(kk, (B, N, S, Dh), dtype) for kk in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (B, N, T * G, Dh), jnp.float32)


def _value_and_grad(q, k, v, w, real, **kw):
    """sum(out * w) over real queries and its gradient in q, k, v (jitted: op by op, one call
    compiled ~100 small programs)."""
    G = q.shape[2] // real.shape[1]
    sel = np.repeat(real, G, 1)[:, None, :, None]
    arrays = {name: a for name, a in kw.items() if isinstance(a, jax.Array | np.ndarray)}
    static = {name: a for name, a in kw.items() if name not in arrays}

    @jax.jit
    def value_and_grad(q, k, v, arrays):
        def loss(q, k, v):
            out = attention.attend(q, k, v, **arrays, **static).astype(jnp.float32)
            return jnp.sum(jnp.where(sel, out * w, 0.0)), out

        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

    (_, out), grads = value_and_grad(q, k, v, arrays)
    return np.where(sel, out, 0.0), [np.asarray(g, np.float32) for g in grads]


def _assert_same(got, want, tol=1e-5):
    (out, grads), (ref_out, ref_grads) = got, want
    scale = lambda a: max(float(np.abs(a).max()), 1e-6)
    np.testing.assert_allclose(out, ref_out, atol=tol * scale(ref_out), rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=tol * scale(r), rtol=0)


def _jnp(kw):
    return {k: jnp.asarray(v) for k, v in kw.items()}


@pytest.mark.parametrize("T", [15, 16, 17, 40])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_blocked_equals_dense_in_value_and_gradient(T, packed, window):
    """Blocks of 8 queries and 8 keys: T one short of, equal to and one past two blocks; a
    segment boundary and the padding edges fall inside blocks; with a window, whole tiles of
    the causal triangle are skipped."""
    kw, real = _row_layout(2, T, packed=packed)
    q, k, v, w = _qkvw(2, 2, 3, T, T, 8, seed=T)
    kw = _jnp(kw) | dict(sliding_window=window)
    want = _value_and_grad(q, k, v, w, real, impl="dense", **kw)
    got = _value_and_grad(q, k, v, w, real, impl="blocked", block_q=8, block_k=8, **kw)
    _assert_same(got, want)


@pytest.mark.parametrize(("block_q", "block_k"), [(4, 16), (16, 3), (64, 64)])
def test_blocked_any_block_shape(block_q, block_k):
    """Query and key blocks of different sizes, one larger than the row (one tile)."""
    kw, real = _row_layout(2, 23, packed=True)
    q, k, v, w = _qkvw(2, 1, 4, 23, 23, 16, seed=1)
    want = _value_and_grad(q, k, v, w, real, impl="dense", **_jnp(kw))
    got = _value_and_grad(
        q, k, v, w, real, impl="blocked", block_q=block_q, block_k=block_k, **_jnp(kw)
    )
    _assert_same(got, want)


def test_blocked_over_cache_slots():
    """A chunk of 6 new tokens written at slot 9 of a 37-slot cache: the keys are the cache's
    slots (9 filled, then the chunk, then empty slots holding NaN keys and values, which must
    reach no value and no gradient)."""
    B, T, S = 2, 6, 37
    q, k, v, w = _qkvw(B, 2, 2, T, S, 8, seed=3)
    slot = np.arange(S)
    kv_pos = np.where(slot < 15, slot, -1)[None].repeat(B, 0)
    kv_pos[0, :4] = -1  # row 0 left-padded in the prompt
    kv_pos[0, 4:15] -= 4
    q_pos = kv_pos[:, 9:15]
    k = k.at[:, :, 15:].set(jnp.nan)  # keys past the filled slots would poison any softmax
    v = v.at[:, :, 15:].set(jnp.nan)
    kw = dict(q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos))
    real = np.ones((B, T), bool)
    zero = lambda a: a.at[:, :, 15:].set(0)  # the dense form reads every slot
    want = _value_and_grad(q, zero(k), zero(v), w, real, impl="dense", **kw)
    got = _value_and_grad(q, k, v, w, real, impl="blocked", block_q=4, block_k=8, **kw)
    filled = lambda r: (r[0], [r[1][0], r[1][1][:, :, :15], r[1][2][:, :, :15]])
    _assert_same(filled(got), filled(want))


def test_blocked_bf16_against_float32():
    """bf16 inputs, float32 softmax statistics: within bf16's rounding of the float32 result."""
    kw, real = _row_layout(2, 40, packed=True)
    q, k, v, w = _qkvw(2, 2, 2, 40, 40, 16, seed=5)
    want = _value_and_grad(q, k, v, w, real, impl="dense", **_jnp(kw))
    bf = lambda a: a.astype(jnp.bfloat16)
    got = _value_and_grad(
        bf(q), bf(k), bf(v), w, real, impl="blocked", block_q=8, block_k=8,
        dtype=jnp.bfloat16, **_jnp(kw),
    )  # fmt: skip
    _assert_same(got, want, tol=3e-2)


def test_a_query_that_sees_no_key_gets_zero_and_no_gradient():
    B, T = 1, 12
    q, k, v, w = _qkvw(B, 1, 1, T, T, 8, seed=7)
    pos = jnp.arange(T)[None]
    kv_pos = jnp.where(pos >= 6, pos, -1)  # queries 0-5 see nothing
    f = lambda q: attention.attend(
        q, k, v, q_positions=pos, kv_positions=kv_pos, impl="blocked", block_q=4, block_k=4
    )
    out, dq = jax.jit(lambda q: (f(q), jax.grad(lambda q: jnp.sum(f(q) * w))(q)))(q)
    assert np.all(np.asarray(out)[0, 0, :6] == 0) and np.isfinite(out).all()
    assert np.all(np.asarray(dq)[0, 0, :6] == 0)


def test_block_table_skips_the_tiles_above_the_diagonal():
    """A causal row of 4 blocks visits the 10 tiles on and below the diagonal, not all 16; a
    sliding window of one block leaves the diagonal band only."""
    T = 32
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    zeros = jnp.zeros_like(pos)
    q = jnp.zeros((1, 1, T, 4))
    for window, want in (
        (None, np.tril(np.ones((4, 4), bool))),
        (8, np.eye(4, k=0, dtype=bool) | np.eye(4, k=-1, dtype=bool)),
    ):
        st = attention._Static(window=window, block_q=8, block_k=8, dtype=jnp.dtype("float32"))
        padded = attention._pad(st, q, q, q, pos, pos, zeros, zeros)
        np.testing.assert_array_equal(attention._block_table(st, padded), want)


def test_block_table_keeps_segments_apart():
    """Two packed sequences of 16 tokens each, blocks of 8: tiles across the boundary are
    skipped (the second sequence's positions restart, so positions alone would not)."""
    seg = jnp.asarray(np.repeat([1, 2], 16)[None], jnp.int32)
    pos = transformer.segment_positions(seg)
    q = jnp.zeros((1, 1, 32, 4))
    st = attention._Static(window=None, block_q=8, block_k=8, dtype=jnp.dtype("float32"))
    table = np.asarray(attention._block_table(st, attention._pad(st, q, q, q, pos, pos, seg, seg)))
    assert not table[2:, :2].any() and table[3, 2] and table[1, 0]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "splash"])
@pytest.mark.parametrize("packed", [False, True])
def test_kernels_equal_dense_on_real_queries(impl, packed):
    """The GPU (Triton) and TPU (splash) kernels in Pallas' interpret mode: T = 129, one past
    a kernel block (rows padded to 256); causal by index and segment where espo's masks are by
    position. Splash also with a sliding window."""
    T = attention.KERNEL_BLOCK + 1
    kw, real = _row_layout(2, T, packed=packed)
    q, k, v, w = _qkvw(2, 2, 2, T, T, 128, seed=11)
    windows = (None, 9) if impl == "splash" else (None,)
    for window in windows:
        args = _jnp(kw) | dict(sliding_window=window, own_keys=True)
        want = _value_and_grad(q, k, v, w, real, impl="dense", **args)
        _assert_same(_value_and_grad(q, k, v, w, real, impl=impl, **args), want)


def test_kernels_are_for_a_forwards_own_keys():
    """Over a cache's slots (own_keys False) a kernel setting runs the XLA forms instead."""
    kw, real = _row_layout(2, 12, packed=False)
    q, k, v, w = _qkvw(2, 1, 2, 12, 12, 8, seed=2)
    with mock.patch.dict(attention.KERNELS, triton=mock.Mock(side_effect=AssertionError)):
        got = _value_and_grad(q, k, v, w, real, impl="triton", **_jnp(kw))
    _assert_same(got, _value_and_grad(q, k, v, w, real, impl="dense", **_jnp(kw)))


def test_default_impl_by_backend_and_length():
    long = 2 * attention.BLOCK_K
    assert attention.default_impl(long - 1) == "dense"
    assert attention.default_impl(long) == "blocked"
    assert attention.default_impl(long, num_queries=1) == "blocked"  # CPU: decode_attention
    with mock.patch.object(jax, "default_backend", lambda: "tpu"):
        assert attention.default_impl(long, own_keys=True) == "splash"
        assert attention.default_impl(long, own_keys=False) == "blocked"
        assert attention.default_impl(long, num_queries=1) == "blocked"
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        assert attention.default_impl(long, own_keys=True) == "triton"
        assert attention.default_impl(long, own_keys=True, sliding_window=4) == "blocked"
        assert attention.default_impl(long, own_keys=False) == "blocked"
        # A decode step (one query a row over a cache) reads the cache once, in two matmuls.
        assert attention.default_impl(long, num_queries=1) == "dense"
        assert attention.default_impl(long, num_queries=1, sliding_window=4) == "dense"
        assert attention.default_impl(long, num_queries=2) == "blocked"
        with mock.patch.object(attention, "GPU_KERNEL", False):
            assert attention.default_impl(long, own_keys=True) == "blocked"


@pytest.mark.parametrize("T", [1, 2])
def test_a_gpu_decode_step_over_a_long_cache_takes_the_dense_form(T):
    """ "auto" on a GPU: one query a row over a cache of two key blocks and more is the dense
    form (the blocked loop never runs), equal to the blocked one; two queries stay blocked."""
    S = 2 * attention.BLOCK_K + 3
    q, k, v, _ = _qkvw(2, 2, 3, T, S, 8, seed=T)
    kv_positions = np.where(np.arange(S) < S - 40, np.arange(S), -1)[None].repeat(2, 0)
    kv_positions[0, :100] = -1  # left padding in row 0
    kw = dict(q_positions=np.full((2, T), S - 41) + np.arange(T), kv_positions=kv_positions)
    want = attention.attend(q, k, v, **_jnp(kw), impl="blocked")
    flash = mock.Mock(wraps=attention._flash)
    with (
        mock.patch.object(jax, "default_backend", lambda: "gpu"),
        mock.patch.object(attention, "_flash", flash),
    ):
        got = attention.attend(q, k, v, **_jnp(kw))
    assert flash.call_count == (T > 1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("field", "value"), [("attention_impl", "flash"), ("remat", "dots"), ("logits_chunk", -1)]
)
def test_long_sequence_settings_are_validated(field, value):
    with pytest.raises(errors.InvalidValue) as caught:
        ModelConfig.tiny(**{field: value})
    assert caught.value.field == field


def test_a_decode_step_over_a_long_cache_is_one_query_not_a_padded_block():
    """One new token a row over a 2,048-slot cache (how a TPU or GPU rollout decodes: "blocked"
    over the cache's slots): the dense form's values, and the tiles' matmuls are one query's
    (a query block padded to BLOCK_Q would do 512x the attention work)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))
    import roofline  # the matmul counter of experiments/aot.py

    B, S, G = 2, 2048, 2
    q, k, v, w = _qkvw(B, 2, G, 1, S, 8, seed=5)
    kv_pos = np.where(np.arange(S) < 1500, np.arange(S), -1)[None].repeat(B, 0)
    kw = dict(q_positions=jnp.full((B, 1), 1499), kv_positions=jnp.asarray(kv_pos))
    real = np.ones((B, 1), bool)
    clean = lambda a: a.at[:, :, 1500:].set(0)  # noqa: E731
    want = _value_and_grad(q, clean(k), clean(v), w, real, impl="dense", **kw)
    _assert_same(_value_and_grad(q, k, v, w, real, impl="blocked", **kw), want)
    fwd = lambda q, k, v: attention.attend(q, k, v, impl="blocked", **kw)  # noqa: E731
    flops = roofline.total_flops(roofline.jaxpr_dots(jax.make_jaxpr(fwd)(q, k, v)))
    assert flops <= 2 * (2 * 2 * B * 2 * G * S * 8)  # q.k and p.v over every slot, x2 slack


def test_dense_form_keeps_bf16_logits_in_float32():
    """bf16 queries and keys whose logits reach ~+-30: the dense form's softmax sees the
    matmul's float32 logits (as the blocked form's tiles do), not logits rounded to bf16 (an
    error of ~0.06 at 30, a 6% change in a probability)."""
    B, N, G, S, Dh = 1, 1, 4, 64, 16
    ks = jax.random.split(jax.random.key(0), 3)
    q = (jax.random.normal(ks[0], (B, N, G, Dh)) * 3).astype(jnp.bfloat16)
    k = (jax.random.normal(ks[1], (B, N, S, Dh)) * 3).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, N, S, Dh)).astype(jnp.bfloat16)
    kw = dict(q_positions=jnp.full((B, 1), S - 1), kv_positions=jnp.arange(S)[None])
    got = attention.attend(q, k, v, **kw, dtype=jnp.bfloat16, impl="dense")
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bngd,bnsd->bngs", q64, k64) / np.sqrt(Dh)
    assert np.abs(logits).max() > 20
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bngs,bnsd->bngd", p / p.sum(-1, keepdims=True), v64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2**-7, rtol=2**-7)
