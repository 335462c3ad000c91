"""Shared pytree data types that cross module boundaries.

Every type here is a registered pytree whose array fields are batch-leading, so filtering,
sharding and mini-batching are a single `jax.tree.map`. Library modules exchange these values;
nothing about routing, sampling or scoring is hidden in mutable state.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


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
