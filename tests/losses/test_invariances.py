"""Invariances of espo.losses, as examples and as hypothesis properties.

- micro-batching: for any split of the rows into micro-batches (the other rows masked, their
  contents left in place, or zero-padded), sum(numerator) / sum(denominator), the accumulated
  gradient and the token-weighted metrics equal the full batch's (module docstring of
  espo.losses);
- permuting the rows leaves the loss unchanged and permutes the gradient;
- GSPO with a constant log ratio per sequence equals GRPO (s_i = r_t for every token);
- ESPO with one entropy group equals GSPO with symmetric eps = alpha mean(e) / log|V|;
- every loss stays finite far past the ratio clamps, and jit equals eager.
The properties run with asymmetric clip ranges, a KL term and failed (all-padding) rows.
"""

import functools
import math
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import losses, testing
from espo.testing import num_den_grad

# tests/ is not a package (pytest runs with --import-mode=importlib): the helpers load by path.
_helpers = testing.load_script(
    pathlib.Path(__file__).with_name("_helpers.py"), name="espo_tests_losses_helpers"
)
TOL, run, random_batch = _helpers.TOL, _helpers.run, _helpers.random_batch


# ---- examples ---------------------------------------------------------------------------------


MICRO_BATCH_CONFIGS = [
    *(dict(name="grpo", agg=agg, dual_clip=3.0) for agg in losses.AGG_MODES),
    dict(name="grpo", agg="seq-mean-token-sum-norm", norm_length=11),
    dict(name="grpo", kl_coef=0.05, kl_estimator="k3"),
    dict(name="gspo", clip_low=0.1, clip_high=0.1),
    dict(name="gspo", agg="token-mean"),
    dict(name="espo", vocab_size=1000, alpha=1.0, num_entropy_groups=3, kl_coef=0.05),
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
@pytest.mark.parametrize("num_entropy_groups", [1, 2])
def test_espo_with_one_group_is_gspo_with_symmetric_eps(num_entropy_groups):
    # One entropy group is one group per sequence; two with all-equal entropies is too (ties
    # join the top group). eps = alpha * 1.5 / log(1000) for every sequence.
    batch = random_batch(9, scale=0.01)  # a seed where some sequences clip and some do not
    batch["entropies"] = np.full_like(batch["logps"], 1.5)
    eps = 0.02 * 1.5 / math.log(1000)
    espo_cfg = losses.LossConfig(
        name="espo", vocab_size=1000, num_entropy_groups=num_entropy_groups
    )
    espo = run(espo_cfg, **batch)
    gspo = run(losses.LossConfig(name="gspo", clip_low=eps, clip_high=eps), **batch)
    assert espo[0] == pytest.approx(gspo[0], rel=1e-6)
    np.testing.assert_allclose(espo[1], gspo[1], **TOL)
    assert 0.0 < float(espo[2].metrics["clip_frac"]) < 1.0


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
    cfg = losses.LossConfig(name="espo", vocab_size=1000, num_entropy_groups=3)
    batch = {k: jnp.asarray(v, jnp.float32) for k, v in random_batch(8).items()}
    eager = losses.compute_loss(cfg, **batch)
    jitted = jax.jit(functools.partial(losses.compute_loss, cfg))(**batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), eager, jitted)
    assert jitted.loss.dtype == jnp.float32 and jitted.loss.shape == ()


# ---- hypothesis properties (jitted losses, one compile per config) ----------------------------


B, T = 4, 6


PROPERTY_CONFIGS = [
    *(
        dict(name="grpo", agg=agg, clip_low=0.1, clip_high=0.25, dual_clip=2.0, kl_coef=0.05)
        for agg in losses.AGG_MODES
    ),
    dict(name="grpo", agg="seq-mean-token-sum-norm", norm_length=11, kl_estimator="k2", kl_coef=1),
    dict(name="gspo", clip_low=0.02, clip_high=0.05, kl_coef=0.05),
    dict(name="gspo", agg="seq-mean-token-sum", clip_low=0.02, clip_high=0.05),
    dict(name="espo", vocab_size=40, alpha=0.3, top_frac=0.3, kl_coef=0.05),
    dict(name="espo", vocab_size=40, alpha=0.3, num_entropy_groups=3, espo_ratio="literal"),
    dict(name="cispo", clip_low=0.2, clip_high=0.1, kl_coef=0.05),
    dict(name="cispo", agg="seq-mean-token-mean", clip_low=0.5, clip_high=0.05),
]


def make_batch(seed, *, scale=0.3):
    """float32 inputs with ragged lengths (0 allowed: a failed row) and token advantages."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (B, T))
    lengths = rng.integers(0, T + 1, B)
    batch = dict(
        logps=old + rng.normal(0.0, scale, (B, T)),
        old_logps=old,
        advantages=rng.normal(0.0, 1.0, (B, T)),
        mask=np.arange(T)[None, :] < lengths[:, None],
        entropies=rng.uniform(0.0, 3.0, (B, T)),
        ref_logps=old + rng.normal(0.0, 0.2, (B, T)),
    )
    return {
        k: jnp.asarray(v) if k == "mask" else jnp.asarray(v, jnp.float32) for k, v in batch.items()
    }


def loss_and_grad(cfg, batch):
    n, d, g = num_den_grad(cfg)(batch)
    d = np.where(float(d) > 0, float(d), 1.0)
    return float(n) / d, np.asarray(g) / d


configs = st.sampled_from(PROPERTY_CONFIGS).map(lambda c: losses.LossConfig(**c))
seeds = st.integers(0, 2**16)


@pytest.mark.slow
@hypothesis.settings(max_examples=30)
@hypothesis.given(cfg=configs, seed=seeds, split=st.lists(st.booleans(), min_size=B, max_size=B))
def test_micro_batches_accumulate_exactly_for_any_split(cfg, seed, split):
    # Wrong answers: the mean of the micro-batch losses; a denominator that counts masked rows.
    batch = make_batch(seed)
    full_n, full_d, full_g = num_den_grad(cfg)(batch)
    split = np.array(split)
    parts = [
        num_den_grad(cfg)(dict(batch, mask=batch["mask"] & keep[:, None]))
        for keep in (split, ~split)
    ]
    num = sum(float(p[0]) for p in parts)
    den = sum(float(p[1]) for p in parts)
    assert den == float(full_d)
    np.testing.assert_allclose(num, float(full_n), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum(np.asarray(p[2]) for p in parts), full_g, rtol=1e-5, atol=1e-7)


@hypothesis.settings(max_examples=30)
@hypothesis.given(cfg=configs, seed=seeds, perm=st.permutations(range(B)))
def test_permuting_rows_permutes_gradient_and_keeps_loss(cfg, seed, perm):
    batch = make_batch(seed)
    perm = np.array(perm)
    loss, grad = loss_and_grad(cfg, batch)
    loss_p, grad_p = loss_and_grad(cfg, {k: v[perm] for k, v in batch.items()})
    np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_p, grad[perm], rtol=1e-5, atol=1e-7)


@hypothesis.settings(max_examples=25)
@hypothesis.given(
    seed=seeds,
    agg=st.sampled_from(losses.AGG_MODES),
    log_r=st.lists(st.floats(-0.5, 0.5), min_size=B, max_size=B),
)
@pytest.mark.slow
def test_gspo_with_constant_ratio_per_sequence_is_grpo(seed, agg, log_r):
    # log r_{i,t} = c_i for every token: GRPO's token ratio r_t = exp(c_i) = GSPO's s_i, so the
    # same clip range and aggregation give the same value and gradient (per-row advantages).
    batch = make_batch(seed)
    batch["logps"] = batch["old_logps"] + jnp.asarray(log_r, jnp.float32)[:, None]
    batch["advantages"] = batch["advantages"][:, 0]
    kw = dict(clip_low=0.15, clip_high=0.3, agg=agg, kl_coef=0.05)
    grpo = loss_and_grad(losses.LossConfig(name="grpo", **kw), batch)
    gspo = loss_and_grad(losses.LossConfig(name="gspo", **kw), batch)
    np.testing.assert_allclose(gspo[0], grpo[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gspo[1], grpo[1], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@hypothesis.settings(max_examples=25)
@hypothesis.given(seed=seeds, entropy=st.floats(0.1, 3.0))
def test_espo_with_one_group_is_gspo_with_symmetric_eps_for_any_entropy(seed, entropy):
    # One entropy group puts every token of a sequence in one group, so s_g = s_i; with all-equal
    # entropies e, eps = alpha e / log|V| for every sequence. A small log-ratio scale makes some
    # sequences clip and some not.
    batch = make_batch(seed, scale=0.02)
    batch["entropies"] = jnp.full((B, T), entropy, jnp.float32)
    batch["advantages"] = batch["advantages"][:, 0]
    espo = losses.LossConfig(
        name="espo", vocab_size=40, alpha=0.05, num_entropy_groups=1, kl_coef=0.05
    )
    eps = 0.05 * float(np.float32(entropy)) / math.log(40)
    gspo = losses.LossConfig(name="gspo", clip_low=eps, clip_high=eps, kl_coef=0.05)
    want = loss_and_grad(gspo, batch)
    got = loss_and_grad(espo, batch)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)
