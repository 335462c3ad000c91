"""Shared pytree data types that cross module boundaries.

Every type here is a registered pytree whose array fields are batch-leading, so filtering,
sharding and mini-batching are a single `jax.tree.map`. Library modules exchange these values;
nothing about routing, sampling or scoring is hidden in mutable state.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@flax.struct.dataclass
class RouterTrace:
    """The routing decisions of every layer for every token.

    Attributes:
      expert_ids: int32 [B, L, T, K], the experts each token was sent to in each layer. Layers
        without a MoE block (dense layers) and unrecorded positions hold -1.
      expert_weights: float32 [B, L, T, K], the gate weight of each chosen expert (after the
        model's own normalisation); 0 where `expert_ids` is -1.

    The trace is an ordinary batch-leading array input: replaying it under `jit`, `pmap` or
    `shard_map` needs nothing special; shard it along batch like the tokens.
    """

    expert_ids: Int[Array, "B L T K"]
    expert_weights: Float[Array, "B L T K"]

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
class Rollout:
    """G samples of each prompt with everything the trainer needs (host numpy arrays).

    Rows are prompt-major (the samples of one prompt adjacent, `group_ids` = prompt index).
    Token layout and router-trace alignment are those of `espo.sampler.SampleOutput`: a
    training forward over `training_inputs()` with `RoutingMode.REPLAY_IDS` replays exactly
    the experts the rollout used. `prompts` / `completions` (texts) and `metrics` are static.
    """

    prompt_tokens: Int[Array, "N Tp"]
    prompt_mask: Bool[Array, "N Tp"]
    tokens: Int[Array, "N Tg"]
    mask: Bool[Array, "N Tg"]
    lengths: Int[Array, " N"]
    finished: Bool[Array, " N"]  # emitted EOS; False: truncated at max_new_tokens
    logps: Float[Array, "N Tg"]  # sampler log-probs (see espo.sampler conventions)
    entropies: Float[Array, "N Tg"]
    router: RouterTrace  # [N, L, Tp + Tg, K]
    group_ids: Int[Array, " N"]
    rewards: Float[Array, " N"]  # the verifier's reward, before shaping (espo.advantages rules)
    reward_ok: Bool[Array, " N"]  # False where the reward function failed (timeout, crash...)
    prompts: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    completions: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    metrics: dict = flax.struct.field(pytree_node=False, default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def training_inputs(self):
        return prompt_then_completion(self.prompt_tokens, self.prompt_mask, self.tokens, self.mask)
