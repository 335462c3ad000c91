"""Tests for espo.advantages: hand-derived values, the issue-7 rules, invariances, padding.

Each hand example gives the formula and numbers; the comment names the wrong answer a plausible
one-token bug would give, so a failure says which bug came back.
"""

import functools
import re

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import strategies as st

from espo import advantages
from espo.testing import raises_invalid

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = advantages.AdvantageConfig()
ZVP = advantages.AdvantageConfig(rl_zvp=True)
FILLS = (1e9, np.inf, -np.inf, np.nan)
# Jitted where a test calls the dense form on larger inputs (op by op: ~60 small compiles).
_compute_dense = jax.jit(advantages.compute_dense, static_argnames="cfg")


def flat(rewards, group_ids, num_groups, cfg=CFG, **kw):
    return advantages.compute_jit(
        jnp.asarray(rewards, jnp.float32),
        group_ids=jnp.asarray(group_ids, jnp.int32),
        num_groups=num_groups,
        cfg=cfg,
        **kw,
    )


# ---------------------------------------------------------------- GRPO / Dr.GRPO by hand


def test_group_normalized_by_hand():
    # Row 0: [1, 0, 0, 1], mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.577350
    #   -> +-0.5 / (0.577350 + 1e-6) = +-0.866024. (Biased std 0.5 (ddof 0) would give +-1.)
    # Row 1: [2, 4, 6, 8], mean 5, deviations [-3, -1, 1, 3], var = 20 / 3, std = 2.581989
    #   -> [-1.161895, -0.387298, 0.387298, 1.161895].
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    adv = advantages.group_normalized(rewards)
    np.testing.assert_allclose(adv[0], [0.866024, -0.866024, -0.866024, 0.866024], atol=1e-6)
    np.testing.assert_allclose(adv[1], [-1.161895, -0.387298, 0.387298, 1.161895], atol=1e-6)
    assert adv.dtype == jnp.float32
    # Dr.GRPO: only the mean is removed.
    dr = advantages.group_normalized(rewards, scale_by_std=False)
    np.testing.assert_allclose(dr, [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]], **TOL)


@pytest.mark.slow
def test_eps_is_added_to_the_std_not_inside_the_square_root():
    # issue 13 #1. R = [0, 0, 0, -1/4096] (a tie broken by a tiny penalty): mean = -1/16384,
    # deviations [1, 1, 1, -3] / 16384, var = 12 / 3 / 16384^2, std = 2/16384 = 1.2207e-4.
    #   A = (1/16384) / (1.2207e-4 + 1e-6) = 0.495937, and -3x that = -1.487812.
    # Wrong answer (centred / sqrt(std^2 + eps)): sqrt(1.49e-8 + 1e-6) = 1.0074e-3 -> 0.0606.
    rewards = jnp.array([[0.0, 0.0, 0.0, -1.0 / 4096]])
    expected = [0.495937, 0.495937, 0.495937, -1.487812]
    np.testing.assert_allclose(advantages.group_normalized(rewards)[0], expected, rtol=1e-5)
    # The same numbers through `compute` (the trainer's path): range 2.4e-4 > atol, informative.
    out = flat(rewards[0], [0, 0, 0, 0], 1)
    np.testing.assert_allclose(out.advantages, expected, rtol=1e-5)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_degenerate_groups_get_zero_not_nan(scale_by_std):
    # G == 1 (the ddof=1 std of one sample is NaN) and zero-variance groups (0 / eps) both give 0.
    single = advantages.group_normalized(jnp.array([[1.0], [0.0]]), scale_by_std=scale_by_std)
    np.testing.assert_array_equal(single, [[0.0], [0.0]])
    same = advantages.group_normalized(jnp.ones((2, 4)), scale_by_std=scale_by_std)
    np.testing.assert_array_equal(same, np.zeros((2, 4)))


def test_config_errors_name_field_value_and_options():
    with raises_invalid("estimator", where="AdvantageConfig"):
        advantages.AdvantageConfig(estimator="ppo")
    with raises_invalid("eps", where="AdvantageConfig"):
        advantages.AdvantageConfig(eps=-1.0)
    with raises_invalid("rl_zvp", where="AdvantageConfig"):
        advantages.AdvantageConfig(rl_zvp=1)
    with pytest.raises(ValueError, match=r"AdvantageConfig.atol='0'"):
        advantages.AdvantageConfig(atol="0")


# ---------------------------------------------------------------- issue 7 #1: shaping


@pytest.mark.slow
def test_shaping_moves_advantages_only_by_its_own_size():
    # The example: all-wrong group of 8, one response 2 tokens into DAPO's soft overlong
    # band (L_max 1024, L_cache 256): shaping s = [0 x7, -2/256 = -0.0078125].
    # Rule: A = 0 (zero-variance verifier rewards) + (s - mean s), mean s = -0.0009765625:
    #   A = [+0.0009765625 x7, -0.0068359375].
    # Wrong answer (normalising the shaped rewards, the old rule): +0.354 x7 and -2.475.
    shaping = np.array([0.0] * 7 + [-2.0 / 256], np.float32)
    out = flat(np.zeros(8), np.zeros(8), 1, shaping=jnp.asarray(shaping))
    np.testing.assert_allclose(out.advantages, [0.0009765625] * 7 + [-0.0068359375], **TOL)
    assert float(jnp.abs(out.advantages).max()) <= 2.0 / 256
    old_rule = advantages.group_normalized(jnp.asarray(shaping)[None])[0]
    np.testing.assert_allclose(old_rule[-1], -2.4749, atol=1e-3)  # what the bug looked like
    np.testing.assert_array_equal(out.zero_variance_groups, [True])
    assert float(out.metrics["adv/num_zero_variance_groups"]) == 1.0
    # rl_zvp mode: the group is zero-variance on the verifier, so it takes RL-ZVP (all wrong):
    # A_{i,t} = centred shaping_i - alpha (max_k H_{i,k} - H_{i,t}); H = [1, 2] on every row:
    #   [s_i - 0.1, s_i + 0].
    entropies, mask = jnp.tile(jnp.array([1.0, 2.0]), (8, 1)), jnp.ones((8, 2), bool)
    out = flat(np.zeros(8), np.zeros(8), 1, ZVP, shaping=shaping, entropies=entropies, mask=mask)
    centred = np.array([0.0009765625] * 7 + [-0.0068359375])
    np.testing.assert_allclose(out.advantages, np.stack([centred - 0.1, centred], 1), **TOL)
    np.testing.assert_array_equal(out.zvp_sign, [-1] * 8)
    assert float(out.metrics["adv/num_rl_zvp_groups"]) == 1.0


def test_shaping_adds_centred_and_unscaled_to_an_informative_group():
    # r = [1, 0, 0, 1] -> GRPO +-0.866024 (above); s = [0, -0.1, 0, 0], mean -0.025 ->
    # centred [0.025, -0.075, 0.025, 0.025]. A = [0.891024, -0.941024, -0.841024, 0.891024].
    # Wrong answer (shaping divided by the std 0.577): -0.075 / 0.577 = -0.130 on row 1.
    out = flat([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], 1, shaping=jnp.array([0.0, -0.1, 0.0, 0.0]))
    np.testing.assert_allclose(out.advantages, [0.891024, -0.941024, -0.841024, 0.891024], **TOL)
    dr = flat([1.0, 0.0, 0.0, 1.0], [0] * 4, 1, advantages.AdvantageConfig(estimator="dr_grpo"),
              shaping=jnp.array([0.0, -0.1, 0.0, 0.0]))  # fmt: skip
    np.testing.assert_allclose(dr.advantages, [0.525, -0.575, -0.475, 0.525], **TOL)


def test_rft_takes_the_correct_rows_of_every_group_by_hand():
    """estimator="rft": A = 1 on correct valid rows, 0 elsewhere, with no baseline, in mixed,
    all-correct and single-row groups alike; shaping and RL-ZVP do not apply. Rows: group 0
    [1, 0, 1], group 1 [1, 1] (zero-variance), group 2 [1] (one row), row 6 invalid (NaN)."""
    cfg = advantages.AdvantageConfig(estimator="rft", rl_zvp=True, success_threshold=0.5)
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, jnp.nan])
    ids = jnp.array([0, 0, 0, 1, 1, 2, 2])
    valid = jnp.array([True] * 6 + [False])
    out = flat(rewards, ids, 3, cfg, valid=valid, shaping=jnp.full((7,), -0.3),
               entropies=jnp.ones((7, 2)), mask=jnp.ones((7, 2), bool))  # fmt: skip
    np.testing.assert_array_equal(out.sequence_advantages, [1, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(out.advantages, np.repeat([[1, 0, 1, 1, 1, 1, 0]], 2, 0).T)
    np.testing.assert_array_equal(out.zvp_sign, [0] * 7)
    assert float(out.metrics["adv/num_zero_variance_groups"]) == 1.0  # still counted


# ---------------------------------------------------------------- issue 7 #2: validity


def test_invalid_samples_contribute_nothing():
    # Group 0: [1, 0, 0, X] with X invalid (a failed reward call, here NaN) -> the group [1, 0, 0]:
    #   mean 1/3, var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std 0.577350 -> [1.154700, -0.577350 x2], X 0.
    # Wrong answers: X read as a wrong answer (reward 0) gives [1.5, -0.5, -0.5, -0.5]; NaN
    # reaching the mean gives NaN everywhere.
    # Group 1: [1, X] -> one valid sample: no baseline, no signal: 0 (counted).
    # Group 2: [1, 1, X=0] -> zero-variance on its valid samples (the failure is not a "wrong").
    rewards = [1.0, 0.0, 0.0, np.nan, 1.0, 0.0, 1.0, 1.0, 0.0]
    ids = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    valid = jnp.array([1, 1, 1, 0, 1, 0, 1, 1, 0], bool)
    out = flat(rewards, ids, 3, ZVP, valid=valid)
    np.testing.assert_allclose(
        out.advantages, [1.154700, -0.577350, -0.577350, 0, 0, 0, 0, 0, 0], atol=1e-5
    )
    np.testing.assert_array_equal(out.zero_variance_groups, [False, False, True])
    np.testing.assert_array_equal(out.no_signal_groups, [False, True, False])
    np.testing.assert_array_equal(out.zvp_sign, [0, 0, 0, 0, 0, 0, 1, 1, 0])
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["adv/num_invalid"] == 3.0 and m["adv/num_no_signal_groups"] == 1.0
    assert m["adv/num_zero_variance_groups"] == 1.0 and m["adv/num_groups"] == 3.0
    assert m["adv/num_rl_zvp_rows"] == 2.0


def test_two_valid_samples_are_enough_and_one_is_not():
    # [1, 0]: mean 0.5, std (ddof 1) sqrt(0.5) -> +-0.707106. Wrong answer with "count > 2":
    # 0. A group of one gets 0 and is counted as no-signal, never as zero-variance.
    out = flat([1.0, 0.0, 1.0], [0, 0, 1], 2)
    np.testing.assert_allclose(out.advantages, [0.707106, -0.707106, 0.0], atol=1e-6)
    np.testing.assert_array_equal(out.no_signal_groups, [False, True])
    np.testing.assert_array_equal(out.zero_variance_groups, [False, False])
    # eps = 0 is allowed: a lone sample (std 0) and a failed one still get 0, not 0 / 0 = NaN.
    eps0 = advantages.AdvantageConfig(eps=0.0)
    out = flat([1.0, 0.0, 1.0, np.nan], [0, 0, 1, 1], 2, eps0, valid=jnp.array([1, 1, 1, 0], bool))
    np.testing.assert_allclose(out.advantages, [0.707107, -0.707107, 0.0, 0.0], atol=1e-6)


def test_rows_outside_the_groups_are_padding_and_absent_groups_are_not_counted():
    # Row 2 has id -1 and row 3 id 3 == num_groups: both padding, NaN rewards; group 1 is empty;
    # group 2's only rows failed: it exists and has no signal (a wrong answer: not counted).
    valid = jnp.array([1, 1, 1, 1, 0, 0], bool)
    out = flat([1.0, 0.0, np.nan, np.nan, 1.0, 0.0], [0, 0, -1, 3, 2, 2], 3, valid=valid)
    np.testing.assert_allclose(out.advantages, [0.707106, -0.707106, 0, 0, 0, 0], atol=1e-6)
    np.testing.assert_array_equal(out.no_signal_groups, [False, False, True])
    assert float(out.metrics["adv/num_groups"]) == 2.0
    assert float(out.metrics["adv/num_no_signal_groups"]) == 1.0  # group 1 has no row at all
    assert float(out.metrics["adv/num_invalid"]) == 2.0  # padding rows are not failed rewards


# ---------------------------------------------------------------- zero-variance boundaries


def test_zero_variance_boundaries_by_hand():
    # Spread = max - min over valid rows; zero-variance iff spread <= atol (0.25, exact in f32).
    # all equal [0.5 x3]; all correct [1 x3]; all wrong [0 x3]; one sample [1]; tie at the
    # tolerance [0.5, 0.75] (spread == atol: zero-variance; the "<" bug says informative);
    # just above [0.5, 0.875] (informative; 0.375 > 0.25).
    cfg = advantages.AdvantageConfig(atol=0.25, rl_zvp=True)
    groups = [[0.5] * 3, [1.0] * 3, [0.0] * 3, [1.0], [0.5, 0.75], [0.5, 0.875]]
    rewards = np.concatenate(groups)
    ids = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    out = flat(rewards, ids, len(groups), cfg)
    np.testing.assert_array_equal(out.zero_variance_groups, [1, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(out.no_signal_groups, [0, 0, 0, 1, 0, 0])
    # RL-ZVP sign: correct iff mean > 0 (success_threshold): all-wrong 0 is "wrong" (the ">="
    # bug calls it correct); 0.5 and 0.625 are correct; the lone sample takes no RL-ZVP.
    np.testing.assert_array_equal(out.zvp_sign, [1, 1, 1, 1, 1, 1, -1, -1, -1, 0, 1, 1, 0, 0])
    # Within the tolerance the verifier part is exactly 0 (not 0.125 / (0.177 + eps) = 0.707).
    np.testing.assert_array_equal(out.sequence_advantages[10:12], [0.0, 0.0])
    # [0.5, 0.875]: deviations +-0.1875, std (ddof 1) 0.265165 -> +-0.1875 / 0.265166 = 0.707104.
    np.testing.assert_allclose(out.sequence_advantages[12:], [-0.707104, 0.707104], atol=1e-6)
    dense = advantages.zero_variance_mask(jnp.asarray([[0.5, 0.75], [0.5, 0.875]]), atol=0.25)
    np.testing.assert_array_equal(dense, [True, False])


# ---------------------------------------------------------------- RL-ZVP and issue 7 #5


def zvp_inputs():
    # P = 3 prompts, G = 2 responses, T = 3 tokens; response 1 of every group has one padded token
    # whose entropy (9.0) must be ignored, by the max too.
    rewards = jnp.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    entropies = jnp.tile(jnp.array([[0.5, 1.0, 2.0], [0.2, 0.4, 9.0]]), (3, 1, 1))
    mask = jnp.tile(jnp.array([[1, 1, 1], [1, 1, 0]], bool), (3, 1, 1))
    return rewards, entropies, mask


@pytest.mark.slow
def test_rl_zvp_by_hand():
    # alpha = 0.1.
    # Prompt 0, all correct: A = alpha H = [[0.05, 0.1, 0.2], [0.02, 0.04, pad 0]].
    # Prompt 1, all wrong: A = -alpha (max_k H - H) with max 2.0 and 0.4 (not the padded 9.0;
    #   a dropped mask in the max gives [-0.88, -0.86] on row 1): [[-0.15, -0.1, 0], [-0.02, 0, 0]].
    # Prompt 2, mixed [1, 0]: GRPO, mean 0.5, unbiased std sqrt(0.5) = 0.707107
    #   -> +-0.5 / 0.707108 = +-0.707106 on every valid token.
    rewards, entropies, mask = zvp_inputs()
    out = advantages.rl_zvp(rewards, entropies, mask, alpha=0.1)
    grpo = 0.5 / (np.sqrt(0.5) + 1e-6)
    expected = [
        [[0.05, 0.1, 0.2], [0.02, 0.04, 0.0]],
        [[-0.15, -0.1, 0.0], [-0.02, 0.0, 0.0]],
        [[grpo, grpo, grpo], [-grpo, -grpo, 0.0]],
    ]
    np.testing.assert_allclose(out.advantages, expected, **TOL)
    np.testing.assert_array_equal(out.zero_variance_groups, [True, True, False])
    assert out.advantages.dtype == jnp.float32
    # The same through compute_dense with per-row output + token_advantages (the train step's
    # path with its own entropies) gives the same tokens.
    seq = advantages.compute_dense(rewards, cfg=ZVP)
    tokens = advantages.token_advantages(
        seq.sequence_advantages.reshape(6), seq.zvp_sign.reshape(6),
        entropies=entropies.reshape(6, 3), mask=mask.reshape(6, 3), alpha=0.1,
    )  # fmt: skip
    np.testing.assert_allclose(tokens.reshape(3, 2, 3), expected, **TOL)


def test_rl_zvp_negative_rewards_count_as_wrong():
    # All -1 (a -1/+1 reward scheme, all wrong) takes the wrong branch: -alpha (max H - H).
    _, entropies, mask = zvp_inputs()
    out = advantages.rl_zvp(-jnp.ones((3, 2)), entropies, mask, alpha=0.2)
    np.testing.assert_allclose(out.advantages[0], [[-0.3, -0.2, 0.0], [-0.04, 0.0, 0.0]], **TOL)


def test_rl_zvp_off_leaves_zero_variance_groups_at_zero():
    rewards, entropies, mask = zvp_inputs()
    out = advantages.compute_dense(rewards, cfg=CFG, entropies=entropies, mask=mask)
    np.testing.assert_array_equal(out.advantages[:2], 0.0)
    np.testing.assert_array_equal(out.zvp_sign, 0)


def test_judge_ties_are_not_pushed_down():
    # issue 7 #5: a judge's all-tie group has r = 0 for every member: "no preference", not
    # "all wrong". Unverifiable -> no RL-ZVP, advantage 0 (left to zero-variance elimination).
    # The same rewards from a verifier are "all wrong" and get -alpha (max H - H).
    # One unverifiable member is enough to make the group's correctness unknown.
    rewards = jnp.zeros(6)
    ids = jnp.array([0, 0, 1, 1, 2, 2])
    verifiable = jnp.array([0, 0, 1, 1, 1, 0], bool)
    entropies, mask = jnp.tile(jnp.array([1.0, 3.0]), (6, 1)), jnp.ones((6, 2), bool)
    out = flat(rewards, ids, 3, ZVP, verifiable=verifiable, entropies=entropies, mask=mask)
    expected = np.zeros((6, 2))
    expected[2:4] = [-0.2, 0.0]
    np.testing.assert_allclose(out.advantages, expected, **TOL)
    np.testing.assert_array_equal(out.zvp_sign, [0, 0, -1, -1, 0, 0])
    assert float(out.metrics["adv/num_unverifiable_zero_variance_groups"]) == 2.0
    # An unverifiable member that failed (invalid) does not count: group 2 = [0, 0, 0*] with the
    # failed row the unverifiable one is a verifier's all-wrong group. (Wrong answer: counting
    # the failed row's flag leaves group 2 without RL-ZVP.)
    ids = jnp.array([0, 0, 1, 1, 2, 2, 2])
    verifiable = jnp.array([0, 0, 1, 1, 1, 1, 0], bool)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 0], bool)
    out = flat(jnp.zeros(7), ids, 3, ZVP, verifiable=verifiable, valid=valid)
    np.testing.assert_array_equal(out.zvp_sign, [0, 0, -1, -1, -1, -1, 0])


def test_advantages_are_constants_of_the_loss():
    # A dropped stop_gradient on rewards, shaping or entropies would let the loss push them.
    rewards, entropies, mask = zvp_inputs()
    r, e, m = rewards.reshape(6), entropies.reshape(6, 3), mask.reshape(6, 3)
    ids = advantages.dense_group_ids(3, 2)

    def total(r, s, e):
        out = advantages.compute(
            r, group_ids=ids, num_groups=3, cfg=ZVP, shaping=s, entropies=e, mask=m
        )
        return out.advantages.sum()

    grads = jax.grad(total, argnums=(0, 1, 2))(r, jnp.full(6, -0.1), e)
    for g in grads:
        np.testing.assert_array_equal(g, np.zeros_like(g))
    g = jax.grad(lambda e: advantages.rl_zvp_tokens(-jnp.ones(6, jnp.int32), entropies=e,
                                                    mask=m, alpha=0.1).sum())(e)  # fmt: skip
    np.testing.assert_array_equal(g, np.zeros_like(g))


def test_shape_errors():
    rewards, entropies, mask = zvp_inputs()
    with pytest.raises(ValueError, match="entropies"):
        advantages.rl_zvp(rewards, entropies.reshape(6, 3), mask)
    with pytest.raises(ValueError, match="mask"):
        advantages.rl_zvp(rewards, entropies, mask[:, :, :2])
    with pytest.raises(ValueError, match="rewards"):
        advantages.group_normalized(rewards.reshape(-1))
    with pytest.raises(ValueError, match=r"valid must be \[N\]=\(6,\)"):
        flat(rewards.reshape(6), np.zeros(6), 1, valid=jnp.ones(5, bool))
    with pytest.raises(ValueError, match="entropies need a token mask"):
        flat(rewards.reshape(6), np.zeros(6), 1, entropies=entropies.reshape(6, 3))


# ---------------------------------------------------------------- adversarial padding


def padded_inputs():
    """Two groups (ragged, 3 + 4 rows), one invalid row in each, padding tokens in most rows."""
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    ids = jnp.array([0, 0, 0, 1, 1, 1, 1])
    valid = jnp.array([1, 1, 0, 1, 1, 1, 0], bool)
    shaping = jnp.array([0.0, -0.1, 0.0, 0.0, -0.05, 0.0, 0.0])
    entropies = jnp.tile(jnp.array([0.3, 1.2, 0.7, 2.0]), (7, 1))
    mask = jnp.array([[1, 1, 1, 0]] * 3 + [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
    return rewards, ids, valid, shaping, entropies, mask.astype(bool)


class AdversarialPaddingTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_and_invalid_rows_cannot_reach_valid_outputs(self):
        # Fill what padding / invalid rows hold (rewards, shaping, entropies of padded tokens and
        # of invalid rows) with 1e9, +-inf, NaN: valid outputs, metrics and finiteness unchanged.
        rewards, ids, valid, shaping, entropies, mask = padded_inputs()
        f = self.variant(
            functools.partial(advantages.compute, group_ids=ids, num_groups=3, cfg=ZVP)
        )

        def run(r, s, e):
            return f(r, valid=valid, shaping=s, entropies=e, mask=mask)

        want = run(rewards, shaping, entropies)
        chex.assert_shape(want.advantages, (7, 4))
        assert np.abs(np.asarray(want.advantages)).sum() > 0  # something to protect
        bad_row = ~np.asarray(valid)
        bad_tok = ~np.asarray(mask) | bad_row[:, None]
        for fill in FILLS:
            got = run(
                jnp.where(bad_row, fill, rewards),
                jnp.where(bad_row, fill, shaping),
                jnp.where(bad_tok, fill, entropies),
            )
            chex.assert_tree_all_finite(got.advantages)
            chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_advantages_ignore_padded_entropies(self):
        _, _, _, _, entropies, mask = padded_inputs()
        seq, sign = jnp.linspace(-1.0, 1.0, 7), jnp.array([1, -1, 0, -1, 1, -1, 0])
        f = self.variant(functools.partial(advantages.token_advantages, alpha=0.1))
        want = f(seq, sign, entropies=entropies, mask=mask)
        for fill in FILLS:
            got = f(seq, sign, entropies=jnp.where(mask, entropies, fill), mask=mask)
            chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
        # Hand check of row 1 (wrong, valid tokens H = [0.3, 1.2, 0.7], max 1.2; the padded 2.0
        # must not be the max): seq[1] = -2/3 -> -2/3 + [-0.09, 0, -0.05], pad 0; row 2 (sign 0,
        # H ignored): -1/3 on its 3 valid tokens.
        np.testing.assert_allclose(want[1], [-2 / 3 - 0.09, -2 / 3, -2 / 3 - 0.05, 0.0], **TOL)
        np.testing.assert_allclose(want[2], [-1 / 3] * 3 + [0.0], **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_normalize_jitted_and_not(self):
        f = self.variant(functools.partial(advantages.normalize, num_groups=2))
        out = f(jnp.array([1.0, 0.0, 0.0, 1.0, 2.0]), group_ids=jnp.array([0, 0, 0, 0, 1]))
        np.testing.assert_allclose(out, [0.866024, -0.866024, -0.866024, 0.866024, 0], atol=1e-6)


# ---------------------------------------------------------------- invariances (hypothesis)


def reference(rewards, ids, num_groups, valid, shaping, verifiable, cfg):
    """Per-group loop in float64 numpy: rules 1-4 of the module docstring, written out."""
    adv, sign = np.zeros(len(rewards)), np.zeros(len(rewards), int)
    for g in range(num_groups):
        rows = np.flatnonzero((ids == g) & valid)
        if rows.size < 2:
            continue
        r, s = rewards[rows].astype(np.float64), shaping[rows].astype(np.float64)
        tied = r.max() - r.min() <= cfg.atol
        a = np.zeros_like(r) if tied else r - r.mean()
        if cfg.scale_by_std and not tied:
            a = a / (r.std(ddof=1) + cfg.eps)
        adv[rows] = a + (s - s.mean())
        if tied and cfg.rl_zvp and verifiable[rows].all():
            sign[rows] = 1 if r.mean() > cfg.success_threshold else -1
    return adv, sign


@st.composite
def ragged_batches(draw, n=12, num_groups=4):
    # A fixed shape (n rows, 4 groups) so the jitted compute compiles once per config; the
    # ragged structure is in the ids: groups of any size, empty groups, padding ids -1 and 4.
    used = draw(st.integers(1, num_groups))
    ids = np.array(draw(st.lists(st.integers(-1, used), min_size=n, max_size=n)))
    ids = np.where(ids == used, num_groups, ids)  # an out-of-range id: a padding row
    quarters = st.integers(0, 4).map(lambda k: k / 4)  # exact in float32: ties are real ties
    rewards = np.array(draw(st.lists(quarters, min_size=n, max_size=n)), np.float32)
    shaping = -np.array(draw(st.lists(quarters, min_size=n, max_size=n)), np.float32) / 8
    valid = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    verifiable = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    cfg = advantages.AdvantageConfig(
        estimator=draw(st.sampled_from(("grpo", "dr_grpo"))),
        rl_zvp=draw(st.booleans()),  # rft: its own hand test
    )
    return rewards, ids, num_groups, valid, shaping, verifiable, cfg


@pytest.mark.slow
@hypothesis.given(ragged_batches())
def test_ragged_segments_equal_a_per_group_loop(batch):
    rewards, ids, num_groups, valid, shaping, verifiable, cfg = batch
    out = flat(rewards, ids, num_groups, cfg, valid=valid, shaping=shaping, verifiable=verifiable)
    want_adv, want_sign = reference(rewards, ids, num_groups, valid, shaping, verifiable, cfg)
    np.testing.assert_allclose(out.advantages, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.zvp_sign, want_sign)


@hypothesis.given(ragged_batches(), st.data())
def test_permuting_rows_permutes_advantages(batch, data):
    rewards, ids, num_groups, valid, shaping, verifiable, cfg = batch
    perm = np.array(data.draw(st.permutations(range(len(rewards)))))
    kw = dict(num_groups=num_groups, cfg=cfg)
    out = flat(rewards, ids, valid=valid, shaping=shaping, verifiable=verifiable, **kw)
    moved = flat(rewards[perm], ids[perm], valid=valid[perm], shaping=shaping[perm],
                 verifiable=verifiable[perm], **kw)  # fmt: skip
    np.testing.assert_allclose(moved.advantages, np.asarray(out.advantages)[perm], **TOL)
    np.testing.assert_array_equal(moved.zvp_sign, np.asarray(out.zvp_sign)[perm])


@hypothesis.given(ragged_batches(), st.lists(st.integers(-8, 8), min_size=6, max_size=6))
def test_adding_a_constant_to_a_group_changes_nothing(batch, shifts):
    # Per group shift c_g (integers: exact in float32 with quarters, so ties stay ties). The
    # RL-ZVP sign may flip (it reads absolute correctness), so compare without it.
    rewards, ids, num_groups, valid, shaping, _, cfg = batch
    cfg = advantages.AdvantageConfig(estimator=cfg.estimator)
    shift = np.asarray(shifts, np.float32)[np.clip(ids, 0, 5)]
    out = flat(rewards, ids, num_groups, cfg, valid=valid, shaping=shaping)
    moved = flat(rewards + shift, ids, num_groups, cfg, valid=valid, shaping=shaping)
    np.testing.assert_allclose(moved.advantages, out.advantages, rtol=1e-5, atol=1e-5)


@hypothesis.given(ragged_batches(), st.sampled_from([0.5, 2.0, 8.0]))
def test_scaling_rewards_leaves_grpo_advantages_unchanged(batch, c):
    # (c r - c mean) / (c std + eps) = (r - mean) / (std + eps / c): equal up to eps / std, with
    # std >= 0.177 here (two quarters apart) a relative 1e-5: hence rtol 5e-5 (written reason).
    # Powers of two keep every product exact, so ties at atol stay ties.
    rewards, ids, num_groups, valid, _, _, _ = batch
    out = flat(rewards, ids, num_groups, valid=valid)
    scaled = flat(rewards * c, ids, num_groups, valid=valid)
    np.testing.assert_allclose(scaled.advantages, out.advantages, rtol=5e-5, atol=1e-5)


@pytest.mark.slow
def test_dense_equals_flat():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (5, 4)).astype(np.float32)
    valid = rng.random((5, 4)) > 0.2
    entropies, mask = rng.gamma(2.0, 0.5, (5, 4, 3)), rng.random((5, 4, 3)) > 0.3
    dense = _compute_dense(rewards, cfg=ZVP, valid=valid, entropies=entropies, mask=mask)
    ids = advantages.dense_group_ids(5, 4)
    out = flat(rewards.reshape(20), ids, 5, ZVP, valid=valid.reshape(20),
               entropies=entropies.reshape(20, 3), mask=mask.reshape(20, 3))  # fmt: skip
    chex.assert_shape(dense.advantages, (5, 4, 3))
    np.testing.assert_allclose(dense.advantages.reshape(20, 3), out.advantages, **TOL)
    np.testing.assert_array_equal(dense.zvp_sign.reshape(20), out.zvp_sign)


# ---------------------------------------------------------------- mutation audit (issue 13)
# Each test below kills mutants that survived `mutmut` on espo/advantages.py (see
# notes/mutmut.md); the mutated line is named in the comment.


def test_low_precision_inputs_are_computed_in_float32():
    # bfloat16 inputs are cast to float32 before any arithmetic (`jnp.asarray(x, jnp.float32)`).
    # R = [1, 2^-8, 0, 0] is exact in bf16, but a bf16 segment sum rounds 1 + 2^-8 to 1:
    # mean 257/1024, deviations [767, -253, -257, -257] / 1024, var = 784396 / 1024^2 / 3,
    # std 0.499354 -> A = [1.499987, -0.494781, -0.502603, -0.502603] (float64 reference below).
    r = np.array([1.0, 2.0**-8, 0.0, 0.0])
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(want, [1.499987, -0.494781, -0.502603, -0.502603], atol=1e-6)
    got = advantages.normalize(
        jnp.asarray(r, jnp.bfloat16), group_ids=jnp.zeros(4, jnp.int32), num_groups=1
    )
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # zero_variance_mask compares in float32: spread 0.30078125 (exact in bf16) > atol 0.3, but
    # 0.3 rounds to 0.30078125 in bf16, where the comparison would say "zero-variance".
    spread = jnp.asarray([[0.0, 0.30078125], [0.5, 0.5]], jnp.bfloat16)
    np.testing.assert_array_equal(advantages.zero_variance_mask(spread, atol=0.3), [False, True])
    # rl_zvp_tokens: alpha H in float32 (bf16 would give 0.1 * 0.5 = 0.050049).
    h = jnp.asarray([[0.5, 1.0, 2.0]], jnp.bfloat16)
    tok = advantages.rl_zvp_tokens(
        jnp.array([1]), entropies=h, mask=jnp.ones((1, 3), bool), alpha=0.1
    )
    assert tok.dtype == jnp.float32
    np.testing.assert_allclose(tok, [[0.05, 0.1, 0.2]], rtol=1e-6)


def test_normalize_validity_pairs_and_lone_rows_with_eps_zero():
    # eps = 0: group 0 = rows 0, 1 (row 2 invalid, its 5.0 ignored): [1, 0] -> +-0.5 / sqrt(0.5)
    # = +-0.707107; group 1 = [2, 0], exactly two valid rows: +-0.707107 (a "count > 2" bug
    # gives 0); group 2 = one valid row: 0 (letting it through gives 0 / (0 + 0) = NaN).
    # Ignoring `valid` would normalise [1, 0, 5] instead.
    out = advantages.normalize(
        jnp.array([1.0, 0.0, 5.0, 2.0, 0.0, 7.0]),
        group_ids=jnp.array([0, 0, 0, 1, 1, 2]),
        num_groups=3,
        valid=jnp.array([1, 1, 0, 1, 1, 1], bool),
        eps=0.0,
    )
    s = 0.5 / np.sqrt(0.5)
    np.testing.assert_allclose(out, [s, -s, 0.0, s, -s, 0.0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"^rewards must be flat \[N\], got shape \(2, 2\)$"):
        advantages.normalize(jnp.ones((2, 2)), group_ids=jnp.zeros(4, jnp.int32), num_groups=1)


def test_group_normalized_passes_eps_and_checks_rank():
    # R = [1, 0, 0, 1], std 0.577350, eps 0.5: A = +-0.5 / 1.077350 = +-0.464102.
    adv = advantages.group_normalized(jnp.array([[1.0, 0.0, 0.0, 1.0]]), eps=0.5)
    np.testing.assert_allclose(adv, [[0.464102, -0.464102, -0.464102, 0.464102]], atol=1e-6)


def test_zero_variance_mask_default_atol_and_axes():
    # Non-square [P=3, G=2]: spreads per prompt 0.5, 0, 0. Default atol 1e-6.
    rewards = jnp.array([[0.0, 0.5], [2.0, 2.0], [3.0, 3.0]])
    np.testing.assert_array_equal(advantages.zero_variance_mask(rewards), [False, True, True])
    # [[0, 0], [1, 1]]: a max over prompts (axis 0) or a min over everything gives [F, T] / [T, F].
    square = jnp.array([[0.0, 0.0], [1.0, 1.0]])
    np.testing.assert_array_equal(advantages.zero_variance_mask(square), [True, True])


@pytest.mark.parametrize(
    ("fn", "arg", "message"),
    [
        (advantages.compute_dense, np.ones(4), r"rewards must be [P, G], got shape (4,)"),
        (advantages.zero_variance_mask, np.ones(4), r"rewards must be [P, G], got shape (4,)"),
        (advantages.group_normalized, np.ones(4), r"rewards must be [P, G], got shape (4,)"),
    ],
)
def test_dense_rank_errors_say_what_they_got(fn, arg, message):
    kw = {"cfg": CFG} if fn is advantages.compute_dense else {}
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        fn(arg, **kw)


def test_compute_dense_with_mask_only_shaping_and_verifiable():
    # Mask without entropies: per-row advantages broadcast over tokens, 0 on padding.
    # Group 0: [1, 0] -> +-0.707106; group 1: [1, 1] zero-variance -> 0 (RL-ZVP needs entropies,
    # so rl_zvp only sets zvp_sign here).
    rewards = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    mask = jnp.array([[[1, 1, 0], [1, 0, 0]], [[1, 1, 1], [0, 1, 1]]], bool)
    out = _compute_dense(rewards, cfg=ZVP, mask=mask)
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(
        out.advantages, [[[a, a, 0], [-a, 0, 0]], [[0, 0, 0], [0, 0, 0]]], atol=1e-6
    )
    np.testing.assert_array_equal(out.zvp_sign, [[0, 0], [1, 1]])
    chex.assert_shape((out.sequence_advantages, out.zvp_sign), (2, 2))
    with pytest.raises(ValueError, match="^entropies need a token mask"):
        advantages.compute_dense(rewards, cfg=ZVP, entropies=jnp.ones((2, 2, 3)))
    # Shaping [0, -0.1] in group 0 adds its centred value [+0.05, -0.05]; group 1 has an
    # unverifiable member: no RL-ZVP sign, counted.
    out = advantages.compute_dense(
        rewards,
        cfg=ZVP,
        shaping=jnp.array([[0.0, -0.1], [0.0, 0.0]]),
        verifiable=jnp.array([[1, 1], [1, 0]], bool),
    )
    np.testing.assert_allclose(out.advantages, [[a + 0.05, -a - 0.05], [0.0, 0.0]], atol=1e-6)
    np.testing.assert_array_equal(out.zvp_sign, [[0, 0], [0, 0]])
    assert float(out.metrics["adv/num_unverifiable_zero_variance_groups"]) == 1.0


def test_rl_zvp_passes_every_option_to_the_config():
    rewards, entropies, mask = zvp_inputs()
    # Default alpha 0.1 (the values of test_rl_zvp_by_hand).
    out = advantages.rl_zvp(rewards, entropies, mask)
    np.testing.assert_allclose(out.advantages[0], [[0.05, 0.1, 0.2], [0.02, 0.04, 0.0]], **TOL)
    # Dr.GRPO: prompt 2 [1, 0] gets +-0.5 (GRPO would give +-0.707106).
    out = advantages.rl_zvp(rewards, entropies, mask, scale_by_std=False)
    np.testing.assert_allclose(out.advantages[2], [[0.5] * 3, [-0.5, -0.5, 0.0]], **TOL)
    # eps 0.5: +-0.5 / (0.707107 + 0.5) = +-0.414214.
    out = advantages.rl_zvp(rewards, entropies, mask, eps=0.5)
    b = 0.5 / (np.sqrt(0.5) + 0.5)
    np.testing.assert_allclose(out.advantages[2], [[b] * 3, [-b, -b, 0.0]], **TOL)
    # atol 0.3: prompt 2 = [1, 0.75] (spread 0.25) is zero-variance and correct: alpha H.
    out = advantages.rl_zvp(rewards.at[2, 1].set(0.75), entropies, mask, atol=0.3)
    np.testing.assert_array_equal(out.zero_variance_groups, [True, True, True])
    np.testing.assert_allclose(out.advantages[2], out.advantages[0], **TOL)


def test_rl_zvp_shape_errors_say_what_they_got():
    rewards, entropies, mask = zvp_inputs()
    # 2-D entropies with the [P, G] of the rewards: still not [P, G, T].
    with pytest.raises(
        ValueError,
        match=r"^rewards must be \[P, G\] and entropies \[P, G, T\]; got \(3, 2\), \(3, 2\)$",
    ):
        advantages.rl_zvp(rewards, entropies[..., 0], mask[..., 0])
    with pytest.raises(
        ValueError, match=r"^mask must have the shape of entropies \(3, 2, 3\), got \(3, 2, 2\)$"
    ):
        advantages.rl_zvp(rewards, entropies, mask[..., :2])


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("estimator", "ppo", "one of ('grpo', 'dr_grpo', 'rft')"),
        ("eps", -1.0, "a float >= 0"),
        ("eps", "1e-6", "a float >= 0"),
        ("atol", -0.5, "a float >= 0"),
        ("atol", True, "a float >= 0"),
        ("rl_zvp", 1, "a bool"),
        ("rl_zvp_alpha", -0.5, ">= 0"),
        ("rl_zvp_alpha", "0.1", ">= 0"),
        ("success_threshold", "0", "a float"),
        ("success_threshold", None, "a float"),
    ],
)
def test_config_errors_name_the_field_and_value(field, value, valid):
    with raises_invalid(field, where="AdvantageConfig") as info:
        advantages.AdvantageConfig(**{field: value})
    assert info.value.value == value and info.value.valid == valid


def test_config_accepts_its_boundaries():
    # atol = 0 (exact ties only) and rl_zvp_alpha = 0 (RL-ZVP off in effect) are valid, and so
    # are ints where floats are expected; a negative success_threshold is valid (-1/+1 rewards).
    cfg = advantages.AdvantageConfig(atol=0, eps=0, rl_zvp_alpha=0.0, success_threshold=-1)
    assert (cfg.atol, cfg.eps, cfg.rl_zvp_alpha, cfg.success_threshold) == (0, 0, 0.0, -1)


def test_compute_casts_low_precision_rewards_to_float32():
    # The same bf16 rewards as above through `compute` (rewards cast before the segment sums).
    r = np.array([1.0, 2.0**-8, 0.0, 0.0])
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    out = advantages.compute(
        jnp.asarray(r, jnp.bfloat16), group_ids=jnp.zeros(4, jnp.int32), num_groups=1, cfg=CFG
    )  # not `flat`, which casts to float32 itself
    assert out.advantages.dtype == jnp.float32
    np.testing.assert_allclose(out.advantages, want, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rewards": np.ones((2, 2))}, "rewards must be flat [N], got shape (2, 2)"),
        ({"group_ids": np.zeros(3, int)}, "group_ids must be [N]=(4,) like rewards, got (3,)"),
        ({"valid": np.ones(5, bool)}, "valid must be [N]=(4,) like rewards, got (5,)"),
        ({"shaping": np.zeros((4, 1))}, "shaping must be [N]=(4,) like rewards, got (4, 1)"),
        ({"verifiable": np.ones(2, bool)}, "verifiable must be [N]=(4,) like rewards, got (2,)"),
        ({"entropies": np.ones((4, 3))}, "entropies need a token mask [N, T]"),
        ({"entropies": np.ones(4), "mask": np.ones(4, bool)},
         "entropies must be [N, T] with N=4, got (4,)"),
        ({"mask": np.ones(4, bool)}, "mask must be [N, T] with N=4, got (4,)"),
        ({"mask": np.ones((3, 2), bool)}, "mask must be [N, T] with N=4, got (3, 2)"),
        ({"entropies": np.ones((4, 3)), "mask": np.ones((4, 2), bool)},
         "entropies (4, 3) and mask (4, 2) differ"),
    ],
)  # fmt: skip
def test_compute_input_errors_in_full(kwargs, message):
    args = dict(rewards=jnp.array([1.0, 0.0, 0.0, 1.0]), group_ids=jnp.zeros(4, jnp.int32))
    args.update(kwargs)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        advantages.compute(args.pop("rewards"), num_groups=1, cfg=CFG, **args)


def test_shaping_verifiable_and_threshold_inputs_of_compute():
    # bf16 shaping is cast before the group mean: s = [1, 2^-8, 0, 0] (a bf16 sum would round
    # 1 + 2^-8 to 1) on a zero-variance group: A = s - mean s, mean s = 257/1024.
    s = np.array([1.0, 2.0**-8, 0.0, 0.0])
    out = flat(np.zeros(4), [0] * 4, 1, shaping=jnp.asarray(s, jnp.bfloat16))
    np.testing.assert_allclose(out.advantages, s - s.mean(), rtol=1e-6)
    # `verifiable` as 0/1 floats reads as booleans; zvp_sign is int32.
    ids, ent, mask = jnp.array([0, 0, 1, 1]), jnp.ones((4, 2)), jnp.ones((4, 2), bool)
    out = flat(jnp.zeros(4), ids, 2, ZVP, verifiable=jnp.array([1.0, 1.0, 1.0, 0.0]),
               entropies=ent, mask=mask)  # fmt: skip
    np.testing.assert_array_equal(out.zvp_sign, [-1, -1, 0, 0])
    assert out.zvp_sign.dtype == jnp.int32
    # success_threshold 0.5: "correct" iff the group MEAN exceeds it. [0.4, 0.4]: mean 0.4 ->
    # wrong (-1) (its sum 0.8 or sum * count 1.6 would say correct); [0.75, 0.75] -> correct.
    cfg = advantages.AdvantageConfig(rl_zvp=True, success_threshold=0.5)
    out = flat([0.4, 0.4, 0.75, 0.75], ids, 2, cfg)
    np.testing.assert_array_equal(out.zvp_sign, [-1, -1, 1, 1])


def test_a_reward_exactly_at_success_threshold_is_not_correct():
    """Correct means r > success_threshold (0.5: a half-credit reward is not a success): rft's
    A is 0 at exactly 0.5 and 1 just above it; an RL-ZVP group whose mean is exactly 0.5 is
    "wrong" (-1), one just above it "correct" (+1)."""
    rft = advantages.AdvantageConfig(estimator="rft", success_threshold=0.5)
    out = flat([0.5, 0.50001, 0.49999, 1.0], [0] * 4, 1, rft)
    np.testing.assert_array_equal(out.sequence_advantages, [0, 1, 0, 1])
    zvp = advantages.AdvantageConfig(rl_zvp=True, success_threshold=0.5)
    out = flat([0.5, 0.5, 0.50001, 0.50001], [0, 0, 1, 1], 2, zvp)
    np.testing.assert_array_equal(out.zvp_sign, [-1, -1, 1, 1])


def test_float_group_ids_are_read_as_integers():
    out = advantages.compute(
        jnp.array([1.0, 0.0, 1.0, 1.0]), group_ids=np.array([0.0, 0.0, 1.0, 1.0]),
        num_groups=2, cfg=CFG,
    )  # fmt: skip
    np.testing.assert_allclose(out.advantages, [0.707106, -0.707106, 0.0, 0.0], atol=1e-6)


def test_float_valid_flags_and_a_group_holding_only_padding():
    # `valid` as 0/1 floats reads as booleans: group 0 = [1, 0] (row 2 failed), group 1 = [1].
    out = advantages.compute(
        jnp.array([1.0, 0.0, 9.0, 1.0]), group_ids=jnp.array([0, 0, 0, 1]), num_groups=2,
        cfg=CFG, valid=jnp.array([1.0, 1.0, 0.0, 1.0]),
    )  # fmt: skip
    np.testing.assert_allclose(out.advantages, [0.707106, -0.707106, 0.0, 0.0], atol=1e-6)
    assert float(out.metrics["adv/num_invalid"]) == 1.0
    # Group 0 holds no row of its own, only a padding row (id -1, clipped into group 0 for the
    # segment ops): it is absent, neither counted nor "no signal".
    out = flat([1.0, 0.0, 5.0], [1, 1, -1], 2)
    np.testing.assert_array_equal(out.no_signal_groups, [False, False])
    assert float(out.metrics["adv/num_groups"]) == 1.0


def test_estimators_are_a_registry_a_new_one_joins():
    """advantage.estimator names an entry of `advantages.ESTIMATORS`; `register` adds one (here
    a group-relative sign estimator) that AdvantageConfig accepts and `compute` applies, with
    zero-variance groups at 0 as for every group-relative estimator."""
    assert tuple(advantages.ESTIMATORS) == ("grpo", "dr_grpo", "rft")
    assert [e.scale_by_std for e in advantages.ESTIMATORS.values()] == [True, False, False]

    @advantages.register("sign_test")
    def _sign(rewards, st, cfg):
        del cfg
        return st.valid & (st.count >= 2)[st.seg], jnp.sign(advantages._centred(rewards, st))

    try:
        cfg = advantages.AdvantageConfig(estimator="sign_test")
        out = advantages.compute(
            jnp.array([1.0, 0.0, 0.0, 0.5, 0.5]), group_ids=jnp.array([0, 0, 0, 1, 1]),
            num_groups=2, cfg=cfg,
        )  # fmt: skip
        np.testing.assert_allclose(out.advantages, [1.0, -1.0, -1.0, 0.0, 0.0])
    finally:
        del advantages.ESTIMATORS["sign_test"]
