"""Stage 2 of espo.zero_variance (rollout): the ZVP probability and adaptive group sizes.

`zvp_probability` p^G + (1-p)^G by hand, by simulation and in float64; `zvp_rate_by_group_size`
measured on rewards; `adaptive_group_sizes` (the smallest allowed G with ZVP probability <=
zvp_target, the rollout budget stepping the largest down, the boundaries and their errors) and
the sizes `fill_batch` hands to `generate`.
"""

import fractions
import itertools
import pathlib

import numpy as np
import pytest

from espo import testing
from espo import zero_variance as zv

# tests/ is not a package (pytest runs with --import-mode=importlib): the helpers load by path.
_helpers = testing.load_script(
    pathlib.Path(__file__).with_name("_helpers.py"), name="espo_tests_zero_variance_helpers"
)
make_prompts, BernoulliPolicy, QuantilePolicy, fill = (
    _helpers.make_prompts,
    _helpers.BernoulliPolicy,
    _helpers.QuantilePolicy,
    _helpers.fill,
)


def test_zvp_probability_by_hand_and_by_simulation():
    # p^G + (1-p)^G: 0.5^4 * 2 = 0.125; 0.1^2 + 0.9^2 = 0.82; p in {0, 1} is always ZVP.
    np.testing.assert_allclose(zv.zvp_probability(0.5, 4), 0.125)
    np.testing.assert_allclose(zv.zvp_probability(np.array([0.1, 0.0, 1.0]), 2), [0.82, 1, 1])
    rewards = BernoulliPolicy(seed=1).sample(make_prompts([0.2] * 20000), 4)  # [P, 4]
    simulated = np.mean([zv.is_zero_variance(r) for r in rewards])
    assert abs(simulated - 0.4112) < 0.015  # 0.2^4 + 0.8^4; standard error 0.0035


def test_zvp_probability_is_float64_for_float32_rates():
    # p = float32(0.1) = 0.100000001490116...; the exact p^2 + (1-p)^2 (rational arithmetic)
    # is matched to float64 precision (float32 arithmetic would be off by ~1e-8).
    p32 = np.float32(0.1)
    v = fractions.Fraction(float(p32))
    want = float(v**2 + (1 - v) ** 2)
    got = zv.zvp_probability(np.array([p32]), 2)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [want], rtol=1e-15, atol=0)


def test_zvp_rate_by_group_size_by_hand():
    assert zv.zvp_rate_by_group_size(np.array([[1, 1, 0, 1], [0, 0, 0, 0]])) == {
        2: 1.0,
        3: 0.5,
        4: 0.5,
    }
    assert zv.zvp_rate_by_group_size([np.array([1, 1, 0]), np.array([0, 0])]) == {2: 1.0, 3: 0.0}


def test_zvp_rate_falls_with_group_size_on_fake_policy():
    rates = np.random.default_rng(2).uniform(0.0, 1.0, 600)
    rewards = BernoulliPolicy(seed=3).sample(make_prompts(rates), 32)  # [P, 32]
    curve = zv.zvp_rate_by_group_size(rewards)
    values = [curve[g] for g in range(2, 33)]
    assert all(b <= a for a, b in itertools.pairwise(values))  # prefixes: exactly monotone
    assert values[0] > values[-1] + 0.3
    for g in (4, 16):  # and it matches the formula averaged over the prompts
        assert abs(curve[g] - zv.zvp_probability(rates, g).mean()) < 0.05


def test_adaptive_group_sizes_by_hand():
    # target 0.5, sizes {4, 8, ..., 32}: p=0.5 -> 0.125 at G=4; p=0.1: 0.9^4=0.656, 0.9^8=0.430
    # -> 8; p=0.05: 0.95^12=0.540, 0.95^16=0.440 -> 16 (and p=0.95 by symmetry); p=0.01:
    # 0.99^32=0.725 still above -> capped at 32, like p in {0, 1}; unknown -> g_min.
    rates = [0.5, 0.1, 0.05, 0.95, 0.01, 0.0, 1.0, None, np.nan]
    sizes = zv.adaptive_group_sizes(rates, g_min=4, g_max=32, zvp_target=0.5)
    np.testing.assert_array_equal(sizes, [4, 8, 16, 16, 32, 32, 32, 4, 4])
    assert sizes.dtype == np.int64
    odd = zv.adaptive_group_sizes([0.1, None], g_min=4, g_max=12, allowed=(4, 6, 8, 12), default=6)
    np.testing.assert_array_equal(odd, [8, 6])  # 0.9^6 = 0.531 > 0.5
    with pytest.raises(ValueError, match="g_min=8, g_max=4"):
        zv.adaptive_group_sizes([0.5], g_min=8, g_max=4)


def test_adaptive_group_sizes_budget_steps_down_the_largest():
    rates = [0.05, 0.5, 0.01]  # unconstrained [16, 4, 32], sum 52
    size = lambda budget: zv.adaptive_group_sizes(rates, g_min=4, g_max=32, budget=budget)
    np.testing.assert_array_equal(size(None), [16, 4, 32])
    np.testing.assert_array_equal(size(40), [16, 4, 20])  # 32 -> 28 -> 24 -> 20
    # ... -> [16, 4, 16] = 36 -> tie, first one steps: [12, 4, 16] = 32 -> [12, 4, 12] = 28.
    np.testing.assert_array_equal(size(30), [12, 4, 12])
    with pytest.raises(ValueError, match="budget=11"):
        size(11)


def test_adaptive_group_sizes_boundaries():
    # g_min = 1 is valid; at p = 0.5, zvp(G) = 2 * 0.5^G: G=1 -> 1, G=2 -> 0.5 == target -> 2
    # ("<=": a strict "<" would give 3, at 0.25).
    sizes = zv.adaptive_group_sizes([0.5], g_min=1, g_max=4, zvp_target=0.5)
    np.testing.assert_array_equal(sizes, [2])
    # g_min == g_max: one allowed size, a fixed G for every prompt.
    np.testing.assert_array_equal(zv.adaptive_group_sizes([0.5, 0.0], g_min=4, g_max=4), [4, 4])
    # Default sizes g_min=3, g_max=7: multiples 3, 6 plus g_max 7. At p = 0.5 the ZVP
    # probabilities are 0.25, 0.03125, 0.015625; target 0.05 -> 6 (not 7: 6 is allowed).
    np.testing.assert_array_equal(
        zv.adaptive_group_sizes([0.5], g_min=3, g_max=7, zvp_target=0.05), [6]
    )
    with pytest.raises(ValueError, match=r"need 1 <= g_min <= g_max; got g_min=0, g_max=4"):
        zv.adaptive_group_sizes([0.5], g_min=0, g_max=4)
    with pytest.raises(ValueError, match=r"allowed=\[16\] has no size in \[g_min=2, g_max=8\]"):
        zv.adaptive_group_sizes([0.5], g_min=2, g_max=8, allowed=[16])
    # Budget: p = 0.9 needs G = 8 (0.9^6 = 0.531 > 0.5, 0.9^8 = 0.430 <= 0.5) out of
    # {2, 4, 6, 8}; three prompts with budget 6 = P * min size (just valid) step down to 2 each.
    np.testing.assert_array_equal(
        zv.adaptive_group_sizes([0.9] * 3, g_min=2, g_max=8, budget=6), [2, 2, 2]
    )
    with pytest.raises(ValueError, match=r"budget=5 < P \* min size = 3 \* 2"):
        zv.adaptive_group_sizes([0.9] * 3, g_min=2, g_max=8, budget=5)


def test_adaptive_group_sizes_reach_generate():
    policy = QuantilePolicy()
    config = zv.ZveConfig(group_size=4, max_group_size=16)
    out = fill(
        [0.5, 0.0, 1.0, 0.5],
        policy=policy,
        mode="rl_zvp",
        group_size=lambda ps: config.group_sizes([p["p"] for p in ps]),
    )
    assert policy.calls == [[4, 16, 16, 4]]
    assert out.batch.group_sizes.tolist() == [4, 16, 16, 4]
    assert out.metrics["zve/zero_advantage_rollout_fraction"] == 32 / 40
