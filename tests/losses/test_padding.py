"""Adversarial padding, invalid rows and overlong filtering for espo.losses (issues 7 and 13).

Padding (mask 0) may hold anything: a -inf log-prob from a masked softmax, NaN from a failed
reward, 1e9 from uninitialised memory. Whatever it holds must reach neither the loss value, its
gradient w.r.t. `logps`, nor any metric. Each check compares a batch whose padding is filled
with an extreme value against the same batch with benign padding, for every registered loss and
aggregation mode, jitted and not (chex variants). A row that is entirely padding (a failed
reward, `mask & valid[:, None]`; or a truncated row under `overlong_filter`) must leave every
denominator, so adding one changes nothing (jitted: the same masking code as the padding check,
which also runs op by op).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from espo import losses
from espo.testing import raises_invalid

B, T = 4, 6
FIELDS = ("logps", "old_logps", "advantages", "entropies", "ref_logps")
FILLS = (np.inf, -np.inf, np.nan, 1e9, -1e9)

# Every registered loss, every aggregation mode, and the options that change the masked code paths
# (dual clip, k3 KL, ESPO scopes / ratio modes / group counts), all with non-default values.
CONFIGS = [
    *(
        dict(name="grpo", agg=agg, clip_low=0.15, clip_high=0.28, dual_clip=2.5, kl_coef=0.07)
        for agg in losses.AGG_MODES
    ),
    dict(name="grpo", agg="seq-mean-token-sum-norm", norm_length=9, kl_estimator="k2", kl_coef=1),
    dict(name="gspo", clip_low=0.05, clip_high=0.08, kl_coef=0.03),
    dict(name="gspo", agg="token-mean", kl_coef=0.03, kl_estimator="k1"),
    dict(name="espo", vocab_size=50, alpha=1.0, top_frac=0.4, kl_coef=0.05),
    dict(name="espo", vocab_size=50, alpha=1.0, num_entropy_groups=3, quantile_scope="batch"),
    dict(name="espo", vocab_size=50, alpha=1.0, espo_ratio="literal", kl_coef=0.05),
    dict(name="cispo", clip_low=0.3, clip_high=0.2, kl_coef=0.05),
    dict(name="cispo", agg="seq-mean-token-mean"),
]
assert {c["name"] for c in CONFIGS} == set(losses.LOSSES), "a registered loss is not covered"


def config_id(cfg):
    return "_".join(f"{k}={v}" for k, v in cfg.items()).replace("-", "")


NAMED_CONFIGS = [(config_id(c), c) for c in CONFIGS]


def make_batch(seed, *, b=B, t=T):
    """float32 [B, T] inputs with a ragged mask; row 1 is all padding (a failed sample)."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (b, t))
    lengths = rng.integers(2, t + 1, b)
    lengths[1] = 0
    batch = dict(
        logps=old + rng.normal(0.0, 0.3, (b, t)),
        old_logps=old,
        advantages=np.repeat(rng.normal(0.0, 1.0, (b, 1)), t, axis=1),
        mask=np.arange(t)[None, :] < lengths[:, None],
        entropies=rng.uniform(0.0, 3.0, (b, t)),
        ref_logps=old + rng.normal(0.0, 0.2, (b, t)),
    )
    return {k: jnp.asarray(v, jnp.bool_ if k == "mask" else jnp.float32) for k, v in batch.items()}


def fill_padding(batch, fills):
    """`batch` with the padded positions of each field in `fills` replaced by its value."""
    pad = ~np.asarray(batch["mask"])
    out = dict(batch)
    for field, value in fills.items():
        out[field] = jnp.asarray(np.where(pad, value, np.asarray(batch[field])), jnp.float32)
    return out


def loss_and_grad(cfg):
    """(loss, d loss / d logps, LossOutput) as one function of the batch dict."""

    def f(batch, **extra):
        def loss(logps):
            out = losses.compute_loss(cfg, **{**batch, "logps": logps}, **extra)
            return out.loss, out

        (value, out), grad = jax.value_and_grad(loss, has_aux=True)(batch["logps"])
        return value, grad, out

    return f


def assert_same(got, want):
    """Value, gradient, numerator, denominator and every metric equal (and all finite)."""
    chex.assert_tree_all_finite(got)
    assert set(got[2].metrics) == set(want[2].metrics)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
class AdversarialPaddingTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*NAMED_CONFIGS)
    def test_padding_reaches_no_value_gradient_or_metric(self, cfg):
        cfg = losses.LossConfig(**cfg)
        f = self.variant(loss_and_grad(cfg))
        batch = make_batch(0)
        want = f(batch)
        # The gradient at padding is exactly zero, and the batch really has padding to attack.
        assert not np.asarray(want[1])[~np.asarray(batch["mask"])].any()
        assert 0 < int(np.asarray(batch["mask"]).sum()) < B * T
        for fill in FILLS:
            got = f(fill_padding(batch, dict.fromkeys(FIELDS, fill)))
            assert_same(got, want)
        # A different extreme in each field at once.
        got = f(fill_padding(batch, dict(zip(FIELDS, FILLS, strict=True))))
        assert_same(got, want)

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*NAMED_CONFIGS)
    def test_adding_an_invalid_row_changes_nothing(self, cfg):
        # issue 7 #2: a failed reward sample reaches the loss as a row with mask & valid = 0.
        # Whatever it holds (here: plausible values with a large advantage, or NaN everywhere),
        # value, gradient of the other rows, numerator and denominator stay those of the batch
        # without it. Wrong answer it catches: a seq-mean / ESPO denominator counting B rows.
        cfg = losses.LossConfig(**cfg)
        f = self.variant(loss_and_grad(cfg))
        batch = make_batch(1)
        rows = np.array([0, 2, 3])
        without = f({k: v[rows] for k, v in batch.items()})
        for junk in (None, np.nan, -np.inf):
            padded = dict(batch)
            if junk is None:
                padded["advantages"] = padded["advantages"].at[1].set(50.0)
                padded["logps"] = padded["logps"].at[1].add(3.0)
            else:
                padded = {k: v if k == "mask" else v.at[1].set(junk) for k, v in padded.items()}
            value, grad, out = f(padded)
            chex.assert_trees_all_close(
                (value, grad[rows], out.numerator, out.denominator),
                (without[0], without[1], without[2].numerator, without[2].denominator),
                rtol=1e-6,
                atol=1e-7,
            )
            assert not np.asarray(grad[1]).any()
            chex.assert_tree_all_finite(out.metrics)


@pytest.mark.slow
class OverlongFilterTest(parameterized.TestCase):
    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*NAMED_CONFIGS)
    def test_truncated_rows_leave_the_loss(self, cfg):
        # DAPO overlong filtering: rows with finished=False are masked out of the loss and every
        # denominator, exactly as if their mask were 0; their contents do not matter.
        batch = make_batch(2)
        batch["mask"] = batch["mask"].at[1, :3].set(True)  # every row has tokens here
        finished = jnp.array([True, False, True, False])
        on = losses.LossConfig(**cfg, overlong_filter=True)
        f = self.variant(functools.partial(loss_and_grad(on), finished=finished))
        masked = dict(batch, mask=batch["mask"] & finished[:, None])
        # NaN in the padding and in every token of the truncated rows.
        nan_filled = dict(fill_padding(masked, dict.fromkeys(FIELDS, np.nan)), mask=batch["mask"])
        got = f(nan_filled)
        want = self.variant(loss_and_grad(losses.LossConfig(**cfg)))(masked)
        metrics = dict(got[2].metrics)
        assert float(metrics.pop("num_overlong_filtered")) == 2.0
        assert float(metrics.pop("num_truncated")) == 2.0
        assert_same((got[0], got[1], got[2].replace(metrics=metrics)), want)
        assert not np.asarray(got[1])[~np.asarray(finished)].any()
        # Off (the default): the flag is only counted, the loss is that of the unfiltered batch.
        off = losses.LossConfig(**cfg)
        got = self.variant(functools.partial(loss_and_grad(off), finished=finished))(batch)
        want = self.variant(loss_and_grad(off))(batch)
        metrics = dict(got[2].metrics)
        assert float(metrics.pop("num_overlong_filtered")) == 0.0
        assert float(metrics.pop("num_truncated")) == 2.0
        assert_same((got[0], got[1], got[2].replace(metrics=metrics)), want)


def test_overlong_filter_needs_finished_with_batch_shape():
    cfg = losses.LossConfig(name="grpo", overlong_filter=True)
    batch = make_batch(3)
    with pytest.raises(ValueError, match="overlong_filter=True needs `finished`"):
        losses.compute_loss(cfg, **batch)
    with pytest.raises(ValueError, match=r"finished must be \[B\]"):
        losses.compute_loss(cfg, **batch, finished=jnp.ones((B, T), bool))
    with raises_invalid("overlong_filter", where="LossConfig"):
        losses.LossConfig(name="grpo", overlong_filter=1)


def test_truncated_row_counts_only_with_tokens():
    # num_truncated counts sequences that have loss tokens and no EOS; an empty row (failed
    # reward) that is also unfinished is not a sequence of this batch and is not counted.
    batch = make_batch(4)  # row 1 is empty
    cfg = losses.LossConfig(name="gspo", overlong_filter=True)
    out = losses.compute_loss(cfg, **batch, finished=jnp.array([True, False, False, True]))
    assert float(out.metrics["num_truncated"]) == 1.0
    assert float(out.metrics["num_overlong_filtered"]) == 1.0
    assert float(out.metrics["num_seqs"]) == 2.0
