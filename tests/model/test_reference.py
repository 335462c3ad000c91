"""espo's forward against the independent float64 NumPy reference (`numpy_reference.py`).

Runs in every environment (no torch); Hugging Face parity (`test_hf.py`) is the second oracle.
The two configs between them build every code path of the model: sliding window, shared expert
with and without its sigmoid gate, dense layers (leading and in the middle), q/k norm,
norm_topk_prob on and off, GQA ratios 2 and 4, tied embeddings, left and right padding, and
non-zero, unequal router-loss coefficients. Norm scales are perturbed away from 1 so that a
dropped or misplaced scale shows. Tolerance: 1e-4 for module outputs (STYLE.md).
"""

import functools
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import model, testing, types
from espo.model import ModelConfig, RoutingMode, layers, moe


def _load_reference():
    """tests/model/numpy_reference.py by path (pytest runs with --import-mode=importlib)."""
    path = pathlib.Path(__file__).with_name("numpy_reference.py")
    return testing.load_script(path, name="espo_numpy_reference")


ref = _load_reference()

TOL = dict(atol=1e-4, rtol=1e-4)
_SMALL = dict(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_experts=6, moe_ffn_dim=16)
CONFIGS = {
    # Window 3 < T = 7, shared expert with sigmoid gate, a dense middle layer, q/k norm,
    # renormalised top-2, GQA 2, left padding.
    "window_shared_dense_qknorm": ModelConfig.tiny(
        **_SMALL, num_layers=3, num_kv_heads=2, top_k=2, dense_layers=(1,), dense_ffn_dim=24,
        shared_expert_ffn_dim=12, sliding_window=3, qk_norm=True, norm_topk_prob=True,
        aux_loss_coef=0.3, z_loss_coef=0.02,
    ),
    # Raw (unrenormalised) top-3, ungated shared expert, a leading dense layer, no q/k norm,
    # GQA 4, tied embeddings, right padding.
    "raw_topk_ungated_tied": ModelConfig.tiny(
        **_SMALL, num_layers=3, num_kv_heads=1, top_k=3, dense_layers=(0,), dense_ffn_dim=20,
        shared_expert_ffn_dim=10, shared_expert_gate=False, qk_norm=False,
        norm_topk_prob=False, tie_embeddings=True, aux_loss_coef=0.05, z_loss_coef=0.4,
    ),
}  # fmt: skip
MASKS = {
    "window_shared_dense_qknorm": [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]],
    "raw_topk_ungated_tied": [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]],
}


def _perturb_scales(params, key):
    """Norm scales 1 + 0.3 N(0, 1), so that each scale's placement matters."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(paths))
    leaves = [
        x + 0.3 * jax.random.normal(k, x.shape) if "scale" in jax.tree_util.keystr(path) else x
        for (path, x), k in zip(paths, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


@functools.cache
def _case(name):
    cfg = CONFIGS[name]
    params = _perturb_scales(model.init(cfg, jax.random.key(0)), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    mask = jnp.asarray(MASKS[name], bool)
    return cfg, params, tokens, mask


def _real(a, mask):
    """a [B, L, T, ...] or [B, T, ...] at the real positions (layer axis kept)."""
    a, mask = np.asarray(a), np.asarray(mask)
    return np.swapaxes(a, 1, 2)[mask] if a.ndim == 4 else a[mask]


def _assert_matches(out, want, mask):
    np.testing.assert_allclose(_real(out.logits, mask), _real(want.logits, mask), **TOL)
    np.testing.assert_array_equal(_real(out.router.expert_ids, mask), _real(want.expert_ids, mask))
    np.testing.assert_allclose(
        _real(out.router.expert_weights, mask), _real(want.expert_weights, mask), **TOL
    )
    np.testing.assert_allclose(out.aux.load_balancing_loss, want.load_balancing_loss, **TOL)
    np.testing.assert_allclose(out.aux.z_loss, want.z_loss, **TOL)
    np.testing.assert_allclose(out.aux.total, want.total, **TOL)
    assert int(out.aux.num_unrecorded_routes) == want.num_unrecorded_routes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "jit"), [(name, True) for name in CONFIGS] + [("window_shared_dense_qknorm", False)]
)
def test_free_forward(name, jit):
    """Jitted, and op by op for one config (a notebook's eager call; the other config op by op
    compiled ~150 small programs for no new path)."""
    cfg, params, tokens, mask = _case(name)
    forward = _jit_forward if jit else model.forward  # jitted: the program test_replayed_...'s
    out = forward(cfg, params, tokens, attention_mask=mask)  # free forward runs too
    want = ref.forward(cfg, params, tokens, attention_mask=mask)
    _assert_matches(out, want, mask)
    # The comparison is not between near-zero numbers, and the losses are distinct, so a
    # swap of the two coefficients changes aux.total.
    assert np.abs(want.logits).max() > 1.0
    assert abs(want.load_balancing_loss - want.z_loss) > 0.5


_jit_forward = jax.jit(
    model.forward, static_argnames=("cfg", "routing_mode", "replay_missing"), static_argnums=0
)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(
    "mode", [RoutingMode.REPLAY_IDS, RoutingMode.REPLAY_IDS_AND_WEIGHTS], ids=lambda m: m.name
)
def test_replayed_forward(name, mode):
    # A trace the router would not choose (ids shifted by one, uneven given weights), with one
    # unrecorded id on a real token routed freely and unrecorded ids on padding.
    cfg, params, tokens, mask = _case(name)
    free = _jit_forward(cfg, params, tokens, attention_mask=mask)
    E = cfg.num_experts
    ids = jnp.where(free.router.expert_ids >= 0, (free.router.expert_ids + 1) % E, -1)
    ids = ids.at[1, cfg.moe_layers[-1], 3, 0].set(-1)
    ids = jnp.where(mask[:, None, :, None], ids, -1)
    weights = jax.random.uniform(jax.random.key(3), ids.shape) * (ids >= 0)
    trace = types.RouterTrace(expert_ids=ids, expert_weights=weights)
    out = _jit_forward(
        cfg, params, tokens, attention_mask=mask, routing=trace, routing_mode=mode,
        replay_missing="free",
    )  # fmt: skip
    want = ref.forward(
        cfg, params, tokens, attention_mask=mask, routing=(ids, weights), mode=mode.value,
        replay_missing="free",
    )  # fmt: skip
    _assert_matches(out, want, mask)
    assert want.num_unrecorded_routes == 1
    assert np.abs(_real(want.logits, mask) - _real(free.logits, mask)).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [RoutingMode.REPLAY_IDS, RoutingMode.REPLAY_IDS_AND_WEIGHTS], ids=lambda m: m.name
)
def test_leading_dense_layers_replay_each_layers_own_routes(mode):
    """Two leading dense layers, then two MoE layers (runs of two: the MoE run starts at layer 2,
    not at its run index 1 nor its MoE index 0). A trace no router chose, different in each MoE
    layer (layer l's free ids shifted by l, uneven given weights): every layer replays its own
    routes, as the float64 reference does, and the forward returns them where they were."""
    cfg = ModelConfig.tiny(
        **_SMALL, num_layers=4, num_kv_heads=2, top_k=2, dense_layers=(0, 1), dense_ffn_dim=24,
    )  # fmt: skip
    params = model.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    free = _jit_forward(cfg, params, tokens)
    layer = jnp.arange(cfg.num_layers)[None, :, None, None]
    ids = jnp.where(
        free.router.expert_ids >= 0, (free.router.expert_ids + layer) % cfg.num_experts, -1
    )
    weights = jax.random.uniform(jax.random.key(3), ids.shape) * (ids >= 0)
    trace = types.RouterTrace(expert_ids=ids, expert_weights=weights)
    out = _jit_forward(cfg, params, tokens, routing=trace, routing_mode=mode)
    want = ref.forward(cfg, params, tokens, routing=(ids, weights), mode=mode.value)
    mask = jnp.ones(tokens.shape, bool)
    _assert_matches(out, want, mask)
    np.testing.assert_array_equal(out.router.expert_ids, ids)
    assert want.num_unrecorded_routes == 0


def test_rms_norm_small_rms_regime_hand_example():
    # y = x / sqrt(mean(x^2) + eps) * scale. A constant 1e-3 input with eps = 1e-6:
    #   1e-3 / sqrt(1e-6 + 1e-6) = 1 / sqrt(2) = 0.70711
    # (eps outside the root, 1e-3 / (sqrt(1e-6) + 1e-6), would give 0.999.)
    norm = layers.RMSNorm(eps=1e-6)
    x = jnp.full((2, 8), 1e-3)
    params = norm.init(jax.random.key(0), x)
    np.testing.assert_allclose(norm.apply(params, x), 1 / np.sqrt(2.0), rtol=1e-5)
    # Random inputs across scales 1e-5 .. 10 with a non-unit scale: the reference formula.
    rng = np.random.default_rng(0)
    scale = rng.normal(size=8) + 1.0
    params = {"params": {"scale": jnp.asarray(scale, jnp.float32)}}
    for magnitude in (1e-5, 1e-4, 1e-3, 1.0, 10.0):
        x = rng.normal(size=(3, 8)) * magnitude
        got = norm.apply(params, jnp.asarray(x, jnp.float32))
        np.testing.assert_allclose(got, ref.rms_norm(x, scale, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_shared_expert_gate_is_a_sigmoid_hand_example():
    # One MoE block, routed experts zeroed out so only the shared expert speaks:
    #   out = sigmoid(h . w_sg) * swiglu_shared(h)   (Qwen2-MoE's shared_expert_gate)
    # With h . w_sg = 2: sigmoid(2) = 0.8808 (no sigmoid would give 2.0, a 2.27x larger output).
    cfg = ModelConfig.tiny(d_model=4, num_experts=2, top_k=1, moe_ffn_dim=4,
                           shared_expert_ffn_dim=3)  # fmt: skip
    block = moe.MoeBlock(cfg)
    h = jnp.array([[[1.0, 0.5, -1.0, 2.0]]])  # [B=1, T=1, D=4]
    kw = dict(token_mask=jnp.ones((1, 1)), replay_ids=None, replay_weights=None)
    # Jitted: op by op, the init and apply compiled ~110 small programs.
    params = jax.jit(block.init)(jax.random.key(0), h, **kw)["params"]
    params = dict(params, down_proj=jnp.zeros_like(params["down_proj"]))
    params["shared_expert_gate"] = jnp.array([[0.0], [0.0], [0.0], [1.0]])  # h . w_sg = 2
    out, _ = jax.jit(block.apply)({"params": params}, h, **kw)
    s = jax.tree.map(np.asarray, params["shared_expert"])
    shared = ref.swiglu(np.asarray(h[0, 0]), s["gate_proj"], s["up_proj"], s["down_proj"])
    np.testing.assert_allclose(out[0, 0], 0.8807971 * shared, rtol=1e-5, atol=1e-6)
    assert np.abs(shared).max() > 0.1


@pytest.mark.slow
def test_router_losses_of_a_padded_row_equal_the_unpadded_row():
    # Left padding (with arbitrary pad tokens) changes neither aux.total nor its gradient: the
    # router statistics run over real tokens only. (P_e or f_e averaged over all B*T tokens
    # would shrink both by the real fraction 5/7.)
    cfg, params, tokens, _ = _case("window_shared_dense_qknorm")
    row = tokens[:1, 2:]  # [1, 5]
    padded = jnp.concatenate([jnp.array([[7, 63]], row.dtype), row], axis=1)  # [1, 7]
    mask = jnp.arange(7)[None] >= 2

    def total(p, toks, m):
        aux = _jit_forward(cfg, p, toks, attention_mask=m).aux
        return aux.total, (aux.load_balancing_loss, aux.z_loss)

    grad_fn = jax.value_and_grad(total, has_aux=True)
    (want, want_parts), want_grad = grad_fn(params, row, jnp.ones((1, 5), bool))
    (got, got_parts), got_grad = grad_fn(params, padded, mask)
    chex.assert_trees_all_close((got, got_parts), (want, want_parts), **TOL)
    chex.assert_trees_all_close(got_grad, want_grad, atol=1e-5, rtol=1e-4)
    assert float(jnp.linalg.norm(want_grad["blocks_0"]["moe"]["router"])) > 1e-3


def test_moe_reference_is_the_per_token_sum_with_more_experts_than_width():
    # `moe.moe_reference` (the oracle of the dispatch tests) with E = 8 experts on width 4
    # (E > D), against a float64 loop over tokens and their k choices.
    e, d, f, m = 8, 4, 6, 5
    rng = np.random.default_rng(0)
    x, wg, wu, wd = (rng.normal(size=s) for s in [(m, d), (e, d, f), (e, d, f), (e, f, d)])
    ids = np.array([[7, 0], [5, 6], [1, 2], [3, 4], [6, 7]])
    w = rng.uniform(0.1, 1.0, size=(m, 2))
    want = np.zeros((m, d))
    for i in range(m):
        for j in range(2):
            want[i] += w[i, j] * ref.swiglu(x[i], wg[ids[i, j]], wu[ids[i, j]], wd[ids[i, j]])
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    got = moe.moe_reference(f32(x), jnp.asarray(ids), f32(w), f32(wg), f32(wu), f32(wd))
    np.testing.assert_allclose(got, want, **TOL)
