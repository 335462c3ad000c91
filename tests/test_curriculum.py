"""Tests for espo.curriculum: advance rules (steps, accuracy EMA by hand), windows, state."""

from __future__ import annotations

import json
import math

import ml_collections
import numpy as np
import pytest

from espo import curriculum
from espo.testing import raises_invalid

State = curriculum.CurriculumState


def _run(cur: curriculum.Curriculum, accuracies, state=None):
    """(states after each update, metrics of each update)."""
    state = state or State()
    states, metrics = [], []
    for acc in accuracies:
        state, m = cur.update(state, train_accuracy=acc)
        states.append(state)
        metrics.append(m)
    return states, metrics


def test_advance_by_steps_then_the_last_stage_stays():
    cur = curriculum.Curriculum(
        [curriculum.Stage(name="easy", steps=3), curriculum.Stage(name="hard", steps=1)]
    )
    states, metrics = _run(cur, [0.5] * 6)
    assert [s.stage for s in states] == [0, 0, 1, 1, 1, 1]
    # The last stage never advances, even past its `steps`; its step count keeps going.
    assert [s.steps_in_stage for s in states] == [1, 2, 0, 1, 2, 3]
    assert [m["curriculum/advanced"] for m in metrics] == [0, 0, 1, 0, 0, 0]
    # Metrics describe the step just done: the advancing step trained in stage 0, its 3rd step.
    assert [m["curriculum/stage"] for m in metrics] == [0, 0, 0, 1, 1, 1]
    assert [m["curriculum/steps_in_stage"] for m in metrics] == [1, 2, 3, 1, 2, 3]
    assert states[2] == State(stage=1, steps_in_stage=0, accuracy_ema=None)  # EMA reset
    assert cur.stage(states[2]).name == "hard"
    assert all(isinstance(v, float) for m in metrics for v in m.values())


def test_advance_by_accuracy_ema_computed_by_hand():
    stage = curriculum.Stage(
        name="a", advance="accuracy", accuracy_threshold=0.6, ema=0.6, steps=10, min_steps=1
    )
    cur = curriculum.Curriculum([stage, curriculum.Stage(name="b")])
    states, metrics = _run(cur, [0.2, 1.0, 1.0])
    # ema_1 = 0.2 (the first accuracy, no zero-init bias); ema_t = 0.6 ema_{t-1} + 0.4 acc_t:
    # ema_2 = 0.12 + 0.4 = 0.52 < 0.6; ema_3 = 0.312 + 0.4 = 0.712 >= 0.6 -> advance at step 3.
    # (Decay and weight swapped, 0.4 ema + 0.6 acc, would give 0.68 and advance at step 2;
    # a zero-initialised EMA would report 0.08, 0.448, 0.6688.)
    emas = [m["curriculum/accuracy_ema"] for m in metrics]
    np.testing.assert_allclose(emas, [0.2, 0.52, 0.712], rtol=1e-12)
    assert [s.accuracy_ema for s in states[:2]] == pytest.approx([0.2, 0.52])
    assert [m["curriculum/advanced"] for m in metrics] == [0, 0, 1]
    assert states[-1] == State(stage=1)


def test_accuracy_rule_waits_for_min_steps_and_caps_at_steps():
    wait = curriculum.Stage(name="a", advance="accuracy", accuracy_threshold=0.5, min_steps=3)
    cur = curriculum.Curriculum([wait, curriculum.Stage(name="b")])
    states, _ = _run(cur, [1.0, 1.0, 1.0])
    assert [s.stage for s in states] == [0, 0, 1]  # EMA 1.0 from step 1, but min_steps=3
    cap = curriculum.Stage(name="a", advance="accuracy", accuracy_threshold=0.9, steps=2)
    cur = curriculum.Curriculum([cap, curriculum.Stage(name="b")])
    states, _ = _run(cur, [0.0, 0.0])
    assert [s.stage for s in states] == [0, 1]  # never accurate: `steps` is the cap
    # The "steps" rule ignores accuracy.
    by_steps = curriculum.Stage(name="a", advance="steps", steps=2, accuracy_threshold=0.1)
    cur = curriculum.Curriculum([by_steps, curriculum.Stage(name="b")])
    assert [s.stage for s in _run(cur, [1.0, 1.0])[0]] == [0, 1]


def test_accuracy_rule_advances_at_exactly_the_threshold():
    """The EMA starts at the stage's first accuracy: 0.5 against accuracy_threshold 0.5 reaches
    it (advance), 0.49999 does not."""
    stage = curriculum.Stage(name="a", advance="accuracy", accuracy_threshold=0.5, min_steps=1)
    cur = curriculum.Curriculum([stage, curriculum.Stage(name="b")])
    assert [s.stage for s in _run(cur, [0.5])[0]] == [1]
    assert [s.stage for s in _run(cur, [0.49999])[0]] == [0]


def test_update_rejects_a_bad_accuracy():
    cur = curriculum.Curriculum([curriculum.Stage(name="a")])
    for bad in (float("nan"), -0.1, 1.5):
        with raises_invalid("train_accuracy"):
            cur.update(State(), train_accuracy=bad)


def test_accepts_difficulty_range_pass_rate_window_and_nan():
    stage = curriculum.Stage(
        name="mid", min_difficulty=0.3, max_difficulty=0.6, pass_rate_low=0.2, pass_rate_high=0.8
    )
    cur = curriculum.Curriculum([stage])
    accepts = lambda d, p=None: cur.accepts(State(), d, p)  # noqa: E731
    assert [accepts(d) for d in (0.29, 0.3, 0.45, 0.6, 0.61)] == [False, True, True, True, False]
    assert accepts(float("nan"))  # unknown difficulty: every stage takes it
    assert [accepts(0.45, p) for p in (0.19, 0.2, 0.5, 0.8, 0.81)] == [
        False, True, True, True, False,
    ]  # fmt: skip
    assert accepts(0.45, None)  # no history yet
    assert not accepts(0.9, 0.5) and not accepts(float("nan"), 0.9)  # both must hold
    # A one-sided window, and no window at all.
    low_only = curriculum.Curriculum([curriculum.Stage(name="x", pass_rate_low=0.5)])
    assert low_only.accepts(State(), 0.5, 1.0) and not low_only.accepts(State(), 0.5, 0.4)
    high_only = curriculum.Curriculum([curriculum.Stage(name="x", pass_rate_high=0.5)])
    assert high_only.accepts(State(), 0.5, 0.0) and not high_only.accepts(State(), 0.5, 0.6)
    open_ = curriculum.Curriculum([curriculum.Stage(name="x")])
    assert open_.accepts(State(), 0.0, 0.0) and open_.accepts(State(), 1.0, 1.0)


def test_accepts_follows_the_current_stage():
    cur = curriculum.Curriculum(
        [
            curriculum.Stage(name="easy", max_difficulty=0.5),
            curriculum.Stage(name="hard", min_difficulty=0.5),
        ]
    )
    assert cur.accepts(State(stage=0), 0.2) and not cur.accepts(State(stage=1), 0.2)
    assert cur.accepts(State(stage=1), 0.9) and not cur.accepts(State(stage=0), 0.9)
    with raises_invalid("stage"):
        cur.accepts(State(stage=2), 0.2)


def test_state_round_trip_through_json_and_numpy():
    for state in (State(), State(stage=2, steps_in_stage=7, accuracy_ema=0.625)):
        d = state.state_dict()
        assert curriculum.CurriculumState.from_state_dict(json.loads(json.dumps(d))) == state
    # As orbax restores it: numpy scalars, None stored as NaN.
    restored = State.from_state_dict(
        {"stage": np.int32(1), "steps_in_stage": np.array(3), "accuracy_ema": np.float32(0.5)}
    )
    assert restored == State(stage=1, steps_in_stage=3, accuracy_ema=0.5)
    assert type(restored.stage) is int and type(restored.accuracy_ema) is float
    nan = State.from_state_dict({"stage": 0, "steps_in_stage": 0, "accuracy_ema": math.nan})
    assert nan.accuracy_ema is None
    with raises_invalid("state", where="curriculum"):
        State.from_state_dict({"stage": 0})
    with raises_invalid("steps_in_stage", where="CurriculumState"):
        State.from_state_dict({"stage": 0, "steps_in_stage": -1, "accuracy_ema": None})
    with raises_invalid("accuracy_ema", where="CurriculumState"):
        State(accuracy_ema=1.5)


def test_resuming_from_the_state_dict_continues_identically():
    cur = curriculum.Curriculum(
        [
            curriculum.Stage(name="a", advance="accuracy", accuracy_threshold=0.7, ema=0.5),
            curriculum.Stage(name="b", steps=2),
            curriculum.Stage(name="c"),
        ]
    )
    accs = [0.1, 0.9, 0.6, 0.9, 0.4, 0.3, 0.2]
    straight, m_straight = _run(cur, accs)
    half, m_half = _run(cur, accs[:3])
    resumed = State.from_state_dict(json.loads(json.dumps(half[-1].state_dict())))
    rest, m_rest = _run(cur, accs[3:], state=resumed)
    assert half + rest == straight and m_half + m_rest == m_straight
    assert straight[-1].stage == 2


def test_from_config_builds_stages_and_max_new_tokens():
    config = [
        dict(name="easy", max_difficulty=0.5, group_size=4, max_new_tokens=32),
        dict(name="hard", min_difficulty=0.5, max_new_tokens=96, advance="accuracy"),
    ]
    cur = curriculum.Curriculum.from_config(config)
    assert cur.stages[0] == curriculum.Stage(
        name="easy", max_difficulty=0.5, group_size=4, max_new_tokens=32
    )
    assert cur.num_stages == 2 and cur.max_new_tokens == 96 and cur.max_group_size == 8
    # An ml_collections config (a ConfigDict holding ConfigDicts) gives the same curriculum.
    cfg = ml_collections.ConfigDict({"stages": [ml_collections.ConfigDict(c) for c in config]})
    assert curriculum.Curriculum.from_config(cfg.stages).stages == cur.stages


def test_largest_budget_and_group_size_are_over_every_stage_not_the_last():
    # They size the compiled buffers and the batch rows, so they are the maxima over all stages
    # whatever the order: here the first stage has the largest G and the longest budget. Wrong
    # (the last stage's, as if stages only grew): 96 and 8, a buffer stage "a" overflows.
    cur = curriculum.Curriculum(
        [
            curriculum.Stage(name="a", group_size=16, max_new_tokens=128),
            curriculum.Stage(name="b", group_size=4, max_new_tokens=64),
            curriculum.Stage(name="c", group_size=8, max_new_tokens=96),
        ]
    )
    assert (cur.max_new_tokens, cur.max_group_size) == (128, 16)


def test_from_config_errors_name_the_stage_and_key():
    with raises_invalid("steps_", where="curriculum.stages[1]"):
        curriculum.Curriculum.from_config([dict(name="a"), dict(name="b", steps_=3)])
    with raises_invalid("G", where="curriculum.stages[0]"):
        curriculum.Curriculum.from_config([dict(name="a", G=3)])
    with raises_invalid("name", where="curriculum.stages[0]"):
        curriculum.Curriculum.from_config([dict(steps=3)])
    with raises_invalid("stages", where="curriculum"):
        curriculum.Curriculum.from_config([])
    with raises_invalid("stages[0]", where="curriculum"):
        curriculum.Curriculum.from_config(["easy"])
    with raises_invalid("stages", where="curriculum"):
        curriculum.Curriculum.from_config("easy")


BAD_FIELDS = [
    ("name", ""),
    ("min_difficulty", -0.1),
    ("min_difficulty", math.nan),
    ("max_difficulty", 1.5),
    ("max_difficulty", "0.5"),
    ("pass_rate_low", 2.0),
    ("pass_rate_high", -1.0),
    ("group_size", 0),
    ("group_size", 2.5),
    ("max_new_tokens", 0),
    ("advance", "loss"),
    ("steps", 0),
    ("accuracy_threshold", 1.1),
    ("min_steps", 0),
    ("ema", 1.0),
    ("ema", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_every_stage_field_is_validated(field, value):
    with raises_invalid(field, where="curriculum.stages[1]"):
        curriculum.Curriculum.from_config([dict(name="ok"), {"name": "x", field: value}])
    with raises_invalid(field, where="Stage"):
        curriculum.Stage(**{"name": "x", field: value})


def test_cross_field_checks():
    with raises_invalid("max_difficulty", where="curriculum.stages[0]"):
        curriculum.Curriculum.from_config([dict(name="a", min_difficulty=0.5, max_difficulty=0.2)])
    with raises_invalid("pass_rate_high", where="curriculum.stages[0]"):
        curriculum.Curriculum.from_config([dict(name="a", pass_rate_low=0.5, pass_rate_high=0.1)])
    with raises_invalid("min_steps", where="curriculum.stages[0]"):
        curriculum.Curriculum.from_config([dict(name="a", steps=4, min_steps=5)])
    with raises_invalid("stages[0]", where="curriculum"):
        curriculum.Curriculum([dict(name="a")])
