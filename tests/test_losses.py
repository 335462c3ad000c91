"""Tests for espo.losses: hand-derived values, invariances and a NumPy re-implementation of verl.

The NumPy reference (`verl_*` below) is written from verl's `compute_policy_loss_vanilla`,
`compute_policy_loss_gspo` and `agg_loss` (current verl, empty sequences excluded), in float64,
with the gradient torch autograd would give (max/min split ties evenly, clamp passes 0 outside).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import losses
from espo.testing import raises_invalid

TOL = dict(rtol=1e-5, atol=1e-6)
B_PAD, T_PAD = 4, 6  # every compute_loss call in these tests sees this shape


def run(cfg, logps, **kw):
    """(loss, d loss / d logps, LossOutput) of compute_loss, eagerly, on inputs padded to [4, 6].

    Eager JAX compiles every primitive once per shape (about 2 s for a loss), so all tests share
    one shape: inputs are zero-padded with mask 0, and padding must change nothing, which is
    checked here: the padded positions get exactly zero gradient.
    """
    b, t = np.shape(logps)

    def pad(x):
        x = np.asarray(x, np.float64)
        widths = [(0, B_PAD - b)] + [(0, T_PAD - t)] * (x.ndim - 1)
        return jnp.asarray(np.pad(x, widths), jnp.float32)

    kw = {k: pad(v) for k, v in kw.items()}

    def f(lp):
        out = losses.compute_loss(cfg, logps=lp, **kw)
        return out.loss, out

    (loss, out), grad = jax.value_and_grad(f, has_aux=True)(pad(logps))
    grad = np.asarray(grad)
    assert not grad[b:].any() and not grad[:, t:].any()
    return float(loss), grad[:b, :t], out


def random_batch(seed, *, b=4, t=6, scale=0.3, empty_row=True):
    """Random [B, T] inputs with ragged masks (and one all-padding row), in float64 NumPy."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (b, t))
    logps = old + rng.normal(0.0, scale, (b, t))
    lengths = rng.integers(1, t + 1, b)
    if empty_row:
        lengths[1] = 0
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(0.0, 1.0, b)
    entropies = rng.uniform(0.0, 3.0, (b, t))
    return dict(logps=logps, old_logps=old, advantages=adv, mask=mask, entropies=entropies)


# ---- NumPy reference of verl --------------------------------------------------------------------
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


# ---- hand-derived values ----------------------------------------------------------------------
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


# ---- the NumPy verl reference -------------------------------------------------------------------
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


# ---- invariances ------------------------------------------------------------------------------
MICRO_BATCH_CONFIGS = [
    *(dict(name="grpo", agg=agg, dual_clip=3.0) for agg in losses.AGG_MODES),
    dict(name="grpo", agg="seq-mean-token-sum-norm", norm_length=11),
    dict(name="grpo", kl_coef=0.05, kl_estimator="k3"),
    dict(name="gspo", clip_low=0.1, clip_high=0.1),
    dict(name="gspo", agg="token-mean"),
    dict(name="espo", vocab_size=1000, alpha=1.0, num_groups=3, kl_coef=0.05),
    dict(name="espo", vocab_size=1000, alpha=1.0, espo_ratio="literal"),
    dict(name="cispo"),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", MICRO_BATCH_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_micro_batches_accumulate_exactly(cfg):
    # Wrong answer: the mean of the two halves' losses, which weights halves equally.
    cfg = losses.LossConfig(**cfg)
    batch = random_batch(4, scale=0.5)
    batch["ref_logps"] = batch["old_logps"] + 0.1
    full = losses.compute_loss(cfg, **batch)
    # Micro-batches of rows [0, 2) and [2, 4), zero-padded (mask 0) to the full shape as a real
    # accumulation loop with fixed shapes would feed them.
    halves = [
        losses.compute_loss(
            cfg, **{k: v * keep.reshape((4,) + (1,) * (v.ndim - 1)) for k, v in batch.items()}
        )
        for keep in (np.array([1, 1, 0, 0]), np.array([0, 0, 1, 1]))
    ]
    num = sum(float(h.numerator) for h in halves)
    den = sum(float(h.denominator) for h in halves)
    assert num / den == pytest.approx(float(full.loss), rel=1e-5)
    # Token-weighted metrics combine exactly with the num_tokens weights.
    weights = [float(h.metrics["num_tokens"]) for h in halves]
    clip_frac = sum(
        w * float(h.metrics["clip_frac"]) for w, h in zip(weights, halves, strict=True)
    ) / sum(weights)
    assert clip_frac == pytest.approx(float(full.metrics["clip_frac"]), abs=1e-6)


def test_gspo_equals_grpo_when_token_ratios_are_constant_per_sequence():
    # log r_{i,t} = c_i for every token: GRPO's r_t = exp(c_i) = GSPO's s_i, so with the same clip
    # range and seq-mean-token-mean the values and gradients agree.
    batch = random_batch(5)
    c = np.array([0.3, -0.1, 0.05, -0.4])[:, None]
    batch["logps"] = batch["old_logps"] + c
    kw = dict(clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean")
    grpo = run(losses.LossConfig(name="grpo", **kw), **batch)
    gspo = run(losses.LossConfig(name="gspo", **kw), **batch)
    assert grpo[0] == pytest.approx(gspo[0], rel=1e-6)
    np.testing.assert_allclose(grpo[1], gspo[1], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("num_groups", [1, 2])
def test_espo_with_one_group_is_gspo_with_symmetric_eps(num_groups):
    # num_groups=1 is one group per sequence; num_groups=2 with all-equal entropies is too (ties
    # join the top group). eps = alpha * 1.5 / log(1000) for every sequence.
    batch = random_batch(9, scale=0.01)  # a seed where some sequences clip and some do not
    batch["entropies"] = np.full_like(batch["logps"], 1.5)
    eps = 0.02 * 1.5 / math.log(1000)
    espo_cfg = losses.LossConfig(name="espo", vocab_size=1000, num_groups=num_groups)
    espo = run(espo_cfg, **batch)
    gspo = run(losses.LossConfig(name="gspo", clip_low=eps, clip_high=eps), **batch)
    assert espo[0] == pytest.approx(gspo[0], rel=1e-6)
    np.testing.assert_allclose(espo[1], gspo[1], **TOL)
    assert 0.0 < float(espo[2].metrics["clip_frac"]) < 1.0


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


LOSS_CONFIGS = [
    dict(name="grpo", dual_clip=3.0),
    dict(name="gspo"),
    dict(name="espo", vocab_size=1000),
    dict(name="espo", vocab_size=1000, espo_ratio="literal"),
    dict(name="cispo", kl_coef=0.1),
]


@pytest.mark.parametrize("cfg", LOSS_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_finite_at_extreme_ratios(cfg):
    # logp - old = +-50 is far past every clamp (20 for token ratios, 10 for group ratios).
    batch = random_batch(7, empty_row=False)
    batch["logps"] = batch["old_logps"] + 50.0 * np.array([[1, -1, 1, -1, 1, -1]])
    batch["logps"][2] = batch["old_logps"][2] - 50.0  # a sequence whose group ratio underflows
    batch["ref_logps"] = batch["old_logps"]
    loss, grad, out = run(losses.LossConfig(**cfg), **batch)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


@pytest.mark.slow
def test_jit_matches_eager():
    cfg = losses.LossConfig(name="espo", vocab_size=1000, num_groups=3)
    batch = {k: jnp.asarray(v, jnp.float32) for k, v in random_batch(8).items()}
    eager = losses.compute_loss(cfg, **batch)
    jitted = jax.jit(functools.partial(losses.compute_loss, cfg))(**batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), eager, jitted)
    assert jitted.loss.dtype == jnp.float32 and jitted.loss.shape == ()


# ---- errors -----------------------------------------------------------------------------------
def test_missing_inputs_raise_clear_errors():
    batch = random_batch(9)
    del batch["entropies"]
    with pytest.raises(ValueError, match="entropies"):
        losses.compute_loss(losses.LossConfig(name="espo", vocab_size=10), **batch)
    with pytest.raises(ValueError, match="ref_logps"):
        losses.compute_loss(losses.LossConfig(name="grpo", kl_coef=0.1), **batch)
    with pytest.raises(ValueError, match="advantages"):
        losses.compute_loss(losses.LossConfig(name="grpo"), **{**batch, "advantages": np.ones(3)})


_ESPO = dict(name="espo", vocab_size=10)
_FLOAT0 = "None or a float >= 0"
BAD_CONFIGS = [  # (LossConfig keywords, the field named): each value just past what is valid
    (dict(name="ppo"), "name"),
    (_ESPO | dict(agg="token-mean"), "agg"),
    (_ESPO | dict(clip_low=0.2), "clip_low"),
    (_ESPO | dict(clip_high=0.0), "clip_high"),
    (dict(name="grpo", agg="mean"), "agg"),
    (dict(name="grpo", clip_low=-0.1), "clip_low"),
    (dict(name="grpo", clip_high="0.2"), "clip_high"),
    (dict(name="grpo", clip_high=True), "clip_high"),
    (dict(name="gspo", dual_clip=3.0), "dual_clip"),
    (dict(name="grpo", dual_clip=True), "dual_clip"),
    (dict(name="grpo", dual_clip=1.0), "dual_clip"),
    (dict(name="grpo", norm_length=0), "norm_length"),
    (dict(name="grpo", norm_length=2.0), "norm_length"),
    (_ESPO | dict(top_frac=0.0), "top_frac"),
    (_ESPO | dict(top_frac=1.01), "top_frac"),
    (_ESPO | dict(top_frac=True), "top_frac"),
    (_ESPO | dict(num_groups=0), "num_groups"),
    (_ESPO | dict(num_groups=2.0), "num_groups"),
    (_ESPO | dict(quantile_scope="global"), "quantile_scope"),
    (_ESPO | dict(alpha=0.0), "alpha"),
    (_ESPO | dict(alpha=True), "alpha"),
    (dict(name="espo"), "vocab_size"),
    (dict(name="grpo", vocab_size=1), "vocab_size"),
    (_ESPO | dict(espo_ratio="token"), "espo_ratio"),
    (dict(name="grpo", kl_coef=-1e-3), "kl_coef"),
    (dict(name="grpo", kl_coef=None), "kl_coef"),
    (dict(name="grpo", kl_estimator="k4"), "kl_estimator"),
    (dict(name="grpo", overlong_filter=1), "overlong_filter"),
    (dict(name="grpo", rollout_is="seq"), "rollout_is"),
    (dict(name="grpo", rollout_is_cap=0.99), "rollout_is_cap"),
    (dict(name="grpo", rollout_is_cap=0.5), "rollout_is_cap"),
    (dict(name="grpo", rollout_is_cap=True), "rollout_is_cap"),
    (dict(name="grpo", rollout_rs="tis"), "rollout_rs"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_high=-0.5), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_low=-1.0), "rollout_rs_low"),
    (dict(name="grpo", rollout_rs_low=0.5), "rollout_rs_low"),
    (dict(name="grpo", rollout_rs_high=3.0), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_low=2.0), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="icepop", rollout_rs_low=6.0), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_low=1.0, rollout_rs_high=1.0),
     "rollout_rs_high"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, field", BAD_CONFIGS, ids=lambda x: str(x)[:40])
def test_an_invalid_config_is_refused_naming_the_field(kwargs, field):
    with raises_invalid(field, where="LossConfig"):
        losses.LossConfig(**kwargs)


def test_configs_at_the_edges_of_what_is_valid_are_accepted():
    edges = [
        dict(name="grpo", clip_low=0.0, clip_high=0, dual_clip=1.001, norm_length=1, kl_coef=0),
        _ESPO | dict(vocab_size=2, top_frac=1.0, num_groups=1, alpha=1e-9),
        dict(name="gspo", rollout_is="token", rollout_is_cap=1.0, rollout_rs="token",
             rollout_rs_low=0.0, rollout_rs_high=1e-9),
    ]  # fmt: skip
    for kwargs in edges:
        cfg = losses.LossConfig(**kwargs)
        assert all(getattr(cfg, k) == v for k, v in kwargs.items())


def test_per_loss_defaults():
    grpo, gspo = losses.LossConfig(name="grpo"), losses.LossConfig(name="gspo")
    assert (grpo.eps_low, grpo.eps_high, grpo.agg_mode) == (0.2, 0.2, "token-mean")
    assert (gspo.eps_low, gspo.eps_high, gspo.agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert losses.LossConfig(name="gspo", clip_high=1e-3).eps_high == 1e-3
    assert losses.LossConfig(name="cispo").eps_high == 0.28
