"""Stage 4 of espo.zero_variance (optimisation): `fill_batch` with fake policies.

The modes: resample (informative groups only, bounded rounds, stopping when prompts run out),
rl_zvp (keeps zero-variance groups) and drop; carry-over of leftovers between steps (ages,
expiry, the buffer through a checkpoint, the rows it returns); the pass-rate history it updates
(every generated group, never a buffered one twice); shaping and failed samples never making a
group informative, with the config's atol everywhere; its counters; and agreement with
`reference_fill`, the plain per-group loop it replaced.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib

import numpy as np
import pytest

from espo import checkpoint, testing
from espo import zero_variance as zv

# tests/ is not a package (pytest runs with --import-mode=importlib): the helpers load by path.
_helpers = testing.load_script(
    pathlib.Path(__file__).with_name("_helpers.py"), name="espo_tests_zero_variance_helpers"
)
make_prompts, QuantilePolicy, group_list, stream, fill = (
    _helpers.make_prompts,
    _helpers.QuantilePolicy,
    _helpers.group_list,
    _helpers.stream,
    _helpers.fill,
)


def informative(table):
    """bool [P]: no tie in the (unshaped) rewards of each group."""
    return np.array([not zv.is_zero_variance(g["rewards"]) for g in group_list(table)], bool)


# ---- resample and carry-over ------------------------------------------------------------------


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


# ---- rl_zvp, drop and the history -------------------------------------------------------------


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


# ---- what makes a group informative -----------------------------------------------------------


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


FOUR_GROUPS = {  # prompt -> (verifier rewards, shaped rewards, valid); * = invalid row
    "g0": ([0.0, 0.25], [0.0, 0.25], [True, True]),  # spread 0.25 <= atol 0.5: zero-variance
    "g1": ([0.0, 1.0], [0.0, 1.0], [True, True]),  # informative
    "g2": ([1.0, 1.0, 0.0], [0.5, 0.5, 5.0], [True, True, False]),  # tie on valid rows, 5.0*
    "g3": ([1.0, 0.0], [1.0, 0.0], [True, False]),  # one valid row: no signal
}


def generate_four(prompts, sizes):
    """The FOUR_GROUPS rows, every group stamped with age 7 (fill_batch must reset it)."""
    raw, shaped, valid = zip(*(FOUR_GROUPS[p] for p in prompts), strict=True)
    return zv.Groups.of(prompt_ids=list(prompts), rewards=shaped, raw_rewards=raw, valid=valid,
                        ages=np.full(len(prompts), 7))  # fmt: skip


@pytest.mark.parametrize("mode", ["rl_zvp", "drop"])
def test_fill_batch_uses_config_atol_and_validity_everywhere(mode):
    # atol 0.5. Verifier: g0 zero (0.25 <= 0.5), g1 informative, g2 zero on its valid rows, g3
    # one valid row -> informative 1 of 4, rollout ZVP rate 3/4. Shaped (valid rows only,
    # same atol): g0 zero, g1 not, g2 [0.5, 0.5] zero, g3 one row zero -> 3/4 (reading the
    # invalid 5.0 or atol 1e-6 would give 1/2). No-signal groups: g3 only (< 2 valid; g0, g1,
    # g2 have exactly 2). rl_zvp keeps all 4 groups: optimiser ZVP 3/4, zero-advantage rows
    # (2 + 3 + 2) / 9; drop keeps g1 alone. New groups have age 0 whatever generate says.
    out = zv.fill_batch(prompts=iter(list(FOUR_GROUPS)), generate=generate_four, batch_size=4,
                        group_size=lambda ps: [len(FOUR_GROUPS[p][0]) for p in ps],
                        config=zv.ZveConfig(mode=mode, atol=0.5))  # fmt: skip
    m = out.metrics
    assert m["zve/rollout_zvp_rate"] == 0.75 and m["zve/post_shaping_zvp_rate"] == 0.75
    assert m["zve/no_signal_groups"] == 1.0 and m["zve/invalid_samples"] == 2.0
    if mode == "rl_zvp":
        assert out.batch.prompt_ids == ("g0", "g1", "g2", "g3")
        assert m["zve/optimizer_zvp_rate"] == 0.75
        assert m["zve/zero_advantage_rollout_fraction"] == 7 / 9
    else:
        assert out.batch.prompt_ids == ("g1",) and m["zve/optimizer_zvp_rate"] == 0.0
    assert out.batch.ages.tolist() == [0] * out.batch.num_groups


def test_fill_batch_counts_prompts_rollouts_and_batch_groups():
    # Resample, B = 2, G = 4, stream p = 0.5, 0, 1, 0 (quantile rewards: 0.5 -> [1, 1, 0, 0]
    # informative, 0 / 1 -> all equal). Calls draw 2 (1 informative, rate 1/2 -> factor 2),
    # then ceil(1 * 2) = 2 (none; rate 1/4 -> factor 4), then 4 (one more): 8 prompts, 32
    # rollouts, a batch of 2 groups.
    rates = itertools.cycle([0.5, 0.0, 1.0, 0.0])

    def generate(prompts, sizes):
        rewards = [
            (np.arange(g) < round(p * g)).astype(np.float32)
            for p, g in zip(prompts, sizes, strict=True)
        ]
        return zv.Groups.of(prompt_ids=[str(p) for p in prompts], rewards=rewards)

    out = zv.fill_batch(prompts=rates, generate=generate, batch_size=2, group_size=4,
                        config=zv.ZveConfig(mode="resample"))  # fmt: skip
    m = out.metrics
    assert m["zve/generate_calls"] == 3.0 and m["zve/prompts_drawn"] == 8.0
    assert m["zve/rollouts_generated"] == 32.0 and m["zve/batch_groups"] == 2.0
    # No prompt at all: an empty batch, reported as exhausted (not None, not an error).
    empty = zv.fill_batch(prompts=iter([]), generate=generate, batch_size=2, group_size=4,
                          config=zv.ZveConfig(mode="resample"))  # fmt: skip
    assert empty.batch.num_groups == 0 and empty.metrics["zve/prompts_exhausted"] == 1.0
    assert empty.metrics["zve/prompts_drawn"] == 0.0


# ---- the per-group reference loop -------------------------------------------------------------


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
