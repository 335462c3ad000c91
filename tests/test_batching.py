"""espo.batching: a batch table of rollout rows -> the fixed-shape TrainBatch."""

from __future__ import annotations

import numpy as np
import pytest

from espo import batching, types
from espo import zero_variance as zv

L, K, PAD = 2, 2, 0


def _rollout(rng, *, sizes, tp, tg) -> types.Rollout:
    """A prompt-major rollout with random tokens, ragged masks and a recorded router trace."""
    n = sum(sizes)
    plen, clen = rng.integers(1, tp + 1, n), rng.integers(1, tg + 1, n)
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
