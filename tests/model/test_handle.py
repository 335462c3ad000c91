"""espo.model.Model: the one handle is a hashable value that forwards to the pure functions."""

import chex
import jax
import jax.numpy as jnp
import pytest

from espo import model
from espo.testing import raises_invalid

CFG = model.ModelConfig.tiny(vocab_size=32, num_layers=1)


def test_model_is_a_value_and_a_jit_static():
    a, b = model.Model(CFG), model.Model(cfg=CFG.replace())
    assert a == b and hash(a) == hash(b)  # same config: same compiled functions
    assert model.Model(CFG.replace(top_k=1)) != a
    assert (a.num_layers, a.top_k, a.vocab_size) == (1, CFG.top_k, 32)
    with raises_invalid("cfg", where="Model"):
        model.Model("tiny")


@pytest.mark.slow
def test_init_forward_and_cache_are_the_module_functions():
    m = model.Model(CFG)
    params = m.init(jax.random.key(0))
    chex.assert_trees_all_equal(params, model.init(CFG, jax.random.key(0)))
    chex.assert_trees_all_equal_shapes_and_dtypes(params, m.param_shapes())
    tokens = jnp.array([[3, 1, 4, 1, 5]])
    cache = m.init_cache(batch=1, max_length=8)
    chex.assert_trees_all_equal(cache, model.init_cache(CFG, batch=1, max_length=8))
    # Jitted: op by op, the two forwards compiled ~140 small programs.
    got = jax.jit(m.forward)(params, tokens, cache=cache)
    want = jax.jit(model.forward, static_argnums=0)(CFG, params, tokens, cache=cache)
    chex.assert_trees_all_close(got, want, atol=1e-6)
    # Every keyword reaches transformer.forward: a replay of the free trace is the free forward.
    replay = jax.jit(m.forward, static_argnames="routing_mode")(
        params, tokens, routing=got.router, routing_mode=model.RoutingMode.REPLAY_IDS
    )
    chex.assert_trees_all_close(replay.logits, got.logits, atol=1e-5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'routing_modes'"):
        m.forward(params, tokens, routing_modes=model.RoutingMode.FREE)
