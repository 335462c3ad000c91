"""The one user-error type and the one validation helper every settings dataclass calls.

A value a user supplied that espo cannot take (a config field, a record of a data file, a
checkpoint on disk) raises an `InvalidValue`: a ValueError carrying where the value lives, the
field, the value and what would be valid, printed in one wording on one line:

    LossConfig.clip_low=-0.1 is invalid: None or a float >= 0
    --config.loss.clip_low=-0.1 is invalid: None or a float >= 0
    data/train.jsonl: line 12: answer=None is invalid: a string or a number (data.answer_field)

The kinds a user meets are subclasses, so a caller can tell them apart (experiments/run.py
prints "config error", "data error" or "checkpoint error" before the line and no traceback);
tests assert the type and `field`, never the wording, which is pinned once (tests/test_errors.py).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any

_NO_VALUE = object()  # the field is missing, or its value is too big to print
_DOTTED = re.compile(r"[-\w.\[\]]+")  # a class, a --config key: where.field; else where: field
_FILE = re.compile(r"\.(json|jsonl|ndjson|parquet|pq|safetensors|jinja)$")


class InvalidValue(ValueError):
    """`where.field=value is invalid: valid`; `where` is a class, a --config section or a file."""

    kind = "error"  # what experiments/run.py prints before the line

    def __init__(self, where: str, field: str, value: Any = _NO_VALUE, valid: str = "", *, note=""):
        self.where, self.field, self.value, self.valid, self.note = where, field, value, valid, note
        super().__init__(where, field, value, valid)

    def __str__(self) -> str:
        dotted = _DOTTED.fullmatch(self.where) and not _FILE.search(self.where)
        sep = "." if dotted else ": "
        head = f"{self.where}{sep}{self.field}" if self.where else self.field
        if self.value is not _NO_VALUE:
            head += f"={self.value!r}"
        return f"{head} is invalid: {self.valid}" + (f" {self.note}" if self.note else "")

    def __reduce__(self):  # picklable across the reward pool's processes
        return _rebuild, (type(self), self.where, self.field, self.value, self.valid, self.note)

    def moved(self, where: str, kind: type[InvalidValue] | None = None) -> InvalidValue:
        """The same field, value and validity under another owner (e.g. a --config key)."""
        return (kind or type(self))(where, self.field, self.value, self.valid, note=self.note)

    @property
    def has_value(self) -> bool:
        return self.value is not _NO_VALUE


def _rebuild(kind, where, field, value, valid, note):
    return kind(where, field, value, valid, note=note)


class ConfigError(InvalidValue):
    """A config value no settings dataclass accepts; `where` is the --config section."""

    kind = "config error"


class DataError(InvalidValue):
    """A malformed record of a data file: `where` is the file and the line, `field` its field."""

    kind = "data error"


class CheckpointError(InvalidValue):
    """A checkpoint (espo workdir, Hugging Face dir, saved reward model) that does not fit the
    run or cannot be read: `where` is the file or directory, `field` the key, tensor or field."""

    kind = "checkpoint error"


def is_int(x: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A real number (Python or NumPy), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def require(obj: Any, ok: bool, field: str, valid: str) -> None:
    """Raises InvalidValue(type(obj).__name__, field, obj.<field>, valid) unless `ok`."""
    if not ok:
        raise InvalidValue(type(obj).__name__, field, getattr(obj, field), valid)


def check(obj: Any, rules: Mapping[str, tuple[bool, str]], *, where: str = "") -> None:
    """Raises InvalidValue for the first rule (field -> (ok, what is valid)) that fails.

    `where` defaults to the class name of `obj`; the value is read from `obj.<field>`. `ok` may
    be a callable of no arguments, evaluated in order (a later rule may assume the earlier ones
    hold); a TypeError it raises (a str where a number belongs) counts as invalid.
    """
    for field, (ok, valid) in rules.items():
        if callable(ok):
            try:
                ok = ok()
            except TypeError:
                ok = False
        if not ok:
            raise InvalidValue(where or type(obj).__name__, field, getattr(obj, field), valid)
