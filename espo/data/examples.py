"""The training example and the `data` config section.

This module owns the two plain value types of the data package:
  * `Example`: one prompt with its gold answer, a stable id, a difficulty level and the metadata
    the reward function reads. The id is "<source>:<dataset name or file stem>:<index>" and is
    the same in every run and process (the pass-rate table, the length predictor and the
    curriculum key on it).
  * `DataConfig`: the `data` section of a config as a frozen, validated dataclass (what
    `espo.data.sources.make_sources` reads).

Invariants: `Example.meta` is JSON-serialisable and holds "answer" and "task";
`Example.difficulty` is in [0, 1] or NaN (the source has no level); `DataConfig` errors name the
field, its value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from espo import errors

SOURCES = ("chains", "reasoning_gym", "jsonl", "parquet", "tfds")

# Two levels of one procedural task, so the curriculum has something to order.
DEFAULT_TASKS = (
    "chain_sum:min_terms=2:max_terms=2:min_digits=1:max_digits=1:difficulty=0;"
    "chain_sum:min_terms=2:max_terms=2:min_digits=2:max_digits=2:difficulty=1"
)


_invalid = errors.InvalidValue


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One prompt (the user message, before any chat template) with its gold answer."""

    id: str  # "<source>:<dataset name or file stem>:<index>", stable across runs and processes
    prompt: str  # the user message, before any chat template
    answer: str  # gold answer text (the verifier's target; also the SFT demonstration)
    difficulty: float  # level in [0, 1], 0 easiest; NaN when the source has none
    meta: dict  # JSON-serialisable; handed to the reward function (holds "answer" and "task")
    # The warm start's target when it is not the bare answer: a worked solution whose last line
    # is the answer (`espo.data.worked`); "" = the answer alone.
    demonstration: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise _invalid("Example", "id", self.id, "a non-empty str")
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise _invalid("Example", "prompt", self.prompt, f"a non-empty str (id {self.id})")
        if not isinstance(self.answer, str):
            raise _invalid("Example", "answer", self.answer, f"a str (id {self.id})")
        d = self.difficulty
        if not isinstance(d, (int, float)) or not (math.isnan(d) or 0.0 <= d <= 1.0):
            raise _invalid("Example", "difficulty", d, f"a float in [0, 1] or NaN (id {self.id})")
        if not isinstance(self.demonstration, str):
            raise _invalid("Example", "demonstration", self.demonstration, f"a str (id {self.id})")
        if not isinstance(self.meta, dict) or "answer" not in self.meta or "task" not in self.meta:
            keys = sorted(self.meta) if isinstance(self.meta, dict) else type(self.meta).__name__
            raise _invalid(
                "Example", "meta", keys, f'a dict holding "answer" and "task" (id {self.id})'
            )


def parse_task_specs(tasks: str) -> list[tuple[str, dict[str, Any]]]:
    """`DataConfig.tasks` as [(name, kwargs)], kwargs holding "difficulty" when the spec sets it.

    Specs are ";"-separated, each "name[:key=value...]"; values are parsed as int, then float,
    then "true"/"false", else kept as str. Empty specs (a trailing ";") are ignored.
    """
    specs = []
    for spec in tasks.split(";"):
        spec = spec.strip()
        if not spec:
            continue
        name, *pairs = (part.strip() for part in spec.split(":"))
        if not name or "=" in name:
            raise _invalid(
                "DataConfig", "tasks", tasks, f'specs "name[:key=value...]"; bad name in {spec!r}'
            )
        kwargs: dict[str, Any] = {}
        for pair in pairs:
            key, sep, value = (s.strip() for s in pair.partition("="))
            if not sep or not key or not value:
                raise _invalid(
                    "DataConfig", "tasks", tasks, f'"key=value" after the name; got {pair!r}'
                )
            if key in kwargs:
                raise _invalid("DataConfig", "tasks", tasks, f"each key once; {key!r} repeats")
            kwargs[key] = _parse_value(value)
        if "difficulty" in kwargs:
            d = kwargs["difficulty"]
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
                raise _invalid(
                    "DataConfig", "tasks", tasks, f"difficulty a float in [0, 1]; got {d!r}"
                )
            kwargs["difficulty"] = float(d)
        specs.append((name, kwargs))
    return specs


def _parse_value(value: str) -> Any:
    for parse in (int, float):
        try:
            return parse(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The `data` config section: where prompts come from and how the held-out set is cut."""

    source: str = "reasoning_gym"  # chains | reasoning_gym | jsonl | parquet | tfds
    # reasoning_gym task specs, ";"-separated, each "name[:key=value...]": "difficulty" (a float
    # in [0, 1]) sets the spec's level, the other keys are the reasoning_gym dataset's config.
    tasks: str = DEFAULT_TASKS
    size: int = 2000  # reasoning_gym: examples generated per task spec
    path: str = ""  # jsonl / parquet file; tfds: the dataset name (e.g. "gsm8k/main")
    tfds_data_dir: str = ""  # tfds: the data_dir holding the prepared (ArrayRecord) dataset
    split: str = "train"  # tfds split read for training
    prompt_field: str = "prompt"  # record field holding the user message
    answer_field: str = "answer"  # record field holding the gold answer
    difficulty_field: str = ""  # optional numeric record field in [0, 1]
    # Optional separate held-out set: a file of the same format as `path` (jsonl / parquet), or
    # for tfds a split name of the same dataset (e.g. "test"). Empty: split by eval_fraction.
    eval_path: str = ""
    eval_fraction: float = 0.1  # held-out share, chosen by a stable hash of the prompt text
    # The training pool: its first this many examples, the held-out set unchanged (0: all;
    # verl's data.train_max_samples). A small pool is revisited every few steps.
    train_max_samples: int = 0
    seed: int = 0  # reasoning_gym generation seed and the stream's shuffle seed
    skip_bad_records: bool = False  # skip (and count) malformed records instead of failing
    # reasoning_gym + / - arithmetic: warm-start demonstrations work the expression one step a
    # line ("7-3=4\n4-6=-2\n-2"; `espo.data.worked`) and the reward reads the last line.
    worked_solutions: bool = False
    # chains (`espo.data.chains`): chain lengths min_terms..max_terms, P(n) ~ terms_decay ** n,
    # and the teacher of the warm start's demonstrations: its flaw and the flaw's rate.
    min_terms: int = 3
    max_terms: int = 8
    terms_decay: float = 0.8
    teacher_flaw: str = "final_sign"
    teacher_error: float = 0.7

    def __post_init__(self) -> None:
        owner = "DataConfig"
        if self.source not in SOURCES:
            raise _invalid(owner, "source", self.source, " | ".join(SOURCES))
        for name in ("tasks", "path", "tfds_data_dir", "split", "prompt_field", "answer_field"):
            if not isinstance(getattr(self, name), str):
                raise _invalid(owner, name, getattr(self, name), "a str")
        for name in ("difficulty_field", "eval_path"):
            if not isinstance(getattr(self, name), str):
                raise _invalid(owner, name, getattr(self, name), "a str")
        for name in ("size", "seed", "min_terms", "max_terms", "train_max_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _invalid(owner, name, value, "an int")
        if self.size < 1:
            raise _invalid(owner, "size", self.size, "an int >= 1")
        if self.seed < 0:
            raise _invalid(owner, "seed", self.seed, "an int >= 0")
        if self.train_max_samples < 0:
            raise _invalid(
                owner, "train_max_samples", self.train_max_samples, "an int >= 0 (0: all)"
            )
        if self.min_terms < 2:
            raise _invalid(owner, "min_terms", self.min_terms, "an int >= 2")
        if self.max_terms < self.min_terms:
            raise _invalid(
                owner, "max_terms", self.max_terms, f"an int >= min_terms={self.min_terms}"
            )
        d, e = self.terms_decay, self.teacher_error
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < math.inf:
            raise _invalid(owner, "terms_decay", d, "a finite float > 0")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e <= 1:
            raise _invalid(owner, "teacher_error", e, "a float in [0, 1]")
        from espo.data import chains  # a leaf module: no import circle

        if self.teacher_flaw not in chains.FLAWS:
            raise _invalid(owner, "teacher_flaw", self.teacher_flaw, " | ".join(chains.FLAWS))
        for name in ("skip_bad_records", "worked_solutions"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(owner, name, getattr(self, name), "True or False")
        if self.worked_solutions and self.source != "reasoning_gym":
            raise _invalid(owner, "worked_solutions", True, 'False unless source="reasoning_gym"')
        f = self.eval_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise _invalid(owner, "eval_fraction", f, "a float in [0, 1)")
        if not self.eval_path and f == 0.0:
            raise _invalid(
                owner,
                "eval_fraction",
                f,
                "a float in (0, 1) when eval_path is empty (held-out set)",
            )
        if self.source == "chains":
            if self.eval_path:
                raise _invalid(owner, "eval_path", self.eval_path, '"" for source="chains"')
        elif self.source == "reasoning_gym":
            if not parse_task_specs(self.tasks):
                raise _invalid(owner, "tasks", self.tasks, 'one or more "name[:key=value...]"')
            if self.eval_path:
                raise _invalid(
                    owner,
                    "eval_path",
                    self.eval_path,
                    '"" for source="reasoning_gym" (its held-out set is cut by eval_fraction)',
                )
        else:
            if not self.path:
                raise _invalid(owner, "path", self.path, f"a file or dataset for {self.source!r}")
            if not self.prompt_field:
                raise _invalid(owner, "prompt_field", self.prompt_field, "a record field name")
            if not self.answer_field:
                raise _invalid(owner, "answer_field", self.answer_field, "a record field name")
        if self.source == "tfds" and not self.split:
            raise _invalid(owner, "split", self.split, 'a TFDS split name such as "train"')


def jsonable(value: Any) -> Any:
    """`value` as plain JSON data: tuples and sets become lists, numpy scalars and arrays Python
    values, bytes UTF-8 text, mapping keys str; anything else its `str()`."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=json.dumps)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return jsonable(value.tolist())
    return str(value)
