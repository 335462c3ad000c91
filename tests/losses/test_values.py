"""Values of espo.losses: worked by hand, and against a NumPy re-implementation of verl.

Hand-derived: each loss (GRPO with clip-higher and dual clip, GSPO, CISPO, ESPO with its
gspo_token and literal ratios), the aggregation modes, the KL estimators and k3's guards, the
metrics (approx_kl / ppo_kl with the +-20 clamp of the log-ratio, clip indicators that count only
tokens with an advantage) and the entropy groups (thresholds, ties, scopes, int32 ids). The same
kind of numbers with asymmetric settings, jitted and eager, are in test_values_asymmetric.py.

The NumPy reference (`verl_*` below) is written from verl's `compute_policy_loss_vanilla`,
`compute_policy_loss_gspo` and `agg_loss` (current verl, empty sequences excluded), in float64,
with the gradient torch autograd would give (max/min split ties evenly, clamp passes 0 outside).
"""

import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import losses, testing

# tests/ is not a package (pytest runs with --import-mode=importlib): the helpers load by path.
_helpers = testing.load_script(
    pathlib.Path(__file__).with_name("_helpers.py"), name="espo_tests_losses_helpers"
)
TOL, run, random_batch, _batch = (
    _helpers.TOL,
    _helpers.run,
    _helpers.random_batch,
    _helpers.one_row_batch,
)


# ---- policy losses and metrics ----------------------------------------------------------------


@pytest.mark.slow
def test_grpo_clip_higher_by_hand():
    # r = [1.5, 0.5, 1.1], A = +1, clip range [0.8, 1.28]:
    # pg1 = -A r = [-1.5, -0.5, -1.1]; pg2 = -A clip(r) = [-1.28, -0.8, -1.1]
    # max = [-1.28, -0.5, -1.1] -> token-mean -2.88 / 3 = -0.96
    # (symmetric 0.2 clips token 0 at 1.2 instead: -2.8 / 3 = -0.9333, the wrong answer here.)
    # grad: token 0 clipped (0); tokens 1, 2: -A r / 3 = -0.5/3, -1.1/3.
    cfg = losses.LossConfig(name="grpo", clip_high=0.28)
    logps = np.log([[1.5, 0.5, 1.1]])
    kw = dict(old_logps=jnp.zeros((1, 3)), mask=jnp.ones((1, 3)))
    loss, grad, out = run(cfg, logps, advantages=jnp.ones(1), **kw)
    assert loss == pytest.approx(-0.96, abs=1e-6)
    np.testing.assert_allclose(grad, [[0.0, -0.5 / 3, -1.1 / 3]], **TOL)
    assert float(out.metrics["clip_frac_high"]) == pytest.approx(1 / 3)
    assert float(out.metrics["clip_frac_low"]) == 0.0
    # A = -1: pg1 = [1.5, 0.5, 1.1], pg2 = [1.28, 0.8, 1.1], max = [1.5, 0.8, 1.1] -> 3.4 / 3;
    # token 1 (r = 0.5 < 0.8, A < 0) is clipped low; grads -A r / 3 = [0.5, 0, 1.1/3].
    loss, grad, out = run(cfg, logps, advantages=-jnp.ones(1), **kw)
    assert loss == pytest.approx(3.4 / 3, abs=1e-6)
    np.testing.assert_allclose(grad, [[0.5, 0.0, 1.1 / 3]], **TOL)
    assert float(out.metrics["clip_frac_low"]) == pytest.approx(1 / 3)
    assert float(out.metrics["clip_frac"]) == pytest.approx(1 / 3)


def test_metrics_by_hand():
    # r = [1.5, 0.5, 1.1]: approx_kl = mean((r - 1) - log r)
    #   = mean(0.5 - 0.405465, -0.5 + 0.693147, 0.1 - 0.095310) = 0.292372 / 3 = 0.097457
    # ppo_kl = mean(-log r) = 0.192372 / 3 = 0.064124; ratio_mean = 3.1 / 3; ratio_max = 1.5.
    cfg = losses.LossConfig(name="grpo")
    _, _, out = run(
        cfg,
        np.log([[1.5, 0.5, 1.1, 7.0]]),
        old_logps=jnp.zeros((1, 4)),
        advantages=jnp.ones(1),
        mask=jnp.array([[1, 1, 1, 0]]),  # the padded ratio 7 must not reach any metric
        entropies=jnp.array([[1.0, 2.0, 3.0, 50.0]]),
    )
    m = {k: float(v) for k, v in out.metrics.items()}
    r = np.array([1.5, 0.5, 1.1])
    assert m["approx_kl"] == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-5)
    assert m["ppo_kl"] == pytest.approx(0.192372 / 3, rel=1e-4)
    assert m["ratio_mean"] == pytest.approx(3.1 / 3, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["entropy"] == pytest.approx(2.0)
    assert (m["num_tokens"], m["num_seqs"]) == (3.0, 1.0)


@pytest.mark.slow
def test_clip_indicators_count_only_tokens_whose_advantage_the_clip_silences():
    cfg = losses.LossConfig(name="grpo", clip_low=0.2, clip_high=0.3)
    # ratios e^d: 0.5 (below 0.8), 2.0 (above 1.3), 0.5, 2.0, 1.0; advantages -1, +1, 0, 0, +1.
    d = [math.log(0.5), math.log(2.0), math.log(0.5), math.log(2.0), 0.0]
    m = losses.compute_loss(cfg, **_batch(d, [-1.0, 1.0, 0.0, 0.0, 1.0])).metrics
    np.testing.assert_allclose(m["clip_frac_low"], 1 / 5, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 5, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac"], 2 / 5, rtol=1e-6)  # low + high


@pytest.mark.slow
def test_approx_kl_and_ppo_kl_hand_values_and_clamp():
    cfg = losses.LossConfig(name="grpo")
    # d = logp - old = [0.5, -1]: approx_kl = mean(expm1(d) - d)
    #   = ((e^0.5 - 1.5) + (e^-1 - 1 + 1)) / 2 = (0.148721 + 0.367879) / 2 = 0.258300;
    # ppo_kl = mean(old - logp) = (-0.5 + 1) / 2 = 0.25.
    m = losses.compute_loss(cfg, **_batch([0.5, -1.0], [1.0, -1.0])).metrics
    np.testing.assert_allclose(m["approx_kl"], 0.258300, rtol=1e-5)
    np.testing.assert_allclose(m["ppo_kl"], 0.25, rtol=1e-6)
    # The log-ratio is clamped to +-20 first: d = -30 reads as -20 (approx_kl = e^-20 + 19,
    # ppo_kl 20, not 29 and 30); d = +30 reads as +20 (approx_kl = expm1(20) - 20).
    low = losses.compute_loss(cfg, **_batch([-30.0], [1.0])).metrics
    np.testing.assert_allclose([low["approx_kl"], low["ppo_kl"]], [19.0, 20.0], rtol=1e-6)
    high = losses.compute_loss(cfg, **_batch([30.0], [1.0])).metrics
    np.testing.assert_allclose(high["approx_kl"], math.expm1(20.0) - 20.0, rtol=1e-5)
    np.testing.assert_allclose(high["ppo_kl"], -20.0, rtol=1e-6)


def test_dual_clip_by_hand_only_for_negative_advantages():
    # Two one-token sequences, r = 5, A = [+1, -1], clip [0.8, 1.2]:
    # A>0: max(-5, -1.2) = -1.2 (clipped, grad 0), dual clip does not apply.
    # A<0: max(5, 1.2) = 5 (grad -A r = 5); with c = 3: min(5, 3 * 1) = 3 (grad 0).
    # seq-mean-token-sum: (-1.2 + 5) / 2 = 1.9 without, (-1.2 + 3) / 2 = 0.9 with dual clip.
    kw = dict(old_logps=jnp.zeros((2, 1)), advantages=jnp.array([1.0, -1.0]), mask=jnp.ones((2, 1)))
    logps = np.full((2, 1), np.log(5.0))
    agg = "seq-mean-token-sum"
    loss, grad, _ = run(losses.LossConfig(name="grpo", agg=agg), logps, **kw)
    assert loss == pytest.approx(1.9, abs=1e-5)
    np.testing.assert_allclose(grad, [[0.0], [2.5]], **TOL)
    loss, grad, out = run(losses.LossConfig(name="grpo", agg=agg, dual_clip=3.0), logps, **kw)
    assert loss == pytest.approx(0.9, abs=1e-5)
    np.testing.assert_allclose(grad, [[0.0], [0.0]], **TOL)
    assert float(out.metrics["dual_clip_frac"]) == pytest.approx(0.5)
    # With only positive advantages, dual clip changes nothing (value or gradient).
    batch = random_batch(0, scale=1.0)
    batch["advantages"] = np.abs(batch["advantages"])
    plain = run(losses.LossConfig(name="grpo"), **batch)
    dual = run(losses.LossConfig(name="grpo", dual_clip=1.5), **batch)
    assert plain[0] == pytest.approx(dual[0], rel=1e-6)
    np.testing.assert_allclose(plain[1], dual[1], **TOL)


@pytest.mark.parametrize(
    "agg, norm_length, num, den",
    [
        ("token-mean", None, 15.0, 5.0),  # (1+2+3+4+5) / 5 tokens = 3
        ("seq-mean-token-mean", None, 6.5, 2.0),  # (6/3 + 9/2) / 2 = 3.25
        ("seq-mean-token-sum", None, 15.0, 2.0),  # (6 + 9) / 2 = 7.5
        ("seq-mean-token-sum-norm", 3, 5.0, 2.0),  # (6/3 + 9/3) / 2 = 2.5
        ("seq-mean-token-sum-norm", 5, 3.0, 2.0),  # (6/5 + 9/5) / 2 = 1.5
    ],
)
def test_aggregation_by_hand(agg, norm_length, num, den):
    # r = 1 everywhere, so the token loss is -A: L = [[1, 2, 3], [4, 5, pad], [pad x 3]].
    # The all-padding third row leaves every denominator (it is not a sequence to average).
    token_losses = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 7.0, 7.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    cfg = losses.LossConfig(name="grpo", agg=agg, norm_length=norm_length)
    zeros = np.zeros((3, 3))
    _, _, out = run(cfg, zeros, old_logps=zeros, advantages=-token_losses, mask=mask)
    assert (float(out.numerator), float(out.denominator)) == pytest.approx((num, den))
    assert float(out.loss) == pytest.approx(num / den)
    # A float mask selects where it is nonzero: its values weight nothing.
    weights = jnp.asarray(mask * np.array([[0.5, 2.0, 3.0], [7.0, 0.25, 9.0], [4.0, 4.0, 4.0]]))
    num_den = losses.aggregate(jnp.asarray(token_losses), weights, agg=agg, norm_length=norm_length)
    assert tuple(map(float, num_den)) == pytest.approx((num, den))
    # Without norm_length, token-sum-norm divides by T: (6/3 + 9/3) = 5 over 2 sequences.
    num_den = losses.aggregate(
        jnp.asarray(token_losses), jnp.asarray(mask), agg="seq-mean-token-sum-norm"
    )
    assert tuple(map(float, num_den)) == pytest.approx((5.0, 2.0))


def test_gspo_by_hand():
    # log r = [0.1, -0.3] -> s = exp(-0.1) = 0.904837 for both tokens; clip [0.9997, 1.0004].
    # A = +1: max(-0.904837, -0.9997) = -0.904837, unclipped; grad per token -A s / (n = 2).
    # A = -1: max(0.904837, 0.9997) = 0.9997, clipped low: grad 0, clip_frac_low = 1.
    cfg = losses.LossConfig(name="gspo")
    logps, kw = np.array([[0.1, -0.3]]), dict(old_logps=jnp.zeros((1, 2)), mask=jnp.ones((1, 2)))
    s = math.exp(-0.1)
    loss, grad, out = run(cfg, logps, advantages=jnp.ones(1), **kw)
    assert loss == pytest.approx(-s, rel=1e-6)
    np.testing.assert_allclose(grad, [[-s / 2, -s / 2]], **TOL)
    assert float(out.metrics["clip_frac"]) == 0.0
    loss, grad, out = run(cfg, logps, advantages=-jnp.ones(1), **kw)
    assert loss == pytest.approx(1 - 3e-4, rel=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0]], **TOL)
    assert float(out.metrics["clip_frac_low"]) == 1.0


def test_cispo_by_hand():
    # r = [1.5, 0.5], logp = [-1, -2], A = +1; weights sg[clip(r, 0, 1.28)] = [1.28, 0.5]
    # l = -w A logp = [1.28, 1.0] -> token-mean 1.14; grad -w A / 2 = [-0.64, -0.25].
    cfg = losses.LossConfig(name="cispo")
    logps = np.array([[-1.0, -2.0]])
    old = logps - np.log([[1.5, 0.5]])
    loss, grad, out = run(cfg, logps, old_logps=old, advantages=jnp.ones(1), mask=jnp.ones((1, 2)))
    assert loss == pytest.approx(1.14, rel=1e-5)
    np.testing.assert_allclose(grad, [[-0.64, -0.25]], **TOL)
    assert float(out.metrics["clip_frac_high"]) == 0.5 and float(out.metrics["clip_frac_low"]) == 0


ESPO_HAND = dict(
    # alpha = 0.1 log|V| makes eps_g = 0.1 * mean group entropy.
    cfg=dict(name="espo", vocab_size=100, alpha=0.1 * math.log(100)),
    logps=np.array([[math.log(1.5), 0.02, 0.0, 0.01, 0.01]]),
    entropies=np.array([[2.0, 0.1, 0.5, 0.2, 0.3]]),
)


@pytest.mark.slow
def test_espo_gspo_token_by_hand():
    # Top 20% of 5 tokens = 1 token: group 0 = {entropy 2.0}, group 1 = the other 4.
    # eps_0 = 0.1 * 2.0 = 0.2; eps_1 = 0.1 * mean(0.1, 0.5, 0.2, 0.3) = 0.0275.
    # s_0 = 1.5 -> clipped at 1.2 -> -1.2 (grad 0).
    # s_1 = exp(mean(0.02, 0, 0.01, 0.01)) = exp(0.01) = 1.010050 < 1.0275 -> -1.010050.
    # loss = mean over groups = -(1.2 + 1.010050) / 2 = -1.105025. (One GSPO group over all five
    # tokens would give s = exp(0.089093) = 1.0932 instead.)
    # grad of group-1 tokens: -A s_1 / (|g| = 4) / (2 groups) = -1.010050 / 8.
    cfg = losses.LossConfig(**ESPO_HAND["cfg"])
    kw = dict(old_logps=jnp.zeros((1, 5)), advantages=jnp.ones(1), mask=jnp.ones((1, 5)))
    loss, grad, out = run(cfg, ESPO_HAND["logps"], entropies=ESPO_HAND["entropies"], **kw)
    s1 = math.exp(0.01)
    assert loss == pytest.approx(-(1.2 + s1) / 2, rel=1e-6)
    np.testing.assert_allclose(grad, [[0.0] + [-s1 / 8] * 4], **TOL)
    m = {k: float(v) for k, v in out.metrics.items()}
    assert (m["clip_frac_group0"], m["clip_frac_group1"]) == (1.0, 0.0)
    assert m["espo_eps_group0"] == pytest.approx(0.2, rel=1e-6)
    assert m["espo_eps_group1"] == pytest.approx(0.0275, rel=1e-6)
    assert m["espo_eps_mean"] == pytest.approx((0.2 + 4 * 0.0275) / 5, rel=1e-6)
    assert (m["num_tokens_group0"], m["num_tokens_group1"]) == (1.0, 4.0)


def test_espo_literal_by_hand():
    # Literal Eq. 9: value s_g * r_t. Group 0: 1.5 * 1.5 = 2.25 -> clipped at 1.2 -> -1.2.
    # Group 1: 1.010050 * exp([0.02, 0, 0.01, 0.01]) = [1.030353, 1.010050, 1.020201, 1.020201],
    # clipped at 1.0275 -> [1.0275, 1.010050, 1.020201, 1.020201], mean 1.019488.
    # loss = -(1.2 + 1.019488) / 2 = -1.109744. Gradient: value * grad logp for unclipped tokens,
    # -[0, 0, 1.010050, 1.020201, 1.020201] / (4 tokens * 2 groups).
    cfg = losses.LossConfig(**ESPO_HAND["cfg"], espo_ratio="literal")
    kw = dict(old_logps=jnp.zeros((1, 5)), advantages=jnp.ones(1), mask=jnp.ones((1, 5)))
    loss, grad, _ = run(cfg, ESPO_HAND["logps"], entropies=ESPO_HAND["entropies"], **kw)
    group1 = math.exp(0.01) * np.exp([0.02, 0.0, 0.01, 0.01])
    assert loss == pytest.approx(-(1.2 + np.minimum(group1, 1.0275).mean()) / 2, rel=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0, *(-group1[1:] / 8)]], **TOL)


# ---- KL penalty -------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    # d = logp - ref = [0.5, -0.5]:
    # k1 = d = [0.5, -0.5] (mean 0); k2 = d^2 / 2 = 0.125 each;
    # k3 = exp(-d) + d - 1 = [0.606531 + 0.5 - 1, 1.648721 - 0.5 - 1] = [0.106531, 0.148721].
    # With r = 1 and A = 0 the policy term is 0, so loss = kl_coef * mean(k).
    logps = np.array([[-1.0, -1.5]])
    ref = np.array([[-1.5, -1.0]])
    expected = {"k1": 0.0, "k2": 0.125, "k3": (0.1065307 + 0.1487213) / 2}
    kw = dict(old_logps=logps, advantages=np.zeros(1), mask=np.ones((1, 2)), ref_logps=ref)
    for estimator, kl in expected.items():
        cfg = losses.LossConfig(name="grpo", kl_coef=0.1, kl_estimator=estimator)
        loss, _, out = run(cfg, logps, **kw)
        assert loss == pytest.approx(0.1 * kl, abs=1e-7), estimator
        assert float(out.metrics["kl"]) == pytest.approx(kl, abs=1e-6), estimator
    # k3 guards (verl): ref - logp = 30 is clamped to 20, and exp(20) - 21 to 10.
    k3 = losses.kl_penalty(
        logps=jnp.zeros((1, 1)), ref_logps=jnp.full((1, 1), 30.0), estimator="k3"
    )
    assert float(k3[0, 0]) == 10.0


def test_k3_far_from_the_reference_saturates_with_a_zero_gradient():
    # log(pi_ref / pi) = 100: exp would overflow; verl's guards clamp it to 20 before exp and k3
    # to 10, so the value is 10 and the gradient 0 (without the first clamp: inf * 0 = NaN).
    k3 = lambda lp: losses.kl_penalty(
        logps=lp, ref_logps=jnp.asarray([[0.0, 0.0]]), estimator="k3"
    ).sum()
    logps = jnp.asarray([[-100.0, -0.5]])
    value, grad = jax.value_and_grad(k3)(logps)
    # Second token: exp(0.5) - 0.5 - 1 = 0.148721; gradient d/dlogp = 1 - exp(-d) = 1 - e^0.5.
    np.testing.assert_allclose(value, 10.0 + 0.148721, rtol=1e-5)
    np.testing.assert_allclose(grad, [[0.0, 1.0 - math.exp(0.5)]], rtol=1e-5)


# ---- entropy groups ---------------------------------------------------------------------------


@pytest.mark.slow
def test_entropy_groups():
    groups = functools.partial(losses.entropy_groups, top_frac=0.2)
    # Row 0: 5 valid tokens (the padded 100 must not move any threshold); row 1: 3 valid tokens.
    e = jnp.array([[3.0, 9.0, 0.0, 5.0, 8.0, 100.0], [1.0, 3.0, 2.0, 7.0, 7.0, 7.0]])
    mask = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])

    def valid(g):
        return np.where(mask, np.asarray(g), -1)

    # 2 groups: ceil(0.2 * 5) = 1 and ceil(0.2 * 3) = 1 token in the top group.
    np.testing.assert_array_equal(
        valid(groups(e, mask, num_groups=2)), [[1, 0, 1, 1, 1, -1], [1, 0, 1, -1, -1, -1]]
    )
    # 3 groups, q = [0.2, 0.6]: row 0 counts [1, 3] -> thresholds 9 and 5 (1st and 3rd largest);
    # row 1 counts [1, ceil(1.8) = 2] -> thresholds 3 and 2.
    np.testing.assert_array_equal(
        valid(groups(e, mask, num_groups=3)), [[2, 0, 2, 1, 1, -1], [2, 0, 1, -1, -1, -1]]
    )
    # A float mask selects where it is nonzero; its values are not counts.
    weights = mask * jnp.array([[0.5, 2.0, 3.0, 0.25, 7.0, 1.0], [4.0, 0.5, 9.0, 1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(groups(e, weights, num_groups=3), groups(e, mask, num_groups=3))
    # All-equal entropies: every token ties with every threshold and joins group 0.
    np.testing.assert_array_equal(groups(jnp.ones((2, 6)), jnp.ones((2, 6)), num_groups=3), 0)
    # Batch scope: one threshold over 12 tokens, ceil(2.4) = 3 -> {11, 10, 9}, all in row 1;
    # sequence scope: ceil(1.2) = 2 per row.
    e = jnp.arange(12.0).reshape(2, 6)
    batch_scope = groups(e, jnp.ones((2, 6)), num_groups=2, scope="batch")
    np.testing.assert_array_equal(batch_scope, [[1] * 6, [1, 1, 1, 0, 0, 0]])
    seq_scope = groups(e, jnp.ones((2, 6)), num_groups=2)
    np.testing.assert_array_equal(seq_scope, [[1, 1, 1, 1, 0, 0]] * 2)


def test_entropy_groups_default_scope_is_per_sequence_and_ids_are_int32():
    entropies = jnp.asarray([[3.0, 2.0, 1.0, 0.5], [9.0, 8.0, 7.0, 6.0]])
    mask = jnp.ones((2, 4), bool)
    default = losses.entropy_groups(entropies, mask, top_frac=0.25, num_groups=2)
    per_sequence = losses.entropy_groups(
        entropies, mask, top_frac=0.25, num_groups=2, scope="sequence"
    )
    # Per sequence: each row's highest entropy is group 0 (per batch: only the 9.0 and 8.0).
    np.testing.assert_array_equal(default, [[0, 1, 1, 1], [0, 1, 1, 1]])
    np.testing.assert_array_equal(default, per_sequence)
    for k in (1, 2, 3):
        groups = losses.entropy_groups(entropies, mask, top_frac=0.25, num_groups=k)
        assert groups.dtype == jnp.int32, (k, groups.dtype)
    want = "scope='global' is invalid: one of ('sequence', 'batch')"
    with pytest.raises(ValueError, match=re.escape(want) + "$"):
        losses.entropy_groups(entropies, mask, top_frac=0.25, num_groups=2, scope="global")


# ---- NumPy reference of verl ------------------------------------------------------------------


def verl_agg_weights(mask, mode, scale_factor=None):
    """w with agg_loss(L) = sum(w * L): current verl `agg_loss`, dp_size=1, no global sizes."""
    counts = mask.sum(-1, keepdims=True)
    num_seqs = (counts > 0).sum()
    if mode == "token-mean":
        return mask / mask.sum()
    if mode == "seq-mean-token-mean":
        return mask / (counts + 1e-8) / num_seqs
    if mode == "seq-mean-token-sum":
        return mask / num_seqs
    return mask / num_seqs / (scale_factor or mask.shape[-1])  # seq-mean-token-sum-norm


def verl_max(x, dx, y, dy):
    return np.maximum(x, y), np.where(x > y, dx, np.where(y > x, dy, 0.5 * (dx + dy)))


def verl_vanilla(logps, old_logps, advantages, mask, *, lo, hi, c=None, mode="token-mean", **_):
    a = np.broadcast_to(advantages[:, None], logps.shape)
    nak = logps - old_logps
    ratio = np.exp(np.clip(nak, -20, 20))
    d_ratio = ratio * (np.abs(nak) < 20)
    pg1, d1 = -a * ratio, -a * d_ratio
    inside = (ratio > 1 - lo) & (ratio < 1 + hi)
    pg2, d2 = -a * np.clip(ratio, 1 - lo, 1 + hi), -a * d_ratio * inside
    clip1, d_clip1 = verl_max(pg1, d1, pg2, d2)
    loss, d_loss = clip1, d_clip1
    if c is not None:
        pg3 = -a * c
        clip2 = np.minimum(pg3, clip1)
        d_clip2 = np.where(pg3 < clip1, 0.0, np.where(pg3 > clip1, d_clip1, 0.5 * d_clip1))
        loss, d_loss = np.where(a < 0, clip2, clip1), np.where(a < 0, d_clip2, d_clip1)
    w = verl_agg_weights(mask, mode)
    return (w * loss).sum(), w * d_loss


def verl_gspo(logps, old_logps, advantages, mask, *, lo, hi, **_):
    a = np.broadcast_to(advantages[:, None], logps.shape)
    nak = logps - old_logps
    seq = (nak * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
    log_s = np.broadcast_to(seq[:, None], logps.shape)  # value of sg[log s_i] + logp - sg[logp]
    s = np.exp(np.minimum(log_s, 10.0))
    ds = s * (log_s < 10.0)  # d s_{i,t} / d logp_t through the logp - sg[logp] term
    pg1, d1 = -a * s, -a * ds
    pg2, d2 = -a * np.clip(s, 1 - lo, 1 + hi), -a * ds * ((s > 1 - lo) & (s < 1 + hi))
    loss, d_loss = verl_max(pg1, d1, pg2, d2)
    w = verl_agg_weights(mask, "seq-mean-token-mean")
    return (w * loss).sum(), w * d_loss


@pytest.mark.parametrize("agg", losses.AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_grpo_matches_verl(agg, dual_clip):
    batch = random_batch(1, scale=0.5)
    cfg = losses.LossConfig(name="grpo", clip_high=0.28, dual_clip=dual_clip, agg=agg)
    loss, grad, _ = run(cfg, **batch)
    ref_loss, ref_grad = verl_vanilla(**batch, lo=0.2, hi=0.28, c=dual_clip, mode=agg)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, **TOL)


def test_grpo_gradient_matches_finite_differences():
    # The GRPO loss is an ordinary function of logps, so the central difference of the float64
    # reference checks the analytic gradient independently of either implementation.
    batch = random_batch(2, scale=0.5)
    cfg = losses.LossConfig(name="grpo", dual_clip=2.0, agg="seq-mean-token-mean")
    _, grad, _ = run(cfg, **batch)
    value = functools.partial(verl_vanilla, lo=0.2, hi=0.2, c=2.0, mode="seq-mean-token-mean")
    fd, h = np.zeros_like(grad), 1e-6
    for idx in np.ndindex(grad.shape):
        step = np.zeros_like(batch["logps"])
        step[idx] = h
        up = value(**{**batch, "logps": batch["logps"] + step})[0]
        down = value(**{**batch, "logps": batch["logps"] - step})[0]
        fd[idx] = (up - down) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip, scale", [((3e-4, 4e-4), 2e-3), ((0.1, 0.15), 0.3)])
def test_gspo_matches_verl(clip, scale):
    batch = random_batch(5, scale=scale)  # a seed where some sequences clip and some do not
    cfg = losses.LossConfig(name="gspo", clip_low=clip[0], clip_high=clip[1])
    loss, grad, out = run(cfg, **batch)
    ref_loss, ref_grad = verl_gspo(**batch, lo=clip[0], hi=clip[1])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, **TOL)
    assert 0.0 < float(out.metrics["clip_frac"]) < 1.0  # both branches are exercised
