"""Off-policy correction between sampler and trainer: truncated IS and rejection (TIS / MIS).

The rollout engine samples from pi_sampler (FP8 weights, possibly other expert routes); the loss
takes its trust-region ratio against pi_old, recomputed by the trainer. The per-token ratio

    rho_t = pi_old(y_t) / pi_sampler(y_t) = exp(clamp(old_t - sampler_t, -20, 20))    (float32)

corrects for sampling from the wrong policy (the decoupled PPO objective; verl
`rollout_correction`, TRL `vllm_importance_sampling_mode`, OpenRLHF `is_correction_type`).
The sequence ratio is the geometric mean over the valid tokens n_i of sequence i, as GSPO's s_i:

    rho_i = exp(mean_{t valid} clamp(old_t - sampler_t, -20, 20))

Two independent options of `losses.LossConfig`, both read from the tokens of `mask` (the loss
tokens before any rejection):
- IS weight (`rollout_is`, truncated IS with cap C = `rollout_is_cap`):
    "none"      w_t = 1
    "token"     w_t = min(rho_t, C)        (verl TIS, C = 2)
    "sequence"  w_t = min(rho_i, C)        for every token of sequence i
- Rejection (`rollout_rs`, masked IS), band [low, high] (`rollout_rs_low`, `rollout_rs_high`):
    "none"      nothing rejected
    "token"     token t rejected when rho_t is outside [low, high]     (default band [0.5, 2])
    "sequence"  sequence i rejected when rho_i is outside [low, high]  (default band [0.5, 2])
    "icepop"    as "token", with IcePop's default band [0.5, 5]
  The [0.5, 2] default is verl's (`rollout_rs_threshold` 2, lower bound 1 / threshold).
Invariants:
- A rejected token leaves the loss mask (`keep_mask`): it is exactly a masked token, so it has
  no loss, no gradient, and leaves every denominator (token counts, n_i, sequence counts, ESPO's
  groups); counting it as a zero-loss token (a known bug elsewhere) would shrink the step.
- Weights are stop-gradient float32, 0 off `keep_mask`. `espo.losses` multiplies the per-token
  policy-gradient term of every loss by w_t, never the KL penalty (its docstrings say where).
- Everything is per row, so micro-batches of whole rows see the same weights as the full batch.
- Padding (outside `mask`) may hold anything: it is selected away before any arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

IS_MODES = ("none", "token", "sequence")
RS_MODES = ("none", "token", "sequence", "icepop")
RS_BANDS = {"token": (0.5, 2.0), "sequence": (0.5, 2.0), "icepop": (0.5, 5.0)}
LOG_RATIO_CLAMP = 20.0  # as espo.losses: |log rho| <= 20 before exp


class Options(Protocol):
    """The correction fields of `espo.losses.LossConfig` (validated there)."""

    rollout_is: str
    rollout_is_cap: float
    rollout_rs: str
    rollout_rs_low: float | None
    rollout_rs_high: float | None


class Correction(NamedTuple):
    weights: Float[Array, "B T"]  # IS weights w_t (1 with rollout_is="none"), 0 off keep_mask
    keep_mask: Bool[Array, "B T"]  # mask minus the rejected tokens: the loss tokens
    metrics: dict[str, Float[Array, ""]]  # see `correct`


def rs_band(mode: str, low: float | None, high: float | None) -> tuple[float, float]:
    """The rejection band [low, high] of `mode`, None meaning the mode's default bound."""
    default_low, default_high = RS_BANDS.get(mode, (0.0, float("inf")))
    return (
        default_low if low is None else float(low),
        default_high if high is None else float(high),
    )


def correct(
    cfg: Options,
    *,
    old_logps: Float[Array, "B T"],
    sampler_logps: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
) -> Correction:
    """IS weights, the mask after rejection, and their metrics (module docstring).

    Metrics (float32 scalars): is_weight_mean and is_weight_max over the kept tokens,
    is_clipped_frac = kept tokens whose ratio exceeded the cap (0 with rollout_is="none"),
    rs_masked_frac = rejected / valid tokens, rs_masked_seq_frac = sequences with a rejected
    token / sequences with a valid token.
    """
    mask = jnp.asarray(mask).astype(bool)  # [B, T]
    old, sampler = (
        jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0) for x in (old_logps, sampler_logps)
    )
    log_rho = jnp.clip(old - sampler, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T], 0 off mask
    num_valid = mask.astype(jnp.float32).sum(-1)  # [B]
    seq_log_rho = log_rho.sum(-1) / jnp.maximum(num_valid, 1.0)  # [B] log of the geometric mean

    def ratio(mode: str) -> Float[Array, "B T"]:
        per_token = seq_log_rho[:, None] if mode == "sequence" else log_rho  # [B, 1] or [B, T]
        return jnp.broadcast_to(jnp.exp(per_token), mask.shape)  # [B, T]

    keep = mask
    if cfg.rollout_rs != "none":
        low, high = rs_band(cfg.rollout_rs, cfg.rollout_rs_low, cfg.rollout_rs_high)
        rho = ratio(cfg.rollout_rs)  # [B, T]
        keep = mask & (rho >= low) & (rho <= high)  # [B, T]
    if cfg.rollout_is == "none":
        weights = jnp.ones(mask.shape, jnp.float32)  # [B, T]
        clipped = jnp.zeros(mask.shape, bool)  # [B, T]
    else:
        rho = ratio(cfg.rollout_is)  # [B, T]
        weights = jnp.minimum(rho, cfg.rollout_is_cap)  # [B, T]
        clipped = rho > cfg.rollout_is_cap  # [B, T]
    weights = jax.lax.stop_gradient(jnp.where(keep, weights, 0.0))  # [B, T]

    num_kept = jnp.maximum(keep.sum(), 1).astype(jnp.float32)
    rejected = mask & ~keep  # [B, T]
    num_seqs = jnp.maximum((num_valid > 0).sum(), 1).astype(jnp.float32)
    metrics = {
        "is_weight_mean": weights.sum() / num_kept,
        "is_weight_max": weights.max(),  # weights are > 0 on kept tokens, 0 elsewhere
        "is_clipped_frac": (clipped & keep).sum() / num_kept,
        "rs_masked_frac": rejected.sum() / jnp.maximum(mask.sum(), 1).astype(jnp.float32),
        "rs_masked_seq_frac": rejected.any(-1).sum() / num_seqs,
    }
    return Correction(weights=weights, keep_mask=keep, metrics=jax.lax.stop_gradient(metrics))
