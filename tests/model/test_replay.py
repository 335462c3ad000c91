"""Router replay with unrecorded (-1) ids on real tokens: an error by default, free on request.

Before, a real token replayed with a -1 id got a zero gate, a zero MoE output and logits moved by
~2 with no sign of it. Now: an eager forward raises naming the layer, row and positions; a jitted
one returns `aux.num_unrecorded_routes` and raises under `checkify`; `replay_missing="free"`
routes those tokens with the router's own top-k.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from espo import model, types
from espo.model import ModelConfig, RoutingMode
from espo.testing import raises_invalid

# Layer 1 is dense, so layer indices in messages are model layers, not MoE-layer indices.
CFG = ModelConfig.tiny(num_layers=3, dense_layers=(1,), dense_ffn_dim=32, d_model=32)
REPLAY_MODES = [RoutingMode.REPLAY_IDS, RoutingMode.REPLAY_IDS_AND_WEIGHTS]
_jit_forward = jax.jit(
    functools.partial(model.forward, CFG), static_argnames=("routing_mode", "replay_missing")
)


@functools.cache
def _setup():
    params = model.init(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, CFG.vocab_size)
    free = _jit_forward(params, tokens)
    # Row 1, position 4: slot 0 of MoE layer 2 unrecorded; row 0, position 2: both slots of
    # layer 0. Everything else is the free forward's own routing.
    ids = free.router.expert_ids.at[1, 2, 4, 0].set(-1).at[0, 0, 2, :].set(-1)
    trace = types.RouterTrace(expert_ids=ids, expert_weights=free.router.expert_weights)
    return params, tokens, free, trace


@pytest.fixture(scope="module")
def setup():
    return _setup()


@pytest.mark.slow
@pytest.mark.parametrize("mode", REPLAY_MODES, ids=lambda m: m.name)
def test_eager_replay_of_an_unrecorded_real_token_raises_naming_layer_and_position(setup, mode):
    params, tokens, _, trace = setup
    with pytest.raises(model.UnrecordedRouteError) as err:
        model.forward(CFG, params, tokens, routing=trace, routing_mode=mode)
    assert "layer 0 row 0 positions [2]" in str(err.value)
    assert "layer 2 row 1 positions [4]" in str(err.value)
    assert 'replay_missing="free"' in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("mode", REPLAY_MODES, ids=lambda m: m.name)
def test_jitted_replay_returns_the_count_and_checkify_raises(setup, mode):
    params, tokens, free, trace = setup
    out = _jit_forward(params, tokens, routing=trace, routing_mode=mode)
    assert int(out.aux.num_unrecorded_routes) == 2  # (row 0, layer 0) and (row 1, layer 2)
    # What the flag guards against: the zero-gated tokens' logits really move.
    assert float(jnp.max(jnp.abs(out.logits[1, 4] - free.logits[1, 4]))) > 0.1
    with pytest.raises(model.UnrecordedRouteError, match=r"layer 0 row 0 positions \[2\]"):
        model.check_replay(CFG, trace)
    checked = checkify.checkify(_jit_forward, errors=checkify.user_checks)
    err, _ = checked(params, tokens, routing=trace, routing_mode=mode)
    with pytest.raises(checkify.JaxRuntimeError, match="2 real .* first at layer 0, row 0, pos"):
        err.throw()


@pytest.mark.slow
def test_unrecorded_padding_is_not_an_error(setup):
    params, tokens, free, trace = setup
    mask = jnp.ones(tokens.shape, bool).at[1, 4].set(False).at[0, 2].set(False)
    model.check_replay(CFG, trace, mask)  # no error: only padding is unrecorded
    out = _jit_forward(
        params, tokens, attention_mask=mask, routing=trace, routing_mode=RoutingMode.REPLAY_IDS
    )
    assert int(out.aux.num_unrecorded_routes) == 0
    # A free forward never counts anything, and a self-replay of a full trace is clean.
    assert int(free.aux.num_unrecorded_routes) == 0
    replay = _jit_forward(params, tokens, routing=free.router, routing_mode=RoutingMode.REPLAY_IDS)
    assert int(replay.aux.num_unrecorded_routes) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "jit"),
    [(m, True) for m in REPLAY_MODES] + [(REPLAY_MODES[0], False)],
    ids=lambda v: v.name if isinstance(v, model.RoutingMode) else ("jit" if v else "op_by_op"),
)
def test_free_routes_those_tokens_with_the_router(mode, jit):
    """Jitted in both modes, and op by op in one (the other op by op compiled ~180 small
    programs for no new path)."""
    params, tokens, free, trace = _setup()
    forward = functools.partial(model.forward, CFG, routing_mode=mode, replay_missing="free")
    out = (jax.jit(forward) if jit else forward)(params, tokens, routing=trace)
    assert int(out.aux.num_unrecorded_routes) == 2
    # Equal to the free forward everywhere: unrecorded tokens route freely, the others
    # replay the free forward's own routing.
    np.testing.assert_array_equal(out.router.expert_ids, free.router.expert_ids)
    chex.assert_trees_all_close(out.router.expert_weights, free.router.expert_weights, atol=1e-6)
    chex.assert_trees_all_close(out.logits, free.logits, atol=1e-4, rtol=1e-4)


def test_replay_missing_is_validated(setup):
    params, tokens, _, trace = setup
    with raises_invalid("replay_missing"):
        model.forward(CFG, params, tokens, routing=trace, replay_missing="zero")
