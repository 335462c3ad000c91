"""Advantage inversion: the metrics on hand-built groups, `adjust_rewards` step by step (margin
derived from G, the dead-zone default), the BT reward model (router aux loss included), and the
end-to-end claim of experiments/repro_inversion.py. The round-robin judge is in test_judge.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from espo import advantages, model, testing
from espo.rewards import reward_model as rm

REPO = pathlib.Path(__file__).resolve().parents[2]

# Jitted once per function, shape and config: run eagerly, every op compiles anew for each new
# shape, ~1 s per `adjust_rewards` call on 2 CPU cores against ~0.2 s for one jit. The eager
# path is held to the jitted one in test_adjust_rewards_eager_matches_jit.
inversion_rate = jax.jit(rm.inversion_rate)
sign_agreement_rate = jax.jit(rm.sign_agreement_rate)
pairwise_inversion_rate = jax.jit(rm.pairwise_inversion_rate)
adjust_rewards = jax.jit(rm.adjust_rewards, static_argnames="cfg")


def _close(got, want, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), rtol=0, atol=atol)


# ---- metrics ---------------------------------------------------------------------------------

Q = [[2.0, 0.0, 1.0, 1.0]]  # mean 1: signs +, -, tie, tie


@pytest.mark.parametrize(
    ("adv", "want"),
    [
        ([[1.0, -1.0, 0.0, 0.0]], 0.0),  # every sign right, the mean-quality pair untouched
        ([[-1.0, 1.0, 0.5, 0.0]], 0.75),  # two reversed + one tie pushed up; i=3 is fine
        ([[0.0, 0.0, 0.0, 0.0]], 0.0),  # signal lost is not inverted (agreement catches it)
        ([[3.0, -1.0, -1.0, -1.0]], 0.5),  # ties pushed down count too
    ],
)
def test_inversion_rate_hand_cases(adv, want):
    _close(inversion_rate(jnp.array(adv), true_quality=jnp.array(Q)), want)


def test_inversion_rate_tie_tolerance_and_groups():
    q = jnp.array([[1.0, 1.05, 0.95], [0.0, 0.0, 3.0]])  # means 1.0 and 1.0
    adv = jnp.array([[0.0, 1.0, -1.0], [-1.0, -1.0, 2.0]])
    _close(inversion_rate(adv, true_quality=q), 0.0)
    # tie_tol = 0.1: group 0 is all ties, so its two pushed rollouts count: 2 of 6.
    _close(inversion_rate(adv, true_quality=q, tie_tol=0.1), 2 / 6)
    # adv_tol = 1.5 reads |A| <= 1.5 as no push: nothing left to be inverted.
    _close(inversion_rate(adv, true_quality=q, tie_tol=0.1, adv_tol=1.5), 0.0)


def test_sign_agreement_rate():
    q = jnp.array(Q)
    _close(sign_agreement_rate(jnp.array([[1.0, -1.0, 5.0, 0.0]]), true_quality=q), 1.0)
    _close(sign_agreement_rate(jnp.zeros((1, 4)), true_quality=q), 0.0)
    _close(sign_agreement_rate(jnp.array([[1.0, 1.0, 0.0, 0.0]]), true_quality=q), 0.5)
    _close(sign_agreement_rate(jnp.ones((1, 3)), true_quality=jnp.ones((1, 3))), 0.0)


@pytest.mark.parametrize(
    ("adv", "want"),
    [
        ([[1.0, 0.0, -1.0]], 0.0),
        ([[-1.0, 0.0, 1.0]], 1.0),
        ([[0.0, 1.0, -1.0]], 1 / 3),  # only (0 > 1) is reversed
        ([[0.0, 0.0, -1.0]], 0.0),  # equal advantages: lost, not reversed
    ],
)
def test_pairwise_inversion_rate_hand_cases(adv, want):
    q = jnp.array([[3.0, 2.0, 1.0]])
    _close(pairwise_inversion_rate(jnp.array(adv), true_quality=q), want)


def test_pairwise_inversion_rate_skips_equal_quality_pairs():
    q = jnp.array([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])  # ordered pairs: (0, 2) and (1, 2) only
    adv = jnp.array([[1.0, -1.0, 0.0], [1.0, -1.0, 0.0]])
    _close(pairwise_inversion_rate(adv, true_quality=q), 0.5)
    _close(pairwise_inversion_rate(adv[1:], true_quality=q[1:]), 0.0)  # no ordered pair


def test_tied_pair_split_rate_by_hand():
    """Group 0 has tied pairs (0, 1) (both 1) and none else of equal quality; group 1 is all
    tied: (0, 1), (0, 2), (1, 2). Opposite signs split (0, 1) of group 0 and (0, 1), (1, 2)
    of group 1; (0, 2) of group 1 share a sign; 3 of 4 tied pairs split."""
    q = jnp.array([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    adv = jnp.array([[0.5, -0.5, 0.0], [1.0, -1.0, 0.5]])
    split = jax.jit(rm.tied_pair_split_rate)
    _close(split(adv, true_quality=q), 3 / 4)
    _close(split(adv[:1], true_quality=q[:1]), 1.0)
    # A zero advantage pushes neither way: not split; no tied pair at all gives 0.
    _close(split(jnp.array([[0.5, 0.0, -1.0]]), true_quality=q[:1]), 0.0)
    _close(split(jnp.array([[1.0, -1.0]]), true_quality=jnp.array([[1.0, 0.0]])), 0.0)


def test_metrics_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        rm.inversion_rate(jnp.zeros((2, 3)), true_quality=jnp.zeros((2, 4)))


# ---- adjust_rewards --------------------------------------------------------------------------

OFF = rm.RmAdjustConfig(tiered=False, dead_zone=0.0, rank=False)


def test_all_steps_off_is_identity():
    s = jnp.array([[0.3, -2.0, 0.3, 7.0]])
    np.testing.assert_array_equal(adjust_rewards(s, correct=None, cfg=OFF), s)


def test_tiers_put_every_correct_rollout_first():
    s = jnp.array([[0.9, 0.1, 0.5, -3.0]])
    correct = jnp.array([[False, True, True, False]])
    got = adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(margin=0.05, dead_zone=0.0))
    # Tier 1 ranks {0.1, 0.5} -> x = -1, +1; tier 0 ranks {0.9, -3} -> x = +1, -1.
    _close(got, [[0.05, 0.95, 1.05, -0.05]])
    # The naive reading (0.9 > 0.5 > 0.1 > -3) would put the wrong answer first.


def test_tiers_without_ranks_squash_the_centred_score():
    s = jnp.array([[0.0, 2.0, 5.0]])
    correct = jnp.array([[True, True, False]])
    cfg = rm.RmAdjustConfig(rank=False, margin=0.1, squash_scale=2.0, dead_zone=0.0)
    t = math.tanh(0.5)  # (0 - 1) / 2 and (2 - 1) / 2; the lone wrong rollout is its tier mean
    _close(adjust_rewards(s, correct=correct, cfg=cfg), [[1 - 0.1 * t, 1 + 0.1 * t, 0.0]])


def test_dead_zone_clusters_and_ranks():
    s = jnp.array([[0.0, 0.3, 0.35, 1.0, 0.32]])
    # Sorted gaps 0.3, 0.02, 0.03, 0.65 with delta 0.1: clusters {0}, {.3, .32, .35}, {1}.
    ranked = rm.RmAdjustConfig(tiered=False, dead_zone=0.1)
    _close(adjust_rewards(s, correct=None, cfg=ranked), [[-1.0, 0.0, 0.0, 1.0, 0.0]])
    means = rm.RmAdjustConfig(tiered=False, dead_zone=0.1, rank=False)
    m = (0.3 + 0.35 + 0.32) / 3
    _close(adjust_rewards(s, correct=None, cfg=means), [[0.0, m, m, 1.0, m]])


def test_dead_zone_is_single_linkage_and_strict():
    cfg = rm.RmAdjustConfig(tiered=False, dead_zone=0.5)
    chain = jnp.array([[0.0, 0.4, 0.8, 1.2]])  # every gap < 0.5, so all four tie (1.2 apart)
    np.testing.assert_array_equal(adjust_rewards(chain, correct=None, cfg=cfg), 0.0)
    edge = jnp.array([[0.0, 0.5]])  # a gap of exactly delta is not a tie
    _close(adjust_rewards(edge, correct=None, cfg=cfg), [[-1.0, 1.0]])


def test_equal_scores_tie_without_dead_zone():
    cfg = rm.RmAdjustConfig(tiered=False, dead_zone=0.0)
    # Ranks 1.5, 1.5, 3 of n = 3: x = (2 * 1.5 - 4) / 2 = -0.5 and (6 - 4) / 2 = 1.
    _close(adjust_rewards(jnp.array([[1.0, 1.0, 2.0]]), correct=None, cfg=cfg), [[-0.5, -0.5, 1]])


@pytest.mark.slow
def test_all_tied_group_becomes_zero_variance_exactly():
    s = jnp.array([[0.11, 0.13, 0.12, 0.1], [0.0, 0.01, 0.02, 5.0]])
    correct = jnp.array([[True] * 4, [False, False, False, True]])
    r = adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(dead_zone=0.05))
    np.testing.assert_array_equal(r[0], 1.0)  # one tier, one cluster: x = 0 exactly
    np.testing.assert_array_equal(r[1], [0.0, 0.0, 0.0, 1.0])  # lone correct: n = 1, x = 0
    adv = advantages.group_normalized(r)
    np.testing.assert_array_equal(adv[0], 0.0)
    assert bool(advantages.zero_variance_mask(r)[0])


@pytest.mark.slow
@pytest.mark.parametrize("rank", [True, False])
def test_correctness_decides_the_sign_in_mixed_groups(rank):
    rng = np.random.default_rng(0)
    G = 8
    s = jnp.asarray(rng.normal(size=(200, G)) * 10.0, jnp.float32)
    correct = rng.random((200, G)) < rng.random((200, 1))
    margin = 0.99 / G if rank else 0.49 / G  # the documented bounds: 1/G, 1/(2G)
    cfg = rm.RmAdjustConfig(margin=margin, rank=rank, dead_zone=0.5)
    adv = advantages.group_normalized(adjust_rewards(s, correct=jnp.asarray(correct), cfg=cfg))
    frac = correct.mean(-1, keepdims=True)
    mixed = (frac[:, 0] > 0) & (frac[:, 0] < 1)
    want = np.sign(correct - frac)[mixed]
    np.testing.assert_array_equal(np.sign(np.asarray(adv))[mixed], want)


# ---- the margin is derived from (or checked against) G ---------------------------------------


def _adversarial_groups(G: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Every mixed composition of a group of G (k = 1..G-1 correct), each with the RM scoring
    every wrong rollout above every correct one and all scores distinct (no dead-zone ties):
    the worst case for the tiers. Scores [G - 1, G], correct [G - 1, G]."""
    k = np.arange(1, G)[:, None]  # [G - 1, 1] correct rollouts per group
    correct = np.arange(G)[None, :] < k  # [G - 1, G]
    scores = np.where(correct, 0.0, 100.0) + 3.0 * np.arange(G)[None, :]  # [G - 1, G]
    return jnp.asarray(scores, jnp.float32), jnp.asarray(correct)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [True, False])
@pytest.mark.parametrize("G", [2, 4, 8, 16, 32, 64])
def test_default_margin_keeps_every_sign_at_every_group_size(G, rank):
    """Catches a G-independent default margin: with the old 0.05 (> 1/32), at G = 32 the group
    of 31 correct rollouts gave its lowest-ranked correct ones negative advantages (G = 32 and
    64 fail, with and without ranks)."""
    scores, correct = _adversarial_groups(G)
    cfg = rm.RmAdjustConfig(rank=rank, dead_zone=0.0)
    adv = np.asarray(advantages.group_normalized(adjust_rewards(scores, correct=correct, cfg=cfg)))
    correct = np.asarray(correct)
    assert (adv[correct] > 0).all(), adv[correct].min()
    assert (adv[~correct] < 0).all(), adv[~correct].max()


def test_margin_boundary_hand_example():
    """G = 4, correct = [1, 1, 1, 0], scores increasing: the correct tier's ranks are
    x = [-1, 0, 1], the lone wrong rollout's x = 0, so r = [1 - m, 1, 1 + m, 0], mean 3/4 and
    r - mean = [1/4 - m, 1/4, 1/4 + m, -3/4]. m = 1/4 = 1/G would give the first correct
    rollout advantage 0 (beyond it, a negative one): it is rejected; the default is 1/8."""
    s = jnp.array([[0.0, 1.0, 2.0, 5.0]])
    correct = jnp.array([[True, True, True, False]])
    got = adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(dead_zone=0.0))
    _close(got, [[0.875, 1.0, 1.125, 0.0]])
    got = adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(margin=0.2, dead_zone=0.0))
    _close(got, [[0.8, 1.0, 1.2, 0.0]])
    _close(np.asarray(got) - 0.75, [[0.05, 0.25, 0.45, -0.75]])
    with pytest.raises(ValueError, match=r"margin=0\.25 is too large for G=4.*< 1/G = 0\.25"):
        rm.adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(margin=0.25))


@pytest.mark.slow
def test_explicit_margin_is_checked_against_g():
    cfg = rm.RmAdjustConfig(margin=0.05)
    assert cfg.margin_for(16) == 0.05  # 0.05 < 1/16
    with pytest.raises(ValueError, match=r"RmAdjustConfig\.margin=0\.05 is too large for G=32"):
        cfg.margin_for(32)
    with pytest.raises(ValueError, match=r"G=16.*1/\(2G\) = 0\.03125 \(rank=False\)"):
        rm.RmAdjustConfig(margin=0.05, rank=False).margin_for(16)
    assert rm.RmAdjustConfig().margin_for(32) == 1 / 64  # half of 1/G
    assert rm.RmAdjustConfig(rank=False).margin_for(32) == 1 / 128  # half of 1/(2G)
    assert rm.RmAdjustConfig().margin_for(1) == 0.25  # capped: half of 0.5
    # Without tiers the margin is unused, so no G is too large for it.
    rm.adjust_rewards(
        jnp.zeros((1, 64)), correct=None, cfg=rm.RmAdjustConfig(tiered=False, margin=0.4)
    )


# ---- the dead-zone default -------------------------------------------------------------------


@pytest.mark.slow
def test_default_dead_zone_ties_rm_noise_in_an_equal_quality_tier():
    """Catches dead_zone=0 as the default: an all-correct group of equal true quality whose RM
    scores differ by noise (gaps 0.3 delta) gets ranks -1..1, i.e. unit-size advantages, and
    `inversion_rate` reads all 4 as inverted; the default ties them into one cluster."""
    delta = rm.DEFAULT_DEAD_ZONE
    assert delta > 0
    s = jnp.asarray([[0.0, 0.3 * delta, 0.6 * delta, 0.9 * delta]], jnp.float32)
    correct = jnp.ones((1, 4), bool)
    q = jnp.ones((1, 4))
    no_zone = advantages.group_normalized(
        adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(dead_zone=0.0))
    )
    _close(inversion_rate(no_zone, true_quality=q), 1.0)
    r = adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig())
    np.testing.assert_array_equal(r, 1.0)
    _close(inversion_rate(advantages.group_normalized(r), true_quality=q), 0.0)
    assert bool(advantages.zero_variance_mask(r)[0])


def test_dead_zone_boundary_is_strict():
    """A gap of exactly delta is a step; one float32 ulp below it is a tie."""
    below = float(np.nextafter(np.float32(0.25), np.float32(0.0)))
    cfg = rm.RmAdjustConfig(tiered=False, dead_zone=0.25)
    _close(adjust_rewards(jnp.array([[0.0, 0.25]]), correct=None, cfg=cfg), [[-1.0, 1.0]])
    _close(adjust_rewards(jnp.array([[0.0, below]]), correct=None, cfg=cfg), [[0.0, 0.0]])


def test_inversion_rate_tolerance_boundaries():
    """q = [0, 1/2, -1/2] (mean 0, exact in float32), A = [0, 1, -1]. With tie_tol = 1/2 the
    |d| = 1/2 rollouts count as ties (|d| <= tol), so the two pushed ones are inverted: 2/3;
    with tie_tol = 1/4 every sign is right: 0. With adv_tol = 1 (|A| <= tol is no push)
    nothing is pushed: 0 inverted and 0 agreement."""
    q = jnp.array([[0.0, 0.5, -0.5]])
    adv = jnp.array([[0.0, 1.0, -1.0]])
    _close(inversion_rate(adv, true_quality=q, tie_tol=0.5), 2 / 3)
    _close(inversion_rate(adv, true_quality=q, tie_tol=0.25), 0.0)
    _close(sign_agreement_rate(adv, true_quality=q, tie_tol=0.25), 1.0)
    _close(inversion_rate(adv, true_quality=q, adv_tol=1.0), 0.0)
    _close(sign_agreement_rate(adv, true_quality=q, adv_tol=1.0), 0.0)


_CFGS = (
    rm.RmAdjustConfig(),
    rm.RmAdjustConfig(dead_zone=0.0),
    rm.RmAdjustConfig(rank=False, dead_zone=0.0),
    rm.RmAdjustConfig(rank=False, squash_scale=0.01),
    rm.RmAdjustConfig(margin=0.49, dead_zone=3.0),  # within the 0.5 cap at G <= 2 only
)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    data=st.data(),
    G=st.sampled_from([1, 2, 3, 8]),
    cfg=st.sampled_from(_CFGS),
)
@pytest.mark.slow
def test_every_correct_reward_beats_every_wrong_one(data, G, cfg):
    """Property: within every group, min(correct rewards) > max(wrong rewards), whatever the RM
    scores (huge, tied, adversarial) and switches."""
    if cfg.margin is not None and cfg.margin >= rm.margin_bound(G, rank=cfg.rank):
        cfg = dataclasses.replace(cfg, margin=None)
    P = 3
    s = data.draw(
        hnp.arrays(np.float32, (P, G), elements=st.floats(-1e4, 1e4, width=32)), label="scores"
    )
    correct = data.draw(hnp.arrays(np.bool_, (P, G)), label="correct")
    r = np.asarray(adjust_rewards(jnp.asarray(s), correct=jnp.asarray(correct), cfg=cfg))
    assert np.isfinite(r).all()
    for p in range(P):
        if correct[p].any() and (~correct[p]).any():
            assert r[p][correct[p]].min() > r[p][~correct[p]].max(), (s[p], correct[p], r[p])


class AdjustVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_example_jitted_and_not(self):
        """Dead-zone 0.5 over one group: correct scores {0.1, 0.3, 2.0} cluster to
        {0.1, 0.3}, {2.0} -> ranks 1.5, 1.5, 3 of 3 -> x = [-0.5, -0.5, 1]; the lone wrong
        rollout gets x = 0. G = 4, margin 1/8: r = [1 - 1/16, 1 - 1/16, 1 + 1/8, 0]."""
        cfg = rm.RmAdjustConfig(dead_zone=0.5)
        fn = self.variant(functools.partial(rm.adjust_rewards, cfg=cfg))
        s = jnp.array([[0.1, 0.3, 2.0, 9.0]])
        correct = jnp.array([[True, True, True, False]])
        chex.assert_trees_all_close(
            fn(s, correct=correct), jnp.array([[0.9375, 0.9375, 1.125, 0.0]]), atol=1e-6
        )


@pytest.mark.slow
def test_adjust_rewards_eager_matches_jit():
    s = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6)), jnp.float32)
    correct = s > 0.3
    cfg = rm.RmAdjustConfig(dead_zone=0.2)
    _close(
        rm.adjust_rewards(s, correct=correct, cfg=cfg), adjust_rewards(s, correct=correct, cfg=cfg)
    )


def test_adjust_rewards_errors():
    with pytest.raises(ValueError, match="tiered=True needs `correct`"):
        rm.adjust_rewards(jnp.zeros((2, 3)), correct=None, cfg=rm.RmAdjustConfig())
    with pytest.raises(ValueError, match="correct must have shape"):
        rm.adjust_rewards(
            jnp.zeros((2, 3)), correct=jnp.zeros((2, 4), bool), cfg=rm.RmAdjustConfig()
        )
    with pytest.raises(ValueError, match=r"rm_scores must be \[P, G\]"):
        rm.adjust_rewards(jnp.zeros((6,)), correct=None, cfg=OFF)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("margin", 0.5),  # tiers would touch
        ("margin", 0.0),
        ("margin", True),
        ("dead_zone", -0.1),
        ("dead_zone", math.inf),
        ("squash_scale", 0.0),
        ("tiered", 1),
        ("rank", "yes"),
    ],
)
def test_config_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"RmAdjustConfig\.{field}={value!r}"):
        rm.RmAdjustConfig(**{field: value})


# ---- the Bradley–Terry reward model ----------------------------------------------------------


def test_reward_model_at_real_size_reads_the_hidden_state_not_logits():
    """A scalar head on the hidden state: w is [D], not [V], and no [B, T, V] logits are built."""
    cfg = model.ModelConfig.qwen3_30b_a3b()
    params = jax.eval_shape(functools.partial(rm.init_reward_model, cfg), jax.random.key(0))
    assert params["backbone"] == model.param_shapes(cfg)  # an espo checkpoint loads as is
    assert params["head"]["w"].shape == (cfg.d_model,) and params["head"]["b"].shape == ()
    B, T = 2, 16
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)
    score = jax.jit(lambda p, t, m: rm.reward_scores(cfg, p, t, attention_mask=m)[0])
    lowered = score.lower(params, tokens, mask)  # traced and lowered, never compiled
    assert (lowered.out_info.shape, lowered.out_info.dtype) == ((B,), jnp.float32)
    # The backbone's LM head is dead code that jit drops; a head on the logits would keep it.
    assert f"{B}x{T}x{cfg.vocab_size}x" not in lowered.as_text()


@pytest.mark.slow
def test_bt_objective_includes_the_router_aux_loss():
    """Catches bug 13 of issue 13 (the router aux loss dropped from the BT objective): with
    nonzero coefficients the objective must equal mean softplus(-(s_c - s_r)) +
    c_lb * load_balancing_loss + c_z * z_loss of one forward over [chosen; rejected], in value
    and in gradient. Every other test model has both coefficients 0, so aux.total is 0 there."""
    cfg = model.ModelConfig.tiny(vocab_size=32, num_layers=1, aux_loss_coef=0.3, z_loss_coef=0.07)
    params = rm.init_reward_model(cfg, jax.random.key(0))
    # A nonzero head, so the BT term reaches the backbone too (w = 0 at init).
    params["head"]["w"] = jax.random.normal(jax.random.key(1), (cfg.d_model,)) * 0.5
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 32, size=(6, 7)), jnp.int32)  # [2B, T]
    mask = jnp.asarray(np.arange(7)[None, :] < np.array([7, 5, 3, 6, 7, 4])[:, None])
    batch = rm.PreferenceBatch(tokens[:3], tokens[3:], mask[:3], mask[3:])

    def reference(p):
        out = model.forward(
            cfg, p["backbone"], tokens, attention_mask=mask, return_hidden=True
        )  # one forward over both sides, as the router statistics must cover both
        last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # [2B]
        h = out.hidden[jnp.arange(6), last]  # [2B, D]
        score = (h * p["head"]["w"]).sum(-1) + p["head"]["b"]  # [2B]
        bt = jnp.mean(jax.nn.softplus(score[3:] - score[:3]))
        aux = 0.3 * out.aux.load_balancing_loss + 0.07 * out.aux.z_loss
        return bt + aux, aux

    # Jitted: op by op, the two forwards compiled ~300 small programs.
    (want, aux), want_grad = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    assert float(aux) > 0.1  # the aux term is not negligible: the check has teeth
    (got, metrics), got_grad = jax.jit(
        jax.value_and_grad(lambda p: rm.bradley_terry_loss(cfg, p, batch), has_aux=True)
    )(params)
    chex.assert_trees_all_close(got, want, atol=1e-5)
    chex.assert_trees_all_close(metrics["aux_loss"], aux, atol=1e-5)
    chex.assert_trees_all_close(metrics["bt_loss"] + aux, want, atol=1e-5)
    chex.assert_trees_all_close(got_grad, want_grad, atol=1e-5)
    # The router weights get an aux gradient the BT term alone would not give them.
    bt_only = jax.jit(jax.grad(lambda p: reference(p)[0] - reference(p)[1]))(params)
    diff = jax.tree.map(
        lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), want_grad, bt_only
    )
    assert max(float(x) for x in jax.tree.leaves(diff)) > 1e-3


def _load_repro():
    return testing.load_script(REPO / "experiments" / "repro_inversion.py")


@pytest.fixture(scope="module")
def repro_lib():
    return _load_repro()


@pytest.fixture(scope="module")
def repro(repro_lib):
    """The script's pipeline, shortened: 100 BT steps on 32 pairs, 128 held-out groups of 8.

    Nearly all of its cost is compiling (init, train step, scorer): the 100 steps take ~1.5 s.
    """
    return repro_lib.run(steps=100, batch_size=32, num_prompts=128, seed=0)


@pytest.mark.slow
def test_reward_scores_ignore_padding(repro, repro_lib):
    cfg, params = repro["cfg"], repro["params"]
    assert jax.tree.structure(params["head"]) == jax.tree.structure({"w": 0, "b": 0})
    assert params["head"]["w"].shape == (cfg.d_model,) and params["head"]["b"].shape == ()
    T = repro_lib.SEQ_LEN  # the fixture's scorer is compiled for [512, T]
    real = np.array([9, 12, 17, 30, 4, 11, 4, 2])  # no real token is 0
    n = len(real)
    pad, junk = np.zeros(T - n, real.dtype), np.array([7, 50, 4, 33, 3, 61, 8])[: T - n]
    tokens = np.stack([
        np.concatenate([real, pad]),  # right padding
        np.concatenate([pad, real]),  # left padding
        np.concatenate([real, junk]),  # right "padding" of real-looking tokens, masked out
        np.concatenate([junk, real]),
    ])  # fmt: skip
    mask = np.stack([np.arange(T) < n, np.arange(T) >= T - n] * 2)
    got = repro["score"](params, tokens, mask)  # [4]
    assert abs(float(got[0])) > 0.1  # a trained head: the check is not vacuous
    _close(got, np.full(4, got[0]), atol=1e-4)


@pytest.mark.slow
def test_trained_bt_model_inversion_cut_at_least_5x(repro):
    rows = repro["rows"]
    naive = rows["naive BT"]["inversion"]
    adjusted = rows["tiered + dead-zone + rank"]["inversion"]
    assert repro["train"]["accuracy"] > 0.75  # the RM learned the task (label noise 0.1)
    assert naive > 0.2, rows
    assert naive >= 5 * adjusted, rows
    # Not won by zeroing advantages: most non-mean rollouts keep a right-signed advantage.
    assert rows["tiered + dead-zone + rank"]["agreement"] > 0.8, rows
    assert rows["oracle q, adjusted"]["inversion"] == 0.0  # the adjustment itself is exact


@pytest.mark.slow
def test_noisy_scorer_inversion_cut_at_least_5x():
    """A BT-like scorer without training: monotone in quality plus noise near the mean."""
    rng = np.random.default_rng(0)
    P, G = 512, 8
    correct = rng.random((P, G)) < rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(P, 1))
    styled = rng.random((P, G)) < rng.choice([0.0, 0.5, 1.0], size=(P, 1))
    q = correct + 0.1 * styled  # 0.1 < 1/G: correctness decides the sign in mixed groups
    scores = 1.0 * correct + 0.6 * styled + rng.normal(scale=0.1, size=(P, G))
    correct, q, scores = (jnp.asarray(x, jnp.float32) for x in (correct, q, scores))
    naive = inversion_rate(advantages.group_normalized(scores), true_quality=q)
    cfg = rm.RmAdjustConfig(dead_zone=0.2)
    adjusted_r = adjust_rewards(scores, correct=correct.astype(bool), cfg=cfg)
    adjusted = inversion_rate(advantages.group_normalized(adjusted_r), true_quality=q)
    assert float(naive) >= 5 * float(adjusted), (float(naive), float(adjusted))
