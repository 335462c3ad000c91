"""Packed rows (`segment_ids`): the forward of sequences laid end to end equals their padded
forward, token by token: logits, router trace (free and replayed), router aux / z losses.

What would be wrong: attention across the segments of a row (a sequence reading its row
neighbours), RoPE positions counting from the row start instead of the segment start, padding
at the end of a row counted in the router losses, a replayed trace read at unpacked columns.
RoPE scores depend only on position differences, so positions that fail to restart (offset by
the segment's start) change the logits by float error only: `segment_positions` is checked
by hand instead.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import model, packing, types
from espo.model import ModelConfig, RoutingMode, transformer

# A dense layer between MoE layers, unnormalised top-k gates (so replayed weights matter).
CFG = ModelConfig.tiny(num_layers=3, dense_layers=(1,), dense_ffn_dim=48, norm_topk_prob=False)
TP, TG = 6, 10
BUDGET = TP + TG
# Sequence lengths 1 .. the budget (prompt + completion), and one row with no token.
PROMPTS = [1, 6, 3, 0, 2, 6, 4, 1]
COMPLETIONS = [0, 10, 4, 0, 1, 7, 9, 3]
forward = jax.jit(
    functools.partial(model.forward, CFG), static_argnames=("routing_mode", "dispatch_impl")
)


def ragged_batch(seed=1):
    """batching's layout: left-padded prompts, right-padded completions ([N, TP + TG])."""
    pos = np.arange(TP + TG)[None, :]
    p, c = np.asarray(PROMPTS)[:, None], np.asarray(COMPLETIONS)[:, None]
    mask = ((pos >= TP - p) & (pos < TP)) | ((pos >= TP) & (pos < TP + c))
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, mask.shape, dtype=np.int32)
    return np.where(mask, tokens, 0).astype(np.int32), mask


@functools.cache
def setup():
    params = model.init(CFG, jax.random.key(0))
    tokens, mask = ragged_batch()
    plan = packing.plan(mask, budget=BUDGET)
    assert plan.num_rows < mask.shape[0]  # really packed: some row holds several sequences
    assert sorted(plan.length) == sorted(mask.sum(-1)) and plan.length.max() == BUDGET
    unpacked = forward(params, tokens, attention_mask=mask)
    return params, tokens, mask, plan, unpacked


def at_unpacked(plan, packed: jax.Array, num_columns: int) -> np.ndarray:
    """[R, ..., L, ...] (time at axis 1) -> [N, T, ...] at the unpacked positions, 0 elsewhere."""
    rows, cols, valid = plan.unpack_index(num_columns)
    x = np.asarray(packed)[rows, cols]  # [N, T, ...]
    return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0)


def masked(x, mask):
    x = np.asarray(x)
    return np.where(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), x, 0)


def trace_time_major(trace: types.RouterTrace) -> np.ndarray:
    return np.moveaxis(np.asarray(trace.expert_ids), 2, 1)  # [B, L, T, K] -> [B, T, L, K]


def pack_trace(plan, trace: types.RouterTrace) -> types.RouterTrace:
    return types.RouterTrace(
        expert_ids=plan.pack(np.asarray(trace.expert_ids), axis=2, fill=-1),
        expert_weights=plan.pack(np.asarray(trace.expert_weights), axis=2, fill=0.0),
    )


def assert_same_tokens(plan, mask, packed_out, unpacked_out):
    """Logits and router ids/weights of every real token, packed vs unpacked (1e-5, float32)."""
    T = mask.shape[1]
    np.testing.assert_allclose(
        at_unpacked(plan, packed_out.logits, T),
        masked(unpacked_out.logits, mask),
        atol=1e-5,
        rtol=1e-5,
    )
    np.testing.assert_array_equal(
        at_unpacked(plan, trace_time_major(packed_out.router), T),
        masked(trace_time_major(unpacked_out.router), mask),
    )
    weights = lambda out: np.moveaxis(np.asarray(out.router.expert_weights), 2, 1)
    np.testing.assert_allclose(
        at_unpacked(plan, weights(packed_out), T),
        masked(weights(unpacked_out), mask),
        atol=1e-6,
    )


@pytest.mark.slow
@pytest.mark.parametrize("given_positions", [True, False], ids=["positions", "default"])
def test_packed_forward_equals_padded_forward(given_positions):
    params, tokens, mask, plan, unpacked = setup()
    positions = plan.positions if given_positions else None
    out = forward(params, plan.pack(tokens), segment_ids=plan.segment_ids, positions=positions)
    assert_same_tokens(plan, mask, out, unpacked)
    # Padding at the end of the packed rows leaves the router losses: the same real tokens give
    # the same load-balancing and z losses and the same expert load. (Counting the padding
    # would change them: the two layouts have different padding.)
    for name in ("load_balancing_loss", "z_loss", "total", "expert_load"):
        np.testing.assert_allclose(
            getattr(out.aux, name), getattr(unpacked.aux, name), atol=1e-6, rtol=1e-5
        )


@pytest.mark.slow
@pytest.mark.parametrize("mode", [RoutingMode.REPLAY_IDS, RoutingMode.REPLAY_IDS_AND_WEIGHTS])
def test_packed_replay_equals_padded_replay(mode):
    # Replay a trace the router would not choose itself (every id shifted by one), so a trace
    # read at the wrong columns, or a packed token routed freely, changes the logits.
    params, tokens, mask, plan, unpacked = setup()
    ids = np.asarray(unpacked.router.expert_ids)
    shifted = np.where(ids >= 0, (ids + 1) % CFG.num_experts, -1)
    trace = types.RouterTrace(
        expert_ids=np.where(mask[:, None, :, None], shifted, -1).astype(np.int32),
        expert_weights=np.where(shifted >= 0, 0.5, 0.0).astype(np.float32),
    )
    want = forward(params, tokens, attention_mask=mask, routing=trace, routing_mode=mode)
    assert float(np.abs(masked(want.logits, mask) - masked(unpacked.logits, mask)).max()) > 1e-3
    got = forward(
        params,
        plan.pack(tokens),
        segment_ids=plan.segment_ids,
        positions=plan.positions,
        routing=pack_trace(plan, trace),
        routing_mode=mode,
    )
    assert_same_tokens(plan, mask, got, want)
    assert int(got.aux.num_unrecorded_routes) == 0  # the -1 ids of row-end padding are padding
    np.testing.assert_allclose(got.aux.total, want.aux.total, atol=1e-6, rtol=1e-5)
    # Eagerly, the replay check reads segment 0 as padding too.
    model.check_replay(CFG, pack_trace(plan, trace), plan.segment_ids > 0)


def test_segment_positions_restart_per_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(
        transformer.segment_positions(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    )


def test_segment_ids_errors():
    params, tokens, _, plan, _ = setup()
    with pytest.raises(ValueError, match=r"segment_ids must have the shape of tokens"):
        model.forward(CFG, params, plan.pack(tokens), segment_ids=plan.segment_ids[:, :3])
    cache = model.init_cache(CFG, batch=plan.num_rows, max_length=BUDGET)
    with pytest.raises(ValueError, match="pass no cache"):
        model.forward(CFG, params, plan.pack(tokens), segment_ids=plan.segment_ids, cache=cache)
