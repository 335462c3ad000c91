"""Tests for espo.zero_variance: every ZVE stage with fake policies of known per-prompt pass rate.

Two fakes: `BernoulliPolicy` samples reward 1 with probability p (seeded numpy RNG) for the
statistical checks; `QuantilePolicy` gives exactly round(p * G) ones then zeros, so p in (0, 1)
is always informative and p in {0, 1} always zero-variance, for exact counting tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

from espo import advantages
from espo import zero_variance as zv


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

    def generate(self, prompts, group_sizes):
        self.calls.append([int(g) for g in group_sizes])
        out = []
        for prompt, g in zip(prompts, group_sizes, strict=True):
            rewards = (np.arange(g) < round(prompt["p"] * g)).astype(np.float32)  # [G]
            out.append(zv.Group(prompt_id=zv.prompt_id(prompt), rewards=rewards, payload=prompt))
        return out


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


def test_zero_variance_agrees_with_advantages_compute():
    # The host rule (is_informative) and the device rule (advantages.compute) are one rule:
    # verifier rewards of valid samples, max - min <= atol, >= 2 valid for any signal.
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, size=(64, 4)).astype(np.float32)  # [P, G], many ties
    rewards[:8] += rng.normal(0, 1e-7, size=(8, 4))  # near-ties, below atol
    rewards[8:16, 0] += 1e-3  # above atol
    valid = rng.random((64, 4)) > 0.25
    rewards[~valid] = np.nan  # what a failed sample holds must not matter
    groups = [zv.Group(prompt_id=str(i), rewards=r, valid=v) for i, (r, v) in
              enumerate(zip(rewards, valid, strict=True))]  # fmt: skip
    ours = [zv.is_informative(g) for g in groups]
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
    group = lambda r, valid=None: zv.Group(prompt_id="a", rewards=np.array(r), valid=valid)
    assert not zv.is_informative(group([1.0]))  # one sample: no signal
    assert not zv.is_informative(group([1.0, 0.0], valid=np.array([True, False])))
    assert zv.is_informative(group([1.0, 0.0]))


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
    group = lambda rewards, raw=None: zv.Group(
        prompt_id="a", rewards=np.array(rewards), raw_rewards=raw
    )
    history.update([group([1, 1, 1, 0])])
    np.testing.assert_allclose(history.pass_rates(["a", "never"]), [3.5 / 5, np.nan])
    history.update([group([0, 0, 0, 0])])
    np.testing.assert_allclose(history.pass_rates(["a"]), [3.5 / 9])
    # raw (unshaped) rewards decide the pass: shaped 0.5 > 0 would count 2 passes, raw counts 1.
    history.update([group([0.5, 0.5], raw=np.array([1.0, 0.0]))])
    np.testing.assert_allclose(history.pass_rates(["a"]), [4.5 / 11])
    state = json.loads(json.dumps(history.state_dict()))
    assert zv.PassRateHistory.from_state_dict(state) == history
    decayed = zv.PassRateHistory(decay=0.5)
    decayed.update([group([1, 1, 1, 0])])
    decayed.update([group([0, 0, 0, 0])])  # counts [3, 1] -> [1.5, 0.5 + 4]
    np.testing.assert_allclose(decayed.pass_rates(["a"]), [2.0 / 7])
    table = zv.PassRateTable(policy_tag="t", num_samples=8, pass_rates={"b": 0.25})
    np.testing.assert_allclose(zv.PassRateHistory.from_table(table).pass_rates(["b"]), [2.5 / 9])
    with pytest.raises(ValueError, match="decay=0"):
        zv.PassRateHistory(decay=0.0)


def test_pass_rate_history_skips_failed_samples_and_judge_groups():
    # issue 7 #2: [1, 0 (failed), 1, 0] counts 2 passes and 1 failure, not 2 and 2.
    history = zv.PassRateHistory()
    valid = np.array([True, False, True, True])
    history.update([zv.Group(prompt_id="a", rewards=np.array([1.0, 0.0, 1.0, 0.0]), valid=valid)])
    assert history.counts == {"a": [2.0, 1.0]}
    # A judge's relative rewards (unverifiable) and an all-failed group say nothing.
    history.update([
        zv.Group(prompt_id="a", rewards=np.array([1.0, -1.0]), verifiable=False),
        zv.Group(prompt_id="b", rewards=np.zeros(2), valid=np.zeros(2, bool)),
    ])  # fmt: skip
    assert history.counts == {"a": [2.0, 1.0]}


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


def is_informative(group):
    return not zv.is_zero_variance(group.rewards)


def test_resample_fills_with_informative_groups_only():
    # Stream 0.5, 0, 1, 0 (informative 1 in 4), B = 2. Round 1 draws 2 -> 1 informative
    # (rate 1/2 -> factor 2); round 2 draws 2 (1, 0) -> none (rate 1/4 -> factor 4); round 3
    # draws 4 -> 1 informative: full after 3 calls.
    policy = QuantilePolicy()
    out = fill([0.5, 0.0, 1.0, 0.0], policy=policy, batch_size=2, mode="resample")
    assert [len(c) for c in policy.calls] == [2, 2, 4]
    assert len(out.groups) == 2 and all(is_informative(g) for g in out.groups)
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
    assert len(first.groups) == 2 and len(first.buffer.groups) == 2
    assert first.buffer.ages == (0, 0)
    assert first.metrics["zve/carried_out"] == 2.0
    # The next step is served from the buffer without generating.
    state = first.buffer.state_dict()
    buffer = zv.ResampleBuffer.from_state_dict(state)
    second = fill([0.5], buffer=buffer, **kw)
    assert len(policy.calls) == 1
    assert [g.prompt_id for g in second.groups] == [g.prompt_id for g in first.buffer.groups]
    # Carried groups are marked: sampled one optimiser step before the batch that uses them
    # (their payload holds that policy's log-probs and router trace).
    assert [g.age for g in first.groups] == [0, 0] and [g.age for g in second.groups] == [1, 1]
    assert second.metrics["zve/carried_in"] == 2.0 and "zve/rollout_zvp_rate" not in second.metrics
    third = fill([0.5], buffer=second.buffer, **kw)
    assert len(policy.calls) == 2 and third.metrics["zve/carried_in"] == 0.0


def test_leftovers_expire_after_max_carry_over_steps():
    policy = QuantilePolicy()
    kw = dict(policy=policy, batch_size=1, mode="resample", oversample=4.0)
    first = fill([0.5], max_carry_over_steps=1, **kw)  # 4 informative: 1 used, 3 buffered
    second = fill([0.5], buffer=first.buffer, max_carry_over_steps=1, **kw)
    assert len(second.groups) == 1 and len(policy.calls) == 1
    assert second.buffer.groups == () and second.metrics["zve/buffer_dropped"] == 2.0
    off = fill([0.5], max_carry_over_steps=0, **kw)
    assert off.buffer.groups == () and off.metrics["zve/buffer_dropped"] == 3.0
    # issue 7 #8: off by default, as in DAPO (no stale groups unless asked for).
    assert zv.ZveConfig().max_carry_over_steps == 0
    default = fill([0.5], **kw)
    assert default.buffer.groups == () and default.metrics["zve/carried_out"] == 0.0


def test_resample_stops_after_its_bound():
    policy = QuantilePolicy()
    out = fill([0.0, 1.0], policy=policy, mode="resample", max_resample_rounds=2)
    assert len(policy.calls) == 3  # the first call + 2 extra rounds, never more
    assert out.groups == [] and out.metrics["zve/batch_fill_fraction"] == 0.0
    assert "zve/zero_advantage_rollout_fraction" not in out.metrics  # empty batch: no ratio
    assert "zve/rollouts_per_informative_group" not in out.metrics
    # Partially filled: returned short, never padded with zero-variance groups.
    policy = QuantilePolicy()
    rates = [0.5] + [0.0] * 7
    short = fill(rates, policy=policy, mode="resample", max_resample_rounds=2, max_oversample=1.0)
    assert [len(c) for c in policy.calls] == [4, 3, 3]
    assert len(short.groups) == 2 and all(is_informative(g) for g in short.groups)
    assert short.metrics["zve/batch_fill_fraction"] == 0.5
    assert short.metrics["zve/zero_advantage_rollout_fraction"] == 0.0


def test_resample_stops_when_prompts_run_out():
    policy = QuantilePolicy()
    out = fill(iter(make_prompts([0.5, 0.5, 0.5])), policy=policy, batch_size=5, mode="resample")
    assert len(policy.calls) == 1 and len(out.groups) == 3
    assert out.metrics["zve/prompts_exhausted"] == 1.0


def test_rl_zvp_keeps_and_drop_drops_zero_variance_groups():
    rates = [0.5, 0.0, 1.0, 0.5]
    policy, history = QuantilePolicy(), zv.PassRateHistory()
    kept = fill(rates, policy=policy, mode="rl_zvp", history=history)
    assert len(policy.calls) == 1 and len(kept.groups) == 4
    assert kept.metrics["zve/optimizer_zvp_rate"] == 0.5
    assert kept.metrics["zve/zero_advantage_rollout_fraction"] == 0.5  # GRPO-zero; RL-ZVP shapes
    ids = [zv.prompt_id(p) for p in make_prompts(rates)]
    # Every generated group updates the history, zero-variance ones included.
    np.testing.assert_allclose(history.pass_rates(ids), [2.5 / 5, 0.5 / 5, 4.5 / 5, 2.5 / 5])
    policy = QuantilePolicy()
    dropped = fill(rates, policy=policy, mode="drop")
    assert len(policy.calls) == 1 and len(dropped.groups) == 2
    assert all(is_informative(g) for g in dropped.groups)
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
    assert [g.group_size for g in out.groups] == [4, 16, 16, 4]
    assert out.metrics["zve/zero_advantage_rollout_fraction"] == 32 / 40


def buffered_group():
    """An informative group waiting in the resample buffer (sampled at the previous step)."""
    group = zv.Group(prompt_id="buffered", rewards=np.array([1.0, 0.0, 1.0, 0.0], np.float32))
    return zv.ResampleBuffer(groups=(group,), ages=(0,))


def test_history_gets_the_generated_groups_in_drop_mode():
    # issue 13 #3. B = 2: the buffered group fills one slot; one call draws q0 (p = 0, ZVP),
    # which drop discards. The history must record q0 (4 failures: it is what adaptive G needs
    # to know) and must not count the buffered group again (it was counted when generated).
    # Wrong answer (history.update(batch)): {"buffered": [2, 2]} and no q0.
    history, ids = zv.PassRateHistory(), [zv.prompt_id(p) for p in make_prompts([0.0, 0.5])]
    out = fill([0.0, 0.5], policy=QuantilePolicy(), batch_size=2, mode="drop",
               buffer=buffered_group(), history=history, max_carry_over_steps=1)  # fmt: skip
    assert [g.prompt_id for g in out.groups] == ["buffered"]
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
    assert [g.prompt_id for g in out.groups] == ["buffered", ids[1]]
    assert history.counts == {ids[0]: [0.0, 12.0], ids[1]: [4.0, 4.0]}
    assert len(out.buffer.groups) == 1 and out.metrics["zve/carried_in"] == 1.0


def verifier_tie_broken_by_shaping(prompts, sizes):
    raw = np.zeros(4, np.float32)  # every group is all-wrong on the verifier...
    shaped = raw - np.array([0.0, 0.1, 0.0, 0.2], np.float32)  # ... ties broken by shaping
    return [zv.Group(prompt_id=str(i), rewards=shaped, raw_rewards=raw) for i, _ in
            enumerate(prompts)]  # fmt: skip


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
        assert len(out.groups) == 2 and m["zve/optimizer_zvp_rate"] == 1.0
    else:
        assert out.groups == []


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
        return [zv.Group(prompt_id=p["question"], rewards=np.array(r, np.float32),
                         valid=np.array(v, bool)) for p, (r, v) in
                zip(prompts, groups, strict=True)]  # fmt: skip

    history = zv.PassRateHistory()
    out = zv.fill_batch(prompts=iter(make_prompts([0.5] * 3)), generate=generate, batch_size=3,
                        group_size=4, config=zv.ZveConfig(mode="drop"),
                        history=history)  # fmt: skip
    assert [g.prompt_id for g in out.groups] == ["q1"]
    m = out.metrics
    assert m["zve/invalid_samples"] == 5.0 and m["zve/no_signal_groups"] == 1.0
    assert m["zve/informative_groups_generated"] == 1.0
    assert history.counts == {"q0": [3.0, 0.0], "q1": [1.0, 2.0], "q2": [1.0, 0.0]}


def test_shaping_stage_is_measured_and_bare_rewards_accepted():
    def generate(prompts, sizes):
        raw = np.zeros(4, np.float32)  # every group is all-wrong before shaping...
        shaped = raw - np.array([0.0, 0.1, 0.0, 0.2])  # ... and broken ties after it
        return [zv.Group(prompt_id="x", rewards=shaped, raw_rewards=raw) for _ in prompts]

    out = zv.fill_batch(
        prompts=stream([0.5]), generate=generate, batch_size=2, group_size=4, config=zv.ZveConfig()
    )
    assert out.metrics["zve/rollout_zvp_rate"] == 1.0
    assert out.metrics["zve/post_shaping_zvp_rate"] == 0.0
    bare = zv.fill_batch(
        prompts=stream([0.5]),
        generate=lambda ps, sizes: [np.array([1.0, 0.0]) for _ in ps],
        batch_size=2,
        group_size=2,
        config=zv.ZveConfig(),
    )
    assert bare.groups[0].prompt_id == zv.prompt_id(make_prompts([0.5])[0])
    with pytest.raises(ValueError, match="2 rewards for G=4"):
        zv.fill_batch(
            prompts=stream([0.5]),
            generate=lambda ps, sizes: [np.array([1.0, 0.0]) for _ in ps],
            batch_size=2,
            group_size=4,
            config=zv.ZveConfig(),
        )
    with pytest.raises(ValueError, match="1 groups for 2 prompts"):
        zv.fill_batch(
            prompts=stream([0.5]),
            generate=lambda ps, sizes: [np.array([1.0, 0.0])],
            batch_size=2,
            group_size=2,
            config=zv.ZveConfig(),
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="grpo"), "ZveConfig.mode='grpo'; valid: one of ('resample', 'rl_zvp', 'drop')"),
        (dict(max_resample_rounds=-1), "ZveConfig.max_resample_rounds=-1; valid: an int >= 0"),
        (dict(max_resample_rounds=1.5), "ZveConfig.max_resample_rounds=1.5"),
        (dict(oversample=0.5), "ZveConfig.oversample=0.5; valid: a float >= 1"),
        (dict(oversample="2"), "ZveConfig.oversample='2'"),
        (dict(oversample=4.0, max_oversample=2.0), "ZveConfig.max_oversample=2.0"),
        (dict(max_carry_over_steps=-1), "ZveConfig.max_carry_over_steps=-1"),
        (dict(prefilter="maybe"), "ZveConfig.prefilter='maybe'; valid: one of ('off'"),
        (dict(prefilter_high=0.0), "ZveConfig.prefilter_high=0.0; valid: (prefilter_low, 1]"),
        (dict(prefilter_downweight=2.0), "ZveConfig.prefilter_downweight=2.0"),
        (dict(group_size=0), "ZveConfig.group_size=0"),
        (dict(group_size=8, max_group_size=4), "ZveConfig.max_group_size=4"),
        (dict(zvp_target=1.0), "ZveConfig.zvp_target=1.0; valid: (0, 1)"),
        (dict(rollout_budget=0), "ZveConfig.rollout_budget=0"),
    ],
)
def test_config_errors_name_field_value_and_options(kwargs, message):
    with pytest.raises(ValueError) as err:
        zv.ZveConfig(**kwargs)
    assert message in str(err.value)


def test_config_is_frozen_and_drives_group_sizes():
    config = zv.ZveConfig(group_size=4, max_group_size=32, rollout_budget=40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "drop"
    np.testing.assert_array_equal(config.group_sizes([0.05, 0.5, 0.01]), [16, 4, 20])
    with pytest.raises(ValueError, match="batch_size=0"):
        fill([0.5], policy=QuantilePolicy(), batch_size=0)
