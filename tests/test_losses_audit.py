"""espo.losses: what the mutation audit (issue 13, `mutmut` on espo/losses.py) found unguarded.

Each test names the bug it catches: a registered loss losing its defaults, error messages that
no longer name the field or the valid values, the k3 guard whose removal turns a saturated
penalty's gradient into NaN, clip indicators counting tokens with no advantage, the shared
approx_kl / ppo_kl metrics (hand values, and the +-20 clamp of the log-ratio), entropy groups'
default scope and integer dtype.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import losses, types
from espo.testing import raises_invalid


def _batch(d, advantages, **kw):
    """compute_loss inputs with logps - old_logps = d (one row)."""
    d = jnp.asarray([d], jnp.float32)
    return dict(
        logps=d - 1.0,
        old_logps=jnp.full_like(d, -1.0),
        advantages=jnp.asarray([advantages], jnp.float32),
        mask=jnp.ones_like(d, bool),
        **kw,
    )


def test_a_registered_loss_keeps_its_function_and_defaults():
    def audit_pg(cfg, batch):
        num = -(batch.advantages * batch.logps * batch.mask).sum()
        return types.LossOutput(numerator=num, denominator=jnp.float32(2.0), metrics={})

    try:
        assert (
            losses.register("audit_pg", clip_low=0.1, clip_high=0.3, agg="seq-mean-token-sum")(
                audit_pg
            )
            is audit_pg
        )
        cfg = losses.LossConfig(name="audit_pg")
        assert (cfg.eps_low, cfg.eps_high, cfg.agg_mode) == (0.1, 0.3, "seq-mean-token-sum")
        assert losses.LOSSES["audit_pg"].fn is audit_pg
        out = losses.compute_loss(cfg, **_batch([0.5, -1.0], [2.0, 2.0]))
        # -(2 * (0.5 - 1) + 2 * (-1 - 1)) = 5, over the denominator 2.
        np.testing.assert_allclose(out.numerator, 5.0, rtol=1e-6)
        np.testing.assert_allclose(out.loss, 2.5, rtol=1e-6)
    finally:
        losses.LOSSES.pop("audit_pg", None)


def test_errors_name_the_field_and_what_is_valid():
    with raises_invalid("name", where="LossConfig"):
        losses.LossConfig(name="ppo")
    with raises_invalid("agg"):
        losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2), bool), agg="sum")
    with raises_invalid("estimator"):
        losses.kl_penalty(logps=jnp.zeros((1, 2)), ref_logps=jnp.zeros((1, 2)), estimator="k4")
    exact = lambda text: pytest.raises(ValueError, match="^" + re.escape(text) + "$")
    grpo = losses.LossConfig(name="grpo")
    with exact("espo needs `entropies` (old-policy token entropies [B, T]); got None"):
        losses.compute_loss(losses.LossConfig(name="espo", vocab_size=8), **_batch([0.1], [1.0]))
    with exact("overlong_filter=True needs `finished` [B] (False = truncated); got None"):
        losses.compute_loss(
            losses.LossConfig(name="grpo", overlong_filter=True), **_batch([0.1], [1.0])
        )
    with exact("rollout_is='token', rollout_rs='none' need `sampler_logps` [B, T]; got None"):
        losses.compute_loss(
            losses.LossConfig(name="grpo", rollout_is="token"), **_batch([0.1], [1.0])
        )
    with exact("logps must be [B, T], got shape (3,)"):
        losses.compute_loss(grpo, **{**_batch([0.1] * 3, [1.0]), "logps": jnp.zeros(3)})
    with exact("finished must be [B]=(1,), got shape (2,)"):
        losses.compute_loss(grpo, **_batch([0.1, 0.2], [1.0, 1.0]), finished=jnp.ones(2, bool))
    # Every per-token input of the wrong shape is named.
    for field in ("old_logps", "mask", "entropies", "ref_logps", "sampler_logps"):
        kw = _batch([0.1, 0.2], [1.0, 1.0])
        kw[field] = jnp.zeros((1, 3))
        with exact(f"{field} must have the shape of logps (1, 2), got (1, 3)"):
            losses.compute_loss(grpo, **kw)


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
