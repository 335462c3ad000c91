"""Policy-gradient losses (GRPO, GSPO, ESPO, CISPO) registered by name, plus the KL penalty.

Owns the per-token surrogate of every algorithm and its reduction to a `types.LossOutput`.
Invariants:
- Pure and jittable: `LossConfig` is frozen and hashable (a static argument under `jit`); every
  array is [B, T] (advantages may be [B]); math is float32.
- Masks select, they never multiply or index: `compute_loss` replaces every padded entry of every
  input by 0 with `jnp.where` before any arithmetic, and every masked reduction selects again,
  so padding may hold anything (inf, -inf, NaN, 1e9) without reaching a value, a gradient or a
  metric. A row with no valid token (a failed reward sample, `mask & valid[:, None]`; a
  truncated sample under `overlong_filter`) is not a sequence of the batch: it leaves every
  denominator, so adding one changes neither the loss nor its gradient.
- The loss is the NEGATIVE of the objective, to be minimised. `old_logps`, `advantages`,
  `entropies` and `ref_logps` are stop-gradient'd: only `logps` carries gradient.
- numerator / denominator per aggregation, so that over micro-batches
  sum(numerator) / sum(denominator) equals the full-batch loss exactly (n_i = valid tokens of
  sequence i, l = per-token loss, m = mask):
    token-mean               num = sum_{i,t} m l                den = sum_{i,t} m
    seq-mean-token-mean      num = sum_i sum_t m l / n_i        den = #{i : n_i > 0}
    seq-mean-token-sum       num = sum_i sum_t m l              den = #{i : n_i > 0}
    seq-mean-token-sum-norm  num = sum_i sum_t m l / norm_len   den = #{i : n_i > 0}
    espo (fixed)             num = sum_i mean_{non-empty groups g} (sum_{t in g} l / |g|)
                             den = #{i : n_i > 0}
  Sequences without valid tokens leave the seq-mean denominators (as current verl `agg_loss`
  with no global batch size). seq-mean-token-sum-norm is Dr.GRPO's (1/B) sum_i sum_t l /
  MAX_TOKENS as in verl >= 0.6; verl <= 0.5 omitted the 1/B. Exception to exactness: ESPO with
  quantile_scope="batch" takes its entropy thresholds over whichever (micro-)batch it sees.
- Sampler correction (`espo.correction`, `rollout_is` / `rollout_rs`): rejected tokens leave the
  mask before anything reads it, so m above is the mask after rejection (a rejected token is
  exactly a padded one); the stop-gradient IS weight w_t multiplies every loss's per-token
  policy-gradient term, l = w_t l_pg + kl_coef kl_t, never the KL penalty.
- Metrics are float32 scalars over the valid tokens of the call (one micro-batch). Unless named
  otherwise they are token-weighted means: combine micro-batches exactly by weighting each with
  its `num_tokens` metric (`*_group{k}` metrics with `num_tokens_group{k}`); `ratio_max`
  combines by max; `num_*` are counts and add. clip_frac = clip_frac_low + clip_frac_high.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from espo import correction, errors, types

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
QUANTILE_SCOPES = ("sequence", "batch")
ESPO_RATIOS = ("gspo_token", "literal")

LOG_RATIO_CLAMP = correction.LOG_RATIO_CLAMP  # verl vanilla: |log r| <= 20 before exp (and CISPO)
SEQ_LOG_RATIO_MAX = 10.0  # verl GSPO: combined log ratio <= 10 before exp (also ESPO)

Mask = Bool[Array, "B T"] | Float[Array, "B T"]


class Batch(NamedTuple):
    """The float32, broadcast inputs every registered loss receives; padding already holds 0."""

    logps: Float[Array, "B T"]  # trained policy, carries the gradient
    old_logps: Float[Array, "B T"]  # behaviour policy (stop-gradient)
    advantages: Float[Array, "B T"]  # broadcast from [B] if needed (stop-gradient)
    mask: Bool[Array, "B T"]  # True for loss tokens; False for padding, prompt, filtered rows
    entropies: Float[Array, "B T"] | None  # old-policy token entropies (stop-gradient)
    penalty: Float[Array, "B T"]  # kl_coef * KL(pi || pi_ref) per token, 0 when KL is off
    is_weights: Float[Array, "B T"]  # pi_old / pi_sampler IS weights (espo.correction), else 1


LossFn = Callable[["LossConfig", Batch], types.LossOutput]


class _Registered(NamedTuple):
    fn: LossFn
    clip_low: float | None  # default eps_low (None: the loss has no fixed clip range)
    clip_high: float | None
    agg: str | None  # default aggregation (None: the loss aggregates its own way)


LOSSES: dict[str, _Registered] = {}


def register(name: str, *, clip_low: float | None, clip_high: float | None, agg: str | None):
    """Registers `fn(cfg, batch) -> LossOutput` under `name` with its default clip and agg."""

    def wrap(fn: LossFn) -> LossFn:
        LOSSES[name] = _Registered(fn, clip_low, clip_high, agg)
        return fn

    return wrap


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Which loss and its hyper-parameters. `None` means "the named loss's default"."""

    name: str  # a registered loss: "grpo" | "gspo" | "espo" | "cispo"
    agg: str | None = None  # one of AGG_MODES; None = loss default; must be None for espo
    clip_low: float | None = None  # ratio clipped below at 1 - clip_low (>= 1: no lower clip)
    clip_high: float | None = None  # ratio clipped above at 1 + clip_high (DAPO: 0.28)
    dual_clip: float | None = None  # grpo only: dual-clip constant c > 1 for A < 0; None = off
    norm_length: int | None = None  # seq-mean-token-sum-norm constant; None = T of the batch
    top_frac: float = 0.2  # espo: fraction of a sequence's tokens in the top-entropy group
    num_entropy_groups: int = 2  # espo: entropy groups per sequence (1 = one = GSPO-like)
    quantile_scope: str = "sequence"  # espo: entropy thresholds per "sequence" or per "batch"
    alpha: float = 0.02  # espo: eps_group = alpha * mean group entropy / log(vocab_size)
    vocab_size: int | None = None  # espo: |V| of the policy (required)
    espo_ratio: str = "gspo_token"  # espo: "gspo_token" (value s_g) | "literal" (s_g * r_t)
    kl_coef: float = 0.0  # beta of the per-token KL(pi || pi_ref) penalty; 0 = off
    kl_estimator: str = "k3"  # "k1" | "k2" | "k3" (verl kl_penalty names)
    overlong_filter: bool = False  # DAPO: rows with finished=False (no EOS) leave the loss
    rollout_is: str = "none"  # IS weight pi_old / pi_sampler: "none" | "token" | "sequence"
    rollout_is_cap: float = 2.0  # truncated IS: w = min(w, cap) (verl TIS)
    rollout_rs: str = "none"  # rejection: "none" | "token" | "sequence" | "icepop"
    rollout_rs_low: float | None = None  # reject ratios below; None = the mode's (0.5)
    rollout_rs_high: float | None = None  # reject ratios above; None = the mode's (2; icepop 5)

    def __post_init__(self):
        errors.require(self, self.name in LOSSES, "name", f"one of {tuple(LOSSES)}")
        espo = self.name == "espo"
        if espo:
            errors.require(
                self, self.agg is None, "agg", "None for espo (it aggregates per entropy group)"
            )
            for field in ("clip_low", "clip_high"):
                errors.require(
                    self, getattr(self, field) is None, field, "None for espo (set alpha instead)"
                )
        errors.require(
            self, self.agg is None or self.agg in AGG_MODES, "agg", f"None or one of {AGG_MODES}"
        )
        for field in ("clip_low", "clip_high", "rollout_rs_low", "rollout_rs_high"):
            value = getattr(self, field)
            errors.require(
                self,
                value is None or (errors.is_real(value) and value >= 0),
                field,
                "None or a float >= 0",
            )
        errors.require(
            self,
            self.dual_clip is None or (self.name == "grpo" and errors.is_real(self.dual_clip)),
            "dual_clip",
            "None, or a float > 1 with name='grpo'",
        )
        errors.require(
            self, self.dual_clip is None or self.dual_clip > 1, "dual_clip", "None or a float > 1"
        )
        errors.require(
            self,
            self.norm_length is None
            or (isinstance(self.norm_length, int) and self.norm_length >= 1),
            "norm_length",
            "None or an int >= 1",
        )
        errors.require(
            self,
            errors.is_real(self.top_frac) and 0 < self.top_frac <= 1,
            "top_frac",
            "a float in (0, 1]",
        )
        errors.require(
            self,
            isinstance(self.num_entropy_groups, int) and self.num_entropy_groups >= 1,
            "num_entropy_groups",
            "an int >= 1",
        )
        errors.require(
            self,
            self.quantile_scope in QUANTILE_SCOPES,
            "quantile_scope",
            f"one of {QUANTILE_SCOPES}",
        )
        errors.require(self, errors.is_real(self.alpha) and self.alpha > 0, "alpha", "a float > 0")
        errors.require(
            self,
            (self.vocab_size is None and not espo)
            or (isinstance(self.vocab_size, int) and self.vocab_size >= 2),
            "vocab_size",
            "an int >= 2 (required by espo: eps uses log(vocab_size))",
        )
        errors.require(self, self.espo_ratio in ESPO_RATIOS, "espo_ratio", f"one of {ESPO_RATIOS}")
        errors.require(
            self, errors.is_real(self.kl_coef) and self.kl_coef >= 0, "kl_coef", "a float >= 0"
        )
        errors.require(
            self, self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"one of {KL_ESTIMATORS}"
        )
        errors.require(
            self, isinstance(self.overlong_filter, bool), "overlong_filter", "True or False"
        )
        errors.require(
            self,
            self.rollout_is in correction.IS_MODES,
            "rollout_is",
            f"one of {correction.IS_MODES}",
        )
        cap = self.rollout_is_cap
        errors.require(self, errors.is_real(cap) and cap >= 1, "rollout_is_cap", "a float >= 1")
        errors.require(
            self,
            self.rollout_rs in correction.RS_MODES,
            "rollout_rs",
            f"one of {correction.RS_MODES}",
        )
        for field in ("rollout_rs_low", "rollout_rs_high"):
            errors.require(
                self,
                getattr(self, field) is None or self.rollout_rs != "none",
                field,
                "None while rollout_rs='none' (set rollout_rs to reject)",
            )
        low, high = correction.rs_band(self.rollout_rs, self.rollout_rs_low, self.rollout_rs_high)
        errors.require(self, low < high, "rollout_rs_high", f"above rollout_rs_low ({low})")

    @property
    def eps_low(self) -> float | None:
        """clip_low, or the loss's default."""
        return LOSSES[self.name].clip_low if self.clip_low is None else float(self.clip_low)

    @property
    def eps_high(self) -> float | None:
        """clip_high, or the loss's default."""
        return LOSSES[self.name].clip_high if self.clip_high is None else float(self.clip_high)

    @property
    def agg_mode(self) -> str | None:
        """agg, or the loss's default (None for espo, which aggregates per group)."""
        return LOSSES[self.name].agg if self.agg is None else self.agg


# ---- shared pieces ----------------------------------------------------------------------------
def _sg(x):
    return jax.lax.stop_gradient(x)


def _select(x: Array, mask: Bool[Array, "..."]) -> Float[Array, "..."]:
    """x where mask, else 0: a select, so inf/NaN outside the mask reach neither value nor grad."""
    return jnp.where(mask, x.astype(jnp.float32), 0.0)


def _token_mean(x: Array, mask: Bool[Array, "B T"]) -> Float[Array, ""]:
    return _select(x, mask).sum() / jnp.maximum(mask.sum(), 1).astype(jnp.float32)


def aggregate(
    token_losses: Float[Array, "B T"], mask: Mask, *, agg: str, norm_length: int | None = None
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(numerator, denominator) of `agg` over [B, T] per-token losses (see module docstring).

    `mask` selects (bool, or nonzero floats): losses outside it are never read arithmetically.
    """
    mask = mask.astype(bool)
    summed = _select(token_losses, mask).sum(-1)  # [B]
    num_valid = mask.astype(jnp.float32).sum(-1)  # [B]
    num_seqs = (num_valid > 0).astype(jnp.float32).sum()
    if agg == "token-mean":
        return summed.sum(), num_valid.sum()
    if agg == "seq-mean-token-mean":
        return (summed / jnp.maximum(num_valid, 1.0)).sum(), num_seqs
    if agg == "seq-mean-token-sum":
        return summed.sum(), num_seqs
    if agg == "seq-mean-token-sum-norm":
        norm = token_losses.shape[-1] if norm_length is None else norm_length
        return summed.sum() / norm, num_seqs
    raise errors.InvalidValue("", "agg", agg, f"one of {AGG_MODES}")


def kl_penalty(
    *, logps: Float[Array, "B T"], ref_logps: Float[Array, "B T"], estimator: str
) -> Float[Array, "B T"]:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1, with
    verl's `kl_penalty` guards: ref - logp clamped to [-20, 20] before exp, k3 to [-10, 10].
    """
    diff = logps - ref_logps  # [B, T]
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * jnp.square(diff)
    if estimator == "k3":
        log_ratio = jnp.clip(-diff, -20.0, 20.0)  # [B, T] log(pi_ref / pi)
        return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise errors.InvalidValue("", "estimator", estimator, f"one of {KL_ESTIMATORS}")


def _ppo_clip(
    ratio: Float[Array, "B T"], low, high, advantages: Float[Array, "B T"]
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """verl's clipped surrogate max(-A r, -A clip(r, low, high)) and its clip indicators."""
    unclipped = -advantages * ratio  # [B, T] pg_losses1
    clipped = -advantages * jnp.clip(ratio, low, high)  # [B, T] pg_losses2
    # pg_losses2 > pg_losses1 exactly when A > 0 and r > high, or A < 0 and r < low.
    indicators = {
        "clip_frac_low": (ratio < low) & (advantages < 0),
        "clip_frac_high": (ratio > high) & (advantages > 0),
    }
    return jnp.maximum(unclipped, clipped), indicators


def _ratio_metrics(ratio, indicators, mask) -> dict[str, Array]:
    metrics = {name: _token_mean(ind, mask) for name, ind in indicators.items()}
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    metrics["ratio_mean"] = _token_mean(ratio, mask)
    metrics["ratio_max"] = _select(ratio, mask).max()  # ratios are > 0, so padding (0) never wins
    return metrics


def _output(num, den, metrics) -> types.LossOutput:
    return types.LossOutput(numerator=num, denominator=den, metrics=metrics)


def _aggregated(cfg: LossConfig, batch: Batch, token_losses, metrics) -> types.LossOutput:
    """Per-token losses, weighted by the sampler's IS weights plus the penalty, aggregated as
    `cfg` says (`aggregate`)."""
    weighted = batch.is_weights * token_losses + batch.penalty  # [B, T]
    num, den = aggregate(weighted, batch.mask, agg=cfg.agg_mode, norm_length=cfg.norm_length)
    return _output(num, den, metrics)


# ---- losses -----------------------------------------------------------------------------------
@register("grpo", clip_low=0.2, clip_high=0.2, agg="token-mean")
def grpo_loss(cfg: LossConfig, batch: Batch) -> types.LossOutput:
    """PPO/GRPO clipped surrogate on token ratios (verl `compute_policy_loss_vanilla`).

    r_t = exp(clamp(logp_t - old_t, -20, 20)),
    l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),
    dual clip (c = dual_clip, only where A < 0): l_t = min(l_t, -A c); then l_t <- w_t l_t.
    Departures from the GRPO paper (DeepSeekMath): default aggregation token-mean (DAPO's; the
    paper's is seq-mean-token-mean, available via `agg`); KL off by default (the paper uses k3
    with beta 0.04: kl_coef=0.04, kl_estimator="k3"); asymmetric clip and dual clip from verl,
    which always applies dual clip with c = 3, whereas here it is off unless dual_clip is set.
    """
    log_ratio = jnp.clip(batch.logps - batch.old_logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)  # [B, T]
    a = batch.advantages
    token_losses, indicators = _ppo_clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, a)
    metrics = _ratio_metrics(ratio, indicators, batch.mask)
    if cfg.dual_clip is not None:
        dual_bound = -a * cfg.dual_clip  # [B, T] pg_losses3
        metrics["dual_clip_frac"] = _token_mean((token_losses > dual_bound) & (a < 0), batch.mask)
        token_losses = jnp.where(a < 0, jnp.minimum(token_losses, dual_bound), token_losses)
    return _aggregated(cfg, batch, token_losses, metrics)


@register("gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean")
def gspo_loss(cfg: LossConfig, batch: Batch) -> types.LossOutput:
    """GSPO-token (arXiv 2507.18071 Eq. 3; verl `compute_policy_loss_gspo`).

    s_i = exp(mean_{t valid} (logp_t - old_t)), the length-normalised sequence ratio;
    log s_{i,t} = min(sg[log s_i] + logp_t - sg[logp_t], 10), so s_{i,t} has value s_i and
    gradient s_i grad logp_t; l_t = w_t max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_lo, 1 + eps_hi)).
    Sampler correction: w_t (`espo.correction`, pi_old / pi_sampler, 1 when off) multiplies the
    clipped term and stays outside s_i: s_i is the trust-region ratio pi / pi_old, which decides
    the clip; w corrects for sampling from pi_sampler. With rollout_is="sequence", w_t = w_i and
    sequence i's objective is w_i max(-A s_i, -A clip(s_i)), gradient w_i s_i A grad mean logp_t.
    Defaults eps = (3e-4, 4e-4), seq-mean-token-mean. With a sequence-level A this is exactly
    GSPO's sequence objective. Departures: the <= 10 clamp is verl's (the paper has none); verl
    forces seq-mean-token-mean, here `agg` may override it.
    """
    log_ratio = batch.logps - batch.old_logps  # [B, T]
    num_valid = jnp.maximum(batch.mask.sum(-1), 1).astype(jnp.float32)  # [B]
    seq_log_ratio = _select(log_ratio, batch.mask).sum(-1) / num_valid  # [B]
    log_ratio = _sg(seq_log_ratio)[:, None] + batch.logps - _sg(batch.logps)  # [B, T]
    ratio = jnp.exp(jnp.minimum(log_ratio, SEQ_LOG_RATIO_MAX))  # [B, T]
    token_losses, indicators = _ppo_clip(
        ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, batch.advantages
    )
    return _aggregated(cfg, batch, token_losses, _ratio_metrics(ratio, indicators, batch.mask))


def entropy_groups(
    entropies: Float[Array, "B T"],
    mask: Mask,
    *,
    top_frac: float,
    num_groups: int,
    scope: str = "sequence",
) -> Int[Array, "B T"]:
    """ESPO's entropy group of every token: 0 = highest entropy, num_groups - 1 = lowest.

    Among the n valid tokens of a sequence (scope="sequence") or of the whole batch
    (scope="batch"), group 0 holds the ceil(top_frac n) highest entropies and the remaining
    tokens are split evenly by entropy rank: group k < num_groups - 1 ends at the cumulative
    fraction q_k = top_frac + k (1 - top_frac) / (num_groups - 1). Each boundary is a threshold,
    the ceil(q_k n)-th largest valid entropy (a masked order statistic found by sorting, fixed
    shapes), and a token is in the first group whose threshold it reaches (entropy >= thr).
    Ties: tokens equal to a threshold join the higher-entropy group, so a group can be larger
    than its quota (all-equal entropies put every token in group 0). ceil uses a 1e-6 relative
    slack so float32 rounding of q n never adds a token. Padding (whatever it holds) reads as
    -inf, so it moves no threshold and lands in the last group; callers select with the mask.
    """
    if scope not in QUANTILE_SCOPES:
        raise errors.InvalidValue("", "scope", scope, f"one of {QUANTILE_SCOPES}")
    valid = mask.astype(bool)
    if num_groups == 1:
        return jnp.zeros(valid.shape, jnp.int32)
    token_scores = jnp.where(valid, entropies.astype(jnp.float32), -jnp.inf)  # [B, T]
    scores = token_scores
    if scope == "batch":
        scores, valid = token_scores.reshape(1, -1), valid.reshape(1, -1)  # [1, B*T]
    descending = jnp.sort(scores, axis=-1)[:, ::-1]  # [B', T'], padding (-inf) last
    num_valid = valid.sum(-1).astype(jnp.float32)  # [B']
    fracs = [top_frac + k * (1.0 - top_frac) / (num_groups - 1) for k in range(num_groups - 1)]
    thresholds = []
    for q in fracs:
        count = jnp.ceil(q * num_valid * (1.0 - 1e-6))  # [B']
        count = jnp.clip(count, 1.0, jnp.maximum(num_valid, 1.0)).astype(jnp.int32)  # [B']
        thresholds.append(jnp.take_along_axis(descending, count[:, None] - 1, axis=-1))  # [B', 1]
    thresholds = jnp.concatenate(thresholds, axis=-1)  # [B', num_groups - 1], non-increasing
    below = token_scores[..., None] < thresholds[:, None, :]  # [B, T, K - 1]
    return below.sum(-1).astype(jnp.int32)  # [B, T]


@register("espo", clip_low=None, clip_high=None, agg=None)
def espo_loss(cfg: LossConfig, batch: Batch) -> types.LossOutput:
    """ESPO (arXiv 2512.00499): entropy-grouped importance sampling, entropy-adaptive clipping.

    Tokens of sequence i are split into entropy groups g by `entropy_groups` (old-policy
    entropies e_t). Per group, with |g| its valid tokens:
      s_g   = exp(mean_{t in g} (logp_t - old_t))               (Eq. 9, geometric-mean ratio)
      eps_g = alpha * mean_{t in g} e_t / log|V|                  (Eq. 8, mean-entropy reading)
      log s_{g,t} = min(sg[log s_g] + logp_t - sg[logp_t], 10)   (espo_ratio="gspo_token")
                  = min(sg[log s_g] + logp_t - old_t, 10)        (espo_ratio="literal", Eq. 9 as
                                                                  printed: value s_g r_t)
      l_t   = w_t max(-A s_{g,t}, -A clip(s_{g,t}, 1 - eps_g, 1 + eps_g))
      loss  = mean_i mean_{non-empty g} mean_{t in g} (l_t + kl_t)  (Eq. 5)
    w_t is the sampler correction (`espo.correction`, pi_old / pi_sampler; 1 when off): it
    multiplies each token's clipped term before the group means and stays outside s_g, which is
    the trust-region ratio pi / pi_old that decides the clip (as in GSPO); with
    rollout_is="sequence" every token of sequence i has w_i, so each group's term is scaled by w_i.
    Rejected tokens (rollout_rs) are masked: they join no group and move no threshold.
    Default "gspo_token": value s_g shared by the group (group-level clip decisions), gradient
    s_g grad logp_t, matching the GSPO-token form the paper builds on. Departures / readings:
    Eq. 8 is printed with a single e_t, read as the group mean; the <= 10 clamp is borrowed
    from verl GSPO; the grouping proportions for num_groups > 2 and ties are ours (see
    `entropy_groups`); with num_groups=1 this is GSPO with symmetric eps = alpha mean(e)/log|V|.
    Validity (Eq. 11's 1[i in G], G = members with a valid reward, docs/formulas.md §2.6): the
    advantages normalise over valid members only, and the trainer passes `mask & valid[:, None]`,
    so an invalid member has no token here: no group, no threshold in batch scope, and it leaves
    the mean over sequences (the denominator counts sequences with a valid token). Read
    literally, Eq. 5 would keep it in 1/G with A = 0 and shrink the others' step; here it
    contributes nothing at all (issue 7 #2). Rows dropped by `overlong_filter` leave the same way.
    """
    mask = batch.mask
    groups = entropy_groups(
        batch.entropies,
        mask,
        top_frac=cfg.top_frac,
        num_groups=cfg.num_entropy_groups,
        scope=cfg.quantile_scope,
    )  # [B, T]
    group_mask = (groups[..., None] == jnp.arange(cfg.num_entropy_groups)) & mask[
        ..., None
    ]  # [B, T, K]
    group_size = group_mask.astype(jnp.float32).sum(1)  # [B, K] valid tokens per group
    safe_size = jnp.maximum(group_size, 1.0)  # [B, K]

    def group_mean(x):  # [B, T] -> [B, K]; select-and-sum, not einsum, to stay in float32
        return _select(x[..., None], group_mask).sum(1) / safe_size

    def to_tokens(x):  # [B, K] -> [B, T], each token reads its own group's value
        return _select(x[:, None, :], group_mask).sum(-1)

    log_ratio = batch.logps - batch.old_logps  # [B, T]
    group_log_ratio = group_mean(log_ratio)  # [B, K] log s_g
    group_eps = cfg.alpha * group_mean(batch.entropies) / math.log(cfg.vocab_size)  # [B, K]
    eps = to_tokens(group_eps)  # [B, T]
    local = log_ratio if cfg.espo_ratio == "literal" else batch.logps - _sg(batch.logps)
    combined = _sg(to_tokens(group_log_ratio)) + local  # [B, T]
    ratio = jnp.exp(jnp.minimum(combined, SEQ_LOG_RATIO_MAX))  # [B, T]
    token_losses, indicators = _ppo_clip(ratio, 1.0 - eps, 1.0 + eps, batch.advantages)
    group_losses = group_mean(batch.is_weights * token_losses + batch.penalty)  # [B, K]
    num_groups = (group_size > 0).astype(jnp.float32).sum(-1)  # [B] non-empty groups
    seq_losses = group_losses.sum(-1) / jnp.maximum(num_groups, 1.0)  # [B]
    denominator = (num_groups > 0).astype(jnp.float32).sum()

    metrics = _ratio_metrics(ratio, indicators, mask)
    metrics["espo_eps_mean"] = _token_mean(eps, mask)
    clipped = indicators["clip_frac_low"] | indicators["clip_frac_high"]  # [B, T]
    for k in range(cfg.num_entropy_groups):
        in_group = group_mask[..., k]  # [B, T]
        metrics[f"clip_frac_group{k}"] = _token_mean(clipped, in_group)
        metrics[f"espo_eps_group{k}"] = _token_mean(eps, in_group)
        metrics[f"num_tokens_group{k}"] = in_group.astype(jnp.float32).sum()
    return _output(seq_losses.sum(), denominator, metrics)


@register("cispo", clip_low=1.0, clip_high=0.28, agg="token-mean")
def cispo_loss(cfg: LossConfig, batch: Batch) -> types.LossOutput:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

    r_t = exp(clamp(logp_t - old_t, -20, 20)); l_t = -w_t sg[clip(r_t, 1 - eps_low, 1 + eps_high)]
    A logp_t (w_t the sampler correction, 1 when off); token-mean. Every token keeps a gradient,
    -w_t clip(r_t) A grad logp_t. Defaults: eps_high = 0.28 (as DAPO's clip-higher; the paper
    tunes only eps_high), eps_low = 1.0, i.e. lower bound 0: no lower clip, as the paper sets
    eps_low "large". Unlike PPO, the clip metrics count every weight outside the range whatever
    the sign of A. The loss value (not its gradient) depends on logp itself, so it is not
    comparable across losses.
    """
    log_ratio = jnp.clip(batch.logps - batch.old_logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)  # [B, T]
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = _sg(jnp.clip(ratio, low, high))  # [B, T]
    token_losses = -weight * batch.advantages * batch.logps  # [B, T]
    indicators = {"clip_frac_low": ratio < low, "clip_frac_high": ratio > high}
    return _aggregated(cfg, batch, token_losses, _ratio_metrics(ratio, indicators, batch.mask))


# ---- entry point ------------------------------------------------------------------------------
def compute_loss(
    cfg: LossConfig,
    *,
    logps: Float[Array, "B T"],
    old_logps: Float[Array, "B T"],
    advantages: Float[Array, "B T"] | Float[Array, " B"],
    mask: Mask,
    entropies: Float[Array, "B T"] | None = None,
    ref_logps: Float[Array, "B T"] | None = None,
    finished: Bool[Array, " B"] | None = None,
    sampler_logps: Float[Array, "B T"] | None = None,
) -> types.LossOutput:
    """The `cfg.name` loss of one (micro-)batch as numerator / denominator plus metrics.

    `mask` selects the loss tokens (True, or a float > 0); the trainer passes
    `mask & valid[:, None]` so a failed reward sample has no token and contributes nothing.
    `finished` [B] (the rollout's EOS flag) is required by `cfg.overlong_filter`, which then also
    drops rows with finished=False (DAPO overlong filtering), as if their mask were 0.
    `sampler_logps` [B, T] (the rollout's log-probs) is required by `cfg.rollout_is` /
    `cfg.rollout_rs` (`espo.correction`): tokens it rejects are masked like padding, and its IS
    weights multiply each loss's policy-gradient term (never the KL penalty).
    Every input is selected with the mask before any arithmetic (see the module docstring).

    Shared metrics: num_tokens, num_seqs (sequences with a valid token); approx_kl = token mean
    of k3 for KL(pi_old || pi) = (r - 1) - log r, r = exp(clamp(logp - old, +-20)) (>= 0, low
    variance); ppo_kl = token mean of old - logp (verl's k1 `ppo_kl`); entropy = token mean of
    `entropies` when given; kl = token mean of the KL estimate (before kl_coef) when kl_coef > 0.
    With `finished`: num_truncated (sequences with a valid token and no EOS, counted before the
    filter) and num_overlong_filtered (those the filter removed: num_truncated, or 0 when off).
    Per loss: clip_frac(_low/_high), ratio_mean, ratio_max, and dual_clip_frac / espo_* extras.
    """
    if cfg.name == "espo" and entropies is None:
        raise ValueError("espo needs `entropies` (old-policy token entropies [B, T]); got None")
    if cfg.kl_coef > 0 and ref_logps is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs `ref_logps` [B, T]; got None")
    if cfg.overlong_filter and finished is None:
        raise ValueError("overlong_filter=True needs `finished` [B] (False = truncated); got None")
    corrected = cfg.rollout_is != "none" or cfg.rollout_rs != "none"
    if corrected and sampler_logps is None:
        raise ValueError(
            f"rollout_is={cfg.rollout_is!r}, rollout_rs={cfg.rollout_rs!r} need `sampler_logps`"
            " [B, T]; got None"
        )

    def f32(x, *, grad=False):
        x = None if x is None else jnp.asarray(x).astype(jnp.float32)
        return x if grad or x is None else _sg(x)

    logps, old_logps, advantages = f32(logps, grad=True), f32(old_logps), f32(advantages)
    entropies, ref_logps, sampler_logps = f32(entropies), f32(ref_logps), f32(sampler_logps)
    mask = jnp.asarray(mask) > 0  # [B, T] bool
    shape = logps.shape
    if logps.ndim != 2:
        raise ValueError(f"logps must be [B, T], got shape {shape}")
    named = dict(
        old_logps=old_logps,
        mask=mask,
        entropies=entropies,
        ref_logps=ref_logps,
        sampler_logps=sampler_logps,
    )
    for field, value in named.items():
        if value is not None and value.shape != shape:
            raise ValueError(f"{field} must have the shape of logps {shape}, got {value.shape}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [B] or [B, T]={shape}, got {advantages.shape}")
    if advantages.ndim == 1:
        advantages = advantages[:, None]  # [B, 1]
    advantages = jnp.broadcast_to(advantages, shape)  # [B, T]

    metrics = {}
    if finished is not None:
        finished = jnp.asarray(finished).astype(bool)  # [B]
        if finished.shape != shape[:1]:
            raise ValueError(f"finished must be [B]={shape[:1]}, got shape {finished.shape}")
        truncated = mask.any(-1) & ~finished  # [B] sequences with tokens and no EOS
        metrics["num_truncated"] = truncated.astype(jnp.float32).sum()
        filtered = truncated if cfg.overlong_filter else jnp.zeros_like(truncated)  # [B]
        metrics["num_overlong_filtered"] = filtered.astype(jnp.float32).sum()
        mask = mask & ~filtered[:, None]  # [B, T]
    is_weights = jnp.ones(shape, jnp.float32)  # [B, T]
    if corrected:  # rejected tokens leave the mask before anything reads it
        fix = correction.correct(cfg, old_logps=old_logps, sampler_logps=sampler_logps, mask=mask)
        is_weights, mask = fix.weights, fix.keep_mask

    # Select before any arithmetic: padding may hold inf/NaN; with 0 everywhere outside the mask
    # every ratio there is 1 and every gradient through the select is exactly 0.
    logps, old_logps, advantages = (_select(x, mask) for x in (logps, old_logps, advantages))
    entropies, ref_logps = (None if x is None else _select(x, mask) for x in (entropies, ref_logps))

    metrics["num_tokens"] = mask.astype(jnp.float32).sum()
    metrics["num_seqs"] = mask.any(-1).astype(jnp.float32).sum()
    log_ratio = jnp.clip(logps - old_logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    metrics["approx_kl"] = _sg(_token_mean(jnp.expm1(log_ratio) - log_ratio, mask))
    metrics["ppo_kl"] = _sg(_token_mean(-log_ratio, mask))
    if entropies is not None:
        metrics["entropy"] = _token_mean(entropies, mask)
    penalty = jnp.zeros(shape, jnp.float32)
    if cfg.kl_coef > 0:
        kl = kl_penalty(logps=logps, ref_logps=ref_logps, estimator=cfg.kl_estimator)  # [B, T]
        penalty = cfg.kl_coef * kl  # [B, T]
        metrics["kl"] = _sg(_token_mean(kl, mask))

    batch = Batch(logps, old_logps, advantages, mask, entropies, penalty, is_weights)
    out = LOSSES[cfg.name].fn(cfg, batch)
    metrics.update(gradient_use(cfg, batch))
    metrics.update({name: _sg(value).astype(jnp.float32) for name, value in out.metrics.items()})
    return _output(out.numerator, out.denominator, metrics)


def gradient_use(cfg: LossConfig, batch: Batch) -> dict[str, Float[Array, ""]]:
    """Gradient utilisation (the ESPO paper's comparison): which loss tokens the update moves.

    A token is live when the policy-gradient term's derivative w.r.t. its log-prob is nonzero
    (the KL penalty left out): it is dead when its advantage is 0, when its ratio is clipped (the
    token's, or for GSPO / ESPO its sequence's or entropy group's), or when its IS weight is 0.
    grad_token_frac = live share of the loss tokens. With entropies, per ESPO entropy group k
    (`entropy_groups` with top_frac / num_entropy_groups / quantile_scope, for every loss; 0 = the
    highest entropies): grad_frac_group{k} = live share, clipped_frac_group{k} = share with a
    nonzero advantage and no gradient, grad_adv_frac_group{k} = the share of the group's advantage
    mass sum |A| on live tokens (the signal the update keeps, weighted by how much each token
    carries; 1 when nothing with an advantage is clipped).
    """
    pg = batch._replace(logps=_sg(batch.logps), penalty=jnp.zeros_like(batch.penalty))
    numerator = lambda lp: LOSSES[cfg.name].fn(cfg, pg._replace(logps=lp)).numerator
    live = (jax.grad(numerator)(pg.logps) != 0) & batch.mask  # [B, T]
    out = {"grad_token_frac": _token_mean(live, batch.mask)}
    if batch.entropies is not None:
        groups = entropy_groups(
            batch.entropies, batch.mask, top_frac=cfg.top_frac, num_groups=cfg.num_entropy_groups,
            scope=cfg.quantile_scope,
        )  # fmt: skip
        signal = batch.advantages != 0  # [B, T]
        for k in range(cfg.num_entropy_groups):
            in_group = batch.mask & (groups == k)
            out[f"grad_frac_group{k}"] = _token_mean(live, in_group)
            out[f"clipped_frac_group{k}"] = _token_mean(signal & ~live, in_group)
            weight = jnp.where(in_group, jnp.abs(batch.advantages), 0.0)  # [B, T]
            out[f"grad_adv_frac_group{k}"] = jnp.where(live, weight, 0.0).sum() / jnp.maximum(
                weight.sum(), 1e-12
            )
    return {name: _sg(value) for name, value in out.items()}
