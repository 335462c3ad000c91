"""Shared pytree data types that cross module boundaries.

Every type here is a registered pytree whose array fields are batch-leading, so filtering,
sharding and mini-batching are a single `jax.tree.map`. Library modules exchange these values;
nothing about routing, sampling or scoring is hidden in mutable state. Arrays only: no text,
metrics or other static (hashed) fields, so a value's pytree structure depends on its shapes
alone and `jax.jit` never retraces for what the arrays hold. `prompt_then_completion` is the one
place the training layout (left-padded prompt, then completion) is built.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


def expert_id_dtype(num_experts: int) -> np.dtype:
    """The smallest signed integer type that holds every expert id and the -1 of unrecorded
    slots: int8 up to 128 experts (Qwen3-MoE's 128 included), int16 up to 32,768."""
    for dtype in (np.int8, np.int16):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)


@flax.struct.dataclass
class RouterTrace:
    """The routing decisions of every layer for every token.

    Attributes:
      expert_ids: signed int [B, L, T, K], the experts each token was sent to in each layer.
        Layers without a MoE block (dense layers) and unrecorded positions hold -1. A forward
        returns int32; the sampler records the smallest type that holds the model's expert ids
        (`expert_id_dtype`: int8 up to 128 experts); replay casts them back.
      expert_weights: float32 [B, L, T, K], the gate weight of each chosen expert (after the
        model's own normalisation); 0 where `expert_ids` is -1. None when not recorded: an RL
        rollout records ids only (as verl's router replay does), since replaying ids
        (`RoutingMode.REPLAY_IDS`) recomputes the gates from the live router; only
        `REPLAY_IDS_AND_WEIGHTS` reads them.

    The trace is an ordinary batch-leading array input: replaying it under `jit`, `pmap` or
    `shard_map` needs nothing special; shard it along batch like the tokens.
    """

    expert_ids: Int[Array, "B L T K"]
    expert_weights: Float[Array, "B L T K"] | None

    @classmethod
    def empty(cls, *, batch: int, num_layers: int, length: int, top_k: int) -> RouterTrace:
        """A trace with every position unrecorded (ids -1, weights 0)."""
        shape = (batch, num_layers, length, top_k)
        return cls(
            expert_ids=jnp.full(shape, -1, jnp.int32),
            expert_weights=jnp.zeros(shape, jnp.float32),
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.expert_ids.shape

    def slice_time(self, start: int, stop: int) -> RouterTrace:
        """Positions [start, stop) of every layer."""
        return jax.tree.map(lambda x: x[:, :, start:stop], self)

    def concat_time(self, other: RouterTrace) -> RouterTrace:
        """This trace followed by `other` along time."""
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=2), self, other)


@flax.struct.dataclass
class LossOutput:
    """A scalar loss kept as a ratio of sums, so that micro-batches accumulate exactly.

    Attributes:
      numerator: float32 [], the sum over this batch's units (tokens or sequences, depending on
        the aggregation) of each unit's loss.
      denominator: float32 [], the number of units (a count; 0 for an all-padding batch).
      metrics: float32 [] scalars by name; `espo.losses` documents what each one means and how to
        combine them across micro-batches.

    Over micro-batches k, the full-batch loss is sum_k numerator_k / sum_k denominator_k, which
    is what a gradient-accumulation loop should compute (not the mean of the `loss` values).
    """

    numerator: Float[Array, " "]
    denominator: Float[Array, " "]
    metrics: dict[str, Float[Array, " "]]

    @property
    def loss(self) -> Float[Array, " "]:
        """numerator / denominator; 0 (not NaN) when the denominator is 0 (nothing to average)."""
        safe_denominator = jnp.where(self.denominator > 0, self.denominator, 1.0)
        return self.numerator / safe_denominator


def prompt_then_completion(
    prompt_tokens: Int[Array, "R Tp"],
    prompt_mask: Array,
    tokens: Int[Array, "R Tg"],
    mask: Array,
) -> tuple[Int[Array, "R T"], Array]:
    """(tokens, attention_mask) [R, Tp + Tg]: left-padded prompt then the completion."""
    xp = jnp if isinstance(tokens, jax.Array) else np
    return (
        xp.concatenate([prompt_tokens, tokens], axis=1),
        xp.concatenate([prompt_mask, mask], axis=1),
    )


@flax.struct.dataclass
class Samples:
    """Completions of prompts, one per row, with what the sampler recorded (arrays only).

    The layout is the sampler's (`espo.sampler` module docstring): prompts left-padded to Tp,
    completions right-padded to Tg, log-probs and entropies aligned with the completion tokens,
    the router trace over [Tp + Tg] positions in the layout of `training_inputs()`, so a training
    forward over those inputs with `RoutingMode.REPLAY_IDS` replays exactly the rollout's experts.
    `SampleOutput` (one sampler call) and `Rollout` (a scored rollout step) extend it.
    """

    prompt_tokens: Int[Array, "R Tp"]  # left-padded to the prompt bucket
    prompt_mask: Bool[Array, "R Tp"]
    tokens: Int[Array, "R Tg"]  # completions, pad after the stop token; Tg = generation bucket
    mask: Bool[Array, "R Tg"]  # the generated tokens, the stop token included
    lengths: Int[Array, " R"]  # mask.sum(-1)
    finished: Bool[Array, " R"]  # emitted a stop id; False: stopped by max_new_tokens
    logps: Float[Array, "R Tg"]  # sampler log-probs (espo.sampler conventions), 0 off the mask
    entropies: Float[Array, "R Tg"]  # full-vocabulary entropies, 0 off the mask
    router: RouterTrace  # [R, L, Tp + Tg, K]

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def training_inputs(self) -> tuple[Int[Array, "R T"], Bool[Array, "R T"]]:
        """(tokens, attention_mask) [R, Tp + Tg]: prompt then completion, as the trace."""
        return prompt_then_completion(self.prompt_tokens, self.prompt_mask, self.tokens, self.mask)


@flax.struct.dataclass
class SampleOutput(Samples):
    """One sampler call: G completions per prompt over B*G rows (row = prompt * G + sample)."""

    num_steps: Int[Array, " "]  # decode steps the call ran


@flax.struct.dataclass
class Rollout(Samples):
    """G scored samples of each prompt: everything the trainer needs, as arrays only.

    Rows are prompt-major (the samples of one prompt adjacent, `group_ids` = prompt index). No
    text and no metrics live here (`espo.rollout.RolloutResult` carries them beside it): two
    rollouts of the same shapes are the same pytree type, so a jitted function of a `Rollout`
    compiles once whatever the texts were.
    """

    group_ids: Int[Array, " N"]
    rewards: Float[Array, " N"]  # the verifier's reward, before shaping (espo.advantages rules)
    reward_ok: Bool[Array, " N"]  # False where the reward function failed (timeout, crash...)

    @classmethod
    def from_samples(
        cls,
        samples: Samples,
        *,
        group_ids: Int[Array, " N"],
        rewards: Float[Array, " N"],
        reward_ok: Bool[Array, " N"],
    ) -> Rollout:
        """The rollout of `samples` (a `SampleOutput` too: its extra fields are dropped) with
        their group ids and rewards."""
        shared = {f.name: getattr(samples, f.name) for f in dataclasses.fields(Samples)}
        return cls(**shared, group_ids=group_ids, rewards=rewards, reward_ok=reward_ok)
