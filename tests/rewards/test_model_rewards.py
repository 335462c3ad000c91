"""The trainer's reward-model stage (espo.rewards.model_rewards): modes, inversion metrics by
hand, ragged groups, save / load; and the trainer run with `reward.model_path`."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from espo import config as config_lib
from espo import errors, metrics, model, testing, trainer
from espo.rewards import model_rewards
from espo.rewards import reward_model as rm
from espo.testing import raises_invalid

ROOT = pathlib.Path(__file__).resolve().parents[2]

# One mixed group (correct: rollouts 0 and 3) and one all-correct group of near-equal scores.
SCORES = np.array([[0.1, 0.5, 2.0, 1.9], [0.0, 0.3, 0.6, 0.9]], np.float32)
CORRECT = np.array([[1, 0, 0, 1], [1, 1, 1, 1]], bool)


def test_modes_by_hand():
    naive = model_rewards.group_rewards(SCORES, CORRECT, mode="naive", dead_zone=0.75)
    np.testing.assert_array_equal(naive, SCORES)
    # adjusted, G = 4: margin = margin_bound(4) / 2 = 1/8. Group 0: tier 1 = {0.1, 1.9} (gap
    # 1.8 >= 0.75: ranks -1, +1), tier 0 = {0.5, 2.0} (gap 1.5: -1, +1); r = tier + x / 8.
    # Group 1: one tier, gaps 0.3 < 0.75 chain into one tie cluster: x = 0, r = 1.
    adjusted = model_rewards.group_rewards(SCORES, CORRECT, mode="adjusted", dead_zone=0.75)
    np.testing.assert_allclose(adjusted, [[0.875, -0.125, 0.125, 1.125], [1, 1, 1, 1]])
    # judge, tie band 0.75: group 0: 0.1 ties 0.5 and loses to 2.0 and 1.9 -> -2/3; 0.5 the
    # same; 2.0 and 1.9 beat both and tie each other -> +2/3. Group 1: only 0.0 vs 0.9 is
    # decided (gap 0.9): -1/3, 0, 0, +1/3.
    judged = model_rewards.group_rewards(SCORES, CORRECT, mode="judge", dead_zone=0.75)
    np.testing.assert_allclose(
        judged, [[-2 / 3, -2 / 3, 2 / 3, 2 / 3], [-1 / 3, 0, 0, 1 / 3]], rtol=1e-6
    )
    # dead_zone, no verifier: group 0 clusters {0.1, 0.5} and {1.9, 2.0} (gaps 0.4, 0.1 < 0.75;
    # 1.4 between), average ranks 1.5 and 3.5 of 4: x = (2 rank - 5) / 3 = -2/3, +2/3; group 1
    # chains into one cluster: 0.
    dead = model_rewards.group_rewards(SCORES, CORRECT, mode="dead_zone", dead_zone=0.75)
    np.testing.assert_allclose(dead, [[-2 / 3, -2 / 3, 2 / 3, 2 / 3], [0, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(
        dead, model_rewards.group_rewards(SCORES, ~CORRECT, mode="dead_zone", dead_zone=0.75)
    )  # the verifier is not read
    with raises_invalid("mode"):
        model_rewards.group_rewards(SCORES, CORRECT, mode="bt", dead_zone=0.75)


@pytest.mark.slow
def test_inversion_metrics_by_hand():
    """Naive: group 0's advantages have signs (-, -, +, +) against correctness (+, -, -, +):
    rollouts 0 and 2 inverted; group 1 is all correct, so each of its 4 nonzero advantages is
    inverted: 6 of 8. Adjusted: none. The RM orders 1 of group 0's 4 (correct, wrong) pairs right
    (1.9 > 0.5), whatever the mode."""
    tokens = np.zeros((8, 3), np.int32)
    rewarder = _rewarder_with_scores(SCORES.ravel(), mode="naive")
    _, verifiable, m = rewarder(tokens, tokens > -1, np.repeat([0, 1], 4), CORRECT.ravel())
    assert m["rm/inversion_rate"] == pytest.approx(6 / 8)
    assert m["rm/inversion_rate_mixed"] == pytest.approx(2 / 4)
    assert m["rm/sign_agreement"] == pytest.approx(2 / 4)  # of group 0's 4 decided rollouts
    assert m["rm/pair_accuracy"] == pytest.approx(1 / 4)
    # Tied pairs: group 0's (0, 3) and (1, 2), both split (signs -, +); group 1's 6, split
    # where a rollout of the lower half meets one of the upper half: 4. Different-quality
    # pairs (0, 1), (0, 2), (3, 2) have the wrong rollout's advantage above: 3 of 4.
    assert m["rm/pair_inversion_tied"] == pytest.approx(6 / 8)
    assert m["rm/pair_inversion_diff"] == pytest.approx(3 / 4)
    assert not verifiable.any()  # relative rewards: never RL-ZVP
    rewarder = _rewarder_with_scores(SCORES.ravel(), mode="adjusted")
    _, verifiable, m = rewarder(tokens, tokens > -1, np.repeat([0, 1], 4), CORRECT.ravel())
    assert m["rm/inversion_rate"] == 0 and m["rm/sign_agreement"] == 1
    assert m["rm/pair_inversion_tied"] == 0 and m["rm/pair_inversion_diff"] == 0
    assert m["rm/pair_accuracy"] == pytest.approx(1 / 4) and verifiable.all()


@pytest.mark.slow
def test_ragged_groups_equal_each_group_alone():
    """Adaptive G: groups of sizes 4, 2, 4, 3 (group-major rows) get what each gets alone."""
    rng = np.random.default_rng(0)
    sizes = [4, 2, 4, 3]
    ids = np.repeat(np.arange(4), sizes)
    scores = rng.normal(size=ids.size).astype(np.float32)
    correct = rng.random(ids.size) < 0.5
    tokens = np.zeros((ids.size, 3), np.int32)
    for mode in model_rewards.MODES:
        rewards, _, _ = _rewarder_with_scores(scores, mode=mode, dead_zone=0.5)(
            tokens, tokens > -1, ids, correct
        )
        for g in range(4):
            rows = ids == g
            alone = model_rewards.group_rewards(
                scores[rows][None], correct[rows][None], mode=mode, dead_zone=0.5
            )[0]
            np.testing.assert_allclose(rewards[rows], alone, rtol=1e-6, err_msg=f"{mode} {g}")


def _rewarder_with_scores(scores, *, mode, dead_zone=0.75):
    """A RewardModelRewards whose scorer returns `scores` (the RM forward is tested below)."""
    cfg = model.ModelConfig.tiny(vocab_size=16, num_layers=1)
    out = model_rewards.RewardModelRewards(cfg=cfg, params={}, mode=mode, dead_zone=dead_zone)
    out.score = lambda params, tokens, mask: np.asarray(scores, np.float32)
    return out


@pytest.mark.slow
def test_save_load_round_trip_and_errors(tmp_path):
    cfg = model.ModelConfig.tiny(vocab_size=32, num_layers=1)
    params = rm.init_reward_model(cfg, jax.random.key(0))
    params["head"] = {"w": jax.random.normal(jax.random.key(1), (cfg.d_model,)), "b": 0.5}
    path = model_rewards.save(tmp_path / "rm", cfg, params)
    cfg2, params2 = model_rewards.load(path)
    assert cfg2 == cfg
    tokens = jax.random.randint(jax.random.key(2), (5, 7), 0, 32)
    mask = np.arange(7)[None] < np.array([7, 6, 5, 4, 3])[:, None]
    score = model_rewards.make_scorer(cfg, chunk=4)  # 5 rows: two chunks, the last padded
    np.testing.assert_allclose(score(params2, tokens, mask), score(params, tokens, mask))
    one = np.asarray(rm.reward_scores(cfg, params, tokens, attention_mask=mask)[0])
    np.testing.assert_allclose(score(params, tokens, mask), one, rtol=1e-5, atol=1e-6)
    assert np.ptp(one) > 0  # the head is not zero: scores differ
    with pytest.raises(FileExistsError, match="already holds a reward model"):
        model_rewards.save(path, cfg, params)
    with raises_invalid(model_rewards.MANIFEST, kind=errors.CheckpointError):
        model_rewards.load(tmp_path / "nowhere")


def _config(**reward):
    cfg = testing.load_script(ROOT / "configs" / "default.py").get_config("tiny")
    cfg.train.steps = 1
    cfg.reward.update(reward)
    return cfg


@pytest.mark.slow
def test_trainer_trains_on_the_reward_model(tmp_path):
    """With a naive RM the rewards the optimiser normalises are RM scores: they differ inside
    every group, so no group is zero-variance (the tiny run's verifier leaves most groups so),
    and the rm/* metrics of the verifier-measured inversion are logged."""
    settings = config_lib.Settings.from_config(_config())
    params = rm.init_reward_model(settings.model, jax.random.key(0))
    params["head"]["w"] = jax.random.normal(jax.random.key(1), (settings.model.d_model,))
    path = model_rewards.save(tmp_path / "rm", settings.model, params)
    trainer.train(_config(model_path=str(path), model_mode="naive"), str(tmp_path / "run"),
                  progress=False)  # fmt: skip
    rows = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert [r["zve/rollout_zvp_rate"] for r in rows] == [0.0]
    for key in ("rm/inversion_rate", "rm/pair_accuracy", "train/accuracy"):
        assert all(0 <= r[key] <= 1 for r in rows), key
    assert all(r["rm/inversion_rate"] > 0 for r in rows)  # random scores invert


@pytest.mark.slow
def test_a_bad_reward_model_path_names_the_key(tmp_path):
    cfg = _config(model_path=str(tmp_path / "missing"))
    with raises_invalid("model_path", where="--config.reward", kind=config_lib.ConfigError):
        trainer.train(cfg, str(tmp_path / "run"), progress=False)
    with raises_invalid("model_mode", where="--config.reward", kind=config_lib.ConfigError):
        config_lib.Settings.from_config(_config(model_mode="bt"))
