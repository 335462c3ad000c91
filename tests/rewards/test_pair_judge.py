"""The trained pair judge (espo.rewards.pair_judge): its input layout and logits by hand, its loss
against numpy, a few Adam steps that fit a batch, and its verdicts in the round robin; saved and
loaded as a "pairwise" model, and the trainer's judge stage (espo.rewards.model_rewards)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from espo import model
from espo.rewards import judge, model_rewards, pair_judge
from espo.rewards import reward_model as rm
from espo.testing import raises_invalid

CFG = model.ModelConfig.tiny(vocab_size=16, num_layers=1)
# Jitted (op by op, each forward compiled ~50 small programs).
_judge_logits = jax.jit(pair_judge.judge_logits, static_argnums=0)
_judge_loss = jax.jit(pair_judge.judge_loss, static_argnums=0)


def _params(seed=0):
    params = pair_judge.init_pair_judge(CFG, jax.random.key(seed))
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    params["head"] = {
        "w": jax.random.normal(k1, (CFG.d_model, 3)),
        "b": jax.random.normal(k2, (3,)),
    }
    return params


def test_pair_rows_by_hand():
    """A's real tokens (padded left or right), the separator, B's real tokens, then padding."""
    a = np.array([[0, 0, 5, 6], [7, 8, 9, 0]])
    a_mask = np.array([[0, 0, 1, 1], [1, 1, 1, 0]], bool)
    b = np.array([[3, 0, 0], [0, 4, 2]])
    b_mask = np.array([[1, 0, 0], [0, 1, 1]], bool)
    tokens, mask = pair_judge.pair_rows(a, a_mask, b, b_mask, sep=15, pad_id=0)
    np.testing.assert_array_equal(tokens, [[5, 6, 15, 3, 0, 0, 0, 0], [7, 8, 9, 15, 4, 2, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]])


@pytest.mark.slow
def test_logits_and_loss_by_hand():
    """logits = the final hidden state at the last real token @ w + b (from model.forward);
    the loss = the mean cross entropy (numpy) + the router aux loss."""
    params = _params()
    tokens = jax.random.randint(jax.random.key(3), (3, 6), 1, 15)
    mask = np.arange(6)[None] < np.array([6, 4, 2])[:, None]
    logits, _ = _judge_logits(CFG, params, tokens, attention_mask=mask)
    forward = jax.jit(model.forward, static_argnums=0, static_argnames="return_hidden")
    out = forward(CFG, params["backbone"], tokens, attention_mask=mask, return_hidden=True)
    hidden = np.asarray(out.hidden)[np.arange(3), [5, 3, 1]]  # [3, D] the last real tokens
    want = hidden @ np.asarray(params["head"]["w"]) + np.asarray(params["head"]["b"])
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)
    labels = np.array([0, 1, 2])
    batch = pair_judge.JudgeBatch(tokens, mask, labels)
    loss, m = _judge_loss(CFG, params, batch)
    logp = want - np.log(np.exp(want).sum(-1, keepdims=True))
    ce = -logp[np.arange(3), labels].mean()
    np.testing.assert_allclose(float(m["ce_loss"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ce + float(m["aux_loss"]), rtol=1e-5)
    assert float(m["accuracy"]) == pytest.approx(np.mean(want.argmax(-1) == labels))


@pytest.mark.slow
def test_train_step_fits_a_batch():
    """make_train_step(loss=judge_loss): 30 Adam steps on one batch of 6 pairs fit its labels."""
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 14, size=(6, 2, 5))
    masks = np.ones((6, 2, 5), bool)
    tokens, mask = pair_judge.pair_rows(rows[:, 0], masks[:, 0], rows[:, 1], masks[:, 1], sep=15)
    batch = pair_judge.JudgeBatch(tokens, mask, np.array([0, 1, 2, 0, 1, 2]))
    optimizer = optax.adam(3e-3)
    params = pair_judge.init_pair_judge(CFG, jax.random.key(0))
    step, state = rm.make_train_step(CFG, optimizer, pair_judge.judge_loss), None
    state = optimizer.init(params)
    first = None
    for _ in range(30):
        params, state, m = step(params, state, batch)
        first = first if first is not None else float(m["ce_loss"])
    assert first == pytest.approx(np.log(3), rel=1e-5)  # the zero head: uniform classes
    _, m = _judge_loss(CFG, params, batch)
    assert float(m["accuracy"]) == 1.0 and float(m["ce_loss"]) < 0.5 * first


@pytest.mark.slow
def test_model_judge_verdicts_and_round_robin():
    """A head whose bias makes "tie" win everywhere calls every pair a tie: a zero-variance
    group with zero rewards and pair scores; otherwise the verdicts are the logits' argmax."""
    params = _params()
    rows = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    masks = rows > 0
    responses = [(rows[i], masks[i]) for i in range(3)]
    mj = pair_judge.ModelJudge(CFG, params, chunk=4)
    logits = mj.logits(rows[[0, 1]], masks[[0, 1]], rows[[1, 2]], masks[[1, 2]])
    want = [judge.VERDICTS[k] for k in logits.argmax(-1)]
    assert mj.judge_pairs([(responses[0], responses[1]), (responses[1], responses[2])]) == want
    assert mj(responses[0], responses[1]) == want[0]
    params["head"]["b"] = jnp.array([0.0, 1e4, 0.0])
    tie = judge.judge_group(responses, pair_judge.ModelJudge(CFG, params), both_orders=True)
    assert tie.zero_variance_mask and not tie.rewards.any() and not tie.pair_scores.any()


@pytest.mark.slow
def test_saved_judge_scores_groups_in_the_trainer_stage(tmp_path):
    """Saved as "pairwise", loaded back with its kind; the trainer's RM stage in judge mode
    gives each group the round robin of the judge (both orders), and refuses other modes."""
    params = _params()
    path = model_rewards.save(tmp_path / "judge", CFG, params, kind="pairwise")
    assert model_rewards.kind(path) == "pairwise"
    stage = model_rewards.RewardModelRewards.load(str(path), mode="judge", dead_zone=0.0)
    rows = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [2, 2, 0, 0], [3, 0, 0, 0]])
    masks = rows > 0
    rewards, verifiable, m = stage(rows, masks, np.repeat([0, 1], [3, 2]), np.ones(5, bool))
    for g, group in enumerate(([0, 1, 2], [3, 4])):
        want = judge.judge_group(
            [(rows[i], masks[i]) for i in group], pair_judge.ModelJudge(CFG, params),
            both_orders=True,
        ).rewards  # fmt: skip
        np.testing.assert_allclose(rewards[group], want, atol=1e-6, err_msg=f"group {g}")
    assert not verifiable.any()
    assert 0 <= m["rm/judge_tie_rate"] <= 1 and "rm/score_mean" not in m
    with raises_invalid("model_mode"):
        model_rewards.RewardModelRewards.load(str(path), mode="naive", dead_zone=0.0)
    with raises_invalid("kind"):
        model_rewards.save(tmp_path / "other", CFG, params, kind="generative")
