"""Scalar reward models and the adjustment that stops advantage inversion (docs/formulas.md §1.5).

This module owns:
  * the measurement of advantage inversion: `inversion_rate` (per rollout: the advantage's sign
    against the rollout's true quality relative to its group), `pairwise_inversion_rate` (per
    within-group pair) and `sign_agreement_rate` (how much correct-sign signal survives, so an
    adjustment cannot score well by zeroing advantages);
  * `adjust_rewards`: reward-model scores [P, G] -> rewards [P, G] through three switchable steps
    configured by `RmAdjustConfig`: a correctness tier, a tie dead-zone and within-tier ranks;
  * a small Bradley–Terry (BT) reward model, a scalar head on the espo backbone's final hidden
    state: `init_reward_model`, `reward_scores`, `bradley_terry_loss`, `make_train_step`.

Layout: rewards, scores and advantages are [P, G] (P prompts, G rollouts each, in group order),
as in `espo.advantages`. Everything is float32, pure and jittable (configs are static).

Why inversion happens: a BT model is trained on orderings only, so its scale is arbitrary and its
noise is of the order of the score gaps between near-equal responses. GRPO's (r - mean) / std
blows that noise up to unit-size advantages of random sign in groups whose rollouts are (nearly)
equally good, and a BT score does not know that a correct answer should outweigh any amount of
style, so in a group mixing both a correct rollout can sink below the mean. The adjustment puts
correctness (from the verifier) first, lets the RM order rollouts only within a tier, treats RM
differences below its noise as ties, and uses ranks, which bound the RM's influence.

The paper's own fix is a generative pairwise judge with an explicit Tie class (`judge.py`);
this module is the scalar-RM counterpart. Its defaults are safe at any G: the tier margin is
derived from G (`margin_bound`: a correct rollout can never get a negative advantage, nor a wrong
one a positive one) and the tie band is DEFAULT_DEAD_ZONE in BT logits, measured on the synthetic
task of experiments/repro_inversion.py; recalibrate it for scores that are not BT logits.
"""

from __future__ import annotations

import dataclasses
import math as pymath
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from espo import errors, model

# ---- measuring inversion ---------------------------------------------------------------------
# The measures are jitted: the trainer's RM stage calls them on host arrays every step, where
# op by op each call compiled ~10 small programs (for each new shape: the mixed groups' count
# varies from step to step).


def _signs(x: Float[Array, "P G"], tol: float) -> Int[Array, "P G"]:
    """-1 / 0 / +1 with |x| <= tol read as 0."""
    return jnp.where(x > tol, 1, jnp.where(x < -tol, -1, 0))


def _check_pair(advantages, true_quality):
    advantages = jnp.asarray(advantages, jnp.float32)
    true_quality = jnp.asarray(true_quality, jnp.float32)
    if advantages.ndim != 2 or advantages.shape != true_quality.shape:
        raise ValueError(
            f"advantages and true_quality must both be [P, G]; got {advantages.shape} and "
            f"{true_quality.shape}"
        )
    return advantages, true_quality


@jax.jit
def inversion_rate(
    advantages: Float[Array, "P G"],
    *,
    true_quality: Float[Array, "P G"],
    tie_tol: float = 1e-6,
    adv_tol: float = 1e-6,
) -> Float[Array, " "]:
    """Fraction of the P*G rollouts whose advantage points the wrong way.

    With d_i = q_i - mean_group(q), s_q = sign(d_i) where |d_i| <= tie_tol counts as 0 (the
    rollout is as good as its group's average) and s_A = sign(A_i) where |A_i| <= adv_tol
    counts as 0 (no push either way), rollout i is inverted when
      * s_q * s_A < 0: better than its group but pushed down, or worse but pushed up; or
      * s_q == 0 and s_A != 0: of (near-)mean quality yet pushed, the sign flip of the paper's
        "equally good responses get +/- advantages".
    A rollout with s_q != 0 and s_A == 0 is not inverted (its signal is lost, not reversed);
    `sign_agreement_rate` measures that loss.
    """
    advantages, true_quality = _check_pair(advantages, true_quality)
    s_q = _signs(true_quality - true_quality.mean(-1, keepdims=True), tie_tol)  # [P, G]
    s_a = _signs(advantages, adv_tol)  # [P, G]
    inverted = (s_q * s_a < 0) | ((s_q == 0) & (s_a != 0))  # [P, G]
    return inverted.astype(jnp.float32).mean()


@jax.jit
def sign_agreement_rate(
    advantages: Float[Array, "P G"],
    *,
    true_quality: Float[Array, "P G"],
    tie_tol: float = 1e-6,
    adv_tol: float = 1e-6,
) -> Float[Array, " "]:
    """Among rollouts not of mean quality (|q_i - mean| > tie_tol), the fraction whose advantage
    has the right sign (|A_i| > adv_tol and sign(A_i) == sign(q_i - mean)); 0 when none are."""
    advantages, true_quality = _check_pair(advantages, true_quality)
    s_q = _signs(true_quality - true_quality.mean(-1, keepdims=True), tie_tol)  # [P, G]
    s_a = _signs(advantages, adv_tol)  # [P, G]
    decided = (s_q != 0).astype(jnp.float32)  # [P, G]
    right = ((s_q == s_a) & (s_q != 0)).astype(jnp.float32)  # [P, G]
    return right.sum() / jnp.maximum(decided.sum(), 1.0)


@jax.jit
def pairwise_inversion_rate(
    advantages: Float[Array, "P G"],
    *,
    true_quality: Float[Array, "P G"],
    tie_tol: float = 1e-6,
    adv_tol: float = 1e-6,
) -> Float[Array, " "]:
    """Among within-group ordered pairs (q_i - q_j > tie_tol), the fraction with A_j - A_i >
    adv_tol: the better rollout got the smaller advantage. Pairs whose advantages are equal
    within adv_tol are not inverted (signal lost, not reversed). Pairs of equal quality are not
    counted (see `inversion_rate` for them). 0 when no group has an ordered pair."""
    advantages, true_quality = _check_pair(advantages, true_quality)
    ordered = (true_quality[:, :, None] - true_quality[:, None, :]) > tie_tol  # [P, G, G]
    reversed_ = (advantages[:, None, :] - advantages[:, :, None]) > adv_tol  # [P, G, G]
    num_ordered = ordered.astype(jnp.float32).sum()
    return (ordered & reversed_).astype(jnp.float32).sum() / jnp.maximum(num_ordered, 1.0)


@jax.jit
def tied_pair_split_rate(
    advantages: Float[Array, "P G"],
    *,
    true_quality: Float[Array, "P G"],
    tie_tol: float = 1e-6,
    adv_tol: float = 1e-6,
) -> Float[Array, " "]:
    """Among within-group unordered pairs of equal quality (|q_i - q_j| <= tie_tol, i < j), the
    fraction whose advantages have opposite signs (one > adv_tol, the other < -adv_tol): equally
    good responses pushed apart, the paper's inversion among ties. `pairwise_inversion_rate` is
    its counterpart over pairs of different quality. 0 when no group has a tied pair."""
    advantages, true_quality = _check_pair(advantages, true_quality)
    G = true_quality.shape[-1]
    upper = jnp.triu(jnp.ones((G, G), bool), k=1)  # [G, G] i < j
    tied = upper & (jnp.abs(true_quality[:, :, None] - true_quality[:, None, :]) <= tie_tol)
    s_a = _signs(advantages, adv_tol)  # [P, G]
    split = (s_a[:, :, None] * s_a[:, None, :]) < 0  # [P, G, G]
    num_tied = tied.astype(jnp.float32).sum()
    return (tied & split).astype(jnp.float32).sum() / jnp.maximum(num_tied, 1.0)


# ---- adjusting RM scores ---------------------------------------------------------------------


# The default tie band, in Bradley-Terry logits: RM score gaps below it are read as noise (a gap
# d means the RM prefers one response with probability sigmoid(d); sigmoid(0.75) = 0.68).
# Chosen by `python experiments/repro_inversion.py --sweep-dead-zone` (trained BT models,
# seeds 0-4, G = 8): inversion 0.308 at 0 -> 0.015 at 0.75 with sign agreement 0.971 -> 0.984;
# larger zones swallow real differences (agreement 0.964 at 1.0, 0.795 at 2.0). The table is
# DEAD_ZONE_SWEEP in that script's docstring.
DEFAULT_DEAD_ZONE = 0.75


def margin_bound(group_size: int, *, rank: bool) -> float:
    """The largest tier margin (exclusive) under which no tier can invert, for groups of G.

    With ranks, x sums to 0 over each tier, so mean_group(r) = f (the fraction correct) and a
    correct rollout's centred reward is 1 - f + margin * x >= 1/G - margin when f <= (G-1)/G;
    a wrong one's is -f + margin * x <= margin - 1/G. Both keep their sign iff margin < 1/G.
    Without ranks x = tanh(.) in (-1, 1) need not sum to 0, and x_i - mean(x) spans (-2, 2):
    margin < 1/(2G). Capped at 0.5 so tiers never overlap (r = tier + margin * x, |x| <= 1).
    """
    per_rollout = 1.0 / group_size if rank else 0.5 / group_size
    return min(0.5, per_rollout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RmAdjustConfig:
    """Switches of `adjust_rewards`. Defaults: every step on, the margin derived from G, the
    dead-zone DEFAULT_DEAD_ZONE (in BT logits; recalibrate for a reward model whose scores are
    not BT logits, e.g. as experiments/repro_inversion.py does on tie-labelled pairs)."""

    tiered: bool = True  # (a) verified-correct rollouts outrank incorrect ones (needs `correct`)
    # (a) RM span inside a tier, r = tier + margin * x. None: half of margin_bound(G), derived
    # per call from the group size; a number must be in (0, 0.5) and below margin_bound(G).
    margin: float | None = None
    dead_zone: float = DEFAULT_DEAD_ZONE  # (b) delta: RM gaps below it are ties
    rank: bool = True  # (c) x = within-tier rank (ties averaged) mapped to [-1, 1]
    squash_scale: float = 1.0  # x = tanh((s - tier mean) / squash_scale) when tiered, not rank

    def __post_init__(self) -> None:
        for name in ("tiered", "rank"):
            if not isinstance(getattr(self, name), bool):
                raise errors.InvalidValue("RmAdjustConfig", name, getattr(self, name), "a bool")
        m = self.margin
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < 0.5
        ):
            raise errors.InvalidValue(
                "RmAdjustConfig", "margin", m,
                "None (derived from G) or in (0, 0.5) so tiers never overlap",
            )  # fmt: skip
        d = self.dead_zone
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < pymath.inf:
            raise errors.InvalidValue("RmAdjustConfig", "dead_zone", d, "in [0, inf)")
        s = self.squash_scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < pymath.inf:
            raise errors.InvalidValue("RmAdjustConfig", "squash_scale", s, "in (0, inf)")

    def margin_for(self, group_size: int) -> float:
        """The margin used for groups of `group_size`: the configured one, checked against
        `margin_bound`, or half the bound when None. Raises ValueError when the configured
        margin would let a tier invert at this G."""
        bound = margin_bound(group_size, rank=self.rank)
        if self.margin is None:
            return bound / 2
        if self.margin >= bound:
            need = "1/G" if self.rank else "1/(2G)"
            raise ValueError(
                f"RmAdjustConfig.margin={self.margin!r} is too large for G={group_size}: a "
                f"correctness tier can invert unless margin < {need} = {bound:.6g} "
                f"(rank={self.rank}); use margin=None to derive it from G"
            )
        return float(self.margin)


def adjust_rewards(
    rm_scores: Float[Array, "P G"],
    *,
    correct: Bool[Array, "P G"] | None,
    cfg: RmAdjustConfig,
) -> Float[Array, "P G"]:
    """Rewards from reward-model scores, built so that RM noise cannot invert advantages.

    Steps, each switchable in `cfg`; the tier of a rollout is `correct` (0 / 1) when
    cfg.tiered, else 0 for all:
      (b) dead-zone: within each group and tier, sort the scores and cut between consecutive
          scores whose gap is >= delta (= cfg.dead_zone); each resulting cluster is a tie and
          every member gets the cluster's mean score. This is single linkage, so a chain of
          small gaps can tie scores further apart than delta. Equal scores always tie.
      (c) rank: x_i = (2 rank_i - n - 1) / (n - 1) in [-1, 1], rank_i the 1-based rank of
          rollout i among the n rollouts of its group and tier, ties (clusters) given their
          average rank; x = 0 when n == 1. x sums to 0 over each tier, and a tier that is all
          one cluster gets x = 0 exactly.
      (a) tiered: r = tier + m * x, with x from (c), or x = tanh((s - tier mean of s) /
          squash_scale) without ranks, and m = cfg.margin_for(G). As |x| <= 1 and m < 0.5, a
          correct rollout always outranks an incorrect one.
    Without tiers, r = x with ranks, else the (dead-zoned) scores themselves; with every step
    off (tiered=False, dead_zone=0, rank=False) `adjust_rewards` is the identity.

    Signs after group normalisation (`margin_bound`): with ranks, mean_group(r) = fraction
    correct, so for m < 1/G every correct rollout of a mixed group gets a positive advantage and
    every incorrect one a negative advantage (without ranks, m < 1/(2G) is needed). m is
    therefore derived from G (margin=None: half the bound) or checked against it, so tiers
    cannot invert at any G; e.g. G = 4, correct = [1, 1, 1, 0], ranks x = [-1, 0, 1, 0]:
    r - mean = [1/4 - m, 1/4, 1/4 + m, -3/4], which is 0 for the first rollout at m = 1/4 and
    negative beyond. A group whose rollouts are all one tier and one cluster gets equal
    rewards: a zero-variance group, not random +/- advantages. With ragged groups (a validity
    mask over [P, G]) the bound at the padded G is the strictest, so it holds for every group.

    Raises ValueError when cfg.tiered and `correct` is None (use tiered=False without a
    verifier), and when cfg.margin is too large for G (see `RmAdjustConfig.margin_for`).
    """
    s = jnp.asarray(rm_scores, jnp.float32)  # [P, G]
    if s.ndim != 2:
        raise ValueError(f"rm_scores must be [P, G], got shape {s.shape}")
    if cfg.tiered:
        if correct is None:
            raise ValueError(
                "adjust_rewards: cfg.tiered=True needs `correct` [P, G]; pass the verifier's "
                "correctness or use RmAdjustConfig(tiered=False)"
            )
        if jnp.shape(correct) != s.shape:
            raise ValueError(f"correct must have shape {s.shape}, got {jnp.shape(correct)}")
        tier = jnp.asarray(correct).astype(jnp.float32)  # [P, G]
        margin = cfg.margin_for(s.shape[-1])  # static: G is a shape
    else:
        tier, margin = jnp.zeros_like(s), 0.0  # [P, G]
    cluster, same_cluster = _tie_clusters(s, tier=tier, delta=cfg.dead_zone)
    values = s
    if cfg.dead_zone > 0:
        sizes = same_cluster.astype(jnp.float32).sum(-1)  # [P, G]
        # Multiply-and-sum, not einsum: a TPU/GPU default-precision matmul would round to bf16.
        values = (same_cluster * s[:, None, :]).sum(-1) / sizes  # [P, G]
    same_tier = (tier[:, :, None] == tier[:, None, :]).astype(jnp.float32)  # [P, G, G]
    tier_size = same_tier.sum(-1)  # [P, G]
    if cfg.rank:
        below = (same_tier * (cluster[:, None, :] < cluster[:, :, None])).sum(-1)  # [P, G]
        size = same_cluster.astype(jnp.float32).sum(-1)  # [P, G]
        # 2 * rank - n - 1 with rank = below + (size + 1) / 2: integers, so ties give exact 0.
        x = (2.0 * below + size - tier_size) / jnp.maximum(tier_size - 1.0, 1.0)  # [P, G]
    elif cfg.tiered:
        tier_mean = (same_tier * values[:, None, :]).sum(-1) / tier_size  # [P, G]
        x = jnp.tanh((values - tier_mean) / cfg.squash_scale)  # [P, G]
    else:
        return values
    return tier + margin * x if cfg.tiered else x


def _tie_clusters(s, *, tier, delta):
    """Cluster ids [P, G] (increasing with tier, then score) and the same-cluster mask [P, G, G]
    of the dead-zone: consecutive sorted scores of one tier tie when their gap is < delta or 0."""
    order = jnp.lexsort((s, tier), axis=-1)  # [P, G] tier-major, score-minor
    s_sorted = jnp.take_along_axis(s, order, axis=-1)  # [P, G]
    t_sorted = jnp.take_along_axis(tier, order, axis=-1)  # [P, G]
    gap = jnp.diff(s_sorted, axis=-1)  # [P, G-1]
    joined = (jnp.diff(t_sorted, axis=-1) == 0) & ((gap < delta) | (gap == 0))  # [P, G-1]
    starts = jnp.concatenate([jnp.zeros_like(s[:, :1]), (~joined).astype(s.dtype)], -1)
    cluster_sorted = jnp.cumsum(starts, axis=-1)  # [P, G]
    cluster = jnp.take_along_axis(cluster_sorted, jnp.argsort(order, axis=-1), axis=-1)  # [P, G]
    return cluster, cluster[:, :, None] == cluster[:, None, :]


# ---- a Bradley–Terry reward model on the espo backbone ---------------------------------------
#
# params = {"backbone": espo model params, "head": {"w": [D], "b": []}} and
#   score = hidden[last real token] . w + b,
# with hidden the backbone's final-norm hidden state (`model.forward(..., return_hidden=True)`).
# The backbone's LM head is dead code for the score: under jit the [B, T, V] logits are never
# built (not even lowered), which matters at real vocabulary sizes.


class PreferenceBatch(NamedTuple):
    chosen: Int[Array, "B T"]  # the preferred response of each pair (with its prompt)
    rejected: Int[Array, "B T"]
    chosen_mask: Bool[Array, "B T"]  # False on padding (left or right)
    rejected_mask: Bool[Array, "B T"]


def init_reward_model(cfg: model.ModelConfig, key: jax.Array) -> dict:
    """Backbone params from `model.init` and a zero scalar head (every score starts at 0).

    The backbone is a plain espo parameter tree, unused LM head included, so an espo checkpoint
    loads into it as is. With w = 0 the backbone gets no BT gradient until w has moved (step 1).
    """
    return {
        "backbone": model.init(cfg, key),
        "head": {
            "w": jnp.zeros((cfg.d_model,), jnp.float32),
            "b": jnp.zeros((), jnp.float32),
        },
    }


def reward_scores(
    cfg: model.ModelConfig,
    params: dict,
    tokens: Int[Array, "B T"],
    *,
    attention_mask: Bool[Array, "B T"],
) -> tuple[Float[Array, " B"], model.ModelAux]:
    """One scalar per sequence and the backbone's router stats: score = h_last . w + b.

    h_last is the final-norm hidden state (float32) at the last real token, wherever the padding
    is (left or right); masked positions are invisible to the real ones, so a sequence scores
    the same however it is padded. A row with no real token reads position T - 1.
    """
    final, aux = last_hidden(cfg, params["backbone"], tokens, attention_mask=attention_mask)
    head = params["head"]
    # Multiply-and-sum, not a matvec: a default-precision dot may run in bf16 (TPU) / tf32 (GPU).
    return (final * head["w"]).sum(-1) + head["b"], aux  # [B]


def last_hidden(
    cfg: model.ModelConfig,
    backbone: dict,
    tokens: Int[Array, "B T"],
    *,
    attention_mask: Bool[Array, "B T"],
) -> tuple[Float[Array, "B D"], model.ModelAux]:
    """The backbone's final-norm hidden state at each row's last real token (wherever the
    padding is; a row with no real token reads position T - 1) and its router stats."""
    out = model.forward(cfg, backbone, tokens, attention_mask=attention_mask, return_hidden=True)
    T = tokens.shape[1]
    last = T - 1 - jnp.argmax(attention_mask[:, ::-1], axis=1)  # [B] last True position
    return jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0], out.aux  # [B, D]


def chunked(fn: Callable, *, chunk: int) -> Callable[[Any, Any, Any], np.ndarray]:
    """`apply(params, tokens [N, T], mask [N, T]) -> np.ndarray [N, ...]` of a jitted
    `fn(params, tokens, mask)` for any N, in chunks of `chunk` rows (the last one padded with
    copies of row 0), so every call shares one compile; N >= 1."""

    def apply(params, tokens, mask):
        tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
        n = len(tokens)
        fill = lambda x: np.concatenate([x, np.repeat(x[:1], -n % chunk, axis=0)])
        tokens, mask = fill(tokens), fill(mask)
        out = [fn(params, tokens[i : i + chunk], mask[i : i + chunk]) for i in range(0, n, chunk)]
        return np.concatenate([np.asarray(o) for o in out])[:n]

    return apply


def bradley_terry_loss(
    cfg: model.ModelConfig, params: dict, batch: PreferenceBatch
) -> tuple[Float[Array, " "], dict]:
    """mean_b -log sigmoid(r_chosen - r_rejected) + the backbone's router aux loss.

    Both sides go through one forward ([2B, T]), so the router statistics cover both.
    """
    B = batch.chosen.shape[0]
    tokens = jnp.concatenate([batch.chosen, batch.rejected], axis=0)  # [2B, T]
    mask = jnp.concatenate([batch.chosen_mask, batch.rejected_mask], axis=0)  # [2B, T]
    scores, aux = reward_scores(cfg, params, tokens, attention_mask=mask)  # [2B]
    margin = scores[:B] - scores[B:]  # [B]
    bt = jnp.mean(jax.nn.softplus(-margin))  # -log sigmoid(m) = softplus(-m)
    metrics = {"bt_loss": bt, "accuracy": jnp.mean(margin > 0), "aux_loss": aux.total}
    return bt + aux.total, metrics


def make_train_step(
    cfg: model.ModelConfig,
    optimizer: optax.GradientTransformation,
    loss: Callable[[model.ModelConfig, dict, Any], tuple[Float[Array, " "], dict]] = (
        bradley_terry_loss
    ),
) -> Callable[[dict, optax.OptState, Any], tuple[dict, optax.OptState, dict]]:
    """A jitted `step(params, opt_state, batch) -> (params, opt_state, metrics)` of `loss`
    (default `bradley_terry_loss`; `espo.rewards.pair_judge.judge_loss` trains a judge).

    Raises FloatingPointError at the first non-finite loss, so a diverged run stops loudly
    (this syncs each step; the model is small).
    """

    @jax.jit
    def update(params, opt_state, batch):
        grad_fn = jax.value_and_grad(lambda p: loss(cfg, p, batch), has_aux=True)
        (value, metrics), grads = grad_fn(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {**metrics, "loss": value}

    def step(params, opt_state, batch):
        params, opt_state, metrics = update(params, opt_state, batch)
        if not bool(jnp.isfinite(metrics["loss"])):
            raise FloatingPointError(f"non-finite {loss.__name__}: {metrics}")
        return params, opt_state, metrics

    return step
