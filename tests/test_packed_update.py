"""The packed update (`train.packing`): micro-batches of packed rows within the token budget.

Packed == padded for every loss, aggregation mode and sampler correction, with and without
router replay: the new parameters of an SGD step (so the gradient) and the loss, and the
prepared batch (pi_old / reference log-probs, entropies, mismatch metrics). Lengths run from 1
to the budget, and the rounded-up micro-batch count leaves all-padding micro-batches (skipped);
a budget of several rows puts R rows in a micro-batch. A run compiles one update per bucket,
then never again; a sequence over the budget is an error.

What would be wrong (each makes a test here fail): a seq-mean, GSPO / ESPO ratio, entropy group
or sequence IS weight taken over a packed row (several sequences) instead of one sequence; a
sequence's first token given a log-prob from its row neighbour's last token; an all-padding
micro-batch counted in a denominator; the router trace packed differently from the tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from espo import advantages, batching, losses, metrics, packing, testing, train_step, trainer
from espo import config as config_lib
from espo import model as model_lib
from espo.testing import raises_invalid

# The router aux loss is a mean per micro-batch, and packed micro-batches group tokens unlike
# padded ones: off where the two use different micro-batches (see test_aux_loss_...).
CFG = model_lib.ModelConfig(
    vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
    num_experts=4, top_k=2, moe_ffn_dim=16, aux_loss_coef=0.0, z_loss_coef=0.0,
)  # fmt: skip
TP, TG, N = 4, 6, 8
BUDGET = TP + TG
# Sequence lengths (prompt + completion) 1, 10, 5, 2, 8, 10, 4, 5: 1 .. the budget. First-fit
# decreasing needs 5 rows of 10, rounded up to 8 micro-batches (3 all padding).
LENGTHS = ([1, 4, 2, 1, 3, 4, 2, 1], [0, 6, 3, 1, 5, 6, 2, 4])

LOSS_CONFIGS = [
    *(dict(name="grpo", agg=agg, kl_coef=0.05) for agg in losses.AGG_MODES),
    dict(name="gspo", clip_low=0.02, clip_high=0.05),
    dict(name="espo", alpha=1.0, top_frac=0.3),
    dict(name="cispo", clip_low=0.2, clip_high=0.1),
]
# Both corrections on, with a band that rejects some tokens of the batch.
CORRECTIONS = [
    {},
    dict(rollout_is="sequence", rollout_rs="token", rollout_rs_low=0.9, rollout_rs_high=1.1),
]


@functools.cache
def _batch(seed: int = 0, model=CFG):
    batch, params = testing.random_train_batch(
        model, num_rows=N, prompt_length=TP, generation_length=TG, seed=seed, lengths=LENGTHS
    )
    ref = jax.tree.map(lambda p: p * 1.01, params)  # a reference policy near the current one
    return batch, params, ref


def _sc(*, loss: dict, replay: bool = True, model=CFG, budget: int | None = BUDGET):
    return train_step.StepConfig(
        model=model,
        loss=losses.LossConfig(vocab_size=model.vocab_size, **loss),
        advantage=advantages.AdvantageConfig(rl_zvp=True),
        entropy=train_step.EntropyConfig(),
        num_groups=N // 4,
        micro_batch_size=N,
        packing_budget=budget,
        router_replay=replay,
    )


def _minibatch(batch, budget):
    (mini,) = batching.minibatches(
        batch, mini_batch_size=N, micro_batch_size=N, epochs=1, key=jax.random.key(0),
        packing_budget=budget,
    )  # fmt: skip
    return mini


def _assert_same_update(packed, padded):
    (p_state, p_metrics), (u_state, u_metrics) = packed, padded
    chex.assert_trees_all_close(p_state.params, u_state.params, atol=1e-5, rtol=1e-5)
    for key in ("loss/loss", "optim/grad_norm", "loss/num_tokens", "loss/num_seqs"):
        np.testing.assert_allclose(
            p_metrics[key], u_metrics[key], rtol=1e-5, atol=1e-7, err_msg=key
        )
    assert float(u_metrics["optim/grad_norm"]) > 1e-3


# The losses with replay, the correction on every other one; routing freely, a token- and a
# sequence-level loss.
UPDATE_CASES = [
    pytest.param(
        loss,
        CORRECTIONS[i % 2],
        True,
        id=f"{loss['name']}{loss.get('agg', '')}-{['plain', 'tis'][i % 2]}-replay",
    )
    for i, loss in enumerate(LOSS_CONFIGS)
    # (suite time) seq-mean-token-sum-norm differs from seq-mean-token-sum by a constant; CISPO
    # aggregates per token like GRPO's token-mean; GSPO (its clips, replay, and the correction
    # too) is test_packed_update_with_two_rows_per_micro_batch's, on the same packed step.
    if loss.get("agg") != "seq-mean-token-sum-norm" and loss["name"] not in ("cispo", "gspo")
] + [pytest.param(LOSS_CONFIGS[5], {}, False, id="espo-plain-free")]


@pytest.mark.slow
@pytest.mark.parametrize("loss, correction, replay", UPDATE_CASES)
def test_packed_update_equals_padded_update(loss, correction, replay):
    batch, params, _ = _batch()
    sc = _sc(loss=loss | correction, replay=replay)
    mini = _minibatch(batch, BUDGET)
    assert mini.layout.num_micro_batches == 8 and not mini.layout.segment_ids[5:].any()
    unpacked = dataclasses.replace(sc, packing_budget=None)
    padded = testing.sgd_update(unpacked, params, batching.split(batch, 1))
    _assert_same_update(testing.sgd_update(sc, params, mini), padded)


@pytest.mark.slow
def test_aux_loss_equal_when_one_packed_micro_batch_holds_the_mini_batch():
    # The router aux / z losses are means over a micro-batch's real tokens: with the whole
    # mini-batch in one packed micro-batch (6 rows of 10) and in one padded micro-batch they are
    # the same tokens, so the updates agree with the losses on (row-end padding leaves them).
    model = dataclasses.replace(CFG, aux_loss_coef=0.1, z_loss_coef=0.01)
    batch, params, _ = _batch(model=model)
    sc = _sc(loss=dict(name="gspo"), model=model, budget=64)
    mini = _minibatch(batch, 64)
    assert (mini.layout.num_micro_batches, mini.layout.rows_per_micro_batch) == (1, 6)
    unpacked = dataclasses.replace(sc, packing_budget=None)
    padded = testing.sgd_update(unpacked, params, batching.split(batch, 1))
    _assert_same_update(testing.sgd_update(sc, params, mini), padded)
    assert float(padded[1]["loss/router_aux_loss"]) > 0


@pytest.mark.parametrize(
    "loss, replay",
    [(LOSS_CONFIGS[4] | CORRECTIONS[1], True), (LOSS_CONFIGS[1], False)],
    ids=["gspo-tis-replay", "grpo-free"],
)
@pytest.mark.slow
def test_packed_update_with_two_rows_per_micro_batch(loss, replay):
    # A budget of 20 = 2 rows of 10: the 5 rows in ceil(5 / 2) = 3 micro-batches, rounded up to
    # 4 (the last all padding); each micro-batch's loss reads its own two rows' sequences only.
    batch, params, _ = _batch()
    sc = _sc(loss=loss, replay=replay, budget=20)
    mini = _minibatch(batch, 20)
    assert (mini.layout.num_micro_batches, mini.layout.rows_per_micro_batch) == (4, 2)
    assert mini.layout.segment_ids[2].any() and not mini.layout.segment_ids[3].any()
    unpacked = dataclasses.replace(sc, packing_budget=None)
    padded = testing.sgd_update(unpacked, params, batching.split(batch, 1))
    _assert_same_update(testing.sgd_update(sc, params, mini), padded)


@pytest.mark.slow
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "free"])
def test_packed_prepare_equals_padded_prepare(replay):
    batch, params, ref = _batch()
    sc = _sc(loss=dict(name="grpo", kl_coef=0.1) | CORRECTIONS[1], replay=replay)
    layout = packing.layout(batch.attention_mask, budget=BUDGET)
    got, got_m = jax.jit(functools.partial(train_step.prepare, sc))(params, ref, batch, layout)
    padded = dataclasses.replace(sc, packing_budget=None, micro_batch_size=2)
    want, want_m = jax.jit(functools.partial(train_step.prepare, padded))(params, ref, batch)
    for field in ("old_logps", "old_entropies", "ref_logps", "advantages"):
        np.testing.assert_allclose(
            getattr(got, field), getattr(want, field), atol=1e-5, rtol=1e-5, err_msg=field
        )
    assert float(jnp.abs(got.old_logps).sum()) > 0 and float(jnp.abs(got.ref_logps).sum()) > 0
    chex.assert_trees_all_close(got_m, want_m, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_bounded_shapes_no_recompile_after_warm_up(in_memory_compiles):
    # Batches of other lengths reuse the compiled update when their packed rows round up to a
    # bucket already seen (powers of two up to N: at most log2(8) + 1 = 4 shapes).
    sc = _sc(loss=dict(name="espo"))
    opt = optax.sgd(0.0)
    update = jax.jit(functools.partial(train_step.train_step, sc, opt))
    batch, params, _ = _batch()
    state = train_step.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params)
    )
    rng = np.random.default_rng(0)
    buckets = []
    for _ in range(6):
        plen, clen = rng.integers(0, TP + 1, N), rng.integers(0, TG + 1, N)
        pos = np.arange(TP + TG)
        attn = ((pos >= TP - plen[:, None]) & (pos < TP)) | (
            (pos >= TP) & (pos < TP + clen[:, None])
        )
        other = batch.replace(attention_mask=attn, loss_mask=attn & (pos >= TP))
        mini = _minibatch(other, BUDGET)
        buckets.append(mini.layout.num_micro_batches)
        state, _ = update(state, mini)
    assert set(buckets) <= {1, 2, 4, 8}
    assert update._cache_size() == len(set(buckets))
    state, _ = update(state, _minibatch(batch, BUDGET))  # 8 micro-batches: compiled or new
    assert update._cache_size() == len(set(buckets) | {8})


@pytest.mark.slow
def test_a_sequence_over_the_budget_is_an_error_naming_it_and_the_budget():
    batch, _, _ = _batch()
    with pytest.raises(
        ValueError,
        match=r"sequence 1 has 10 tokens, more than the packing budget "
        r"train.max_tokens_per_micro_batch=9",
    ):
        _minibatch(batch, 9)


def test_bucket():
    assert [packing.bucket(r, max_rows=8) for r in (0, 1, 2, 3, 5, 8)] == [1, 1, 2, 4, 8, 8]
    assert packing.bucket(5, max_rows=6) == 6


# ---- the trainer -------------------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(**train):
    cfg = testing.load_script(ROOT / "configs" / "default.py").get_config("tiny")
    cfg.train.update(train)
    return cfg


def test_packing_config_errors_name_the_key():
    with raises_invalid(
        "max_tokens_per_micro_batch", where="--config.train", kind=config_lib.ConfigError
    ):
        config_lib.Settings.from_config(_config(max_tokens_per_micro_batch=0))
    # tiny: max_prompt_length 32 + max_new_tokens 16; only checked when packing is on.
    config_lib.Settings.from_config(_config(max_tokens_per_micro_batch=40))
    with raises_invalid(
        "max_tokens_per_micro_batch", where="--config.train", kind=config_lib.ConfigError
    ):
        config_lib.Settings.from_config(_config(max_tokens_per_micro_batch=40, packing=True))


@pytest.mark.slow
def test_trainer_packed_step_equals_padded_step(tmp_path, monkeypatch):
    # One RL step of the tiny config: same rollout, same prepared batch, so the same loss
    # before the update; the packed run really packs (prepare's layout, the mini-batch's).
    layouts = []
    plan = packing.layout
    monkeypatch.setattr(packing, "layout", lambda *a, **k: layouts.append(1) or plan(*a, **k))

    def run(name, **train):
        cfg = _config(steps=1, **train)
        # No warm start: the step of the random init has a batch already (8 sequences, ~100
        # loss tokens), and the SFT step is padded in both runs.
        cfg.sft.steps = 0
        trainer.train(cfg, str(tmp_path / name), progress=False)

    run("padded")
    assert not layouts
    run("packed", packing=True, max_tokens_per_micro_batch=64)
    assert len(layouts) == 2
    padded, packed = (
        metrics.read_jsonl(tmp_path / name / "metrics.jsonl")[-1] for name in ("padded", "packed")
    )
    for key in ("loss/loss", "loss/num_tokens", "mismatch/k3_kl", "train/accuracy"):
        np.testing.assert_allclose(packed[key], padded[key], rtol=1e-5, atol=1e-7, err_msg=key)
