"""Tests for espo.correction and its use by every loss: sampler/trainer TIS, rejection, metrics.

Hand-computed weights on one 2x4 example for every mode (jitted and not, chex variants), then
invariances as hypothesis properties over every registered loss and aggregation:
- sampler == pi_old: w == 1 exactly, nothing rejected, the loss and gradient unchanged;
- a rejected token is exactly a masked token: numerator, denominator and gradient equal those
  of the same batch with that token's mask 0, and whatever the token holds reaches nothing;
- micro-batches accumulate exactly with rejection (sum num / sum den == the full batch);
- the weight multiplies the policy-gradient term (a constant w scales loss and gradient by w)
  and never the KL penalty; it carries no gradient.
The wrong answers a plausible bug gives are noted beside the right ones.
"""

import dataclasses
import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from espo import correction, losses
from espo.testing import num_den_grad

TOL = dict(rtol=1e-6, atol=1e-6)


# ---- hand-computed weights ----------------------------------------------------------------------
# rho = pi_old / pi_sampler per token; row 1 has 3 valid tokens and a padded 4th that holds
# old = +inf, sampler = NaN (it must reach nothing).
RHO = np.array([[3.0, 1.0, 0.25, 1.5], [1.2, 0.8, 12.0, 1.0]])
MASK = np.array([[True, True, True, True], [True, True, True, False]])
SAMPLER = np.where(MASK, -1.0, np.nan)
OLD = np.where(MASK, -1.0 + np.log(RHO), np.inf)
# Geometric means over the valid tokens: row 0 (3 * 1 * 0.25 * 1.5)^(1/4) = 1.125^(1/4);
# row 1 (1.2 * 0.8 * 12)^(1/3) = 11.52^(1/3) = 2.258662. Wrong (mean over the 4 positions, the
# padding counted as log rho = 0): 11.52^(1/4) = 1.842303, below the cap of 2.
GEO0, GEO1 = 1.125**0.25, 11.52 ** (1 / 3)

HAND_CASES = [
    # name, options, weights, keep mask, (is_weight_mean, is_weight_max, is_clipped_frac,
    # rs_masked_frac, rs_masked_seq_frac)
    (
        "none",
        dict(),
        [[1, 1, 1, 1], [1, 1, 1, 0]],
        MASK,
        (1.0, 1.0, 0.0, 0.0, 0.0),
    ),
    (
        # min(rho, 2): tokens 3.0 and 12.0 truncated. Mean (2 + 1 + .25 + 1.5 + 1.2 + .8 + 2) / 7.
        "is_token",
        dict(rollout_is="token"),
        [[2, 1, 0.25, 1.5], [1.2, 0.8, 2, 0]],
        MASK,
        (8.75 / 7, 2.0, 2 / 7, 0.0, 0.0),
    ),
    (
        # Cap 1.4: 3.0, 1.5 and 12.0 truncated. Mean (1.4 + 1 + .25 + 1.4 + 1.2 + .8 + 1.4) / 7.
        "is_token_cap",
        dict(rollout_is="token", rollout_is_cap=1.4),
        [[1.4, 1, 0.25, 1.4], [1.2, 0.8, 1.4, 0]],
        MASK,
        (7.45 / 7, 1.4, 3 / 7, 0.0, 0.0),
    ),
    (
        # Row 0 GEO0 = 1.029883 on all 4 tokens; row 1 GEO1 = 2.258662 -> 2 on its 3 tokens.
        "is_sequence",
        dict(rollout_is="sequence"),
        [[GEO0] * 4, [2, 2, 2, 0]],
        MASK,
        ((4 * GEO0 + 6) / 7, 2.0, 3 / 7, 0.0, 0.0),
    ),
    (
        # Band [0.5, 2]: 3.0, 0.25 and 12.0 rejected; both rows lose a token.
        "rs_token",
        dict(rollout_rs="token"),
        [[0, 1, 0, 1], [1, 1, 0, 0]],
        [[False, True, False, True], [True, True, False, False]],
        (1.0, 1.0, 0.0, 3 / 7, 1.0),
    ),
    (
        # Band [0.2, 2.5]: 0.25 now kept, 3.0 and 12.0 rejected.
        "rs_token_band",
        dict(rollout_rs="token", rollout_rs_low=0.2, rollout_rs_high=2.5),
        [[0, 1, 1, 1], [1, 1, 0, 0]],
        [[False, True, True, True], [True, True, False, False]],
        (1.0, 1.0, 0.0, 2 / 7, 1.0),
    ),
    (
        # Row 1's geometric mean 2.258662 is above 2: the whole row is rejected.
        "rs_sequence",
        dict(rollout_rs="sequence"),
        [[1, 1, 1, 1], [0, 0, 0, 0]],
        [[True] * 4, [False] * 4],
        (1.0, 1.0, 0.0, 3 / 7, 0.5),
    ),
    (
        # IcePop band [0.5, 5]: only 0.25 and 12.0 rejected (3.0 kept, unlike "token").
        "rs_icepop",
        dict(rollout_rs="icepop"),
        [[1, 1, 0, 1], [1, 1, 0, 0]],
        [[True, True, False, True], [True, True, False, False]],
        (1.0, 1.0, 0.0, 2 / 7, 1.0),
    ),
    (
        # Both: TIS weights on the tokens IcePop keeps; metrics over the 5 kept tokens.
        # Mean (2 + 1 + 1.5 + 1.2 + 0.8) / 5 = 1.3; 3.0 -> 2 is the one clipped kept token.
        "is_token_rs_icepop",
        dict(rollout_is="token", rollout_rs="icepop"),
        [[2, 1, 0, 1.5], [1.2, 0.8, 0, 0]],
        [[True, True, False, True], [True, True, False, False]],
        (1.3, 2.0, 1 / 5, 2 / 7, 1.0),
    ),
]


def loss_config(name="grpo", **kw) -> losses.LossConfig:
    if name == "espo":
        kw.setdefault("vocab_size", 50)
        kw.setdefault("alpha", 1.0)
    return losses.LossConfig(name=name, **kw)


class HandTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*HAND_CASES)
    def test_weights_mask_and_metrics_by_hand(self, options, weights, keep, metrics):
        cfg = loss_config(**options)

        @self.variant
        def correct(old, sampler, mask):
            return correction.correct(cfg, old_logps=old, sampler_logps=sampler, mask=mask)

        out = correct(jnp.asarray(OLD, jnp.float32), jnp.asarray(SAMPLER, jnp.float32), MASK)
        np.testing.assert_allclose(out.weights, weights, **TOL)
        np.testing.assert_array_equal(out.keep_mask, keep)
        assert out.weights.dtype == jnp.float32
        names = ("is_weight_mean", "is_weight_max", "is_clipped_frac", "rs_masked_frac")
        names += ("rs_masked_seq_frac",)
        got = tuple(float(out.metrics[k]) for k in names)
        np.testing.assert_allclose(got, metrics, **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_extreme_log_ratios_are_clamped_before_exp(self):
        # old - sampler = +-1000 reads as +-20: w = min(e^20, 2) = 2 and e^-20, finite; the
        # geometric mean of [+1000, -1000] is exp(0) = 1. Unclamped: w = exp(-1000) = 0.
        cfg = loss_config(rollout_is="token")
        seq = loss_config(rollout_is="sequence")
        old = jnp.array([[1000.0, -1000.0]])

        @self.variant
        def weights(old):
            tok = correction.correct(cfg, old_logps=old, sampler_logps=0 * old, mask=old != 0)
            sq = correction.correct(seq, old_logps=old, sampler_logps=0 * old, mask=old != 0)
            return tok.weights, sq.weights

        tok, sq = weights(old)
        np.testing.assert_allclose(tok, [[2.0, math.exp(-20.0)]], rtol=1e-5)
        np.testing.assert_allclose(sq, [[1.0, 1.0]], **TOL)

    def test_weights_carry_no_gradient(self):
        # Wrong (no stop_gradient): d sum(w) / d old = w on the unclipped tokens.
        for options in (dict(rollout_is="token"), dict(rollout_is="sequence", rollout_is_cap=5.0)):
            cfg = loss_config(**options)

            def total(old, sampler, cfg=cfg):
                out = correction.correct(cfg, old_logps=old, sampler_logps=sampler, mask=MASK)
                return out.weights.sum() + sum(out.metrics.values())

            old, sampler = jnp.asarray(np.nan_to_num(OLD, posinf=0.0)), jnp.full((2, 4), -1.0)
            grads = jax.grad(total, argnums=(0, 1))(old, sampler)
            assert not np.asarray(grads[0]).any() and not np.asarray(grads[1]).any()

    def test_loss_by_hand_weight_outside_the_clip_never_on_kl(self):
        # GRPO token-mean, eps 0.2, one row: logp - old = [ln 1.5, 0, 0], A = +1, k1 KL with
        # logp - ref = [0, 0, 1], kl_coef 0.5. rho = [1.5, 3, 0.6] with rollout_is="token"
        # (cap 2): w = [1.5, 2, 0.6].
        #   pg = max(-A r, -A clip(r, 0.8, 1.2)) = [-1.2, -1, -1]; w pg = [-1.8, -2, -0.6]
        #   kl term 0.5 * [0, 0, 1]; loss = (-4.4 + 0.5) / 3 = -1.3.
        # Wrong: w on the KL term too: (-4.4 + 0.3) / 3 = -1.366667; w inside the clipped ratio
        # (r w = [2.25, 2, 0.6] -> [-1.2, -1.2, -0.6]): (-3 + 0.5) / 3 = -0.833333.
        logps = np.array([[math.log(1.5), 0.0, 0.0]]) - 1.0
        old = np.full((1, 3), -1.0)
        out = losses.compute_loss(
            loss_config(
                clip_low=0.2, clip_high=0.2, kl_coef=0.5, kl_estimator="k1", rollout_is="token"
            ),
            logps=logps,
            old_logps=old,
            advantages=np.ones(1),
            mask=np.ones((1, 3)),
            ref_logps=logps - np.array([[0.0, 0.0, 1.0]]),
            sampler_logps=old - np.log([[1.5, 3.0, 0.6]]),
        )
        assert float(out.loss) == pytest.approx(-1.3, abs=1e-6)


@pytest.mark.parametrize("band", [(1.0, 2.0), (0.5, 1.0)], ids=["low_end", "high_end"])
@pytest.mark.parametrize("mode", ["token", "sequence", "icepop"])
def test_a_ratio_exactly_on_a_band_end_is_kept(mode, band):
    # The band is closed: a token (or sequence) is rejected only OUTSIDE [low, high]. log rho is
    # exactly 0 (rho = 1, each band's end) on row 0 and [+3, -3] on row 1 (padding holds NaN);
    # row 1's geometric mean is exp(0) = 1 too. Token modes keep row 0 and reject e^3 and e^-3;
    # "sequence" keeps both rows. Wrong (an open band, rho > low or rho < high): row 0 rejected.
    mask = np.array([[True, True, True], [True, True, False]])
    sampler = np.where(mask, -1.0, np.nan)
    old = np.where(mask, -1.0 + np.array([[0.0, 0.0, 0.0], [3.0, -3.0, 0.0]]), np.nan)
    cfg = loss_config(rollout_rs=mode, rollout_rs_low=band[0], rollout_rs_high=band[1])
    out = correction.correct(
        cfg,
        old_logps=jnp.asarray(old, jnp.float32),
        sampler_logps=jnp.asarray(sampler, jnp.float32),
        mask=mask,
    )
    keep = mask if mode == "sequence" else np.array([[True] * 3, [False] * 3])
    np.testing.assert_array_equal(out.keep_mask, keep)
    np.testing.assert_array_equal(out.weights, keep.astype(np.float32))


# ---- invariances over every loss and aggregation ------------------------------------------------
B, T = 4, 6
LOSS_CONFIGS = [
    *(
        dict(name="grpo", agg=agg, clip_low=0.15, clip_high=0.25, kl_coef=0.05)
        for agg in losses.AGG_MODES
    ),
    dict(name="grpo", dual_clip=2.0, agg="seq-mean-token-sum-norm", norm_length=9),
    dict(name="gspo", clip_low=0.02, clip_high=0.05, kl_coef=0.05),
    dict(name="espo", top_frac=0.3, kl_coef=0.05),
    dict(name="espo", num_entropy_groups=3, espo_ratio="literal"),
    dict(name="cispo", clip_low=0.2, clip_high=0.1, kl_coef=0.05),
]
assert {c["name"] for c in LOSS_CONFIGS} == set(losses.LOSSES), "a registered loss is not covered"
CORRECTIONS = [
    dict(rollout_is="token", rollout_rs="token", rollout_rs_low=0.8, rollout_rs_high=1.25),
    dict(rollout_is="sequence", rollout_is_cap=1.3, rollout_rs="icepop", rollout_rs_low=0.7),
    dict(rollout_rs="sequence", rollout_rs_low=0.85, rollout_rs_high=1.15),
    dict(rollout_is="token", rollout_is_cap=1.2),
]
configs = st.builds(
    lambda c, k: loss_config(**c, **k), st.sampled_from(LOSS_CONFIGS), st.sampled_from(CORRECTIONS)
)
seeds = st.integers(0, 2**16)


def make_batch(seed, *, mismatch=0.3):
    """float32 inputs with ragged lengths (0 allowed) and a sampler `mismatch` away from pi_old."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (B, T))
    lengths = rng.integers(0, T + 1, B)
    batch = dict(
        logps=old + rng.normal(0.0, 0.3, (B, T)),
        old_logps=old,
        advantages=rng.normal(0.0, 1.0, (B, T)),
        mask=np.arange(T)[None, :] < lengths[:, None],
        entropies=rng.uniform(0.0, 3.0, (B, T)),
        ref_logps=old + rng.normal(0.0, 0.2, (B, T)),
        sampler_logps=old + rng.normal(0.0, mismatch, (B, T)),
    )
    return {k: jnp.asarray(v, bool if k == "mask" else jnp.float32) for k, v in batch.items()}


def close(got, want):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-6)
    assert float(got[1]) == float(want[1])
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@hypothesis.settings(max_examples=30)
@hypothesis.given(cfg=configs, seed=seeds)
def test_sampler_equal_to_old_changes_nothing(cfg, seed):
    # rho = exp(0) = 1 exactly: w = 1, no band rejects 1, and w l == l in float32.
    batch = make_batch(seed)
    batch["sampler_logps"] = batch["old_logps"]
    fix = correction.correct(
        cfg, old_logps=batch["old_logps"], sampler_logps=batch["old_logps"], mask=batch["mask"]
    )
    np.testing.assert_array_equal(fix.weights, np.where(batch["mask"], 1.0, 0.0))
    np.testing.assert_array_equal(fix.keep_mask, batch["mask"])
    off = dataclasses.replace(
        cfg, rollout_is="none", rollout_rs="none", rollout_rs_low=None, rollout_rs_high=None
    )
    got, want = num_den_grad(cfg)(batch), num_den_grad(off)(batch)
    # w == 1 exactly (above); the two programs may fuse and order their float32 sums differently,
    # so the loss agrees to an ulp or two, not bit for bit.
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@hypothesis.settings(max_examples=40)
@hypothesis.given(cfg=configs, seed=seeds, fill=st.sampled_from([np.nan, np.inf, 1e9]))
def test_rejected_token_is_a_masked_token(cfg, seed, fill):
    # Rejection through rollout_rs == the same batch with the rejected tokens' mask 0 (IS off in
    # both: sequence IS weights are geometric means over the tokens before rejection); and what
    # a rejected token holds (logp, advantage, entropy, reference) reaches nothing. Wrong
    # (rejected token kept as a zero-loss token): the denominator counts it under token-mean,
    # and n_i of seq-mean-token-mean includes it.
    batch = make_batch(seed)
    cfg = dataclasses.replace(cfg, rollout_is="none")
    fix = correction.correct(
        cfg, old_logps=batch["old_logps"], sampler_logps=batch["sampler_logps"], mask=batch["mask"]
    )
    rejected = np.asarray(batch["mask"] & ~fix.keep_mask)
    hypothesis.assume(rejected.any())
    off = dataclasses.replace(cfg, rollout_rs="none", rollout_rs_low=None, rollout_rs_high=None)
    want = num_den_grad(off)(dict(batch, mask=fix.keep_mask))
    filled = {
        k: jnp.where(rejected, fill, v)
        if k in ("logps", "advantages", "entropies", "ref_logps")
        else v
        for k, v in batch.items()
    }
    got = num_den_grad(cfg)(filled)
    close(got, want)
    assert not np.asarray(got[2])[rejected].any()  # no gradient on a rejected token


@pytest.mark.slow
@hypothesis.settings(max_examples=30)
@hypothesis.given(cfg=configs, seed=seeds, split=st.lists(st.booleans(), min_size=B, max_size=B))
def test_micro_batches_accumulate_exactly_with_rejection(cfg, seed, split):
    # Any split of the rows into two micro-batches: sum num / sum den and the summed gradient
    # equal the full batch's. Wrong: the mean of the micro-batch losses; sequence weights or
    # rejections taken over the batch instead of per row.
    batch = make_batch(seed)
    full = num_den_grad(cfg)(batch)
    split = np.array(split)
    parts = [
        num_den_grad(cfg)(dict(batch, mask=batch["mask"] & keep[:, None]))
        for keep in (split, ~split)
    ]
    assert sum(float(p[1]) for p in parts) == float(full[1])
    num = sum(float(p[0]) for p in parts)
    np.testing.assert_allclose(num, float(full[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sum(np.asarray(p[2]) for p in parts), full[2], rtol=1e-5, atol=1e-7)


@hypothesis.settings(max_examples=25)
@hypothesis.given(
    loss=st.sampled_from(LOSS_CONFIGS),
    seed=seeds,
    log_w=st.floats(-0.3, 0.15),
    mode=st.sampled_from(["token", "sequence"]),
)
@pytest.mark.slow
def test_constant_weight_scales_the_policy_gradient_term_not_the_kl(loss, seed, log_w, mode):
    # sampler = old - log_w everywhere: w = e^log_w (below the cap 1.2) on every token, so each
    # loss's policy-gradient term, value and gradient, is scaled by w, and the KL term is not:
    #   L(IS) = w L_pg + L_kl, with L_pg = L(no IS, no KL) and L_kl = L(no IS) - L_pg.
    # Wrong: w on the KL too (L = w L(no IS)); a loss that ignores the weight (L = L(no IS)).
    batch = make_batch(seed)
    hypothesis.assume(np.asarray(batch["mask"]).any())
    batch["sampler_logps"] = batch["old_logps"] - log_w
    w = float(np.exp(np.float32(log_w)))
    cfg = loss_config(**loss, rollout_is=mode, rollout_is_cap=1.2)
    off = dataclasses.replace(cfg, rollout_is="none")
    pg = dataclasses.replace(off, kl_coef=0.0)
    got, base, pg_only = (num_den_grad(c)(batch) for c in (cfg, off, pg))
    want = [w * pg_only[0] + (base[0] - pg_only[0]), base[1], w * pg_only[2] + base[2] - pg_only[2]]
    close(got, want)


def test_missing_or_misshapen_sampler_logps_raise_clear_errors():
    batch = make_batch(0)
    del batch["sampler_logps"]
    with pytest.raises(ValueError, match="rollout_is='token', rollout_rs='none' need `sampler_"):
        losses.compute_loss(loss_config(rollout_is="token"), **batch)
    with pytest.raises(ValueError, match=r"sampler_logps must have the shape of logps"):
        losses.compute_loss(
            loss_config(rollout_rs="icepop"), **batch, sampler_logps=jnp.zeros((B, T + 1))
        )
    # The LossConfig checks of these options: tests/losses/test_config.py BAD_CONFIGS.
