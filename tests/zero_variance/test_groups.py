"""espo.zero_variance.Groups, the table of generated groups that the ZVE stages pass around.

Fields normalised to their documented dtypes, validation messages, take / concat carrying every
field (validity, verifiability, raw rewards, ages, row payload) and the state dict's exact round
trip through the checkpoint's JSON.
"""

import dataclasses
import json

import chex
import jax
import numpy as np
import pytest

from espo import checkpoint
from espo import zero_variance as zv
from espo.testing import raises_invalid


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
    # The verifier's own rewards of a reward model's groups (true_rewards) move with their rows;
    # a table without them contributes its verifier rewards.
    rm = zv.Groups.of(prompt_ids=["d"], rewards=[[0.3, 0.7]], true_rewards=[[0.0, 1.0]])
    assert rm.measured_rewards.tolist() == [0.0, 1.0] and c.measured_rewards.tolist() == [0, 1]
    mixed = zv.Groups.concat([rm, ab.take([1])])
    assert mixed.true_rewards.tolist() == [0.0, 1.0, 1.0]
    assert mixed.take([1]).true_rewards.tolist() == [1.0]
    assert zv.Groups.concat([c, c]).true_rewards is None


def test_groups_state_dict_round_trip_is_exact():
    # Through the checkpoint's JSON: dtypes, shapes, NaN in a failed row, 4-d payload (a router
    # trace), per-group fields; an empty table (zero-size arrays) too.
    table = zv.Groups.of(
        prompt_ids=["a", "b"], rewards=[[1.0, np.nan], [0.5]], raw_rewards=[[1.0, 0.0], [1.0]],
        valid=[[True, False], [True]], verifiable=[True, False], ages=[2, 0],
        true_rewards=[[0.0, 1.0], [1.0]],
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
