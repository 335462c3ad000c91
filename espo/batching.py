"""The host -> device step: rollout rows -> one fixed-shape `TrainBatch`, and its mini-batches.

Every optimiser batch has the same shape, [N, T] with N = prompts_per_step * max G (rounded up to
whole mini-batches) and T = max_prompt_length + the generation bucket of the largest budget, so the
jitted steps compile once: rows the ZVE stage did not fill are padding (`group_ids` -1,
`valid` False, no loss token). Prompts are left-padded to `max_prompt_length` and completions
right-padded; the router trace is padded with -1 the same way, so position t of every array is
token t (the `espo.train_step` alignment).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from espo import types


@flax.struct.dataclass
class TrainBatch:
    """One optimiser batch, batch-leading [N, ...]; T = Tp + Tg positions aligned with tokens."""

    tokens: Int[Array, "N T"]
    attention_mask: Bool[Array, "N T"]  # real prompt and completion tokens
    loss_mask: Bool[Array, "N T"]  # completion tokens of valid rows
    router: types.RouterTrace  # [N, L, T, K] the rollout's experts (-1: none)
    sampler_logps: Float[Array, "N T"]  # the rollout's log-probs, 0 off the completion
    sampler_entropies: Float[Array, "N T"]
    finished: Bool[Array, " N"]
    group_ids: Int[Array, " N"]  # 0..P-1, -1 on padding rows
    rewards: Float[Array, " N"]  # verifier rewards
    shaping: Float[Array, " N"]  # shaped - verifier reward
    valid: Bool[Array, " N"]  # a real row whose reward call succeeded
    # Filled on the device by the trainer (zeros until then):
    old_logps: Float[Array, "N T"]
    old_entropies: Float[Array, "N T"]
    ref_logps: Float[Array, "N T"]
    advantages: Float[Array, " N"]  # per-row (sequence) advantages, RL-ZVP added per token later
    zvp_sign: Int[Array, " N"]

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


def _pad_time(x: np.ndarray, *, axis: int, left: int, right: int, value) -> np.ndarray:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (left, right)
    return np.pad(x, widths, constant_values=value)


def make_train_batch(
    parts: Sequence[tuple[types.Rollout, np.ndarray, np.ndarray]],
    *,
    group_ids: Sequence[np.ndarray],
    num_rows: int,
    prompt_length: int,
    generation_length: int,
    pad_id: int,
) -> TrainBatch:
    """Host `TrainBatch` from rows of several rollouts.

    Args:
      parts: (rollout, rows, shaped_rewards[rows]) triples: the rows of each rollout to take.
      group_ids: per part, the batch group id (0..P-1) of each taken row.
      num_rows: N, the fixed row count (>= rows taken); the rest is padding.
      prompt_length / generation_length: the fixed Tp and Tg.
    """
    Tp, Tg = prompt_length, generation_length
    cols: dict[str, list[np.ndarray]] = {k: [] for k in _HOST_FIELDS}
    for (r, rows, shaped), gids in zip(parts, group_ids, strict=True):
        for k, v in _rows(
            r, np.asarray(rows, np.int64), shaped, Tp=Tp, Tg=Tg, pad_id=pad_id
        ).items():
            cols[k].append(v)
        cols["group_ids"].append(np.asarray(gids, np.int32))
    out = {k: np.concatenate(v) if v else None for k, v in cols.items()}
    n = 0 if out["tokens"] is None else out["tokens"].shape[0]
    if n > num_rows:
        raise ValueError(f"{n} rows do not fit the batch of {num_rows} rows")
    if out["tokens"] is None:
        raise ValueError("make_train_batch needs at least one part")
    pad_values = dict(tokens=pad_id, expert_ids=-1, group_ids=-1)
    for k, v in out.items():
        out[k] = np.concatenate(
            [v, np.full((num_rows - n,) + v.shape[1:], pad_values.get(k, 0), v.dtype)]
        )
    zeros = np.zeros((num_rows, Tp + Tg), np.float32)
    return TrainBatch(
        tokens=out["tokens"].astype(np.int32),
        attention_mask=out["attention_mask"],
        loss_mask=out["loss_mask"],
        router=types.RouterTrace(
            expert_ids=out["expert_ids"], expert_weights=out["expert_weights"]
        ),
        sampler_logps=out["sampler_logps"].astype(np.float32),
        sampler_entropies=out["sampler_entropies"].astype(np.float32),
        finished=out["finished"],
        group_ids=out["group_ids"],
        rewards=out["rewards"],
        shaping=out["shaping"].astype(np.float32),
        valid=out["valid"],
        old_logps=zeros,
        old_entropies=zeros,
        ref_logps=zeros,
        advantages=np.zeros(num_rows, np.float32),
        zvp_sign=np.zeros(num_rows, np.int32),
    )


def _rows(r: types.Rollout, rows, shaped, *, Tp: int, Tg: int, pad_id: int) -> dict:
    """The fixed-width host arrays of `rows` of one rollout (see the module docstring)."""
    tp, tg = r.prompt_tokens.shape[1], r.tokens.shape[1]
    if tp > Tp or tg > Tg:
        raise ValueError(f"rollout shape Tp={tp}, Tg={tg} exceeds the batch's Tp={Tp}, Tg={Tg}")
    left, right = Tp - tp, Tg - tg

    def take(x, *, before=0, after=0, value=0, axis=1):
        return _pad_time(np.asarray(x)[rows], axis=axis, left=before, right=after, value=value)

    prompt_mask = take(r.prompt_mask, before=left, value=False)
    completion_mask = take(r.mask, after=right, value=False)
    ok = np.asarray(r.reward_ok, bool)[rows]
    verifier = np.asarray(r.rewards, np.float32)[rows]
    trace = dict(before=left, after=right, axis=2)
    return dict(
        tokens=np.concatenate(
            [
                take(r.prompt_tokens, before=left, value=pad_id),
                take(r.tokens, after=right, value=pad_id),
            ],
            1,
        ),
        attention_mask=np.concatenate([prompt_mask, completion_mask], 1),
        loss_mask=np.concatenate([np.zeros_like(prompt_mask), completion_mask & ok[:, None]], 1),
        expert_ids=take(r.router.expert_ids, value=-1, **trace),
        expert_weights=take(r.router.expert_weights, value=0.0, **trace),
        sampler_logps=take(r.logps, before=Tp, after=right),
        sampler_entropies=take(r.entropies, before=Tp, after=right),
        finished=np.asarray(r.finished, bool)[rows],
        rewards=np.where(ok, verifier, 0.0).astype(np.float32),
        shaping=np.where(ok, np.asarray(shaped, np.float32) - verifier, 0.0).astype(np.float32),
        valid=ok,
    )


_HOST_FIELDS = (
    "tokens", "attention_mask", "loss_mask", "expert_ids", "expert_weights", "sampler_logps",
    "sampler_entropies", "finished", "group_ids", "rewards", "shaping", "valid",
)  # fmt: skip


def split(tree, num_splits: int):
    """[N, ...] leaves -> [num_splits, N / num_splits, ...]; part i holds rows i, i + k, ...

    Strided, not contiguous: the batch axis stays the sharded one (axis 1), so `lax.scan` /
    `lax.map` over the parts (axis 0, replicated) needs no resharding. `unsplit` inverts it.
    """

    def f(x):
        if x.shape[0] % num_splits:
            raise ValueError(f"{x.shape[0]} rows do not split into {num_splits} equal parts")
        return x.reshape((x.shape[0] // num_splits, num_splits) + x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(f, tree)


def unsplit(tree):
    """The inverse of `split`: [k, N / k, ...] -> [N, ...]."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape((-1,) + x.shape[2:]), tree)


def minibatches(
    batch: TrainBatch, *, mini_batch_size: int, micro_batch_size: int, epochs: int, key
):
    """Yields `epochs` passes of mini-batches, each [num_micro, micro, ...] (device arrays).

    Each epoch draws a new row permutation from `key` (fold_in by epoch), as verl shuffles its
    mini-batches, when there is more than one mini-batch or more than one epoch.
    """
    n = batch.num_rows
    num_mini = n // mini_batch_size
    for epoch in range(epochs):
        shuffled = batch
        if num_mini > 1 or epochs > 1:
            perm = jax.random.permutation(jax.random.fold_in(key, epoch), n)
            shuffled = jax.tree.map(functools.partial(jnp.take, indices=perm, axis=0), batch)
        minis = split(shuffled, num_mini)
        for i in range(num_mini):
            mini = jax.tree.map(operator.itemgetter(i), minis)
            yield split(mini, mini_batch_size // micro_batch_size)
