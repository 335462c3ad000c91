"""espo.batching: a batch table of rollout rows -> the fixed-shape TrainBatch, `trim` to buckets
and the mini- / micro-batches of `minibatches`."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from espo import batching, scheduling, types
from espo import zero_variance as zv

L, K, PAD = 2, 2, 0


def _rollout(rng, *, sizes, tp, tg, plen=None, clen=None) -> types.Rollout:
    """A prompt-major rollout with random tokens, ragged masks and a recorded router trace;
    prompt / completion lengths `plen` / `clen` [n] as given, else random."""
    n = sum(sizes)
    plen = rng.integers(1, tp + 1, n) if plen is None else np.asarray(plen)
    clen = rng.integers(1, tg + 1, n) if clen is None else np.asarray(clen)
    prompt_mask = np.arange(tp) >= tp - plen[:, None]  # [n, tp] left-padded
    mask = np.arange(tg) < clen[:, None]  # [n, tg]
    trace_mask = np.concatenate([prompt_mask, mask], 1)[:, None, :, None]  # [n, 1, T, 1]
    return types.Rollout(
        prompt_tokens=np.where(prompt_mask, rng.integers(1, 50, (n, tp)), PAD).astype(np.int32),
        prompt_mask=prompt_mask,
        tokens=np.where(mask, rng.integers(1, 50, (n, tg)), PAD).astype(np.int32),
        mask=mask,
        lengths=clen.astype(np.int32),
        finished=rng.random(n) < 0.5,
        logps=np.where(mask, -rng.random((n, tg)), 0.0).astype(np.float32),
        entropies=np.where(mask, rng.random((n, tg)), 0.0).astype(np.float32),
        router=types.RouterTrace(
            expert_ids=np.where(trace_mask, rng.integers(0, 4, (n, L, tp + tg, K)), -1),
            expert_weights=np.where(trace_mask, rng.random((n, L, tp + tg, K)), 0.0),
        ),
        group_ids=np.repeat(np.arange(len(sizes)), sizes).astype(np.int32),
        rewards=rng.integers(0, 2, n).astype(np.float32),
        reward_ok=np.arange(n) != 1,  # row 1's reward call failed
    )


def test_train_batch_from_a_batch_table_of_two_calls():
    # Two generate calls with different prompt / generation widths, then the batch keeps group 1
    # of call A and group 0 of call B (as fill_batch would): the TrainBatch rows are those rows,
    # in the fixed widths, ids renumbered, the rest padding. Wrong answer (rows gathered by
    # position): call A's group 0 rows in the batch.
    rng = np.random.default_rng(0)
    Tp, Tg, num_rows = 5, 6, 12
    tables = []
    for sizes, tp, tg in (([2, 3], 3, 4), ([4], 5, 6)):
        r = _rollout(rng, sizes=sizes, tp=tp, tg=tg)
        shaped = np.asarray(r.rewards) - 0.1 * np.arange(r.num_rows)
        rows = batching.rollout_rows(r, prompt_length=Tp, generation_length=Tg, pad_id=PAD)
        ids = [f"p{i}" for i in range(len(sizes))]
        table = zv.Groups(prompt_ids=ids, group_ids=r.group_ids, rewards=shaped,
                          raw_rewards=r.rewards, valid=r.reward_ok, rows=rows)  # fmt: skip
        tables.append((r, table))
    (ra, a), (rb, b) = tables
    table = zv.Groups.concat([a.take([1]), b.take([0])])
    batch = batching.make_train_batch(table, num_rows=num_rows, pad_id=PAD)
    np.testing.assert_array_equal(batch.group_ids, [0] * 3 + [1] * 4 + [-1] * 5)
    taken = [(ra, np.arange(2, 5)), (rb, np.arange(4))]  # (rollout, its rows) in batch order
    tokens = [np.concatenate([np.pad(r.prompt_tokens[i], (Tp - r.prompt_tokens.shape[1], 0)),
                              np.pad(r.tokens[i], (0, Tg - r.tokens.shape[1]))], 0)
              for r, rows in taken for i in rows]  # fmt: skip
    np.testing.assert_array_equal(batch.tokens[:7], tokens)
    assert (batch.tokens[7:] == PAD).all() and not batch.attention_mask[7:].any()
    logps = [np.pad(r.logps[i], (Tp, Tg - r.logps.shape[1])) for r, rows in taken for i in rows]
    np.testing.assert_array_equal(batch.sampler_logps[:7], logps)  # aligned with the tokens
    # Rewards: the verifier's; shaping = shaped - verifier; row 1 of call B failed: no loss.
    verifier = np.concatenate([ra.rewards[2:5], rb.rewards])
    np.testing.assert_array_equal(batch.valid[:7], [True] * 4 + [False] + [True] * 2)
    np.testing.assert_allclose(batch.rewards[:7], np.where(batch.valid[:7], verifier, 0.0))
    shaping = -0.1 * np.array([2, 3, 4, 0, 1, 2, 3], np.float32)
    np.testing.assert_allclose(batch.shaping[:7], np.where(batch.valid[:7], shaping, 0.0))
    assert not batch.loss_mask[4].any() and not batch.loss_mask[:, :Tp].any()
    lengths = np.concatenate([ra.lengths[2:5], rb.lengths])
    np.testing.assert_array_equal(batch.loss_mask[:7].sum(1), np.where(batch.valid[:7], lengths, 0))
    ids = batch.router.expert_ids
    assert ids.shape == (num_rows, L, Tp + Tg, K) and (ids[7:] == -1).all()
    np.testing.assert_array_equal(ids[3:7, :, :, :], rb.router.expert_ids)  # widths already full
    with pytest.raises(ValueError, match="do not fit"):
        batching.make_train_batch(table, num_rows=6, pad_id=PAD)
    with pytest.raises(ValueError, match="lacks"):
        batching.make_train_batch(zv.Groups.of(prompt_ids=["x"], rewards=[[1.0]]), num_rows=4,
                                  pad_id=PAD)  # fmt: skip


@pytest.mark.parametrize(
    "longest_prompt, longest_completion, widths",
    [
        (4, 4, (4, 4)),  # exactly at a bucket boundary: that bucket
        (5, 5, (8, 8)),  # one past it: the next bucket
        (3, 3, (4, 4)),  # one short of it
        (1, 1, (2, 2)),
        (8, 9, (8, 12)),  # the prompt slot is whole; the generation slot's last bucket is 12
    ],
)
def test_trim_keeps_every_real_column_at_bucket_boundaries(
    longest_prompt, longest_completion, widths
):
    # Fixed widths Tp = 8, Tg = 12, buckets 2, 4, 8 (prompt) and 2, 4, 8, 12 (generation): the
    # trimmed batch is [Tp - bp, Tp + bg) with bp / bg the buckets of the longest prompt /
    # completion (by hand above), and every real token, loss token and trace entry survives.
    # Wrong answers: a bucket of the last real column's index instead of its count (5 -> 4,
    # dropping column 4 of the completion), or of the first padded column's.
    rng = np.random.default_rng(1)
    Tp, Tg = 8, 12
    plen, clen = [1, longest_prompt, 2], [longest_completion, 1, 1]
    r = _rollout(rng, sizes=[3], tp=Tp, tg=Tg, plen=plen, clen=clen)
    rows = batching.rollout_rows(r, prompt_length=Tp, generation_length=Tg, pad_id=PAD)
    table = zv.Groups(prompt_ids=["p"], group_ids=r.group_ids, rewards=r.rewards, rows=rows)
    batch = batching.make_train_batch(table, num_rows=4, pad_id=PAD)
    buckets = scheduling.LengthBuckets(prompt_buckets=(2, 4, 8), generation_buckets=(2, 4, 8, 12))
    trimmed = batching.trim(batch, prompt_length=Tp, buckets=buckets)
    bp, bg = widths
    cols = slice(Tp - bp, Tp + bg)
    assert trimmed.tokens.shape == (4, bp + bg)
    assert trimmed.router.expert_ids.shape[2] == bp + bg
    for name in ("tokens", "attention_mask", "loss_mask", "sampler_logps"):
        np.testing.assert_array_equal(getattr(trimmed, name), getattr(batch, name)[:, cols], name)
    assert trimmed.attention_mask.sum() == sum(plen) + sum(clen)
    assert trimmed.loss_mask.sum() == batch.loss_mask.sum() == sum(clen)
    assert (trimmed.router.expert_ids >= 0).sum() == (batch.router.expert_ids >= 0).sum()


def _tagged_batch(num_rows: int) -> batching.TrainBatch:
    """A TrainBatch of `num_rows` rows (groups of 4) whose `advantages` tag each row: 0, 1, ..."""
    rng = np.random.default_rng(2)
    r = _rollout(rng, sizes=[4] * (num_rows // 4), tp=3, tg=4)
    rows = batching.rollout_rows(r, prompt_length=3, generation_length=4, pad_id=PAD)
    ids = [f"p{i}" for i in range(num_rows // 4)]
    table = zv.Groups(prompt_ids=ids, group_ids=r.group_ids, rewards=r.rewards, rows=rows)
    batch = batching.make_train_batch(table, num_rows=num_rows, pad_id=PAD)
    return batch.replace(advantages=np.arange(num_rows, dtype=np.float32))


@pytest.mark.parametrize("mini_batch_size", [16, 8])
def test_minibatches_cover_every_row_once_per_epoch_and_reshuffle_each_epoch(mini_batch_size):
    # 16 rows, micro-batches of 2, two epochs: each mini-batch is [mini / micro, micro, ...];
    # every epoch holds every row exactly once, in a new order (the key is folded with the
    # epoch), also with a single mini-batch (several epochs shuffle too), and the whole thing is
    # a function of the key. Wrong answers: the same order every epoch (the key not folded, or
    # no shuffle for one mini-batch), [micro, mini / micro] micro-batches, a row seen twice.
    batch = _tagged_batch(16)
    run = lambda key: [
        np.asarray(mini.advantages)
        for mini in batching.minibatches(
            batch, mini_batch_size=mini_batch_size, micro_batch_size=2, epochs=2, key=key
        )
    ]
    minis = run(jax.random.key(0))
    per_epoch = 16 // mini_batch_size
    assert len(minis) == 2 * per_epoch
    assert all(m.shape == (mini_batch_size // 2, 2) for m in minis)
    epochs = [np.concatenate([m.ravel() for m in minis[e * per_epoch : (e + 1) * per_epoch]])
              for e in range(2)]  # fmt: skip
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), np.arange(16))
    assert not np.array_equal(epochs[0], epochs[1])
    again = run(jax.random.key(0))
    for a, b in zip(minis, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_one_minibatch_one_epoch_keeps_the_row_order_in_strided_micro_batches():
    # No shuffle with one mini-batch and one epoch; micro-batch i holds rows i, i + k, ... (k
    # micro-batches), so the row axis stays the sharded one. By hand for 8 rows, k = 4.
    batch = _tagged_batch(8)
    (mini,) = batching.minibatches(
        batch, mini_batch_size=8, micro_batch_size=2, epochs=1, key=jax.random.key(0)
    )
    np.testing.assert_array_equal(mini.advantages, [[0, 4], [1, 5], [2, 6], [3, 7]])
    np.testing.assert_array_equal(mini.tokens[1, 1], batch.tokens[5])
    np.testing.assert_array_equal(batching.unsplit(mini).advantages, np.arange(8))
