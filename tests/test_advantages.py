"""Tests for espo.advantages: hand-derived GRPO / Dr.GRPO / RL-ZVP values and invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import advantages

TOL = dict(rtol=1e-5, atol=1e-6)


def test_group_normalized_by_hand():
    # Row 0: [1, 0, 0, 1], mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.577350
    #   -> +-0.5 / (0.577350 + 1e-6) = +-0.866024. (Biased std 0.5 would give +-1: wrong.)
    # Row 1: [2, 4, 6, 8], mean 5, deviations [-3, -1, 1, 3], var = 20 / 3, std = 2.581989
    #   -> [-1.161895, -0.387298, 0.387298, 1.161895].
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    adv = advantages.group_normalized(rewards)
    std0, std1 = np.sqrt(1 / 3), np.sqrt(20 / 3)
    expected = [
        np.array([0.5, -0.5, -0.5, 0.5]) / (std0 + 1e-6),
        np.array([-3.0, -1.0, 1.0, 3.0]) / (std1 + 1e-6),
    ]
    np.testing.assert_allclose(adv, expected, **TOL)
    np.testing.assert_allclose(adv[0], [0.866024, -0.866024, -0.866024, 0.866024], atol=1e-6)
    assert adv.dtype == jnp.float32
    # Dr.GRPO: only the mean is removed.
    dr = advantages.group_normalized(rewards, scale_by_std=False)
    np.testing.assert_allclose(dr, [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]], **TOL)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_degenerate_groups_get_zero_not_nan(scale_by_std):
    # G == 1 (the ddof=1 std of one sample is NaN) and zero-variance groups (0 / eps) both give 0.
    single = advantages.group_normalized(jnp.array([[1.0], [0.0]]), scale_by_std=scale_by_std)
    np.testing.assert_array_equal(single, [[0.0], [0.0]])
    flat = advantages.group_normalized(jnp.ones((2, 4)), scale_by_std=scale_by_std)
    np.testing.assert_array_equal(flat, np.zeros((2, 4)))


def test_permuting_a_group_permutes_its_advantages():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 5)).astype(np.float32)
    perm = rng.permutation(5)
    adv = advantages.group_normalized(jnp.asarray(rewards))
    np.testing.assert_allclose(
        advantages.group_normalized(jnp.asarray(rewards[:, perm])), adv[:, perm], **TOL
    )
    # Groups are independent: changing prompt 0 leaves prompts 1 and 2 unchanged.
    other = advantages.group_normalized(jnp.asarray(rewards).at[0].set(7.0))
    np.testing.assert_allclose(other[1:], adv[1:], **TOL)


def test_zero_variance_mask():
    rewards = jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5 + 1e-8, 0.5]])
    np.testing.assert_array_equal(advantages.zero_variance_mask(rewards), [1, 1, 0, 1])
    strict = advantages.zero_variance_mask(jnp.array([[0.5, 0.5001]]), atol=1e-6)
    np.testing.assert_array_equal(strict, [False])


def zvp_inputs():
    # P = 3 prompts, G = 2 responses, T = 3 tokens; response 1 of every group has one padded token
    # whose entropy (9.0) must be ignored, by the max too.
    rewards = jnp.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    entropies = jnp.tile(jnp.array([[0.5, 1.0, 2.0], [0.2, 0.4, 9.0]]), (3, 1, 1))
    mask = jnp.tile(jnp.array([[1, 1, 1], [1, 1, 0]]), (3, 1, 1))
    return rewards, entropies, mask


def test_rl_zvp_by_hand():
    # alpha = 0.1.
    # Prompt 0, all correct: A = alpha H = [[0.05, 0.1, 0.2], [0.02, 0.04, pad 0]].
    # Prompt 1, all wrong: A = -alpha (max_k H - H) with max 2.0 and 0.4 (not the padded 9.0):
    #   [[-0.15, -0.1, 0.0], [-0.02, 0.0, pad 0]].
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
    np.testing.assert_array_equal(out.zero_variance_mask, [True, True, False])
    assert out.advantages.dtype == jnp.float32


def test_rl_zvp_negative_rewards_count_as_wrong():
    # All -1 (a -1/+1 reward scheme, all wrong) takes the R <= 0 branch: -alpha (max H - H).
    _, entropies, mask = zvp_inputs()
    out = advantages.rl_zvp(-jnp.ones((3, 2)), entropies, mask, alpha=0.2)
    np.testing.assert_allclose(out.advantages[0], [[-0.3, -0.2, 0.0], [-0.04, 0.0, 0.0]], **TOL)


def test_rl_zvp_entropy_is_detached():
    rewards, entropies, mask = zvp_inputs()
    grad = jax.grad(lambda e: advantages.rl_zvp(rewards, e, mask).advantages.sum())(entropies)
    np.testing.assert_array_equal(grad, np.zeros_like(entropies))


def test_rl_zvp_shape_errors():
    rewards, entropies, mask = zvp_inputs()
    with pytest.raises(ValueError, match="entropies"):
        advantages.rl_zvp(rewards, entropies.reshape(6, 3), mask)
    with pytest.raises(ValueError, match="mask"):
        advantages.rl_zvp(rewards, entropies, mask[:, :, :2])
    with pytest.raises(ValueError, match="rewards"):
        advantages.group_normalized(rewards.reshape(-1))
