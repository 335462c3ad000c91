"""Group-relative advantages: GRPO / Dr.GRPO normalisation and RL-ZVP for zero-variance groups.

Owns the map from rewards to advantages. Layout: rewards are [P, G] (P prompts, G rollouts of
each, in group order); token-level quantities are [P, G, T] (reshape a flat [P*G, T] batch with
`.reshape(P, G, T)`; flatten the result back with `.reshape(P*G, T)`). Everything is float32,
jittable and free of gradient (advantages are constants of the policy loss).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def group_normalized(
    rewards: Float[Array, "P G"], *, eps: float = 1e-6, scale_by_std: bool = True
) -> Float[Array, "P G"]:
    """A_{p,i} = (R_{p,i} - mean_p) / (std_p + eps), the GRPO advantage.

    std is the unbiased (G - 1) standard deviation, as torch.std in verl and TRL. With
    scale_by_std=False this is Dr.GRPO's R - mean. G == 1 has no baseline: its advantage is 0
    (never NaN). A zero-variance group gets 0 as well (its numerator is 0).
    """
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    centred = rewards - rewards.mean(-1, keepdims=True)  # [P, G]
    if not scale_by_std:
        return centred
    if rewards.shape[-1] == 1:
        return jnp.zeros_like(rewards)  # ddof=1 std of one sample is NaN; R - mean is 0 anyway
    std = jnp.std(rewards, axis=-1, ddof=1, keepdims=True)  # [P, 1]
    return centred / (std + eps)


def zero_variance_mask(rewards: Float[Array, "P G"], *, atol: float = 1e-6) -> Bool[Array, " P"]:
    """True for each prompt whose G rewards all lie within `atol` of each other (max - min)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    return (rewards.max(-1) - rewards.min(-1)) <= atol


class ZvpAdvantages(NamedTuple):
    advantages: Float[Array, "P G T"]  # token advantages, 0 on padding
    zero_variance_mask: Bool[Array, " P"]  # the groups that took the entropy-shaped branch


def rl_zvp(
    rewards: Float[Array, "P G"],
    entropies: Float[Array, "P G T"],
    mask: Bool[Array, "P G T"] | Float[Array, "P G T"],
    *,
    alpha: float = 0.1,
    eps: float = 1e-6,
    atol: float = 1e-6,
    scale_by_std: bool = True,
) -> ZvpAdvantages:
    """RL-ZVP token advantages (arXiv 2509.21880, "No Prompt Left Behind").

    For a zero-variance group (`zero_variance_mask`), with H_{i,t} the detached entropy of
    token t of response i under the rollout policy:
      R_i > 0 (all correct):  A_{i,t} =  alpha H_{i,t}
      R_i <= 0 (all wrong):   A_{i,t} = -alpha (max_{k valid in i} H_{i,k} - H_{i,t})
    Other groups get `group_normalized(rewards, eps, scale_by_std)` broadcast over tokens.
    Padding tokens (mask 0) get 0 and are excluded from the max. Defaults follow the paper
    (alpha = 0.1). "All correct" is read as R > 0, so rewards are assumed to be 0/1 or -1/+1.
    """
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    entropies = jax.lax.stop_gradient(jnp.asarray(entropies, jnp.float32))
    mask = jnp.asarray(mask).astype(jnp.float32)
    if rewards.ndim != 2 or entropies.shape[:2] != rewards.shape or entropies.ndim != 3:
        raise ValueError(
            f"rewards must be [P, G] and entropies [P, G, T]; got {rewards.shape}, "
            f"{entropies.shape}"
        )
    if mask.shape != entropies.shape:
        raise ValueError(
            f"mask must have the shape of entropies {entropies.shape}, got {mask.shape}"
        )
    entropies = entropies * mask  # [P, G, T] entropies are >= 0, so padding never wins the max
    zero_variance = zero_variance_mask(rewards, atol=atol)  # [P]
    max_entropy = entropies.max(-1, keepdims=True)  # [P, G, 1]
    positive = alpha * entropies  # [P, G, T]
    negative = -alpha * (max_entropy - entropies)  # [P, G, T]
    zvp = jnp.where(rewards[..., None] > 0, positive, negative)  # [P, G, T]
    normal = group_normalized(rewards, eps=eps, scale_by_std=scale_by_std)[..., None]  # [P, G, 1]
    advantages = jnp.where(zero_variance[:, None, None], zvp, normal) * mask  # [P, G, T]
    return ZvpAdvantages(advantages=advantages, zero_variance_mask=zero_variance)
