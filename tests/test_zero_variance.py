"""Tests for espo.zero_variance: every ZVE stage with fake policies of known per-prompt pass rate.

Two fakes: `BernoulliPolicy` samples reward 1 with probability p (seeded numpy RNG) for the
statistical checks; `QuantilePolicy` gives exactly round(p * G) ones then zeros, so p in (0, 1)
is always informative and p in {0, 1} always zero-variance, for exact counting tests. Its rows
carry a payload ("tokens": a serial number per generated row) so tests can check which rows a
batch holds; `reference_fill` is the plain per-group loop that `fill_batch` must agree with.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os

import chex
import jax
import numpy as np
import pytest

from espo import advantages, checkpoint
from espo import zero_variance as zv
from espo.testing import raises_invalid


def make_prompts(rates) -> list[dict]:
    return [{"question": f"q{i}", "p": float(r)} for i, r in enumerate(rates)]


class BernoulliPolicy:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.sampled: list[str] = []  # questions passed to `sample`, in order

    def sample(self, prompts, num_samples):
        self.sampled += [p["question"] for p in prompts]
        p = np.array([[q["p"]] for q in prompts])  # [P, 1]
        return (self.rng.random((len(prompts), num_samples)) < p).astype(np.float32)  # [P, N]


class QuantilePolicy:
    def __init__(self):
        self.calls: list[list[int]] = []  # the group sizes of each generate call
        self.made: list[zv.Groups] = []  # every table generated, in order
        self.num_rows = 0

    def generate(self, prompts, group_sizes):
        self.calls.append([int(g) for g in group_sizes])
        rewards = [(np.arange(g) < round(p["p"] * g)).astype(np.float32)  # [G]
                   for p, g in zip(prompts, group_sizes, strict=True)]  # fmt: skip
        n = int(np.sum(group_sizes))
        tokens = self.num_rows + np.arange(n)[:, None] * np.ones(3, np.int32)  # [n, 3] row serial
        self.num_rows += n
        out = zv.Groups.of(prompt_ids=[zv.prompt_id(p) for p in prompts], rewards=rewards)
        out = dataclasses.replace(out, rows={"tokens": tokens})
        self.made.append(out)
        return out


def group_list(table: zv.Groups) -> list[dict]:
    """The table as one dict per group (prompt id, rewards, tokens, age): the reference view."""
    starts = np.cumsum(table.group_sizes) - table.group_sizes
    return [
        dict(prompt_id=pid, age=int(table.ages[g]),
             rewards=table.rewards[s : s + n].tolist(),
             tokens=table.rows["tokens"][s : s + n].tolist() if "tokens" in table.rows else None)
        for g, (pid, s, n) in enumerate(zip(table.prompt_ids, starts, table.group_sizes,
                                            strict=True))
    ]  # fmt: skip


def stream(rates):
    """An endless prompt iterator cycling through `rates`."""
    return iter(itertools.cycle(make_prompts(rates)))


# ---------------------------------------------------------------- shared definitions


def test_prompt_id_is_stable_and_order_free():
    a = zv.prompt_id({"question": "1+1?", "answer": "2"})
    assert a == zv.prompt_id({"answer": "2", "question": "1+1?"})  # key order is irrelevant
    assert a != zv.prompt_id({"question": "1+2?", "answer": "3"})
    assert len(a) == 16 and int(a, 16) >= 0
    assert zv.prompt_id("text") == zv.prompt_id("text") != zv.prompt_id("text ")


@pytest.mark.slow
def test_zero_variance_agrees_with_advantages_compute():
    # The host rule (is_informative) and the device rule (advantages.compute) are one rule:
    # verifier rewards of valid samples, max - min <= atol, >= 2 valid for any signal.
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, size=(64, 4)).astype(np.float32)  # [P, G], many ties
    rewards[:8] += rng.normal(0, 1e-7, size=(8, 4))  # near-ties, below atol
    rewards[8:16, 0] += 1e-3  # above atol
    valid = rng.random((64, 4)) > 0.25
    rewards[~valid] = np.nan  # what a failed sample holds must not matter
    groups = zv.Groups.of(prompt_ids=[str(i) for i in range(64)], rewards=rewards, valid=valid)
    ours = zv.is_informative(groups)
    one_by_one = [not zv.is_zero_variance(r, valid=v) for r, v in zip(rewards, valid, strict=True)]
    np.testing.assert_array_equal(ours, one_by_one)
    out = advantages.compute_dense(rewards, cfg=advantages.AdvantageConfig(), valid=valid)
    theirs = ~np.asarray(out.zero_variance_groups) & ~np.asarray(out.no_signal_groups)
    np.testing.assert_array_equal(ours, theirs)
    assert 0 < sum(ours) < 64
    dense = [zv.is_zero_variance(r) for r in np.nan_to_num(rewards)]
    np.testing.assert_array_equal(dense, advantages.zero_variance_mask(np.nan_to_num(rewards)))


def test_zero_variance_boundaries_by_hand():
    # max - min <= atol: all equal, all correct, all wrong -> True; one sample (no spread) ->
    # True but not informative; at the tolerance (spread 0.25 == atol) -> True (the "<" bug:
    # False); above (0.375) -> False. Invalid entries (NaN here) are never read.
    check = lambda r, **kw: zv.is_zero_variance(np.array(r, np.float32), atol=0.25, **kw)
    assert check([0.5, 0.5, 0.5]) and check([1, 1, 1]) and check([0, 0, 0]) and check([1])
    assert check([0.5, 0.75]) and not check([0.5, 0.875])
    assert check([1.0, np.nan, 1.0], valid=[True, False, True])
    assert not check([1.0, 0.0, np.nan], valid=[True, True, False])
    table = zv.Groups.of(prompt_ids=["a", "b", "c"], rewards=[[1.0], [1.0, 0.0], [1.0, 0.0]],
                         valid=[[True], [True, False], [True, True]])  # fmt: skip
    # one sample: no signal; one valid sample: no signal; two different: informative.
    np.testing.assert_array_equal(zv.is_informative(table), [False, False, True])
    zero, num_valid = zv.zero_variance_groups(
        table.rewards, group_ids=table.group_ids, num_groups=3, valid=table.valid
    )
    np.testing.assert_array_equal(zero, [True, True, False])
    np.testing.assert_array_equal(num_valid, [1, 1, 2])


# ---------------------------------------------------------------- stage 1: offline pre-filter


def test_estimate_pass_rates_with_fake_policy():
    prompts = make_prompts([0.0, 0.25, 0.5, 1.0])
    policy = BernoulliPolicy()
    table = zv.estimate_pass_rates(
        prompts + prompts[:1],  # a duplicate is sampled once
        sample_fn=policy.sample,
        num_samples=400,
        policy_tag="init",
        batch_size=3,
    )
    assert policy.sampled == ["q0", "q1", "q2", "q3"]
    rates = [table.pass_rates[zv.prompt_id(p)] for p in prompts]
    assert rates[0] == 0.0 and rates[3] == 1.0  # exact at the ends
    np.testing.assert_allclose(rates, [0.0, 0.25, 0.5, 1.0], atol=0.1)  # ~4 standard errors
    assert (table.policy_tag, table.num_samples) == ("init", 400)


def test_estimate_resumes_from_existing_and_checks_shape():
    prompts = make_prompts([0.5, 0.5, 0.5])
    policy = BernoulliPolicy()
    first = zv.estimate_pass_rates(
        prompts[:2], sample_fn=policy.sample, num_samples=4, policy_tag="t"
    )
    full = zv.estimate_pass_rates(
        prompts, sample_fn=policy.sample, num_samples=4, policy_tag="t", existing=first
    )
    assert policy.sampled == ["q0", "q1", "q2"]  # the resumed call sampled only the new prompt
    assert len(full.pass_rates) == 3
    with pytest.raises(ValueError, match="'t', N=4"):
        zv.estimate_pass_rates(
            prompts, sample_fn=policy.sample, num_samples=8, policy_tag="t", existing=first
        )
    with pytest.raises(ValueError, match=r"need \(3, 4\)"):
        zv.estimate_pass_rates(
            prompts,
            sample_fn=lambda ps, n: np.zeros((len(ps), n + 1)),
            num_samples=4,
            policy_tag="t",
        )


def test_table_round_trip_next_to_dataset(tmp_path):
    path = zv.table_path(tmp_path / "train.jsonl")
    assert path == tmp_path / "train.jsonl.pass_rates.json"
    table = zv.PassRateTable(policy_tag="sft-v1", num_samples=8, pass_rates={"a": 0.125, "b": 1.0})
    table.save(path)
    loaded = zv.PassRateTable.load(path)
    assert loaded == table
    assert sorted(os.listdir(tmp_path)) == ["train.jsonl.pass_rates.json"]  # no temp file left
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="other.json"):
        zv.PassRateTable.load(tmp_path / "other.json")


def test_table_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl.pass_rates.json"
    zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"a": 0.5}).save(path)
    before = path.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"a": 0.75}).save(path)
    assert path.read_text() == before  # the old table is intact
    assert os.listdir(tmp_path) == [path.name]  # and the temp file was removed


def test_table_refuses_to_overwrite_another_policy(tmp_path):
    path = tmp_path / "d.jsonl.pass_rates.json"
    zv.PassRateTable(policy_tag="old", num_samples=4, pass_rates={"a": 0.5}).save(path)
    new = zv.PassRateTable(policy_tag="new", num_samples=4, pass_rates={"a": 0.0})
    with pytest.raises(FileExistsError, match=str(path)) as err:
        new.save(path)
    assert "'old'" in str(err.value) and "'new'" in str(err.value)
    assert zv.PassRateTable.load(path).policy_tag == "old"
    same_tag = zv.PassRateTable(policy_tag="old", num_samples=16, pass_rates={"a": 0.25})
    same_tag.save(path)  # a re-estimate by the same policy may replace it
    assert zv.PassRateTable.load(path) == same_tag
    new.save(path, overwrite_other_tag=True)
    assert zv.PassRateTable.load(path) == new


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(policy_tag="", num_samples=4, pass_rates={}), "policy_tag"),
        (dict(policy_tag="t", num_samples=0, pass_rates={}), "num_samples"),
        (dict(policy_tag="t", num_samples=4, pass_rates={"a": 1.5}), "pass_rates"),
    ],
)
def test_table_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"PassRateTable.{field}"):
        zv.PassRateTable(**kwargs)


def hand_table():
    prompts = make_prompts([0.0, 0.5, 1.0, 0.3])
    rates = {zv.prompt_id(p): p["p"] for p in prompts[:3]}  # prompts[3] is unknown
    return prompts, zv.PassRateTable(policy_tag="t", num_samples=8, pass_rates=rates)


def test_prefilter_drop_and_downweight():
    prompts, table = hand_table()
    dropped = zv.prefilter(prompts, table, mode="drop")
    assert [p["question"] for p in dropped.prompts] == ["q1", "q3"]
    np.testing.assert_array_equal(dropped.weights, [1.0, 1.0])
    assert dropped.metrics == {
        "zve/prefilter_flagged_fraction": 0.5,
        "zve/prefilter_removed_fraction": 0.5,
        "zve/prefilter_unknown_fraction": 0.25,
    }
    down = zv.prefilter(prompts, table, mode="downweight", downweight=0.1)
    assert down.prompts == prompts
    np.testing.assert_array_equal(down.weights, [0.1, 1.0, 0.1, 1.0])
    assert down.metrics["zve/prefilter_removed_fraction"] == 0.0
    off = zv.prefilter(prompts, table, mode="off")
    np.testing.assert_array_equal(off.weights, np.ones(4))
    assert off.metrics["zve/prefilter_flagged_fraction"] == 0.5  # still measured
    with pytest.raises(ValueError, match="'keep'"):
        zv.prefilter(prompts, table, mode="keep")


def test_prefilter_thresholds_and_difficulty():
    prompts = make_prompts([0.05, 0.5, 0.95, 0.1])
    table = zv.PassRateTable(
        policy_tag="t", num_samples=20, pass_rates={zv.prompt_id(p): p["p"] for p in prompts}
    )
    kept = zv.prefilter(prompts, table, low=0.1, high=0.9).prompts
    assert [p["question"] for p in kept] == ["q1"]  # <= low and >= high are both flagged
    np.testing.assert_allclose(zv.difficulty(np.array([0.0, 0.25, 1.0])), [1.0, 0.75, 0.0])


# ---------------------------------------------------------------- stage 2: rollout


def test_zvp_probability_by_hand_and_by_simulation():
    # p^G + (1-p)^G: 0.5^4 * 2 = 0.125; 0.1^2 + 0.9^2 = 0.82; p in {0, 1} is always ZVP.
    np.testing.assert_allclose(zv.zvp_probability(0.5, 4), 0.125)
    np.testing.assert_allclose(zv.zvp_probability(np.array([0.1, 0.0, 1.0]), 2), [0.82, 1, 1])
    rewards = BernoulliPolicy(seed=1).sample(make_prompts([0.2] * 20000), 4)  # [P, 4]
    simulated = np.mean([zv.is_zero_variance(r) for r in rewards])
    assert abs(simulated - 0.4112) < 0.015  # 0.2^4 + 0.8^4; standard error 0.0035


def test_adaptive_group_sizes_by_hand():
    # target 0.5, sizes {4, 8, ..., 32}: p=0.5 -> 0.125 at G=4; p=0.1: 0.9^4=0.656, 0.9^8=0.430
    # -> 8; p=0.05: 0.95^12=0.540, 0.95^16=0.440 -> 16 (and p=0.95 by symmetry); p=0.01:
    # 0.99^32=0.725 still above -> capped at 32, like p in {0, 1}; unknown -> g_min.
    rates = [0.5, 0.1, 0.05, 0.95, 0.01, 0.0, 1.0, None, np.nan]
    sizes = zv.adaptive_group_sizes(rates, g_min=4, g_max=32, zvp_target=0.5)
    np.testing.assert_array_equal(sizes, [4, 8, 16, 16, 32, 32, 32, 4, 4])
    assert sizes.dtype == np.int64
    odd = zv.adaptive_group_sizes([0.1, None], g_min=4, g_max=12, allowed=(4, 6, 8, 12), default=6)
    np.testing.assert_array_equal(odd, [8, 6])  # 0.9^6 = 0.531 > 0.5
    with pytest.raises(ValueError, match="g_min=8, g_max=4"):
        zv.adaptive_group_sizes([0.5], g_min=8, g_max=4)


def test_adaptive_group_sizes_budget_steps_down_the_largest():
    rates = [0.05, 0.5, 0.01]  # unconstrained [16, 4, 32], sum 52
    size = lambda budget: zv.adaptive_group_sizes(rates, g_min=4, g_max=32, budget=budget)
    np.testing.assert_array_equal(size(None), [16, 4, 32])
    np.testing.assert_array_equal(size(40), [16, 4, 20])  # 32 -> 28 -> 24 -> 20
    # ... -> [16, 4, 16] = 36 -> tie, first one steps: [12, 4, 16] = 32 -> [12, 4, 12] = 28.
    np.testing.assert_array_equal(size(30), [12, 4, 12])
    with pytest.raises(ValueError, match="budget=11"):
        size(11)


def test_zvp_rate_by_group_size_by_hand():
    assert zv.zvp_rate_by_group_size(np.array([[1, 1, 0, 1], [0, 0, 0, 0]])) == {
        2: 1.0,
        3: 0.5,
        4: 0.5,
    }
    assert zv.zvp_rate_by_group_size([np.array([1, 1, 0]), np.array([0, 0])]) == {2: 1.0, 3: 0.0}


def test_zvp_rate_falls_with_group_size_on_fake_policy():
    rates = np.random.default_rng(2).uniform(0.0, 1.0, 600)
    rewards = BernoulliPolicy(seed=3).sample(make_prompts(rates), 32)  # [P, 32]
    curve = zv.zvp_rate_by_group_size(rewards)
    values = [curve[g] for g in range(2, 33)]
    assert all(b <= a for a, b in itertools.pairwise(values))  # prefixes: exactly monotone
    assert values[0] > values[-1] + 0.3
    for g in (4, 16):  # and it matches the formula averaged over the prompts
        assert abs(curve[g] - zv.zvp_probability(rates, g).mean()) < 0.05


def test_pass_rate_history_updates_and_serialises():
    history = zv.PassRateHistory()  # Beta(0.5, 0.5) prior
    group = lambda rewards, raw=None: zv.Groups.of(
        prompt_ids=["a"], rewards=[rewards], raw_rewards=None if raw is None else [raw]
    )
    history.update(group([1, 1, 1, 0]))
    np.testing.assert_allclose(history.pass_rates(["a", "never"]), [3.5 / 5, np.nan])
    history.update(group([0, 0, 0, 0]))
    np.testing.assert_allclose(history.pass_rates(["a"]), [3.5 / 9])
    # raw (unshaped) rewards decide the pass: shaped 0.5 > 0 would count 2 passes, raw counts 1.
    history.update(group([0.5, 0.5], raw=np.array([1.0, 0.0])))
    np.testing.assert_allclose(history.pass_rates(["a"]), [4.5 / 11])
    state = json.loads(json.dumps(history.state_dict()))
    assert zv.PassRateHistory.from_state_dict(state) == history
    decayed = zv.PassRateHistory(decay=0.5)
    decayed.update(group([1, 1, 1, 0]))
    decayed.update(group([0, 0, 0, 0]))  # counts [3, 1] -> [1.5, 0.5 + 4]
    np.testing.assert_allclose(decayed.pass_rates(["a"]), [2.0 / 7])
    table = zv.PassRateTable(policy_tag="t", num_samples=8, pass_rates={"b": 0.25})
    np.testing.assert_allclose(zv.PassRateHistory.from_table(table).pass_rates(["b"]), [2.5 / 9])
    with pytest.raises(ValueError, match="decay=0"):
        zv.PassRateHistory(decay=0.0)


def test_pass_rate_history_skips_failed_samples_and_judge_groups():
    # issue 7 #2: [1, 0 (failed), 1, 0] counts 2 passes and 1 failure, not 2 and 2.
    history = zv.PassRateHistory()
    valid = np.array([True, False, True, True])
    history.update(zv.Groups.of(prompt_ids=["a"], rewards=[[1.0, 0.0, 1.0, 0.0]], valid=[valid]))
    assert history.counts == {"a": [2.0, 1.0]}
    # A judge's relative rewards (unverifiable) and an all-failed group say nothing.
    history.update(zv.Groups.of(
        prompt_ids=["a", "b"], rewards=[[1.0, -1.0], [0.0, 0.0]], verifiable=[False, True],
        valid=[[True, True], [False, False]],
    ))  # fmt: skip
    assert history.counts == {"a": [2.0, 1.0]}
    # One table visits a prompt twice: decays twice, in order ([2, 1] -> [1, 2.5] -> [1.5, 1.25]).
    decayed = zv.PassRateHistory(decay=0.5, counts={"a": [2.0, 1.0]})
    decayed.update(zv.Groups.of(prompt_ids=["a", "a"], rewards=[[0.0, 0.0], [1.0]]))
    assert decayed.counts == {"a": [1.5, 1.25]}


# ---------------------------------------------------------------- stage 4: optimisation


def fill(rates_or_iter, *, policy, batch_size=4, group_size=4, buffer=None, history=None, **cfg):
    prompts = stream(rates_or_iter) if isinstance(rates_or_iter, list) else rates_or_iter
    return zv.fill_batch(
        prompts=prompts,
        generate=policy.generate,
        batch_size=batch_size,
        group_size=group_size,
        config=zv.ZveConfig(**cfg),
        buffer=buffer,
        history=history,
    )


def informative(table):
    """bool [P]: no tie in the (unshaped) rewards of each group."""
    return np.array([not zv.is_zero_variance(g["rewards"]) for g in group_list(table)], bool)


def test_resample_fills_with_informative_groups_only():
    # Stream 0.5, 0, 1, 0 (informative 1 in 4), B = 2. Round 1 draws 2 -> 1 informative
    # (rate 1/2 -> factor 2); round 2 draws 2 (1, 0) -> none (rate 1/4 -> factor 4); round 3
    # draws 4 -> 1 informative: full after 3 calls.
    policy = QuantilePolicy()
    out = fill([0.5, 0.0, 1.0, 0.0], policy=policy, batch_size=2, mode="resample")
    assert [len(c) for c in policy.calls] == [2, 2, 4]
    assert out.batch.num_groups == 2 and informative(out.batch).all()
    m = out.metrics
    assert m["zve/zero_advantage_rollout_fraction"] == 0.0  # exactly 0 in resample mode
    assert m["zve/optimizer_zvp_rate"] == 0.0
    assert m["zve/rollout_zvp_rate"] == 6 / 8
    assert m["zve/rollouts_per_informative_group"] == 32 / 2
    assert (m["zve/generate_calls"], m["zve/batch_fill_fraction"]) == (3.0, 1.0)
    assert "zve/post_shaping_zvp_rate" not in m  # no raw rewards were given


def test_resample_carries_leftovers_over():
    # oversample 4 draws 8 prompts from 0.5, 0.5, 0, 1: 4 informative for B = 2 -> 2 left over.
    policy = QuantilePolicy()
    kw = dict(policy=policy, batch_size=2, mode="resample", oversample=4.0, max_carry_over_steps=1)
    first = fill([0.5, 0.5, 0.0, 1.0], **kw)
    assert first.batch.num_groups == 2 and first.buffer.num_groups == 2
    # Buffer ages are the ages the groups will have in the next batch: sampled one step before.
    assert first.buffer.ages.tolist() == [1, 1]
    assert first.metrics["zve/carried_out"] == 2.0
    # The next step is served from the (checkpointed) buffer without generating.
    state = json.loads(json.dumps(checkpoint.arrays_to_json(first.buffer.state_dict())))
    buffer = zv.Groups.from_state_dict(checkpoint.arrays_from_json(state))
    second = fill([0.5], buffer=buffer, **kw)
    assert len(policy.calls) == 1
    assert second.batch.prompt_ids == first.buffer.prompt_ids
    # Carried groups are marked: sampled one optimiser step before the batch that uses them
    # (their rows hold that policy's tokens, log-probs and router trace).
    assert first.batch.ages.tolist() == [0, 0] and second.batch.ages.tolist() == [1, 1]
    assert second.metrics["zve/carried_in"] == 2.0 and "zve/rollout_zvp_rate" not in second.metrics
    third = fill([0.5], buffer=second.buffer, **kw)
    assert len(policy.calls) == 2 and third.metrics["zve/carried_in"] == 0.0


def test_resample_carry_over_returns_the_generated_rows():
    # Hand trace, G = 4, stream q0 .5, q1 0, q2 .25, q3 1 (q0 and q2 informative); row payload
    # "tokens" = the serial number of each generated row. Step 1 (B = 3, oversample 2.5) draws
    # 8 -> rows 0.. 31; informative q0 [0-3], q2 [8-11], q0 [16-19] fill it, q2 [24-27] is
    # left over. Step 2 (B = 3): q2 [24-27] from the buffer (age 1), then 5 drawn -> q0
    # [32-35], q1, q2 [40-43], q3, q0 [48-51]: q0 and q2 fill it, q0 [48-51] is left over.
    # Wrong answers: rows of the first groups of the call (tokens gathered by position in the
    # batch, not by group), ids not renumbered (0, 2, 0), the buffer's rows lost on the round trip.
    policy, prompts = QuantilePolicy(), stream([0.5, 0.0, 0.25, 1.0])
    kw = dict(policy=policy, batch_size=3, mode="resample", oversample=2.5, max_carry_over_steps=2)
    first = fill(prompts, **kw)
    state = json.loads(json.dumps(checkpoint.arrays_to_json(first.buffer.state_dict())))
    second = fill(prompts, buffer=zv.Groups.from_state_dict(checkpoint.arrays_from_json(state)),
                  **kw)  # fmt: skip
    assert [len(c) for c in policy.calls] == [8, 5]
    serials = lambda *starts: [list(range(s, s + 4)) for s in starts]
    tokens_of = lambda table: [g["tokens"] and [row[0] for row in g["tokens"]]
                               for g in group_list(table)]  # fmt: skip
    assert tokens_of(first.batch) == serials(0, 8, 16) and tokens_of(first.buffer) == serials(24)
    assert tokens_of(second.batch) == serials(24, 32, 40)
    assert tokens_of(second.buffer) == serials(48)
    np.testing.assert_array_equal(second.batch.group_ids, np.repeat([0, 1, 2], 4))
    assert second.batch.ages.tolist() == [1, 0, 0] and second.buffer.ages.tolist() == [1]
    # Every batch group is exactly the generated group its rows came from (prompt, rewards).
    made = {tuple(g["tokens"][0]): g for t in policy.made for g in group_list(t)}
    for g in group_list(second.batch):
        assert dict(g, age=0) == made[tuple(g["tokens"][0])]
    ids = [zv.prompt_id(p) for p in make_prompts([0.5, 0.0, 0.25])]
    assert second.batch.prompt_ids == (ids[2], ids[0], ids[2])


def test_groups_state_dict_round_trip_is_exact():
    # Through the checkpoint's JSON: dtypes, shapes, NaN in a failed row, 4-d payload (a router
    # trace), per-group fields; an empty table (zero-size arrays) too.
    table = zv.Groups.of(
        prompt_ids=["a", "b"], rewards=[[1.0, np.nan], [0.5]], raw_rewards=[[1.0, 0.0], [1.0]],
        valid=[[True, False], [True]], verifiable=[True, False], ages=[2, 0],
        rows={"expert_ids": [np.arange(16, dtype=np.int32).reshape(2, 2, 2, 2),
                             -np.ones((1, 2, 2, 2), np.int32)],
              "sampler_logps": [np.full((2, 3), -0.1, np.float32), np.zeros((1, 3), np.float32)]},
    )  # fmt: skip
    for t in (table, zv.Groups.empty(), table.take([])):
        state = json.loads(json.dumps(checkpoint.arrays_to_json(t.state_dict())))
        back = zv.Groups.from_state_dict(checkpoint.arrays_from_json(state))
        chex.assert_trees_all_equal(back.state_dict(), t.state_dict())  # NaN == NaN here
        dtype = lambda x: getattr(x, "dtype", type(x))
        assert jax.tree.map(dtype, back.state_dict()) == jax.tree.map(dtype, t.state_dict())
    assert back.num_groups == 0 and back.rows["expert_ids"].shape == (0, 2, 2, 2)  # names kept


def test_groups_take_concat_and_validation():
    table = zv.Groups.of(prompt_ids=["a", "b", "c"], rewards=[[1.0], [2.0, 3.0], [4.0]],
                         rows={"x": [[10], [20, 30], [40]]})  # fmt: skip
    picked = table.take([2, 1])
    assert picked.prompt_ids == ("c", "b") and picked.rewards.tolist() == [4.0, 2.0, 3.0]
    assert picked.group_ids.tolist() == [0, 1, 1] and picked.rows["x"].tolist() == [40, 20, 30]
    both = zv.Groups.concat([picked, zv.Groups.empty(), table.take([0])])
    assert both.group_ids.tolist() == [0, 1, 1, 2] and both.rows["x"].tolist() == [40, 20, 30, 10]
    with pytest.raises(ValueError, match="different payload rows"):
        zv.Groups.concat([table, dataclasses.replace(table, rows={})])
    with pytest.raises(ValueError, match="non-decreasing, every group with >= 1 row"):
        zv.Groups(prompt_ids=("a", "b"), group_ids=np.array([1, 0]), rewards=np.zeros(2))
    with pytest.raises(ValueError, match="non-decreasing, every group with >= 1 row"):
        zv.Groups(prompt_ids=("a", "b"), group_ids=np.array([0, 0]), rewards=np.zeros(2))
    with pytest.raises(ValueError, match=r"Groups.valid has shape \(1,\); need \(2,\)"):
        zv.Groups(prompt_ids=("a",), group_ids=np.zeros(2), rewards=np.zeros(2), valid=[True])
    with pytest.raises(ValueError, match="not row-aligned"):
        dataclasses.replace(table, rows={"x": np.zeros((3, 2))})


def reference_fill(prompts, policy, *, batch_size, group_size, config, buffer, counts):
    """The per-group loop fill_batch was before it worked on tables, on `group_list` dicts.
    `buffer`: [(group, steps waited)]; `counts`: a plain PassRateHistory.counts, decay 0.5."""
    limit = config.max_carry_over_steps
    fresh = [(g, a) for g, a in buffer if a < limit]
    batch = [dict(g, age=a + 1) for g, a in fresh[:batch_size]]
    waiting = fresh[batch_size:]
    leftovers, generated = [], []
    useful = lambda g: not zv.is_zero_variance(np.array(g["rewards"]), atol=config.atol)
    resample = config.mode == "resample"
    calls, exhausted = 0, False
    max_calls = 1 + config.max_resample_rounds if resample else 1
    while len(batch) < batch_size and calls < max_calls and not exhausted:
        rate = sum(map(useful, generated)) / len(generated) if generated else 1.0
        factor = min(config.max_oversample, max(config.oversample, 1 / max(rate, 1e-9)))
        n = math.ceil((batch_size - len(batch)) * (factor if resample else 1.0))
        drawn = list(itertools.islice(prompts, n))
        exhausted = len(drawn) < n
        if not drawn:
            break
        calls += 1
        for g in group_list(policy.generate(drawn, [group_size] * len(drawn))):
            generated.append(g)
            if config.mode == "rl_zvp" or useful(g):
                (batch if len(batch) < batch_size else leftovers).append(g)
    for g in generated:
        c = counts.setdefault(g["prompt_id"], [0.0, 0.0])
        passes = sum(r > 0 for r in g["rewards"])
        c[:] = [0.5 * c[0] + passes, 0.5 * c[1] + len(g["rewards"]) - passes]
    aged = [(g, a + 1) for g, a in waiting] + [(g, 0) for g in leftovers]
    carried = [(g, a) for g, a in aged if a < limit]
    metrics = {
        "zve/generate_calls": calls, "zve/carried_in": len(fresh[:batch_size]),
        "zve/carried_out": len(carried), "zve/groups_generated": len(generated),
        "zve/buffer_dropped": len(buffer) - len(fresh) + len(aged) - len(carried),
    }  # fmt: skip
    return batch, carried, metrics


@pytest.mark.parametrize("mode", ["resample", "rl_zvp", "drop"])
@pytest.mark.parametrize("limit", [0, 1, 2])
def test_fill_batch_equals_the_per_group_loop(mode, limit):
    # Five steps over a random stream, the buffer carried from step to step: batch and buffer
    # (prompts, rewards, row payload, ages), counters and the history equal the plain loop's.
    rng = np.random.default_rng(limit)
    rates = rng.choice([0.0, 0.25, 0.5, 1.0], size=11, p=[0.2, 0.3, 0.3, 0.2]).tolist()
    config = zv.ZveConfig(mode=mode, max_carry_over_steps=limit, oversample=2.5,
                          max_resample_rounds=2)  # fmt: skip
    ours, theirs = QuantilePolicy(), QuantilePolicy()
    ours_prompts, their_prompts = stream(rates), stream(rates)
    history, counts = zv.PassRateHistory(decay=0.5), {}
    buffer, ref_buffer, carried_in = None, [], 0.0
    for step in range(5):
        batch_size = int(rng.integers(1, 5))
        out = zv.fill_batch(
            prompts=ours_prompts,
            generate=ours.generate,
            batch_size=batch_size,
            group_size=4,
            config=config,
            buffer=buffer,
            history=history,
        )
        batch, ref_buffer, metrics = reference_fill(
            their_prompts, theirs, batch_size=batch_size, group_size=4, config=config,
            buffer=ref_buffer, counts=counts,
        )  # fmt: skip
        assert group_list(out.batch) == batch, step
        # The table's buffer ages are the ages in the next batch: steps waited + 1.
        assert group_list(out.buffer) == [dict(g, age=a + 1) for g, a in ref_buffer], step
        assert {k: out.metrics[k] for k in metrics} == metrics, step
        assert history.counts == counts, step
        buffer, carried_in = out.buffer, carried_in + out.metrics["zve/carried_in"]
    assert (carried_in > 0) == (mode == "resample" and limit > 0)  # the buffer was exercised


def test_leftovers_expire_after_max_carry_over_steps():
    policy = QuantilePolicy()
    kw = dict(policy=policy, batch_size=1, mode="resample", oversample=4.0)
    first = fill([0.5], max_carry_over_steps=1, **kw)  # 4 informative: 1 used, 3 buffered
    second = fill([0.5], buffer=first.buffer, max_carry_over_steps=1, **kw)
    assert second.batch.num_groups == 1 and len(policy.calls) == 1
    assert second.buffer.num_groups == 0 and second.metrics["zve/buffer_dropped"] == 2.0
    off = fill([0.5], max_carry_over_steps=0, **kw)
    assert off.buffer.num_groups == 0 and off.metrics["zve/buffer_dropped"] == 3.0
    # issue 7 #8: off by default, as in DAPO (no stale groups unless asked for).
    assert zv.ZveConfig().max_carry_over_steps == 0
    default = fill([0.5], **kw)
    assert default.buffer.num_groups == 0 and default.metrics["zve/carried_out"] == 0.0


def test_resample_stops_after_its_bound():
    policy = QuantilePolicy()
    out = fill([0.0, 1.0], policy=policy, mode="resample", max_resample_rounds=2)
    assert len(policy.calls) == 3  # the first call + 2 extra rounds, never more
    assert out.batch.num_groups == 0 and out.metrics["zve/batch_fill_fraction"] == 0.0
    assert "zve/zero_advantage_rollout_fraction" not in out.metrics  # empty batch: no ratio
    assert "zve/rollouts_per_informative_group" not in out.metrics
    # Partially filled: returned short, never padded with zero-variance groups.
    policy = QuantilePolicy()
    rates = [0.5] + [0.0] * 7
    short = fill(rates, policy=policy, mode="resample", max_resample_rounds=2, max_oversample=1.0)
    assert [len(c) for c in policy.calls] == [4, 3, 3]
    assert short.batch.num_groups == 2 and informative(short.batch).all()
    assert short.metrics["zve/batch_fill_fraction"] == 0.5
    assert short.metrics["zve/zero_advantage_rollout_fraction"] == 0.0


def test_resample_stops_when_prompts_run_out():
    policy = QuantilePolicy()
    out = fill(iter(make_prompts([0.5, 0.5, 0.5])), policy=policy, batch_size=5, mode="resample")
    assert len(policy.calls) == 1 and out.batch.num_groups == 3
    assert out.metrics["zve/prompts_exhausted"] == 1.0


def test_rl_zvp_keeps_and_drop_drops_zero_variance_groups():
    rates = [0.5, 0.0, 1.0, 0.5]
    policy, history = QuantilePolicy(), zv.PassRateHistory()
    kept = fill(rates, policy=policy, mode="rl_zvp", history=history)
    assert len(policy.calls) == 1 and kept.batch.num_groups == 4
    assert kept.metrics["zve/optimizer_zvp_rate"] == 0.5
    assert kept.metrics["zve/zero_advantage_rollout_fraction"] == 0.5  # GRPO-zero; RL-ZVP shapes
    ids = [zv.prompt_id(p) for p in make_prompts(rates)]
    # Every generated group updates the history, zero-variance ones included.
    np.testing.assert_allclose(history.pass_rates(ids), [2.5 / 5, 0.5 / 5, 4.5 / 5, 2.5 / 5])
    policy = QuantilePolicy()
    dropped = fill(rates, policy=policy, mode="drop")
    assert len(policy.calls) == 1 and dropped.batch.num_groups == 2
    assert informative(dropped.batch).all()
    assert dropped.metrics["zve/batch_fill_fraction"] == 0.5
    assert dropped.metrics["zve/rollout_zvp_rate"] == 0.5


def test_adaptive_group_sizes_reach_generate():
    policy = QuantilePolicy()
    config = zv.ZveConfig(group_size=4, max_group_size=16)
    out = fill(
        [0.5, 0.0, 1.0, 0.5],
        policy=policy,
        mode="rl_zvp",
        group_size=lambda ps: config.group_sizes([p["p"] for p in ps]),
    )
    assert policy.calls == [[4, 16, 16, 4]]
    assert out.batch.group_sizes.tolist() == [4, 16, 16, 4]
    assert out.metrics["zve/zero_advantage_rollout_fraction"] == 32 / 40


def buffered_group():
    """An informative group waiting in the resample buffer (sampled at the previous step)."""
    return zv.Groups.of(prompt_ids=["buffered"], rewards=[[1.0, 0.0, 1.0, 0.0]], ages=[1],
                        rows={"tokens": [-np.ones((4, 3), np.int64)]})  # fmt: skip


def test_history_gets_the_generated_groups_in_drop_mode():
    # issue 13 #3. B = 2: the buffered group fills one slot; one call draws q0 (p = 0, ZVP),
    # which drop discards. The history must record q0 (4 failures: it is what adaptive G needs
    # to know) and must not count the buffered group again (it was counted when generated).
    # Wrong answer (history.update(batch)): {"buffered": [2, 2]} and no q0.
    history, ids = zv.PassRateHistory(), [zv.prompt_id(p) for p in make_prompts([0.0, 0.5])]
    out = fill([0.0, 0.5], policy=QuantilePolicy(), batch_size=2, mode="drop",
               buffer=buffered_group(), history=history, max_carry_over_steps=1)  # fmt: skip
    assert out.batch.prompt_ids == ("buffered",)
    assert history.counts == {ids[0]: [0.0, 4.0]}


def test_history_gets_the_generated_groups_in_resample_mode():
    # Same buffer, resample: round 1 draws 1 prompt (q0, ZVP; informative rate 0 -> factor 4),
    # round 2 draws 4: q1, q0, q1, q0 -> q1 fills the batch, the second q1 is left over.
    # Generated: q0 x3 (4 failures each), q1 x2 (2 passes, 2 failures each).
    # Wrong answer (history.update(batch)): {"buffered": [2, 2], q1: [2, 2]}.
    history, ids = zv.PassRateHistory(), [zv.prompt_id(p) for p in make_prompts([0.0, 0.5])]
    policy = QuantilePolicy()
    out = fill([0.0, 0.5], policy=policy, batch_size=2, mode="resample",
               buffer=buffered_group(), history=history, max_carry_over_steps=1)  # fmt: skip
    assert [len(c) for c in policy.calls] == [1, 4]
    assert out.batch.prompt_ids == ("buffered", ids[1])
    assert history.counts == {ids[0]: [0.0, 12.0], ids[1]: [4.0, 4.0]}
    assert out.buffer.num_groups == 1 and out.metrics["zve/carried_in"] == 1.0


def verifier_tie_broken_by_shaping(prompts, sizes):
    raw = np.zeros(4, np.float32)  # every group is all-wrong on the verifier...
    shaped = raw - np.array([0.0, 0.1, 0.0, 0.2], np.float32)  # ... ties broken by shaping
    n = len(prompts)
    return zv.Groups.of(prompt_ids=[str(i) for i in range(n)], rewards=[shaped] * n,
                        raw_rewards=[raw] * n)  # fmt: skip


@pytest.mark.parametrize("mode", ["resample", "drop", "rl_zvp"])
def test_shaping_never_makes_a_group_informative(mode):
    # issue 7 #1: zero-variance is judged on verifier rewards, so resample and drop keep none of
    # these groups; rl_zvp keeps them for RL-ZVP. Wrong answer (judging the shaped rewards):
    # every group "informative", a full batch in every mode, optimizer ZVP rate 0.
    out = zv.fill_batch(prompts=stream([0.5]), generate=verifier_tie_broken_by_shaping,
                        batch_size=2, group_size=4,
                        config=zv.ZveConfig(mode=mode, max_resample_rounds=1))  # fmt: skip
    m = out.metrics
    assert m["zve/rollout_zvp_rate"] == 1.0 and m["zve/post_shaping_zvp_rate"] == 0.0
    assert m["zve/informative_groups_generated"] == 0.0
    if mode == "rl_zvp":
        assert out.batch.num_groups == 2 and m["zve/optimizer_zvp_rate"] == 1.0
    else:
        assert out.batch.num_groups == 0


def test_failed_samples_are_not_answers_in_fill_batch():
    # issue 7 #2. Three groups of G = 4 with failed samples (valid False, reward 0 or NaN):
    #   [1, 1, 0*, 1]: all correct on its valid samples -> zero-variance (not informative);
    #   [1, 0, nan*, 0]: informative; [1*, 0*, 0*, 1]: one valid sample -> no signal.
    # Wrong answer (failures read as wrong answers): the first group informative.
    groups = [
        ([1.0, 1.0, 0.0, 1.0], [1, 1, 0, 1]),
        ([1.0, 0.0, np.nan, 0.0], [1, 1, 0, 1]),
        ([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 1]),
    ]

    def generate(prompts, sizes):
        return zv.Groups.of(
            prompt_ids=[p["question"] for p in prompts],
            rewards=[r for r, _ in groups],
            valid=[v for _, v in groups],
        )

    history = zv.PassRateHistory()
    out = zv.fill_batch(prompts=iter(make_prompts([0.5] * 3)), generate=generate, batch_size=3,
                        group_size=4, config=zv.ZveConfig(mode="drop"),
                        history=history)  # fmt: skip
    assert out.batch.prompt_ids == ("q1",)
    m = out.metrics
    assert m["zve/invalid_samples"] == 5.0 and m["zve/no_signal_groups"] == 1.0
    assert m["zve/informative_groups_generated"] == 1.0
    assert history.counts == {"q0": [3.0, 0.0], "q1": [1.0, 2.0], "q2": [1.0, 0.0]}


def test_shaping_stage_is_measured_and_generate_is_checked():
    def generate(prompts, sizes):
        raw = np.zeros(4, np.float32)  # every group is all-wrong before shaping...
        shaped = raw - np.array([0.0, 0.1, 0.0, 0.2])  # ... and broken ties after it
        n = len(prompts)
        return zv.Groups.of(prompt_ids=["x"] * n, rewards=[shaped] * n, raw_rewards=[raw] * n)

    out = zv.fill_batch(
        prompts=stream([0.5]), generate=generate, batch_size=2, group_size=4, config=zv.ZveConfig()
    )
    assert out.metrics["zve/rollout_zvp_rate"] == 1.0
    assert out.metrics["zve/post_shaping_zvp_rate"] == 0.0
    pair = lambda n: zv.Groups.of(prompt_ids=["x"] * n, rewards=[[1.0, 0.0]] * n)
    with pytest.raises(ValueError, match=r"group sizes \[2 2\] for G=\[4 4\]"):
        zv.fill_batch(
            prompts=stream([0.5]),
            generate=lambda ps, sizes: pair(len(ps)),
            batch_size=2,
            group_size=4,
            config=zv.ZveConfig(),
        )
    with pytest.raises(ValueError, match="1 groups for 2 prompts"):
        zv.fill_batch(
            prompts=stream([0.5]),
            generate=lambda ps, sizes: pair(1),
            batch_size=2,
            group_size=2,
            config=zv.ZveConfig(),
        )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="grpo"), "mode"),
        (dict(max_resample_rounds=-1), "max_resample_rounds"),
        (dict(max_resample_rounds=1.5), "max_resample_rounds"),
        (dict(oversample=0.5), "oversample"),
        (dict(oversample="2"), "oversample"),
        (dict(oversample=4.0, max_oversample=2.0), "max_oversample"),
        (dict(max_carry_over_steps=-1), "max_carry_over_steps"),
        (dict(prefilter="maybe"), "prefilter"),
        (dict(prefilter_high=0.0), "prefilter_high"),
        (dict(prefilter_downweight=2.0), "prefilter_downweight"),
        (dict(group_size=0), "group_size"),
        (dict(group_size=8, max_group_size=4), "max_group_size"),
        (dict(zvp_target=1.0), "zvp_target"),
        (dict(rollout_budget=0), "rollout_budget"),
    ],
)
def test_config_errors_name_field_and_value(kwargs, field):
    with raises_invalid(field, where="ZveConfig") as info:
        zv.ZveConfig(**kwargs)
    assert info.value.value == kwargs[field]


def test_config_is_frozen_and_drives_group_sizes():
    config = zv.ZveConfig(group_size=4, max_group_size=32, rollout_budget=40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "drop"
    np.testing.assert_array_equal(config.group_sizes([0.05, 0.5, 0.01]), [16, 4, 20])
    with pytest.raises(ValueError, match="batch_size=0"):
        fill([0.5], policy=QuantilePolicy(), batch_size=0)


def test_pass_rate_history_prior_is_passes_then_failures():
    """prior=(a, b) adds a pseudo-passes and b pseudo-failures: (passes + a) / (n + a + b),
    also when seeded from an offline table (rate * N passes)."""
    history = zv.PassRateHistory(prior=(2.0, 1.0))
    history.update(zv.Groups.of(prompt_ids=["a"], rewards=[[1, 1, 1, 0]]))
    np.testing.assert_allclose(history.pass_rates(["a", "never"]), [5 / 7, np.nan])
    table = zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"b": 0.25})
    seeded = zv.PassRateHistory.from_table(table, prior=(1.0, 3.0))
    np.testing.assert_allclose(seeded.pass_rates(["b"]), [2 / 8])


def test_predicted_zero_variance_by_hand():
    rates = np.array([np.nan, 0.0, 0.1, 0.5, 0.9, 1.0])
    got = zv.predicted_zero_variance(rates, low=0.1, high=0.9)
    np.testing.assert_array_equal(got, [False, True, True, False, True, True])
    assert not zv.predicted_zero_variance(0.5, low=0.0, high=1.0)
