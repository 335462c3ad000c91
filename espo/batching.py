"""The host -> device step: rollout rows -> one `TrainBatch`, and its mini-batches.

Rows are built at the run's fixed widths, [N, T] with N = prompts_per_step * max G (rounded up to
whole mini-batches) and T = max_prompt_length + the generation bucket of the largest budget: rows
the ZVE stage did not fill are padding (`group_ids` -1, `valid` False, no loss token). `trim`
then drops the columns every row pads, to a prompt and a generation bucket, so the jitted steps
compile once per bucket pair and a step computes the lengths it has, not the budgets.
Prompts are left-padded to `max_prompt_length` and completions right-padded; the router trace
is padded with -1 the same way, so position t of every array is token t (the `espo.train_step`
alignment). Rows arrive as a `zero_variance.Groups` table (the
batch of `zero_variance.fill_batch`) whose payload is `rollout_rows` of each rollout, already in
these fixed widths, so rows of different generate calls and steps concatenate.
"""

from __future__ import annotations

import functools
import operator

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from espo import packing, types, zero_variance


@flax.struct.dataclass
class TrainBatch:
    """One optimiser batch, batch-leading [N, ...]; T = Tp + Tg positions aligned with tokens."""

    tokens: Int[Array, "N T"]
    attention_mask: Bool[Array, "N T"]  # real prompt and completion tokens
    loss_mask: Bool[Array, "N T"]  # completion tokens of valid rows
    router: types.RouterTrace  # [N, L, T, K] the rollout's experts (-1: none), ids only
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


# The per-row payload (`zero_variance.Groups.rows`) `rollout_rows` builds, `make_train_batch` reads.
ROW_FIELDS = (
    "tokens", "attention_mask", "completion_mask", "expert_ids",
    "sampler_logps", "sampler_entropies", "finished",
)  # fmt: skip


def rollout_rows(
    r: types.Rollout, *, prompt_length: int, generation_length: int, pad_id: int
) -> dict[str, np.ndarray]:
    """The fixed-width host arrays [R, ...] of every row of `r` (`ROW_FIELDS`), T = Tp + Tg.

    Every rollout of a run gets the same widths (the fixed Tp and Tg), so rows of different
    generate calls and steps concatenate: this is the payload of `zero_variance.Groups`.
    """
    Tp, Tg = prompt_length, generation_length
    tp, tg = r.prompt_tokens.shape[1], r.tokens.shape[1]
    if tp > Tp or tg > Tg:
        raise ValueError(f"rollout shape Tp={tp}, Tg={tg} exceeds the batch's Tp={Tp}, Tg={Tg}")
    left, right = Tp - tp, Tg - tg

    def pad(x, *, before=0, after=0, value=0, axis=1):
        return _pad_time(np.asarray(x), axis=axis, left=before, right=after, value=value)

    trace = dict(before=left, after=right, axis=2)
    tokens = [
        pad(r.prompt_tokens, before=left, value=pad_id),
        pad(r.tokens, after=right, value=pad_id),
    ]
    prompt_mask = pad(r.prompt_mask, before=left, value=False)  # [R, Tp]
    completion_mask = pad(r.mask, after=right, value=False)  # [R, Tg]
    return dict(
        tokens=np.concatenate(tokens, 1).astype(np.int32),  # [R, T]
        attention_mask=np.concatenate([prompt_mask, completion_mask], 1),  # [R, T]
        completion_mask=np.concatenate([np.zeros_like(prompt_mask), completion_mask], 1),
        expert_ids=_trace_ids(pad(r.router.expert_ids, value=-1, **trace)),  # [R, L, T, K]
        sampler_logps=pad(r.logps, before=Tp, after=right).astype(np.float32),  # [R, T]
        sampler_entropies=pad(r.entropies, before=Tp, after=right).astype(np.float32),
        finished=np.asarray(r.finished, bool),  # [R]
    )


def _trace_ids(ids: np.ndarray) -> np.ndarray:
    """The sampler's ids as recorded (`types.expert_id_dtype`, int8 for most MoEs); a wider
    integer (numpy's default int64) becomes the int32 a forward returns."""
    return ids if ids.dtype.itemsize <= 4 else ids.astype(np.int32)


def make_train_batch(groups: zero_variance.Groups, *, num_rows: int, pad_id: int) -> TrainBatch:
    """Host `TrainBatch` [N = num_rows, ...] of a batch table (`zero_variance.fill_batch`).

    `groups.rows` holds `ROW_FIELDS` (`rollout_rows`); `groups.group_ids` (0..P-1) become the
    batch's. Rewards are the verifier's (`raw_rewards`), shaping = final - verifier, both 0 on
    rows whose reward failed, which get no loss token. Rows past `groups.num_rows` are padding.
    """
    n = groups.num_rows
    if n == 0:
        raise ValueError("make_train_batch needs at least one group")
    if n > num_rows:
        raise ValueError(f"{n} rows do not fit the batch of {num_rows} rows")
    missing = set(ROW_FIELDS) - set(groups.rows)
    if missing:
        raise ValueError(f"make_train_batch: groups.rows lacks {sorted(missing)} (rollout_rows)")
    ok = groups.valid  # [n]
    verifier = groups.verifier_rewards  # [n]
    out = {k: groups.rows[k] for k in ROW_FIELDS}
    out.update(
        group_ids=groups.group_ids.astype(np.int32),
        rewards=np.where(ok, verifier, 0.0).astype(np.float32),
        shaping=np.where(ok, groups.rewards - verifier, 0.0).astype(np.float32),
        valid=ok,
    )
    pad_values = dict(tokens=pad_id, expert_ids=-1, group_ids=-1)
    for k, v in out.items():
        out[k] = np.concatenate(
            [v, np.full((num_rows - n,) + v.shape[1:], pad_values.get(k, 0), v.dtype)]
        )
    zeros = np.zeros(out["tokens"].shape, np.float32)  # [N, T]
    return TrainBatch(
        tokens=out["tokens"],
        attention_mask=out["attention_mask"],
        loss_mask=out["completion_mask"] & out["valid"][:, None],
        router=types.RouterTrace(expert_ids=out["expert_ids"], expert_weights=None),
        sampler_logps=out["sampler_logps"],
        sampler_entropies=out["sampler_entropies"],
        finished=out["finished"],
        group_ids=out["group_ids"],
        rewards=out["rewards"],
        shaping=out["shaping"],
        valid=out["valid"],
        old_logps=zeros,
        old_entropies=zeros,
        ref_logps=zeros,
        advantages=np.zeros(num_rows, np.float32),
        zvp_sign=np.zeros(num_rows, np.int32),
    )


# TrainBatch fields [N, T] (the router trace, [N, L, T, K], is trimmed on its axis 2).
_TIME_FIELDS = (
    "tokens", "attention_mask", "loss_mask", "sampler_logps", "sampler_entropies", "old_logps",
    "old_entropies", "ref_logps",
)  # fmt: skip


def trim(batch: TrainBatch, *, prompt_length: int, buckets) -> TrainBatch:
    """`batch` (host arrays) without the columns that are padding in every row, kept to buckets.

    Rows are laid out at the run's fixed widths (prompts left-padded to `prompt_length` = Tp,
    completions right-padded), so a step whose longest prompt has p tokens and longest
    completion g tokens computes only columns [Tp - bp, Tp + bg), bp = the prompt bucket of p and
    bg = the generation bucket of g (`scheduling.LengthBuckets`): a bounded set of compiled
    shapes, as the sampler's. Positions count real tokens (`transformer` derives them from the
    mask), so the forward of every real token is unchanged; only sums over padding shrink.
    """
    mask = np.asarray(batch.attention_mask)  # [N, T]
    Tp, T = prompt_length, mask.shape[1]
    real = mask.any(0)  # [T]
    p = Tp - int(np.argmax(real[:Tp])) if real[:Tp].any() else 0
    g = int(np.nonzero(real[Tp:])[0].max()) + 1 if real[Tp:].any() else 1
    bp = min(buckets.prompt_bucket(p), Tp)
    bg = min(buckets.generation_bucket(g), T - Tp)
    cols = slice(Tp - bp, Tp + bg)
    if (bp, bg) == (Tp, T - Tp):
        return batch
    fields = {k: np.asarray(getattr(batch, k))[:, cols] for k in _TIME_FIELDS}
    router = jax.tree.map(lambda x: np.asarray(x)[:, :, cols], batch.router)
    return batch.replace(router=router, **fields)


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


@flax.struct.dataclass
class PackedMiniBatch:
    """A mini-batch for a packed update (`train.packing`): its rows [n, ...] and where they go
    in packed micro-batches of one row of `train.max_tokens_per_micro_batch` tokens each."""

    batch: TrainBatch  # [n, ...] (device)
    layout: packing.Layout  # host ints; the number of packed rows is a `packing.bucket`


def minibatches(
    batch: TrainBatch,
    *,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    key,
    packing_budget: int | None = None,
    host_attention_mask: np.ndarray | None = None,
):
    """Yields `epochs` passes of mini-batches, each [num_micro, micro, ...] (device arrays), or
    with `packing_budget` a `PackedMiniBatch` (micro-batches formed by token budget; a sequence
    longer than the budget is an error naming it and the budget). The packing is planned from
    `host_attention_mask` (the batch's mask as a host array), read from the batch if None; a
    multi-process run passes it, since no process can read a batch spanning every process.

    Each epoch draws a new row permutation from `key` (fold_in by epoch), as verl shuffles its
    mini-batches, when there is more than one mini-batch or more than one epoch.
    """
    n = batch.num_rows
    num_mini = n // mini_batch_size
    host_mask = host_attention_mask if host_attention_mask is not None else batch.attention_mask
    host_mask = None if packing_budget is None else np.asarray(host_mask, bool)
    for epoch in range(epochs):
        shuffled, perm = batch, np.arange(n)
        if num_mini > 1 or epochs > 1:
            perm = jax.random.permutation(jax.random.fold_in(key, epoch), n)
            shuffled = jax.tree.map(functools.partial(jnp.take, indices=perm, axis=0), batch)
        minis = split(shuffled, num_mini)
        for i in range(num_mini):
            mini = jax.tree.map(operator.itemgetter(i), minis)
            if packing_budget is None:
                yield split(mini, mini_batch_size // micro_batch_size)
            else:
                mask = split(host_mask[np.asarray(perm)], num_mini)[i]  # mini's rows, in order
                layout = packing.layout(mask, budget=packing_budget)
                yield PackedMiniBatch(batch=mini, layout=layout)
