"""Tests for espo.packing: first-fit decreasing by hand, errors, pack / unpack round trips, and the
losses per segment (packed == unpacked loss and gradient for every loss, aggregation and
sampler correction)."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import losses, packing

TP, TG = 4, 6


def ragged_mask(prompt_lengths, completion_lengths, *, tp=TP, tg=TG):
    """batching's layout: left-padded prompts, right-padded completions ([N, tp + tg])."""
    pos = np.arange(tp + tg)[None, :]
    p, c = np.asarray(prompt_lengths)[:, None], np.asarray(completion_lengths)[:, None]
    return ((pos >= tp - p) & (pos < tp)) | ((pos >= tp) & (pos < tp + c))


def test_first_fit_decreasing_by_hand():
    # Lengths [2, 5, 3, 6, 0], budget 8. Decreasing: n3 (6) -> row 0 [0, 6); n1 (5) -> row 1
    # [0, 5); n2 (3) does not fit row 0 (2 left) -> row 1 [5, 8); n0 (2) -> row 0 [6, 8); n4 has
    # no token and is not placed. Wrong (first fit in batch order): n0, n1 share row 0, n2 row 1,
    # n3 a third row.
    mask = ragged_mask([1, 2, 1, 3, 0], [1, 3, 2, 3, 0])
    p = packing.plan(mask, budget=8)
    assert p.num_rows == 2
    np.testing.assert_array_equal(p.row, [0, 1, 1, 0, -1])
    np.testing.assert_array_equal(p.offset, [6, 0, 5, 0, 0])
    np.testing.assert_array_equal(p.length, [2, 5, 3, 6, 0])
    np.testing.assert_array_equal(p.start, [3, 2, 3, 1, 0])
    np.testing.assert_array_equal(p.segment_ids, [[1] * 6 + [2] * 2, [1] * 5 + [2] * 3])
    np.testing.assert_array_equal(p.positions, [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]])
    assert packing.plan(mask, budget=8, num_rows=3).num_rows == 3  # an empty row of padding


def test_errors_name_the_sequence_and_the_budget():
    mask = ragged_mask([3, 4], [2, 6])
    with pytest.raises(
        ValueError,
        match=r"sequence 1 has 10 tokens, more than the packing budget"
        r" train.max_tokens_per_micro_batch=8",
    ):
        packing.plan(mask, budget=8)
    with pytest.raises(ValueError, match=r"need 2 packed rows of 10, more than num_rows=1"):
        packing.plan(mask, budget=10, num_rows=1)
    holed = np.array([[True, False, True]])
    with pytest.raises(ValueError, match="sequence 0 is not contiguous"):
        packing.plan(holed, budget=8)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    prompts = draw(st.lists(st.integers(0, TP), min_size=n, max_size=n))
    completions = draw(st.lists(st.integers(0, TG), min_size=n, max_size=n))
    mask = ragged_mask(prompts, completions)
    budget = draw(st.integers(max(int(mask.sum(-1).max()), 1), 3 * (TP + TG)))
    return mask, budget, draw(st.integers(0, 2**16))


@pytest.mark.slow
@hypothesis.given(batches())
def test_pack_unpack_round_trip(case):
    mask, budget, seed = case
    rng = np.random.default_rng(seed)
    p = packing.plan(mask, budget=budget)
    seg = p.segment_ids
    assert (p.offset + p.length <= budget).all()
    # Every sequence is one segment: its tokens, and only those, carry its id in its row.
    for n in np.flatnonzero(p.length):
        assert (seg[p.row[n], p.offset[n] : p.offset[n] + p.length[n]] > 0).all()
    assert (seg > 0).sum() == mask.sum()
    assert ((p.positions >= 0) == (seg > 0)).all()
    x = np.where(mask, rng.normal(size=mask.shape), 0.0).astype(np.float32)
    unpack = jax.jit(packing.unpack)  # op by op: ~60 small compiles
    np.testing.assert_array_equal(unpack(p.pack(x), p.unpack_index(TP + TG)), x)
    # The router trace [N, L, T, K] packs along time exactly like the tokens.
    trace = rng.integers(0, 8, (mask.shape[0], 2, TP + TG, 3))
    packed = p.pack(trace, axis=2, fill=-1)
    for layer in range(2):
        for k in range(3):
            np.testing.assert_array_equal(
                packed[:, layer, :, k], p.pack(trace[:, layer, :, k], fill=-1)
            )
    assert (packed[np.broadcast_to((seg == 0)[:, None, :, None], packed.shape)] == -1).all()


LOSS_CONFIGS = [
    *(
        dict(name="grpo", agg=agg, clip_low=0.15, clip_high=0.25, kl_coef=0.05)
        for agg in losses.AGG_MODES
    ),
    dict(name="gspo", clip_low=0.02, clip_high=0.05),
    dict(name="espo", vocab_size=50, alpha=1.0, top_frac=0.3),
    dict(name="cispo", clip_low=0.2, clip_high=0.1),
]
CORRECTIONS = [{}, dict(rollout_is="sequence", rollout_rs="token", rollout_rs_high=1.3)]


@functools.cache
def packed_and_unpacked(cfg: losses.LossConfig):
    """jit((packed logps, unpacked logps, batch, index) -> ((loss, grad packed), (loss, grad)))."""

    def loss(logps, batch):
        return losses.compute_loss(cfg, logps=logps, **batch).loss

    @jax.jit
    def f(packed, logps, batch, index):
        a = jax.value_and_grad(lambda x: loss(packing.unpack(x, index), batch))(packed)
        return a, jax.value_and_grad(loss)(logps, batch)

    return f


@pytest.mark.slow
@pytest.mark.parametrize("correction", CORRECTIONS, ids=["plain", "tis"])
@pytest.mark.parametrize("loss", LOSS_CONFIGS, ids=lambda c: c["name"] + str(c.get("agg", "")))
def test_loss_on_unpacked_forward_equals_unpacked_loss(loss, correction):
    # Per-sequence quantities are per segment: the loss of logps computed in the packed layout
    # and unpacked equals the loss of the unpacked batch, and its gradient w.r.t. the packed
    # logps is the unpacked gradient packed. Lengths 1 .. the budget, one empty row.
    # Wrong: seq-mean over a packed row (several sequences) as one sequence.
    rng = np.random.default_rng(0)
    mask = ragged_mask([1, 4, 2, 0, 3, 1], [0, 6, 3, 0, 1, 5])
    p = packing.plan(mask, budget=TP + TG)
    loss_mask = mask & (np.arange(TP + TG) >= TP)
    old = np.where(mask, rng.normal(-1.5, 0.5, mask.shape), 0.0)
    logps = np.where(mask, old + rng.normal(0, 0.3, mask.shape), 0.0).astype(np.float32)
    batch = dict(
        old_logps=old,
        advantages=rng.normal(0, 1, mask.shape[0]),
        mask=loss_mask,
        entropies=rng.uniform(0, 3, mask.shape),
        ref_logps=old + 0.1,
        sampler_logps=old + rng.normal(0, 0.2, mask.shape),
    )
    batch = {k: jnp.asarray(v, bool if k == "mask" else jnp.float32) for k, v in batch.items()}
    cfg = losses.LossConfig(**loss, **correction)
    index = p.unpack_index(TP + TG)
    packed = jnp.asarray(p.pack(logps))
    (pv, pg), (uv, ug) = packed_and_unpacked(cfg)(packed, logps, batch, index)
    np.testing.assert_allclose(float(pv), float(uv), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(pg), p.pack(np.asarray(ug)), rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(pg)).sum() > 0
