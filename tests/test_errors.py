"""espo.errors: the one wording of a user error (pinned here and nowhere else), its kinds and
the validation helper every settings dataclass calls."""

import dataclasses
import pickle

import numpy as np
import pytest

from espo import errors
from espo.testing import raises_invalid


def test_the_one_wording():
    assert str(errors.InvalidValue("LossConfig", "clip_low", -0.1, "None or a float >= 0")) == (
        "LossConfig.clip_low=-0.1 is invalid: None or a float >= 0"
    )
    assert str(errors.ConfigError("--config.loss", "name", "ppo", "one of ('grpo',)")) == (
        "--config.loss.name='ppo' is invalid: one of ('grpo',)"
    )
    # A file (a path or a *.json name) is followed by ": ", a class or a --config key by ".".
    record = errors.DataError("data/d.jsonl: line 3", "answer", None, "a string", note="(hint)")
    assert str(record) == "data/d.jsonl: line 3: answer=None is invalid: a string (hint)"
    assert str(errors.CheckpointError("config.json", "rope_type", "yarn", "default")) == (
        "config.json: rope_type='yarn' is invalid: default"
    )
    # No value (a missing key) and no owner.
    assert str(errors.CheckpointError("/ckpt", "config.json", valid="present")) == (
        "/ckpt: config.json is invalid: present"
    )
    assert (
        str(errors.InvalidValue("", "agg", "sum", "one of x")) == "agg='sum' is invalid: one of x"
    )


def test_kinds_are_value_errors_with_their_label():
    kinds = {
        errors.InvalidValue: "error",
        errors.ConfigError: "config error",
        errors.DataError: "data error",
        errors.CheckpointError: "checkpoint error",
    }
    for kind, label in kinds.items():
        assert issubclass(kind, ValueError) and kind.kind == label


def test_moved_keeps_field_value_and_valid():
    e = errors.InvalidValue("Stage", "steps", 0, "an int >= 1", note="n")
    moved = e.moved("--config.curriculum.stages[1]", errors.ConfigError)
    assert type(moved) is errors.ConfigError
    assert (moved.where, moved.field, moved.value, moved.valid, moved.note) == (
        "--config.curriculum.stages[1]", "steps", 0, "an int >= 1", "n"
    )  # fmt: skip
    assert type(e.moved("x")) is errors.InvalidValue


def test_pickles_across_processes():
    e = errors.DataError("d.jsonl: line 1", "prompt", ["p"], "a string", note="hint")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.DataError and str(back) == str(e)
    assert (back.field, back.value) == ("prompt", ["p"])


@dataclasses.dataclass
class _Thing:
    size: object = 1
    low: object = 0.0
    high: object = 1.0


def test_check_raises_for_the_first_failed_rule_in_order():
    def rules(t):
        return {
            "size": (errors.is_int(t.size) and t.size >= 1, "an int >= 1"),
            "low": (errors.is_real(t.low), "a number"),
            # Lazy: only evaluated once `low` passed; a TypeError counts as invalid.
            "high": (lambda: t.high > t.low, "> low"),
        }

    errors.check(_Thing(), rules(_Thing()))
    for thing, field in [
        (_Thing(size=0, low="x"), "size"),
        (_Thing(low="x"), "low"),
        (_Thing(high=0.0), "high"),
        (_Thing(high="2"), "high"),  # "2" > 0.0 is a TypeError
    ]:
        with raises_invalid(field, where="_Thing") as info:
            errors.check(thing, rules(thing))
        assert info.value.value == getattr(thing, field)
    with raises_invalid("size", where="Other"):
        errors.check(_Thing(size=0), rules(_Thing(size=0)), where="Other")
    with raises_invalid("size", where="_Thing"):
        errors.require(_Thing(size=0), False, "size", "an int >= 1")
    errors.require(_Thing(), True, "size", "an int >= 1")


def test_number_predicates():
    assert errors.is_int(3) and errors.is_int(np.int64(3))
    assert not errors.is_int(True) and not errors.is_int(3.0) and not errors.is_int("3")
    assert errors.is_real(0.5) and errors.is_real(2) and errors.is_real(np.float32(1))
    assert not errors.is_real(False) and not errors.is_real("1") and not errors.is_real(None)


def test_raises_invalid_checks_field_and_owner():
    with pytest.raises(AssertionError, match="field"), raises_invalid("other"):
        raise errors.InvalidValue("A", "x", 1, "v")
    with pytest.raises(AssertionError, match="where"), raises_invalid("x", where="B"):
        raise errors.InvalidValue("A", "x", 1, "v")
