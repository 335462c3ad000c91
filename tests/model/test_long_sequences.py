"""Long traces: the update's gradient in memory linear in T, and the same values as before.

Memory is read from XLA's memory analysis of the compiled gradient (compile only, nothing run):
`token_logps(...).logps.sum()` differentiated in the params, blocked attention (blocks of 128
here), the head in chunks, each layer rematerialised. Values: every long-sequence setting
against the materialised path (dense attention, one head chunk, no remat).
"""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import testing, train_step, types
from espo.model import RoutingMode, attention, transformer
from espo.model.config import ModelConfig

LONG = dict(attention_impl="blocked", remat="full", logits_chunk=256)


def _temp_bytes(cfg, T, *, scanned=True):
    params = transformer.param_shapes(cfg)
    if not scanned:
        params = jax.eval_shape(lambda p: transformer.unstack_layers(cfg, p), params)
    loss = lambda p, t, m: train_step.token_logps(cfg, p, t, m).logps.sum()
    shapes = (jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1, T), bool))
    compiled = jax.jit(jax.grad(loss)).lower(params, *shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.fixture
def small_blocks():
    with mock.patch.multiple(attention, BLOCK_Q=128, BLOCK_K=128):
        yield


@pytest.mark.parametrize("scanned", [True, False])
def test_gradient_memory_grows_linearly_in_the_sequence(small_blocks, scanned):
    """Doubling T at most 2.3x the temporaries with the long settings (the scanned layer loop
    once stacked every attention tile: 4x); the materialised path grows ~4x (the test sees a
    quadratic term when there is one)."""
    cfg = ModelConfig.tiny(num_layers=2, vocab_size=512)
    long = cfg.replace(**LONG)
    grow = lambda c: _temp_bytes(c, 2048, scanned=scanned) / _temp_bytes(c, 1024, scanned=scanned)
    assert grow(long) <= 2.3
    assert grow(cfg.replace(attention_impl="dense", logits_chunk=10**6)) > 3.0


def test_remat_and_chunks_each_cut_memory(small_blocks):
    """(Measured: 13.5 MiB; no remat 48.5; the head in one chunk 65.7.)"""
    cfg = ModelConfig.tiny(num_layers=4, vocab_size=8192).replace(**LONG)
    base = _temp_bytes(cfg, 1024)
    assert base < 0.5 * _temp_bytes(cfg.replace(remat="none"), 1024)
    assert base < 0.5 * _temp_bytes(cfg.replace(logits_chunk=10**6), 1024)


@pytest.mark.parametrize("remat", ["none", "full", "dots_with_no_batch_dims_saveable"])
@pytest.mark.parametrize("scanned", [True, False])
def test_remat_policy_wraps_every_layer_of_either_loop(remat, scanned):
    """`model.remat` reaches both layer loops of a model with two layer runs (a leading dense
    layer): one rematerialised scan body per run, or one rematerialised block per unrolled
    layer, each with the named policy. Structure, not memory: the values are the same either
    way (test_long_settings_keep_values_and_gradients), and XLA:CPU's temporaries barely move
    with remat in the unrolled loop (`transformer.remat_block`)."""
    cfg = _MIXED.replace(remat=remat)
    params = transformer.param_shapes(cfg)
    if not scanned:
        params = jax.eval_shape(lambda p: transformer.unstack_layers(cfg, p), params)
    tokens = jnp.zeros((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: transformer.forward(cfg, p, tokens).logits)(params)
    remats = [e for e, _ in testing.jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "remat2"]
    want = 0 if remat == "none" else len(cfg.layer_runs()) if scanned else cfg.num_layers
    assert len(remats) == want
    policy = None if remat in ("none", "full") else getattr(jax.checkpoint_policies, remat)
    assert all(e.params["policy"] == policy for e in remats)
    # Unrolled, nothing but prevent_cse keeps XLA from merging the recomputation with the forward.
    assert all(e.params["prevent_cse"] == (not scanned) for e in remats)


def test_moe_chunks_cut_memory():
    """The MoE dispatch in chunks of 128 tokens: its per-(token, expert) buffers one chunk at a
    time, forward and backward (measured: 21.8 MiB of temporaries against 132.0 whole)."""
    cfg = ModelConfig.tiny(num_layers=1, vocab_size=64, top_k=8, num_experts=16, moe_ffn_dim=256)
    cfg = cfg.replace(**LONG)
    assert _temp_bytes(cfg.replace(moe_chunk=128), 2048) < 0.5 * _temp_bytes(cfg, 2048)


def _batch(cfg, B=3, T=40, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, cfg.vocab_size)
    mask = np.ones((B, T), bool)
    mask[0, :7] = False  # left padding
    mask[B - 1, 30:] = False  # right padding
    return tokens, jnp.asarray(mask)


def _logps_and_grad(cfg, params, tokens, mask, **kw):
    def loss(p):
        out = train_step.token_logps(cfg, p, tokens, mask, **kw)
        return jnp.sum(out.logps * jnp.arange(tokens.shape[1])), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, grads


def _assert_same(got, want, tol=1e-5):
    (out, grads), (ref, ref_grads) = got, want
    for a, b in ((out.logps, ref.logps), (out.entropies, ref.entropies)):
        np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=tol * float(np.abs(b).max()) + 1e-7)


REFERENCE = dict(attention_impl="dense", remat="none", logits_chunk=10**6)


_MIXED = ModelConfig.tiny(num_layers=3, dense_layers=(0,), dense_ffn_dim=32, vocab_size=97)


@functools.cache
def _mixed_run(scanned: bool, **settings):
    """Log-probs and gradient of the model whose first layer is dense (two layer runs),
    temperature 0.7, blocks of 8 (cached: the reference is shared by the cases)."""
    params = transformer.init(_MIXED, jax.random.key(1))
    if not scanned:
        params = transformer.unstack_layers(_MIXED, params)
    tokens, mask = _batch(_MIXED)
    with mock.patch.multiple(attention, BLOCK_Q=8, BLOCK_K=8):
        return _logps_and_grad(_MIXED.replace(**settings), params, tokens, mask, temperature=0.7)


@pytest.mark.parametrize(
    ("settings", "scanned"),
    [
        (dict(logits_chunk=7), True),  # a chunk that does not divide B * (T - 1)
        (dict(logits_chunk=1), False),
        # remat="full" on the scan: with the blocked attention ("auto" at 40 tokens in blocks
        # of 8) the case below, whose other setting (the head in chunks) is outside the layers.
        (dict(remat="dots_with_no_batch_dims_saveable"), False),
        (dict(attention_impl="blocked", logits_chunk=16, remat="full"), True),
        (dict(attention_impl="blocked", logits_chunk=16, remat="full"), False),
        (dict(moe_chunk=7), True),  # 40 tokens a row: 6 chunks, the last one padded
        (dict(moe_chunk=39, remat="full"), False),  # one token in a second chunk
    ],
)
def test_long_settings_keep_values_and_gradients(settings, scanned):
    # One reference for both layouts: per-layer params hold the stacked ones' slices, so their
    # gradient is the stacked gradient's slices (test_transformer: the unrolled loop computes
    # the scan's values).
    out, grads = _mixed_run(True, **REFERENCE)
    if not scanned:
        grads = transformer.unstack_layers(_MIXED, grads)
    _assert_same(_mixed_run(scanned, **settings), (out, grads))


def test_packed_rows_and_replay_with_long_settings():
    """Packed segments (positions restarting inside blocks) and router replay, tied
    embeddings (the head's gradient reaches the embedding through the chunks)."""
    cfg = ModelConfig.tiny(num_layers=2, vocab_size=61, tie_embeddings=True)
    params = transformer.init(cfg, jax.random.key(2))
    tokens, _ = _batch(cfg, B=2, T=37, seed=3)
    seg = np.zeros((2, 37), np.int32)
    seg[0, :13], seg[0, 13:30] = 1, 2
    seg[1, :37] = 1
    seg = jnp.asarray(seg)
    mask = seg > 0
    # Jitted: op by op, this forward compiled ~170 small programs.
    trace = jax.jit(functools.partial(transformer.forward, cfg))(params, tokens, segment_ids=seg)
    trace = trace.router
    replay = types.RouterTrace(expert_ids=trace.expert_ids, expert_weights=trace.expert_weights)
    kw = dict(segment_ids=seg, routing=replay, routing_mode=RoutingMode.REPLAY_IDS)
    with mock.patch.multiple(attention, BLOCK_Q=8, BLOCK_K=8):
        long = cfg.replace(attention_impl="blocked", remat="full", logits_chunk=9, moe_chunk=8)
        got = _logps_and_grad(long, params, tokens, mask, replay_missing="free", **kw)
        want = _logps_and_grad(
            cfg.replace(**REFERENCE), params, tokens, mask, replay_missing="free", **kw
        )
    _assert_same(got, want)
