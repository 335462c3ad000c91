"""Edge cases of espo.zero_variance that the stage tests (test_zero_variance.py) leave open.

Found by mutation testing (issue 13): each test pins a behaviour that a plausible slip in the
code would change without failing any other test: a boundary value that is just valid, an error
message, a dtype the docstrings promise, an argument forwarded (atol, zvp_target, decay...), a
field a selection must carry (valid, verifiable, raw_rewards). Expected values are derived by
hand in the comments; no JAX, everything here is host numpy and runs in well under a second.
"""

from __future__ import annotations

import collections.abc
import fractions
import hashlib
import itertools
import json
import os
import types
import warnings

import numpy as np
import pytest

from espo import zero_variance as zv
from espo.testing import raises_invalid

# ---------------------------------------------------------------- shared definitions


def test_prompt_id_hashes_text_itself_and_json_of_anything_else():
    # sha256("abc") = ba7816bf8f01cfea 414140de... (FIPS 180-2 test vector): text is hashed as
    # is, not as its JSON string '"abc"' (which would hash to something else).
    assert zv.prompt_id("abc") == "ba7816bf8f01cfea"
    # A mapping is hashed as canonical JSON (sorted keys, json's default separators).
    want = hashlib.sha256(b'{"a": 2, "b": 1}').hexdigest()[:16]
    assert zv.prompt_id({"b": 1, "a": 2}) == want
    # Values json cannot encode (numpy scalars from a dataset loader) are encoded by str().
    assert zv.prompt_id({"p": np.float32(1.5)}) == zv.prompt_id({"p": "1.5"})


def test_zero_variance_groups_spread_is_float32_and_inputs_are_normalised():
    # float32 spread: 1e8 lies in [2^26, 2^27), where float32 steps by 2^(26-23) = 8, so
    # 1e8 - (-1) = 100000001 rounds to 1e8 == atol -> zero-variance. In float64 the spread
    # would be 100000001 > atol (the wrong answer: informative).
    zero, _ = zv.zero_variance_groups(
        np.array([1e8, -1.0], np.float32), group_ids=np.zeros(2, np.int64), num_groups=1,
        atol=1e8,
    )  # fmt: skip
    np.testing.assert_array_equal(zero, [True])
    # Group ids of any numeric dtype and a validity mask given as 0/1 ints (not bool: as
    # integer indices they would pick rows 0 and 1) mean the same as int64 ids and bools.
    # Groups: 0 = [1, 0*, 1] (zero-variance on its 2 valid rows), 1 = [5*, 5*] (no valid
    # row), 2 = [2, 3] (spread 1).
    rewards = np.array([1.0, 0.0, 1.0, 5.0, 5.0, 2.0, 3.0])
    ids = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0])  # float ids
    valid = np.array([1, 0, 1, 0, 0, 1, 1])
    zero, num_valid = zv.zero_variance_groups(rewards, group_ids=ids, num_groups=3, valid=valid)
    np.testing.assert_array_equal(zero, [True, True, False])
    np.testing.assert_array_equal(num_valid, [2, 0, 2])
    # Rewards all +inf (or all -inf): max - min = inf - inf = NaN, a spread (not zero-variance),
    # as `advantages.zero_variance_mask` says; computed silently, without a RuntimeWarning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero, _ = zv.zero_variance_groups(
            np.array([np.inf, np.inf, -np.inf, -np.inf]), group_ids=np.array([0, 0, 1, 1]),
            num_groups=2,
        )  # fmt: skip
    np.testing.assert_array_equal(zero, [False, False])
    # A trailing group without a valid row: bincount alone would give num_valid [2] (length 1).
    zero, num_valid = zv.zero_variance_groups(
        np.array([1.0, 0.0, 1.0, 0.0]), group_ids=np.array([0, 0, 1, 1]), num_groups=2,
        valid=np.array([True, True, False, False]),
    )  # fmt: skip
    np.testing.assert_array_equal(zero, [False, True])
    np.testing.assert_array_equal(num_valid, [2, 0])


def test_is_informative_and_zvp_rate_use_the_given_atol():
    # Spreads 0.25 and 1: with atol 0.5 only the second is a signal (the default 1e-6 would
    # call both informative).
    groups = zv.Groups.of(prompt_ids=["a", "b"], rewards=[[0.0, 0.25], [0.0, 1.0]])
    np.testing.assert_array_equal(zv.is_informative(groups, atol=0.5), [False, True])
    assert zv.zvp_rate_by_group_size([[0.0, 0.25], [0.0, 1.0]], atol=0.5) == {2: 0.5}
    assert zv.zvp_rate_by_group_size([]) == {}  # no prompts: no group size to report


# ---------------------------------------------------------------- stage 1: offline pre-filter


def test_table_validation_boundaries():
    zv.PassRateTable(policy_tag="t", num_samples=1, pass_rates={"a": 0.0})  # N = 1 is valid
    with raises_invalid("num_samples", where="PassRateTable"):
        zv.PassRateTable(policy_tag="t", num_samples=0, pass_rates={})


class _Rates(collections.abc.Mapping):
    """A read-only Mapping that is not a dict (json cannot encode it)."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def test_table_file_is_canonical_and_any_mapping_saves(tmp_path):
    # Same table, keys inserted in another order -> the same bytes (sorted keys at every
    # level), so a re-estimate that changes nothing leaves the file unchanged.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"y": 0.5, "x": 0.25}).save(a)
    zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"x": 0.25, "y": 0.5}).save(b)
    assert a.read_bytes() == b.read_bytes()
    text = a.read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True)
    # pass_rates is typed Mapping: a read-only proxy or a custom Mapping saves as a JSON object.
    for rates in (types.MappingProxyType({"x": 0.25}), _Rates({"x": 0.25})):
        table = zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates=rates)
        table.save(a, overwrite_other_tag=True)
        assert zv.PassRateTable.load(a).pass_rates == {"x": 0.25}


def test_table_temp_file_is_hidden_next_to_the_target(tmp_path, monkeypatch):
    # os.replace is atomic only within one filesystem: the temp file must sit in the target's
    # directory, hidden (".<name>.") and marked ".tmp" so a crash leaves an obvious leftover.
    path = tmp_path / "d.jsonl.pass_rates.json"
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"a": 0.5}).save(path)
    [(src, dst)] = seen
    src = os.fspath(src)
    assert os.path.dirname(src) == os.fspath(tmp_path) and os.fspath(dst) == os.fspath(path)
    name = os.path.basename(src)
    assert name.startswith(".d.jsonl.pass_rates.json.") and name.endswith(".tmp")


def test_table_interrupt_after_the_replace_keeps_the_interrupt(tmp_path, monkeypatch):
    # Ctrl-C landing right after os.replace: the temp file is already gone (it became the
    # table), so the clean-up must not raise FileNotFoundError over the KeyboardInterrupt.
    path = tmp_path / "d.json"
    real_replace = os.replace

    def replace_then_interrupt(src, dst):
        real_replace(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        zv.PassRateTable(policy_tag="t", num_samples=4, pass_rates={"a": 0.5}).save(path)
    monkeypatch.undo()
    assert zv.PassRateTable.load(path).pass_rates == {"a": 0.5}
    assert os.listdir(tmp_path) == ["d.json"]


def test_estimate_pass_rates_batches_threshold_and_float32():
    # 130 distinct prompts at the default batch_size 64 -> sample_fn sees 64, 64, 2.
    calls = []

    def sample_fn(prompts, n):
        calls.append(len(prompts))
        # Reward 0.5 + 1e-9: above the threshold 0.5 in float64, exactly 0.5 in float32 (the
        # spacing at 0.5 is 2^-24 ~ 6e-8), so it does NOT pass: rewards are float32, as
        # everywhere else (PassRateHistory compares the float32 Groups.rewards).
        return np.full((len(prompts), n), 0.5 + 1e-9, np.float64)

    table = zv.estimate_pass_rates(
        [f"q{i}" for i in range(130)], sample_fn=sample_fn, num_samples=2, policy_tag="t",
        success_threshold=0.5,
    )  # fmt: skip
    assert calls == [64, 64, 2]
    assert table.success_threshold == 0.5  # recorded, so from_table reuses it
    assert set(table.pass_rates.values()) == {0.0}
    history = zv.PassRateHistory(success_threshold=0.5)
    history.update(zv.Groups.of(prompt_ids=["q0"], rewards=[np.full(2, 0.5 + 1e-9)]))
    assert history.counts == {"q0": [0.0, 2.0]}  # the online stage agrees: 0 passes


def test_prefilter_default_downweight_and_single_prompt_fractions():
    table = zv.PassRateTable(
        policy_tag="t", num_samples=4, pass_rates={zv.prompt_id("x"): 1.0, zv.prompt_id("y"): 0.5}
    )
    down = zv.prefilter(["x", "y"], table, mode="downweight")  # default downweight 0.1
    np.testing.assert_array_equal(down.weights, [0.1, 1.0])
    # One flagged prompt out of one: every fraction is over P = 1 (not over max(P, 2)).
    one = zv.prefilter(["x"], table, mode="drop")
    assert one.prompts == [] and one.weights.shape == (0,)
    assert one.metrics == {
        "zve/prefilter_flagged_fraction": 1.0,
        "zve/prefilter_removed_fraction": 1.0,
        "zve/prefilter_unknown_fraction": 0.0,
    }


# ---------------------------------------------------------------- stage 2: rollout


def test_zvp_probability_is_float64_for_float32_rates():
    # p = float32(0.1) = 0.100000001490116...; the exact p^2 + (1-p)^2 (rational arithmetic)
    # is matched to float64 precision (float32 arithmetic would be off by ~1e-8).
    p32 = np.float32(0.1)
    v = fractions.Fraction(float(p32))
    want = float(v**2 + (1 - v) ** 2)
    got = zv.zvp_probability(np.array([p32]), 2)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [want], rtol=1e-15, atol=0)


def test_adaptive_group_sizes_boundaries():
    # g_min = 1 is valid; at p = 0.5, zvp(G) = 2 * 0.5^G: G=1 -> 1, G=2 -> 0.5 == target -> 2
    # ("<=": a strict "<" would give 3, at 0.25).
    sizes = zv.adaptive_group_sizes([0.5], g_min=1, g_max=4, zvp_target=0.5)
    np.testing.assert_array_equal(sizes, [2])
    # g_min == g_max: one allowed size, a fixed G for every prompt.
    np.testing.assert_array_equal(zv.adaptive_group_sizes([0.5, 0.0], g_min=4, g_max=4), [4, 4])
    # Default sizes g_min=3, g_max=7: multiples 3, 6 plus g_max 7. At p = 0.5 the ZVP
    # probabilities are 0.25, 0.03125, 0.015625; target 0.05 -> 6 (not 7: 6 is allowed).
    np.testing.assert_array_equal(
        zv.adaptive_group_sizes([0.5], g_min=3, g_max=7, zvp_target=0.05), [6]
    )
    with pytest.raises(ValueError, match=r"need 1 <= g_min <= g_max; got g_min=0, g_max=4"):
        zv.adaptive_group_sizes([0.5], g_min=0, g_max=4)
    with pytest.raises(ValueError, match=r"allowed=\[16\] has no size in \[g_min=2, g_max=8\]"):
        zv.adaptive_group_sizes([0.5], g_min=2, g_max=8, allowed=[16])
    # Budget: p = 0.9 needs G = 8 (0.9^6 = 0.531 > 0.5, 0.9^8 = 0.430 <= 0.5) out of
    # {2, 4, 6, 8}; three prompts with budget 6 = P * min size (just valid) step down to 2 each.
    np.testing.assert_array_equal(
        zv.adaptive_group_sizes([0.9] * 3, g_min=2, g_max=8, budget=6), [2, 2, 2]
    )
    with pytest.raises(ValueError, match=r"budget=5 < P \* min size = 3 \* 2"):
        zv.adaptive_group_sizes([0.9] * 3, g_min=2, g_max=8, budget=5)


def test_config_group_sizes_use_its_zvp_target():
    # Sizes {2, 4, 6, 8}, p = 0.5: 2 * 0.5^G is 0.5 at G=2, 0.125 at G=4. Target 0.2 -> 4
    # (the default target 0.5 would give 2).
    config = zv.ZveConfig(group_size=2, max_group_size=8, zvp_target=0.2)
    np.testing.assert_array_equal(config.group_sizes([0.5]), [4])


def test_pass_rate_history_validation_boundaries():
    zv.PassRateHistory(decay=1.0, prior=(1e-9, 1.0))  # decay 1 and any prior > 0 are valid
    with raises_invalid("decay", where="PassRateHistory"):
        zv.PassRateHistory(decay=1.5)
    with raises_invalid("prior", where="PassRateHistory"):
        zv.PassRateHistory(prior=(0.0, 1.0))
    with raises_invalid("prior"):
        zv.PassRateHistory(prior=(1.0, 1.0, 1.0))


def test_pass_rate_history_from_table_and_state_keep_their_settings():
    # from_table: threshold from the table, other settings from kwargs. Rate 0.25 of N = 4
    # seeds [1, 3]; an update with rewards [0.3, 0.7] at threshold 0.5 is 1 pass, 1 fail and
    # decays first: [0.5 * 1 + 1, 0.5 * 3 + 1] = [1.5, 2.5].
    table = zv.PassRateTable(
        policy_tag="t", num_samples=4, pass_rates={"a": 0.25}, success_threshold=0.5
    )
    history = zv.PassRateHistory.from_table(table, decay=0.5)
    assert (history.success_threshold, history.decay) == (0.5, 0.5)
    history.update(zv.Groups.of(prompt_ids=["a"], rewards=[[0.3, 0.7]]))
    assert history.counts == {"a": [1.5, 2.5]}
    # A judge group first must not stop the update of the verifiable groups after it.
    history.update(
        zv.Groups.of(prompt_ids=["j", "b"], rewards=[[1.0, 0.0], [1.0, 1.0]],
                     verifiable=[False, True])
    )  # fmt: skip
    assert history.counts == {"a": [1.5, 2.5], "b": [2.0, 0.0]}
    # The state restores every setting, and the restored history owns its counts: updating
    # it leaves the state (and the history it came from) unchanged.
    state = history.state_dict()
    back = zv.PassRateHistory.from_state_dict(state)
    assert back == history
    back.update(zv.Groups.of(prompt_ids=["a"], rewards=[[1.0]]))
    assert state["counts"]["a"] == [1.5, 2.5] and history.counts["a"] == [1.5, 2.5]
    assert back.counts["a"] == [0.5 * 1.5 + 1.0, 0.5 * 2.5]


# ---------------------------------------------------------------- Groups


def test_groups_normalise_their_fields():
    # Lists and other dtypes in, the documented dtypes out: prompt ids as str, group ids
    # int32, rewards float32, valid / verifiable bool, ages int64, payload arrays.
    table = zv.Groups(
        prompt_ids=[1, 2], group_ids=[0.0, 0.0, 1.0], rewards=[0, 1, 1],
        raw_rewards=np.array([0.0, 1.0, 1.0]), valid=[1, 0, 1], verifiable=[1, 0],
        ages=[0.0, 2.0], rows={"tokens": [[1, 2], [3, 4], [5, 6]]},
    )  # fmt: skip
    assert table.prompt_ids == ("1", "2")
    assert table.group_ids.dtype == np.int32 and table.group_ids.tolist() == [0, 0, 1]
    assert table.rewards.dtype == np.float32 and table.raw_rewards.dtype == np.float32
    assert table.valid.dtype == bool and table.valid.tolist() == [True, False, True]
    assert table.verifiable.dtype == bool and table.verifiable.tolist() == [True, False]
    assert table.ages.dtype == np.int64 and table.ages.tolist() == [0, 2]
    assert isinstance(table.rows["tokens"], np.ndarray) and table.rows["tokens"].shape == (3, 2)
    # No groups at all, every per-group list empty: an empty table, not an error.
    empty = zv.Groups.of(prompt_ids=[], rewards=[], raw_rewards=[], valid=[])
    assert empty.num_groups == 0 and empty.rewards.dtype == np.float32
    assert empty.rewards.shape == (0,) and empty.raw_rewards is None and empty.valid.shape == (0,)


def test_groups_validation_messages():
    bad_ids = r"Groups\.group_ids=.* invalid: need \[N\] ids 0\.\.{} \(P = len\(prompt_ids\)\)"
    for ids in ([0, 1], [-1, 0], np.zeros((1, 2)), np.array(0)):
        # id 1 == P, a negative id, 2-d and 0-d ids: all the same message (P = 1 -> ids 0..0).
        with pytest.raises(ValueError, match=bad_ids.format(0)):
            zv.Groups(prompt_ids=("a",), group_ids=ids, rewards=np.zeros(np.size(ids)))
    with pytest.raises(ValueError, match=bad_ids.format(2)):
        zv.Groups(prompt_ids=("a", "b", "c"), group_ids=[0, 1], rewards=np.zeros(2))
    one = dict(prompt_ids=("a", "b"), group_ids=[0, 1])
    for field in ("rewards", "raw_rewards"):
        with pytest.raises(ValueError, match=rf"Groups\.{field} has shape \(1,\); need \(2,\)"):
            zv.Groups(**one, **{"rewards": np.zeros(2), field: np.zeros(1)})
    with pytest.raises(ValueError, match=r"Groups\.verifiable has shape \(1,\); need \(2,\), one"):
        zv.Groups(**one, rewards=np.zeros(2), verifiable=[True])
    with raises_invalid("ages", where="Groups"):
        zv.Groups(**one, rewards=np.zeros(2), ages=[0, -1])


def test_groups_take_and_concat_carry_every_field():
    # Group a: rows [1, 0*] (second row invalid), a judge's (unverifiable), shaped over raw;
    # group b: [1], verifiable, raw 1; c: a table without raw rewards.
    ab = zv.Groups.of(
        prompt_ids=["a", "b"], rewards=[[0.9, 0.1], [0.8]], raw_rewards=[[1.0, 0.0], [1.0]],
        valid=[[True, False], [True]], verifiable=[False, True], ages=[3, 1],
    )  # fmt: skip
    a = ab.take([0])
    assert a.valid.tolist() == [True, False] and a.verifiable.tolist() == [False]
    assert a.raw_rewards.tolist() == [1.0, 0.0] and a.ages.tolist() == [3]
    b = ab.take(np.array(1))  # a 0-d index: one group, as take([1])
    assert b.prompt_ids == ("b",) and b.rewards.tolist() == [np.float32(0.8)]
    c = zv.Groups.of(prompt_ids=["c"], rewards=[[0.0, 1.0]])
    # Three tables: ids offset by 0, 1, 2; raw rewards kept, c's taken from its rewards (its
    # verifier rewards); validity and verifiability move with their groups.
    abc = zv.Groups.concat([a, b, c])
    assert abc.prompt_ids == ("a", "b", "c") and abc.group_ids.tolist() == [0, 0, 1, 2, 2]
    assert abc.raw_rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert abc.valid.tolist() == [True, False, True, True, True]
    assert abc.verifiable.tolist() == [False, True, True] and abc.ages.tolist() == [3, 1, 0]
    # No table with raw rewards: the result has none either (verifier rewards = rewards).
    assert zv.Groups.concat([c, c]).raw_rewards is None


# ---------------------------------------------------------------- stage 4: optimisation


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
