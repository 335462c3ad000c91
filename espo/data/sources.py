"""Prompt sources: `make_sources(cfg) -> (train, held_out)`, grain random-access data sources.

This module owns reading prompts from each `DataConfig.source` and cutting the held-out set:
  * "reasoning_gym": `reasoning_gym.create_dataset(name, size=, seed=, **kwargs)` per task spec;
    ids "reasoning_gym:<spec index>-<name>:<index>", meta {"task", "answer", "entry"} where
    "entry" is the generator's entry (question, answer, metadata) that the task's own scorer
    reads (`espo.rewards.gym.ReasoningGymReward`).
  * "jsonl": one JSON object per line (blank lines are not records); ids
    "jsonl:<file stem>:<line number - 1>".
  * "parquet": one record per row, read with pyarrow; ids "parquet:<file stem>:<row index>".
  * "tfds": `tfds.data_source(path, split=, data_dir=tfds_data_dir)` (prepared ArrayRecord files,
    no TensorFlow, no download); ids "tfds:<name>/<split>:<record index>".
  For file-like sources meta is the whole record (as JSON data) plus "answer" (the answer field
  as text) and "task": the record's own str "task" field when it has one, else the file stem
  (dataset name for tfds).

A malformed record (bad JSON, not an object, a missing / null / non-text / empty prompt or
answer field, a bad difficulty) raises `BadRecordError` naming the file, the line (1-based; row
index for parquet, record index for tfds) and the field; with `skip_bad_records` it is skipped
and counted in `Source.num_skipped`. Sources hold their Examples in memory (all records are read
and checked once, before training starts).

Held-out split: without `eval_path`, a prompt goes to the held-out set when a stable hash of its
text (BLAKE2b, not Python's salted `hash`) falls below `eval_fraction`, so equal prompts always
land on the same side (also when a small procedural problem space repeats prompts), in every run
and process. Bad records of a shared file are counted on the train side.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from espo import errors
from espo.data import chains, worked
from espo.data import examples as examples_lib

_EXTENSIONS = {"jsonl": (".jsonl", ".json", ".ndjson"), "parquet": (".parquet", ".pq")}
_SKIP_HINT = "(set data.skip_bad_records=True to skip and count malformed records)"


BadRecordError = errors.DataError  # a malformed record: the file and line, the field


class Source:
    """A grain `RandomAccessDataSource` of `Example`s (len, getitem), with a name and the
    number of malformed records skipped while reading it."""

    def __init__(
        self, *, name: str, examples: Sequence[examples_lib.Example], num_skipped: int = 0
    ) -> None:
        self.name = name
        self.num_skipped = int(num_skipped)
        self._examples = tuple(examples)

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> examples_lib.Example:
        return self._examples[index]

    def __repr__(self) -> str:  # grain uses it to tell sources apart in checkpoints
        return f"Source(name={self.name!r}, len={len(self)}, num_skipped={self.num_skipped})"


def make_sources(cfg: examples_lib.DataConfig) -> tuple[Source, Source]:
    """(train, held-out eval) sources for `cfg`; raises when either is empty, naming the config."""
    if cfg.source == "chains":
        everything, dataset = _chains_examples(cfg), chains.TASK
        train_skipped, eval_skipped = 0, 0
    elif cfg.source == "reasoning_gym":
        everything = _reasoning_gym_examples(cfg)
        dataset = "+".join(name for name, _ in examples_lib.parse_task_specs(cfg.tasks))
        train_skipped, eval_skipped = 0, 0
    else:
        everything, train_skipped = _read_examples(cfg, cfg.path)
        dataset = _dataset_name(cfg, cfg.path)
    if cfg.eval_path:
        train = everything
        held_out, eval_skipped = _read_examples(cfg, cfg.eval_path, held_out=True)
    else:
        held = [_in_held_out(e.prompt, cfg.eval_fraction) for e in everything]
        train = [e for e, h in zip(everything, held, strict=True) if not h]
        held_out = [e for e, h in zip(everything, held, strict=True) if h]
        eval_skipped = 0
    if cfg.train_max_samples:
        train = train[: cfg.train_max_samples]
    train_source = Source(
        name=f"{cfg.source}:{dataset} (train)", examples=train, num_skipped=train_skipped
    )
    eval_source = Source(
        name=f"{cfg.source}:{dataset} (held-out)", examples=held_out, num_skipped=eval_skipped
    )
    for source, what in ((train_source, "training"), (eval_source, "held-out")):
        if not len(source):
            raise errors.InvalidValue(
                "data", f"{what} examples", 0,
                f">= 1 from {_describe(cfg)} (read {len(everything)} records, skipped "
                f"{train_skipped + eval_skipped} malformed); check data.path / data.tasks / "
                "data.eval_fraction / data.eval_path",
            )  # fmt: skip
    return train_source, eval_source


def group_of(example: examples_lib.Example) -> str:
    """The dataset part an example came from: its id without the record index
    ("reasoning_gym:1-basic_arithmetic", "jsonl:math")."""
    return example.id.rsplit(":", 1)[0]


def eval_subset(
    source: Source, n: int, *, keep: Callable[[examples_lib.Example], bool] = lambda e: True
) -> list[examples_lib.Example]:
    """Up to `n` held-out examples with distinct prompt texts, taken round-robin over the
    source's groups (`group_of`: one per reasoning_gym task spec, one per file), each group in
    source order, keeping only examples with `keep(example)`. Deterministic. A small procedural
    space repeats prompts many times, and the held-out set lists group after group, so taking
    the first `n` records would evaluate a few prompts of the first group over and over."""
    groups: dict[str, list[examples_lib.Example]] = {}
    seen: set[str] = set()
    for i in range(len(source)):
        e = source[i]
        if e.prompt not in seen and keep(e):
            seen.add(e.prompt)
            groups.setdefault(group_of(e), []).append(e)
    out: list[examples_lib.Example] = []
    for row in itertools.zip_longest(*groups.values()):
        out += [e for e in row if e is not None][: n - len(out)]
    return out


def _describe(cfg: examples_lib.DataConfig) -> str:
    if cfg.source == "chains":
        return f"data.source='chains', data.size={cfg.size}"
    if cfg.source == "reasoning_gym":
        return f"data.source='reasoning_gym', data.tasks={cfg.tasks!r}, data.size={cfg.size}"
    return (
        f"data.source={cfg.source!r}, data.path={cfg.path!r}, data.eval_path={cfg.eval_path!r}, "
        f"data.eval_fraction={cfg.eval_fraction}"
    )


def _in_held_out(prompt: str, fraction: float) -> bool:
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


EVAL_SPLITS = ("test", "dev")  # evaluate.EVAL_SPLITS (tests/data/test_sources.py checks)


def eval_split_of(prompt: str) -> str:
    """ "dev" or "test": which half of the held-out set a prompt is in, by a stable hash of its
    text independent of the held-out hash (tune on dev, report on test)."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8, person=b"espo-dev").digest()
    return "dev" if digest[0] & 1 else "test"


# ---- chains (espo.data.chains) -------------------------------------------------------------


def _chains_examples(cfg: examples_lib.DataConfig) -> list[examples_lib.Example]:
    """`cfg.size` chains of `cfg.seed` with the flawed teacher's demonstrations."""
    lo, hi = cfg.min_terms, cfg.max_terms
    out = []
    for j in range(cfg.size):
        chain = chains.draw(cfg.seed, j, min_terms=lo, max_terms=hi, decay=cfg.terms_decay)
        n = len(chain.terms)
        demo = chains.demonstration(
            cfg.seed, j, chain, flaw=cfg.teacher_flaw, error=cfg.teacher_error
        )
        answer = str(chain.answer)
        out.append(
            examples_lib.Example(
                id=f"{chains.TASK}:{n}-terms:{j}",
                prompt=chain.prompt,
                answer=answer,
                difficulty=(n - lo) / (hi - lo) if hi > lo else 0.0,
                meta={"task": chains.TASK, "answer": answer, "terms": list(chain.terms),
                      "ops": list(chain.ops)},
                demonstration=demo,
            )
        )  # fmt: skip
    return out


# ---- reasoning_gym -------------------------------------------------------------------------


def _reasoning_gym_examples(cfg: examples_lib.DataConfig) -> list[examples_lib.Example]:
    import reasoning_gym  # heavy; only this source needs it
    from reasoning_gym import factory

    out = []
    for i, (name, kwargs) in enumerate(examples_lib.parse_task_specs(cfg.tasks)):
        kwargs = dict(kwargs)
        difficulty = kwargs.pop("difficulty", math.nan)
        where = f"DataConfig.tasks[{i}]"
        if name not in factory.DATASETS:
            close = difflib.get_close_matches(name, factory.DATASETS, n=5)
            raise errors.InvalidValue(
                where, "name", name,
                "a reasoning_gym task: " + (f"did you mean {', '.join(close)}? " if close else "")
                + ", ".join(sorted(factory.DATASETS)),
            )  # fmt: skip
        seed = _spec_seed(cfg.seed, i)
        try:
            dataset = reasoning_gym.create_dataset(name, size=cfg.size, seed=seed, **kwargs)
        except (TypeError, ValueError, AssertionError) as e:
            config_cls = factory.DATASETS[name][1]
            valid = sorted(f for f in config_cls.__dataclass_fields__ if f not in ("size", "seed"))
            raise errors.InvalidValue(
                where, "settings", kwargs,
                f"{type(e).__name__}: {e}; valid keys: difficulty, {', '.join(valid)}",
            ) from e  # fmt: skip
        for j in range(len(dataset)):
            entry = examples_lib.jsonable(dataset[j])
            answer = entry.get("answer")
            answer = "" if answer is None else str(answer)
            out.append(
                examples_lib.Example(
                    id=f"reasoning_gym:{i}-{name}:{j}",
                    prompt=entry["question"],
                    answer=answer,
                    difficulty=difficulty,
                    meta={"task": name, "answer": answer, "entry": entry},
                    demonstration=_worked(entry, answer, where) if cfg.worked_solutions else "",
                )
            )
    return out


def _worked(entry: dict, answer: str, where: str) -> str:
    """The worked solution of an arithmetic entry (`data.worked_solutions`), checked against
    the generator's answer."""
    expression = (entry.get("metadata") or {}).get("expression")
    if not isinstance(expression, str):
        raise errors.InvalidValue(
            where, "name", entry.get("metadata", {}).get("source_dataset", "?"),
            "an arithmetic task whose entries carry metadata.expression (basic_arithmetic, "
            "chain_sum) with data.worked_solutions=True",
        )  # fmt: skip
    try:
        solution = worked.arithmetic_solution(expression)
    except ValueError as e:
        raise errors.InvalidValue(where, "expression", expression, f"{e}") from e
    last = solution.rsplit("\n", 1)[-1]
    if last != answer:
        raise errors.InvalidValue(
            where, "expression", expression,
            f"one whose worked solution ends in the generator's answer {answer!r}, not {last!r}",
        )  # fmt: skip
    return solution


def _spec_seed(seed: int, spec_index: int) -> int:
    """The generation seed of spec `spec_index`. reasoning_gym seeds entry j with `seed + j`, so
    nearby seeds (0 and 1, or seed + spec index) would repeat each other's problems shifted by
    one; a hash spreads the specs (and the runs' seeds) far apart."""
    digest = hashlib.blake2b(f"espo:{seed}:{spec_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % 2**31


# ---- files and TFDS ------------------------------------------------------------------------


def _dataset_name(cfg: examples_lib.DataConfig, path: str) -> str:
    if cfg.source == "tfds":
        return cfg.path
    return os.path.splitext(os.path.basename(path))[0]


def _read_examples(
    cfg: examples_lib.DataConfig, path: str, *, held_out: bool = False
) -> tuple[list[examples_lib.Example], int]:
    """Examples of one file (or TFDS split) and the number of malformed records skipped."""
    field = "eval_path" if held_out else "path"
    if cfg.source == "tfds":
        split = cfg.eval_path if held_out else cfg.split
        dataset, records = cfg.path, _tfds_records(cfg, split=split, field=field)
        id_prefix, task, unit = f"tfds:{dataset}/{split}", dataset, "record"
        label = f"tfds {dataset!r} split {split!r}"
    else:
        valid = _EXTENSIONS[cfg.source]
        ext = os.path.splitext(path)[1].lower()
        if ext not in valid:
            raise errors.InvalidValue(
                "DataConfig", field, path, f"a file ending in {', '.join(valid)} for "
                f"source={cfg.source!r}",
            )  # fmt: skip
        if not os.path.isfile(path):
            raise errors.InvalidValue("DataConfig", field, path, "an existing file")
        task = _dataset_name(cfg, path)
        id_prefix, label = f"{cfg.source}:{task}", path
        if cfg.source == "jsonl":
            records, unit = _jsonl_records(path), "line"
        else:
            records, unit = _parquet_records(path), "row index"
    out, num_skipped = [], 0
    for index, record in records:
        try:
            out.append(_to_example(cfg, record, id_=f"{id_prefix}:{index}", task=task))
        except BadRecordError as e:
            if not cfg.skip_bad_records:
                where = index + 1 if unit == "line" else index
                raise e.moved(f"{label}: {unit} {where}") from None
            num_skipped += 1
    return out, num_skipped


def _jsonl_records(path: str) -> Iterator[tuple[int, Any]]:
    """(line number - 1, the parsed line or a BadRecordError) per non-blank line."""
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield index, BadRecordError("", "line", valid=f"UTF-8 text ({e})", note=_SKIP_HINT)
                continue
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as e:
                yield index, BadRecordError("", "line", valid=f"JSON ({e})", note=_SKIP_HINT)


def _parquet_records(path: str) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq  # only this source needs it

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for an unreadable file
        raise errors.InvalidValue(
            "DataConfig", "path", path, f"a readable parquet file ({type(e).__name__}: {e})"
        ) from e
    yield from enumerate(table.to_pylist())


def _tfds_records(cfg: examples_lib.DataConfig, *, split: str, field: str):
    import tensorflow_datasets as tfds  # only this source needs it

    try:
        source = tfds.data_source(
            cfg.path, split=split, data_dir=cfg.tfds_data_dir or None, download=False
        )
    except Exception as e:  # tfds raises its own types (DatasetNotFoundError, ...)
        raise errors.InvalidValue(
            "DataConfig", "path", cfg.path,
            f"a TFDS dataset with split {split!r} in tfds_data_dir={cfg.tfds_data_dir!r} "
            f"({type(e).__name__}: {str(e)[:500]})",
        ) from e  # fmt: skip
    for index in range(len(source)):
        yield index, source[index]


def _to_example(
    cfg: examples_lib.DataConfig, record: Any, *, id_: str, task: str
) -> examples_lib.Example:
    if isinstance(record, BadRecordError):
        raise record
    if not isinstance(record, dict):
        raise BadRecordError("", "record", type(record).__name__, "a JSON object", note=_SKIP_HINT)
    record = examples_lib.jsonable(record)
    prompt = _text_field(record, cfg.prompt_field, "prompt_field", numbers=False)
    answer = _text_field(record, cfg.answer_field, "answer_field", numbers=True)
    difficulty = math.nan
    if cfg.difficulty_field:
        value = _field(record, cfg.difficulty_field, "difficulty_field")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            value = None  # not a number: invalid below
        if value is None or not 0.0 <= value <= 1.0:
            raise BadRecordError(
                "", cfg.difficulty_field, record[cfg.difficulty_field],
                "a number in [0, 1] (data.difficulty_field)", note=_SKIP_HINT,
            )  # fmt: skip
        difficulty = float(value)
    own_task = record.get("task")
    meta = {**record, "answer": answer, "task": own_task if isinstance(own_task, str) else task}
    return examples_lib.Example(
        id=id_, prompt=prompt, answer=answer, difficulty=difficulty, meta=meta
    )


def _field(record: dict, name: str, config_field: str) -> Any:
    if name not in record:
        raise BadRecordError(
            "", name, valid=f"present (data.{config_field}); the record has {sorted(record)}",
            note=_SKIP_HINT,
        )  # fmt: skip
    if record[name] is None:
        raise BadRecordError("", name, None, f"not null (data.{config_field})", note=_SKIP_HINT)
    return record[name]


def _text_field(record: dict, name: str, config_field: str, *, numbers: bool) -> str:
    value = _field(record, name, config_field)
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        valid = "a string or a number" if numbers else "a string"
        raise BadRecordError("", name, value, f"{valid} (data.{config_field})", note=_SKIP_HINT)
    if not value.strip():
        raise BadRecordError("", name, value, f"not empty (data.{config_field})", note=_SKIP_HINT)
    return value
