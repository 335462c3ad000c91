"""The pure forward: cached decode, router replay, padding, and real-size shapes."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import model, quant, types
from espo.model import ModelConfig, RoutingMode, attention

CFG = ModelConfig.tiny(num_layers=3, dense_layers=(1,), dense_ffn_dim=48, norm_topk_prob=False)


@functools.cache
def forward_of(cfg: ModelConfig):
    """One jitted forward per config, so that tests running the same shapes share its programs
    (a new jit object traces and looks its program up again)."""
    static = ("routing_mode", "dispatch_impl", "return_hidden")
    return jax.jit(functools.partial(model.forward, cfg), static_argnames=static)


forward = forward_of(CFG)


@pytest.fixture(scope="module")
def params():
    return model.init(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)


@pytest.mark.slow
def test_shapes_and_dense_layers_in_trace(params, tokens):
    out = forward(params, tokens)
    assert out.logits.shape == (2, 12, CFG.vocab_size) and out.logits.dtype == jnp.float32
    assert out.router.expert_ids.shape == (2, 3, 12, CFG.top_k)
    assert (out.router.expert_ids[:, 1] == -1).all() and (
        out.router.expert_weights[:, 1] == 0
    ).all()
    assert (out.router.expert_ids[:, np.array([0, 2])] >= 0).all()
    np.testing.assert_allclose(out.aux.expert_load[np.array([0, 2])].sum(-1), 1.0, rtol=1e-6)
    assert out.cache is None


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["capacity", "blocked"])
def test_dispatch_impls_agree(params, tokens, impl):
    got = forward(params, tokens, dispatch_impl=impl)
    ragged = forward(params, tokens, dispatch_impl="ragged")
    np.testing.assert_allclose(got.logits, ragged.logits, atol=1e-5, rtol=1e-5)


def test_model_moe_impl_picks_the_dispatch_path_and_a_forwards_own_wins(
    params, tokens, monkeypatch
):
    """`ModelConfig.moe_impl` is the path of every MoE block where the forward says "auto";
    a forward's explicit `dispatch_impl` wins; "auto" in both is `experts.default_impl` (capacity
    on CPU). Each config's logits equal the capacity path's."""
    seen, expert_ffn = [], model.experts.expert_ffn

    def spy(*args, impl, **kw):
        seen.append(impl)
        return expert_ffn(*args, impl=impl, **kw)

    monkeypatch.setattr(model.experts, "expert_ffn", spy)
    want = model.forward(CFG, params, tokens).logits
    cases = [("auto", "auto", "capacity"), ("ragged", "auto", "ragged")]
    cases += [("ragged", "blocked", "blocked"), ("auto", "ragged", "ragged")]
    for moe_impl, dispatch_impl, path in cases:
        seen.clear()
        cfg = CFG.replace(moe_impl=moe_impl)
        got = model.forward(cfg, params, tokens, dispatch_impl=dispatch_impl).logits
        assert seen and set(seen) == {path}, (moe_impl, dispatch_impl, seen)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "splash"])
def test_a_kernel_setting_runs_a_cached_forward_on_the_xla_forms(params, tokens, impl):
    """model.attention_impl a backend kernel (masks causal by index, for a forward's own
    tokens): a forward over a cache's slots (a prefill of 5 tokens into 16 slots) never calls
    it, and gives the dense form's logits."""
    cache = model.init_cache(CFG, batch=2, max_length=16)
    want = forward_of(CFG.replace(attention_impl="dense"))(params, tokens[:, :5], cache=cache)
    never = mock.Mock(side_effect=AssertionError(f"{impl} kernel called over a cache"))
    with mock.patch.dict(attention.KERNELS, {impl: never}):  # a fresh jit: traced here
        fwd = jax.jit(functools.partial(model.forward, CFG.replace(attention_impl=impl)))
        got = fwd(params, tokens[:, :5], cache=cache)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_prefill_then_decode_equals_full_forward(params, tokens):
    full = forward(params, tokens)
    prefill = 5
    cache = model.init_cache(CFG, batch=2, max_length=16)
    out = forward(params, tokens[:, :prefill], cache=cache)
    logits, ids = [out.logits], [out.router.expert_ids]
    cache = out.cache
    for t in range(prefill, tokens.shape[1]):
        step = forward(params, tokens[:, t : t + 1], cache=cache)
        cache = step.cache
        logits.append(step.logits)
        ids.append(step.router.expert_ids)
    np.testing.assert_allclose(jnp.concatenate(logits, 1), full.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(jnp.concatenate(ids, 2), full.router.expert_ids)
    assert int(cache.index) == tokens.shape[1]


@pytest.mark.slow
def test_padding_does_not_change_real_tokens(params, tokens):
    # Left-pad the first row by 3: its real tokens must see exactly what they saw unpadded.
    row = tokens[0, :9]
    padded = jnp.concatenate([jnp.zeros(3, row.dtype), row])[None]
    mask = jnp.arange(12)[None] >= 3
    got = forward(params, padded, attention_mask=mask)
    want = forward(params, row[None])
    np.testing.assert_allclose(got.logits[0, 3:], want.logits[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got.router.expert_ids[0, :, 3:], want.router.expert_ids[0])


@pytest.mark.slow
def test_self_replay_reproduces_logits(params, tokens):
    free = forward(params, tokens)
    for mode in (RoutingMode.REPLAY_IDS, RoutingMode.REPLAY_IDS_AND_WEIGHTS):
        replay = forward(params, tokens, routing=free.router, routing_mode=mode)
        np.testing.assert_allclose(replay.logits, free.logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(replay.router.expert_ids, free.router.expert_ids)


@functools.partial(jax.jit, static_argnames="mode")
def _router_grad_norm(params, tokens, trace, mode):
    def loss(p):
        out = model.forward(CFG, p, tokens, routing=trace, routing_mode=mode)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0])

    grads = jax.grad(loss)(params)
    return jnp.linalg.norm(grads["blocks_0"]["moe"]["router"])


@pytest.mark.slow
def test_router_gradient_only_under_replay_ids(params, tokens):
    trace = forward(params, tokens).router
    assert float(_router_grad_norm(params, tokens, trace, RoutingMode.REPLAY_IDS)) > 1e-6
    assert float(_router_grad_norm(params, tokens, trace, RoutingMode.REPLAY_IDS_AND_WEIGHTS)) == 0


@pytest.mark.slow
def test_replaying_a_different_trace_routes_exactly_as_given(params, tokens):
    free = forward(params, tokens)
    # Shift every expert id by one: a routing the router itself would not choose.
    shifted_ids = jnp.where(
        free.router.expert_ids >= 0, (free.router.expert_ids + 1) % CFG.num_experts, -1
    )
    # float32, not weak-typed: the replayed forwards are then the programs of the self-replay.
    weights = jnp.where(shifted_ids >= 0, 0.5, 0.0).astype(jnp.float32)
    trace = types.RouterTrace(expert_ids=shifted_ids, expert_weights=weights)
    out = forward(params, tokens, routing=trace, routing_mode=RoutingMode.REPLAY_IDS)
    np.testing.assert_array_equal(out.router.expert_ids, shifted_ids)
    assert float(jnp.max(jnp.abs(out.logits - free.logits))) > 1e-3
    # The recomputed gates are the router's own softmax gathered at the replayed ids.
    given = forward(params, tokens, routing=trace, routing_mode=RoutingMode.REPLAY_IDS_AND_WEIGHTS)
    np.testing.assert_array_equal(given.router.expert_weights, weights)
    assert not np.allclose(out.router.expert_weights, weights)


def test_replay_needs_a_trace_of_the_right_shape(params, tokens):
    with pytest.raises(ValueError, match=r"\[B, L, T, K\]=\(2, 3, 12, 2\)"):
        model.forward(CFG, params, tokens, routing_mode=RoutingMode.REPLAY_IDS)
    small = types.RouterTrace.empty(batch=2, num_layers=3, length=4, top_k=2)
    with pytest.raises(ValueError, match="got \\(2, 3, 4, 2\\)"):
        model.forward(CFG, params, tokens, routing=small, routing_mode=RoutingMode.REPLAY_IDS)


def test_qwen3_30b_a3b_shapes_without_allocation():
    cfg = ModelConfig.qwen3_30b_a3b()
    shapes = model.param_shapes(cfg)
    num_params = sum(np.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert 30.0e9 < num_params < 31.0e9  # Qwen3-30B-A3B has 30.5B parameters
    assert shapes["blocks_0"]["moe"]["gate_proj"].shape == (48, 128, 2048, 768)
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    out = jax.eval_shape(functools.partial(model.forward, cfg), shapes, tokens)
    assert out.logits.shape == (2, 64, 151936)
    assert out.router.expert_ids.shape == (2, 48, 64, 8)
    assert out.aux.expert_load.shape == (48, 128)


@pytest.mark.slow
def test_return_hidden_feeds_the_lm_head(params, tokens):
    out = forward(params, tokens, return_hidden=True)
    assert out.hidden.shape == (2, 12, CFG.d_model)
    np.testing.assert_allclose(out.hidden @ params["lm_head"], out.logits, atol=1e-4, rtol=1e-4)
    assert forward(params, tokens).hidden is None


@pytest.mark.slow
@pytest.mark.parametrize("dense_layers", [(1,), ()])
def test_per_layer_params_run_the_same_model(tokens, dense_layers):
    # `unstack_layers` (the sampler's CPU decode layout) splits the layer runs (MoE, dense, MoE
    # of one layer each; or one MoE run of three) into per-layer subtrees; forward runs them
    # unrolled: the same logits, cache, trace and router statistics, free and replayed, prefill
    # and one cached decode step.
    cfg = CFG.replace(dense_layers=dense_layers)
    fwd = forward_of(cfg)
    params = model.init(cfg, jax.random.key(0))
    per_layer = model.transformer.unstack_layers(cfg, params)
    assert not any(k.startswith("blocks_") and "layer" not in k for k in per_layer)
    cache = model.init_cache(cfg, batch=2, max_length=16)
    want = fwd(params, tokens[:, :11], cache=cache)
    got = fwd(per_layer, tokens[:, :11], cache=cache)
    want_step = fwd(params, tokens[:, 11:], cache=want.cache)
    got_step = fwd(per_layer, tokens[:, 11:], cache=got.cache)
    replay = dict(routing=want.router, routing_mode=RoutingMode.REPLAY_IDS)
    want_replay = fwd(params, tokens[:, :11], **replay)
    got_replay = fwd(per_layer, tokens[:, :11], **replay)
    for g, w in ((got, want), (got_step, want_step), (got_replay, want_replay)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), g, w)


@pytest.mark.slow
def test_decode_params_fuse_each_layers_qkv_and_run_the_same_model(params, tokens):
    """`Model.decode_params`: q/k/v as one [D, H + 2N, Dh] weight per layer (one matmul a
    decode step), the forward unchanged (prefill and a cached step); FP8 weights fuse their
    values and scales, per-block ones only where every width is whole blocks."""
    m = model.Model(CFG)
    fused = m.decode_params(params)
    attn = fused["blocks_0_layer_0"]["attn"]
    assert {"q_proj", "k_proj", "v_proj"}.isdisjoint(attn)
    want_w = [params["blocks_0"]["attn"][n][0] for n in ("q_proj", "k_proj", "v_proj")]
    np.testing.assert_array_equal(attn["qkv_proj"], np.concatenate(want_w, axis=1))
    cache = model.init_cache(CFG, batch=2, max_length=16)
    want = forward(params, tokens[:, :11], cache=cache)
    got = forward(fused, tokens[:, :11], cache=cache)
    for g, w in (
        (got, want),
        (
            forward(fused, tokens[:, 11:], cache=got.cache),
            forward(params, tokens[:, 11:], cache=want.cache),
        ),
    ):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), g, w)
    D, H, N, Dh = CFG.d_model, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    for granularity, block, fuses in (
        ("channel", 0, True),
        ("block", 16, True),
        ("block", 24, False),
    ):
        quantize = functools.partial(
            quant.quantize_fp8, granularity=granularity, block_size=block or 128
        )
        q = jax.jit(quantize)(params)  # op by op: ~200 small programs
        attn = m.decode_params(q)["blocks_0_layer_0"]["attn"]
        assert ("qkv_proj" in attn) == fuses, (granularity, block)
        if fuses:
            layer = [q["blocks_0"]["attn"][n] for n in ("q_proj", "k_proj", "v_proj")]
            layer = [jax.tree.map(lambda a: a[0], w) for w in layer]  # layer 0 of the run
            np.testing.assert_array_equal(
                attn["qkv_proj"].astype(jnp.float32),
                np.concatenate([w.astype(jnp.float32) for w in layer], axis=1),
            )
            assert attn["qkv_proj"].values.shape == (D, H + 2 * N, Dh)


# Two leading dense layers, then two MoE layers: two layer runs, the MoE run starting at layer 2,
# which is neither its run index (1) nor its index among the MoE layers (0), and runs of two
# layers (a scan index that is not always 0). CFG's runs of one layer each hide a route or a
# cache buffer picked by the wrong one of these indices.
LEADING_DENSE = ModelConfig.tiny(num_layers=4, dense_layers=(0, 1), dense_ffn_dim=48)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "decode params"])
def test_leading_dense_layers_each_read_their_own_cache_in_decode(tokens, layout):
    """Prefill 5 tokens, then 7 cached decode steps, with the scanned [L, ...] runs and with the
    sampler's per-layer decode params (`Model.decode_params`): the logits and routes of one full
    forward, and every layer's cache buffer holds that layer's keys (each layer's differ)."""
    cfg = LEADING_DENSE
    fwd = forward_of(cfg)
    params = model.init(cfg, jax.random.key(0))
    full = fwd(params, tokens)
    if layout == "decode params":
        params = model.Model(cfg).decode_params(params)
    out = fwd(params, tokens[:, :5], cache=model.init_cache(cfg, batch=2, max_length=16))
    logits, ids = [out.logits], [out.router.expert_ids]
    for t in range(5, tokens.shape[1]):
        out = fwd(params, tokens[:, t : t + 1], cache=out.cache)
        logits.append(out.logits)
        ids.append(out.router.expert_ids)
    np.testing.assert_allclose(jnp.concatenate(logits, 1), full.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(jnp.concatenate(ids, 2), full.router.expert_ids)
    keys = np.asarray(out.cache.k)[:, :, :, :12]  # [L, B, N, T, Dh]
    assert all(np.abs(keys[i] - keys[j]).max() > 1e-3 for i in range(4) for j in range(i))
