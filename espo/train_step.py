"""Token log-probs and entropies from ONE forward, old log-probs with router replay, entropy choice.

Owns the only place where the trainer turns a forward into per-token log-probs: `token_logps`.
The same function gives pi_old's log-probs (`old_logps`: a stop-gradient forward that replays
the rollout's experts, `RoutingMode.REPLAY_IDS`) and the current policy's log-probs in the loss,
and in both cases the full-vocabulary entropies of the same distribution, from the same logits.

Conventions (those of `espo.sampler`, so a rollout's arrays line up without shifting):
  * Inputs are `Rollout.training_inputs()`: left-padded prompt then completion, [B, T].
  * Outputs are ALIGNED with `tokens`, [B, T]: logps[b, t] = log softmax(z_{b,t-1} / temp)
    [tokens[b, t]] with z the logits, i.e. the log-probability of token t given the tokens
    before it; entropies[b, t] = -sum_v p_v log p_v of that same distribution. Position t is
    meaningful when tokens t-1 and t are both real (attention_mask True); elsewhere (t = 0,
    padding, the first real prompt token) both are 0. So `logps[:, Tp:]` lines up with
    `Rollout.logps` [B, Tg] and the router trace [B, L, Tp + Tg, K] lines up with `tokens`.
  * Everything in float32 (log_softmax of float32 logits). `temperature` scales the logits as
    the sampler did (temperature 0, greedy, means 1), so with the rollout's temperature and its
    router trace replayed, `old_logps` reproduces the sampler's log-probs up to float error.
  * Entropies are always detached (stop_gradient): no objective here differentiates them.

Which entropy each consumer uses (issue 7 #10) is `EntropyConfig`:
  * ESPO grouping and adaptive clip (papers.md §2.2, Eq. 6: entropy of pi_old): "old" (default)
    = recomputed in the old-log-prob forward (the trainer's parameters, bf16/f32, untempered
    unless the rollout was tempered), or "sampler" = the rollout's entropies (the FP8 rollout
    copy, temperature-scaled; cheaper, but another distribution).
  * RL-ZVP (arXiv 2509.21880 §3: H of pi_theta, detached): "current" (default) = the policy
    being optimised, from the same forward as the training log-probs (`token_logps` in the loss;
    pass them to `espo.advantages.token_advantages`), or "old" / "sampler" as above.
Memory: the [B, T, V] log-softmax is materialised once per forward; chunk over T for long
sequences with a real vocabulary (not done here).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from espo import types
from espo.model import config as config_lib
from espo.model import transformer

RoutingMode = config_lib.RoutingMode
ESPO_ENTROPY_SOURCES = ("old", "sampler")
RL_ZVP_ENTROPY_SOURCES = ("current", "old", "sampler")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyConfig:
    """Which policy's token entropies ESPO and RL-ZVP use (see the module docstring)."""

    espo: str = "old"  # ESPO grouping / adaptive clip: "old" (pi_old recomputed) or "sampler"
    rl_zvp: str = "current"  # RL-ZVP: "current" (training forward), "old" or "sampler"

    def __post_init__(self) -> None:
        for name, valid in (("espo", ESPO_ENTROPY_SOURCES), ("rl_zvp", RL_ZVP_ENTROPY_SOURCES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"EntropyConfig.{name}={getattr(self, name)!r}; valid: {valid}")


def select_entropies(
    source: str,
    *,
    old: Float[Array, "B T"] | None = None,
    sampler: Float[Array, "B T"] | None = None,
    current: Float[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """The entropies named by `source` ("old", "sampler" or "current"), detached."""
    options = {"old": old, "sampler": sampler, "current": current}
    if source not in options:
        raise ValueError(f"entropy source={source!r}; valid: {tuple(options)}")
    if options[source] is None:
        raise ValueError(f"entropy source={source!r} was selected but its entropies were not given")
    return jax.lax.stop_gradient(jnp.asarray(options[source], jnp.float32))


class TokenLogps(NamedTuple):
    """What `token_logps` returns (unpacks as `logps, entropies, aux = ...`)."""

    logps: Float[Array, "B T"]  # aligned with tokens; 0 where not meaningful
    entropies: Float[Array, "B T"]  # detached; 0 where not meaningful
    aux: transformer.ModelAux  # router statistics of this forward (losses, replay checks)


def token_logps(
    model_cfg: config_lib.ModelConfig,
    params: dict,
    tokens: Int[Array, "B T"],
    attention_mask: Bool[Array, "B T"],
    *,
    routing: types.RouterTrace | None = None,
    routing_mode: RoutingMode = RoutingMode.FREE,
    temperature: float = 1.0,
    **forward_options,
) -> TokenLogps:
    """Per-token log-probs and entropies of `tokens` from one forward (module conventions).

    Jittable with `model_cfg`, `routing_mode`, `temperature` and `forward_options` static
    (e.g. `dispatch_impl`); differentiable in `params` through `logps` only.
    """
    if not isinstance(temperature, int | float) or temperature < 0:
        raise ValueError(f"temperature={temperature!r}; valid: a float >= 0 (0: greedy, as 1)")
    if tokens.ndim != 2 or jnp.shape(attention_mask) != tokens.shape:
        raise ValueError(
            f"tokens and attention_mask must both be [B, T]; got {tokens.shape} and "
            f"{jnp.shape(attention_mask)}"
        )
    out = transformer.forward(
        model_cfg,
        params,
        tokens,
        attention_mask=attention_mask,
        routing=routing,
        routing_mode=routing_mode,
        **forward_options,
    )
    scale = 1.0 if temperature == 0 else 1.0 / temperature
    logp = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32) * scale, axis=-1)  # [B,T-1,V]
    taken = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(logp)  # [B, T-1, V]
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)  # [B, T-1]
    mask = jnp.asarray(attention_mask, bool)
    real = mask[:, 1:] & mask[:, :-1]  # [B, T-1] token t and its context's last token are real
    first = jnp.zeros((tokens.shape[0], 1), jnp.float32)  # [B, 1] position 0 has no context
    logps = jnp.concatenate([first, jnp.where(real, taken, 0.0)], axis=1)  # [B, T]
    entropies = jnp.concatenate([first, jnp.where(real, entropy, 0.0)], axis=1)  # [B, T]
    return TokenLogps(logps=logps, entropies=jax.lax.stop_gradient(entropies), aux=out.aux)


def old_logps(
    model_cfg: config_lib.ModelConfig,
    params: dict,
    tokens: Int[Array, "B T"],
    attention_mask: Bool[Array, "B T"],
    routing: types.RouterTrace,
    *,
    temperature: float = 1.0,
    **forward_options,
) -> TokenLogps:
    """pi_old's log-probs and entropies: `token_logps` with the rollout's experts replayed
    (`RoutingMode.REPLAY_IDS`) and no gradient. A carried-over resample group (Group.age > 0)
    must keep the log-probs of the policy that sampled it instead (see espo.zero_variance)."""
    return token_logps(
        model_cfg,
        jax.lax.stop_gradient(params),
        tokens,
        attention_mask,
        routing=routing,
        routing_mode=RoutingMode.REPLAY_IDS,
        temperature=temperature,
        **forward_options,
    )


def completion(values: Float[Array, "B T"], *, prompt_length: int) -> Float[Array, "B Tg"]:
    """The completion part [B, T - Tp] of an aligned [B, Tp + Tg] array (Rollout.logps layout)."""
    return values[:, prompt_length:]
