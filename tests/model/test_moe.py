"""The routing of `route` (free, replayed ids and weights) and the router losses."""

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from espo.model import RoutingMode, moe

E, K = 8, 2


def test_route_free_and_replay_semantics():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    probs = np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum()
    ids, w = moe.route(logits, top_k=2, norm_topk_prob=False, mode=RoutingMode.FREE)
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [probs[:2]], rtol=1e-6)  # unnormalised: softmax over all
    ids, w = moe.route(logits, top_k=2, norm_topk_prob=True, mode=RoutingMode.FREE)
    np.testing.assert_allclose(w, [probs[:2] / probs[:2].sum()], rtol=1e-6)
    # Replay different experts: gates are the model's own gating at those ids.
    replay = jnp.array([[3, 2]])
    ids, w = moe.route(
        logits, top_k=2, norm_topk_prob=True, mode=RoutingMode.REPLAY_IDS, replay_ids=replay
    )
    assert ids.tolist() == [[3, 2]]
    np.testing.assert_allclose(w, [[probs[3], probs[2]] / (probs[3] + probs[2])], rtol=1e-6)
    # -1 contributes zero weight; the remaining valid expert takes all the (renormalised) mass.
    ids, w = moe.route(
        logits, top_k=2, norm_topk_prob=True, mode=RoutingMode.REPLAY_IDS,
        replay_ids=jnp.array([[1, -1]]),
    )  # fmt: skip
    np.testing.assert_allclose(w, [[1.0, 0.0]], rtol=1e-6)
    ids, w = moe.route(
        logits, top_k=2, norm_topk_prob=False, mode=RoutingMode.REPLAY_IDS_AND_WEIGHTS,
        replay_ids=jnp.array([[1, -1]]), replay_weights=jnp.array([[0.3, 0.9]]),
    )  # fmt: skip
    np.testing.assert_allclose(w, [[0.3, 0.0]])
    # A replay mode without the ids to replay is refused, naming the mode (the model forward
    # checks its `routing` first; this is the error of a direct caller).
    with pytest.raises(ValueError, match=r"routing_mode=REPLAY_IDS needs `routing` \(a Rou"):
        moe.route(logits, top_k=2, norm_topk_prob=True, mode=RoutingMode.REPLAY_IDS)


@pytest.mark.slow
def test_router_losses_balanced_router_scores_top_k():
    # Uniform router logits and perfectly balanced assignments: E * sum_e (K/E)(1/E) = K.
    logits = jnp.zeros((8, 4))
    ids = jnp.array([[0, 1], [2, 3]] * 4, jnp.int32)
    lb, z, load = moe.router_losses(logits, ids, jnp.ones(8))
    np.testing.assert_allclose(lb, 2.0, rtol=1e-6)
    np.testing.assert_allclose(z, np.log(4.0) ** 2, rtol=1e-6)
    np.testing.assert_allclose(load, [0.25] * 4)


@pytest.mark.slow
def test_router_losses_hand_example_with_padding():
    # E=2, K=1. Real tokens: logits [0, 0] (p = [1/2, 1/2]), both routed to expert 0; the padded
    # third token holds extreme logits [1e9, -1e9] (p = [1, 0]) and id 1. Over the n=2 real tokens:
    #   f = [1, 0], P = [1/2, 1/2]  ->  lb = E * sum_e f_e P_e = 2 * (1 * 1/2) = 1.0
    #   z = mean lse^2 = ln(2)^2 = 0.48045
    # Wrong answers: P over all M=3 tokens, padding included: P = [2/3, 1/3] -> lb = 1.333;
    # padding zeroed but divided by M: P = [1/3, 1/3] -> lb = 0.667.
    logits = jnp.array([[0.0, 0.0], [0.0, 0.0], [1e9, -1e9]])
    ids = jnp.array([[0], [0], [1]], jnp.int32)
    lb, z, load = moe.router_losses(logits, ids, jnp.array([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(lb, 1.0, rtol=1e-6)
    np.testing.assert_allclose(z, np.log(2.0) ** 2, rtol=1e-6)
    np.testing.assert_allclose(load, [1.0, 0.0])


def test_router_losses_of_one_real_token_and_of_none():
    # E=2, K=1, one real token with p = [1/4, 3/4] routed to expert 1, one padded row:
    #   f = [0, 1], P = [1/4, 3/4] -> lb = 2 * 3/4 = 1.5; z = lse([0, ln 3])^2 = ln(4)^2.
    # With no real token at all every loss and load is 0, not 0/0.
    logits = jnp.array([[0.0, np.log(3.0)], [5.0, -5.0]])
    ids = jnp.array([[1], [0]], jnp.int32)
    lb, z, load = moe.router_losses(logits, ids, jnp.array([1.0, 0.0]))
    np.testing.assert_allclose([lb, z], [1.5, np.log(4.0) ** 2], rtol=1e-6)
    np.testing.assert_allclose(load, [0.0, 1.0])
    none = moe.router_losses(logits, ids, jnp.zeros(2))
    chex.assert_trees_all_equal(none, (0.0, 0.0, jnp.zeros(2)))


def _router_losses(lg, i, m):
    lb, z, _ = moe.router_losses(lg, i, m)
    return 0.7 * lb + 0.3 * z, (lb, z)


# Jitted once (a program a shape; op by op, each example compiled ~7 small ones): the masks are
# the same operations either way, and 0 * inf is NaN in both.
_router_value_and_grad = jax.jit(jax.value_and_grad(_router_losses, has_aux=True))


@hypothesis.given(
    seed=st.integers(0, 2**16),
    num_pad=st.integers(1, 4),
    fill=st.sampled_from([1e9, -1e9, np.inf, -np.inf, np.nan]),
)
@pytest.mark.slow
@hypothesis.settings(max_examples=25, deadline=None)
def test_router_losses_ignore_whatever_padding_holds(seed, num_pad, fill):
    # Padded rows hold extreme / non-finite logits and arbitrary ids: value and gradient equal
    # those of the real rows alone (gradient 0 at padding). Catches P_e or f_e averaged over all
    # tokens, and masks applied by multiplication (0 * inf = NaN).
    rng = np.random.default_rng(seed)  # built in numpy: no small program compiled a shape
    real_logits = (rng.normal(size=(5, E)) * 2).astype(np.float32)
    real_ids = rng.choice(E, size=(5, K)).astype(np.int32)
    pad_logits = np.full((num_pad, E), fill, np.float32)
    pad_logits[:, 0] = 1.0
    pad_ids = rng.choice(E, size=(num_pad, K)).astype(np.int32)
    logits = np.concatenate([pad_logits, real_logits])
    ids = np.concatenate([pad_ids, real_ids])
    mask = np.concatenate([np.zeros(num_pad, np.float32), np.ones(5, np.float32)])

    (_, want), want_grad = _router_value_and_grad(real_logits, real_ids, np.ones(5, np.float32))
    (_, got), grad = _router_value_and_grad(logits, ids, mask)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    chex.assert_tree_all_finite(grad)
    chex.assert_trees_all_close(grad[num_pad:], want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(grad[:num_pad], 0.0)
