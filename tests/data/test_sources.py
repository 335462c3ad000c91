"""espo.data.sources and DataConfig: JSONL / Parquet / TFDS / reasoning_gym sources, malformed
records, the held-out split."""

import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from espo import errors
from espo.data import examples, sources
from espo.testing import raises_invalid


def _cfg(**kw) -> examples.DataConfig:
    return examples.DataConfig(**kw)


def _all(cfg):
    train, held_out = sources.make_sources(cfg)
    return train, held_out, sorted([*train, *held_out], key=lambda e: int(e.id.rsplit(":", 1)[1]))


def _records(n):
    return [{"prompt": f"what is {i} + 1?", "answer": str(i + 1), "level": i / n} for i in range(n)]


# ---- JSONL ---------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path, write_lines):
    records = [{**r, "source": "web"} for r in _records(40)]
    records[5]["answer"] = 6  # numeric answers become text
    path = write_lines(tmp_path / "math.jsonl", records)
    cfg = _cfg(source="jsonl", path=str(path), difficulty_field="level", eval_fraction=0.25)
    train, held_out, everything = _all(cfg)
    assert len(train) + len(held_out) == 40 and len(held_out) > 0
    assert train.num_skipped == 0 and held_out.num_skipped == 0
    for i, (e, r) in enumerate(zip(everything, records, strict=True)):
        assert e.id == f"jsonl:math:{i}"
        assert e.prompt == r["prompt"]
        assert e.answer == str(r["answer"])
        assert e.difficulty == pytest.approx(r["level"])
        assert e.meta == {**r, "answer": str(r["answer"]), "task": "math"}
        json.dumps(e.meta)


def test_jsonl_custom_fields_blank_lines_and_own_task(tmp_path, write_lines):
    lines = [
        {"question": "q0", "solution": "a0"},
        "",  # blank lines are not records; ids keep the line numbers
        "   ",
        {"question": "q3", "solution": "a3", "task": "algebra"},
    ]
    path = write_lines(tmp_path / "set.jsonl", lines)
    cfg = _cfg(
        source="jsonl",
        path=str(path),
        prompt_field="question",
        answer_field="solution",
        eval_path=str(write_lines(tmp_path / "held.jsonl", [{"question": "q", "solution": "s"}])),
    )
    train, held_out = sources.make_sources(cfg)
    assert [(e.id, e.prompt, e.answer, e.meta["task"]) for e in train] == [
        ("jsonl:set:0", "q0", "a0", "set"),
        ("jsonl:set:3", "q3", "a3", "algebra"),
    ]
    assert math.isnan(train[0].difficulty)
    assert [(e.id, e.prompt) for e in held_out] == [("jsonl:held:0", "q")]


_GOOD = {"prompt": "p", "answer": "a"}


@pytest.mark.parametrize(
    "bad, field, value",
    [
        ('{"prompt": "p", "answer": ', "line", None),
        ('["p", "a"]', "record", "list"),
        ({"answer": "a"}, "prompt", None),
        ({"prompt": "p"}, "answer", None),
        ({"prompt": "  \n", "answer": "a"}, "prompt", "  \n"),
        ({"prompt": "p", "answer": ""}, "answer", ""),
        ({"prompt": None, "answer": "a"}, "prompt", None),
        ({"prompt": ["p"], "answer": "a"}, "prompt", ["p"]),
        ({"prompt": "p", "answer": "a", "level": 1.5}, "level", 1.5),
        ({"prompt": "p", "answer": "a", "level": "hard"}, "level", "hard"),
        ({"prompt": "p", "answer": "a"}, "level", None),
    ],
)
def test_jsonl_bad_record_names_file_line_and_field(tmp_path, write_lines, bad, field, value):
    good = {**_GOOD, "level": 0.5}
    path = write_lines(tmp_path / "d.jsonl", [good, good, bad, good])
    cfg = _cfg(source="jsonl", path=str(path), difficulty_field="level", eval_fraction=0.5)
    with raises_invalid(field, where=f"{path}: line 3", kind=sources.BadRecordError) as info:
        sources.make_sources(cfg)
    assert info.value.value == value or not info.value.has_value
    assert "skip_bad_records" in str(info.value)


def test_jsonl_skip_bad_records_counts_them(tmp_path, write_lines):
    good = [{"prompt": f"p{i}", "answer": f"a{i}"} for i in range(30)]
    lines = [*good[:10], "{oops", *good[10:20], {"answer": "x"}, {"prompt": "", "answer": "y"}]
    lines += good[20:]
    path = write_lines(tmp_path / "d.jsonl", lines)
    cfg = _cfg(source="jsonl", path=str(path), skip_bad_records=True, eval_fraction=0.3)
    train, held_out, everything = _all(cfg)
    assert train.num_skipped == 3 and held_out.num_skipped == 0
    assert [e.prompt for e in everything] == [g["prompt"] for g in good]
    assert everything[10].id == "jsonl:d:11"  # the line after the bad one


def test_bad_utf8_is_a_bad_record(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "a"}\n{"prompt": "\xff", "answer": "a"}\n')
    with raises_invalid("line", where=f"{path}: line 2", kind=sources.BadRecordError):
        sources.make_sources(_cfg(source="jsonl", path=str(path), eval_fraction=0.5))


# ---- Parquet -------------------------------------------------------------------------------


def test_parquet_round_trip_and_bad_row(tmp_path):
    records = _records(30)
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    cfg = _cfg(source="parquet", path=str(path), difficulty_field="level", eval_fraction=0.3)
    train, held_out, everything = _all(cfg)
    assert len(held_out) > 0
    assert [(e.id, e.prompt, e.answer) for e in everything] == [
        (f"parquet:math:{i}", r["prompt"], r["answer"]) for i, r in enumerate(records)
    ]
    assert [e.difficulty for e in everything] == pytest.approx([r["level"] for r in records])
    assert everything[3].meta == {**records[3], "task": "math"}

    records[2]["prompt"] = ""
    records[7]["prompt"] = None
    pq.write_table(pa.Table.from_pylist(records), path)
    with raises_invalid("prompt", where=f"{path}: row index 2", kind=sources.BadRecordError):
        sources.make_sources(cfg)
    train, held_out = sources.make_sources(dataclasses.replace(cfg, skip_bad_records=True))
    assert train.num_skipped == 2 and len(train) + len(held_out) == 28


# ---- the held-out split --------------------------------------------------------------------


def test_held_out_split_is_disjoint_by_prompt_and_stable(tmp_path, write_lines):
    # 120 distinct prompts, each written 5 times (a small procedural space repeats prompts).
    records = [{"prompt": f"q{i % 120}", "answer": "a"} for i in range(600)]
    path = write_lines(tmp_path / "rep.jsonl", records)
    cfg = _cfg(source="jsonl", path=str(path), eval_fraction=0.25)
    train, held_out = sources.make_sources(cfg)
    train_prompts, held_prompts = {e.prompt for e in train}, {e.prompt for e in held_out}
    assert not train_prompts & held_prompts
    assert len(train_prompts | held_prompts) == 120
    assert 0.1 < len(held_prompts) / 120 < 0.4
    assert all(len([e for e in held_out if e.prompt == p]) == 5 for p in held_prompts)
    # The same split in every call and whatever the seed (a function of the prompt text).
    again_train, again_held = sources.make_sources(dataclasses.replace(cfg, seed=7))
    assert [e.id for e in again_held] == [e.id for e in held_out]
    assert [e.id for e in again_train] == [e.id for e in train]


def test_train_max_samples_keeps_the_first_training_examples_and_the_held_out_set(
    tmp_path, write_lines
):
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(200)]
    path = write_lines(tmp_path / "pool.jsonl", records)
    cfg = _cfg(source="jsonl", path=str(path), eval_fraction=0.25)
    train, held_out = sources.make_sources(cfg)
    small, small_held = sources.make_sources(dataclasses.replace(cfg, train_max_samples=10))
    assert [e.id for e in small] == [e.id for e in train][:10]
    assert [e.id for e in small_held] == [e.id for e in held_out]
    more, _ = sources.make_sources(dataclasses.replace(cfg, train_max_samples=10**6))
    assert len(more) == len(train)


def test_eval_subset_is_distinct_and_round_robin_over_groups():
    def ex(group, i, prompt):
        return examples.Example(
            id=f"{group}:{i}",
            prompt=prompt,
            answer="1",
            difficulty=math.nan,
            meta={"answer": "1", "task": "add"},
        )

    # Group a repeats its prompts (a small procedural space); b and c follow it in source order.
    held = [ex("rg:0-add", i, f"a{i % 2}") for i in range(6)]
    held += [ex("rg:1-add", i, f"b{i}") for i in range(4)] + [ex("jsonl:c", 0, "c0")]
    source = sources.Source(name="held", examples=held)
    got = [e.prompt for e in sources.eval_subset(source, 6)]
    assert got == ["a0", "b0", "c0", "a1", "b1", "b2"]
    assert [e.prompt for e in sources.eval_subset(source, 100)] == got + ["b3"]
    short = sources.eval_subset(source, 3, keep=lambda e: e.prompt != "b0")
    assert [e.prompt for e in short] == ["a0", "b1", "c0"]
    assert sources.group_of(held[7]) == "rg:1-add"


def test_held_out_split_is_pinned():
    # A fixed function of the text (BLAKE2b), not Python's per-process salted hash() or the seed:
    # every process of every run agrees. Changing the hash reshuffles train/held-out for users.
    held = [i for i in range(40) if sources._in_held_out(f"q{i}", 0.25)]
    assert held == [0, 4, 6, 9, 10, 13, 16, 17, 25, 31, 39]


def test_empty_side_is_an_error_naming_the_config(tmp_path, write_lines):
    path = write_lines(tmp_path / "one.jsonl", [{"prompt": "only", "answer": "a"}])
    with pytest.raises(errors.InvalidValue) as info:
        sources.make_sources(_cfg(source="jsonl", path=str(path), eval_fraction=0.5))
    assert info.value.field in ("training examples", "held-out examples")
    assert "one.jsonl" in info.value.valid
    all_bad = write_lines(tmp_path / "bad.jsonl", ["{", "{"])
    cfg = _cfg(source="jsonl", path=str(all_bad), skip_bad_records=True)
    with raises_invalid("training examples", where="data") as info:
        sources.make_sources(cfg)
    assert "skipped 2" in info.value.valid


def test_unknown_extension_and_missing_file(tmp_path):
    with raises_invalid("path", where="DataConfig") as info:
        sources.make_sources(_cfg(source="jsonl", path="x.csv"))
    assert info.value.value == "x.csv" and ".jsonl" in info.value.valid
    with raises_invalid("path", where="DataConfig") as info:
        sources.make_sources(_cfg(source="parquet", path="x.jsonl"))
    assert ".parquet" in info.value.valid
    missing = str(tmp_path / "nope.jsonl")
    with raises_invalid("path", where="DataConfig") as info:
        sources.make_sources(_cfg(source="jsonl", path=missing))
    assert info.value.value == missing


# ---- DataConfig ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"source": "csv"}, "source"),
        ({"size": 0}, "size"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"eval_fraction": 0.0}, "eval_fraction"),
        ({"source": "jsonl"}, "path"),
        ({"source": "jsonl", "path": "a.jsonl", "prompt_field": ""}, "prompt_field"),
        ({"tasks": "chain_sum:min_terms"}, "tasks"),
        ({"tasks": "chain_sum:difficulty=2"}, "tasks"),
        ({"tasks": "chain_sum:a=1:a=2"}, "tasks"),
        ({"tasks": " ; "}, "tasks"),
        ({"eval_path": "x.jsonl"}, "eval_path"),
        ({"skip_bad_records": "yes"}, "skip_bad_records"),
        ({"train_max_samples": -1}, "train_max_samples"),
        ({"train_max_samples": 2.5}, "train_max_samples"),
    ],
)
def test_data_config_errors(kw, field):
    with raises_invalid(field, where="DataConfig"):
        examples.DataConfig(**kw)


def test_parse_task_specs():
    specs = examples.parse_task_specs(" chain_sum:min_terms=2:x=1.5:flag=true:s=abc:difficulty=0 ;")
    assert specs == [
        ("chain_sum", {"min_terms": 2, "x": 1.5, "flag": True, "s": "abc", "difficulty": 0.0})
    ]
    assert isinstance(specs[0][1]["min_terms"], int)


# ---- reasoning_gym -------------------------------------------------------------------------

_TASKS = (
    "chain_sum:min_terms=2:max_terms=2:min_digits=1:max_digits=1:difficulty=0;"
    "chain_sum:min_terms=3:max_terms=3:min_digits=2:max_digits=2:difficulty=1"
)


def test_reasoning_gym_source():
    import reasoning_gym

    cfg = _cfg(tasks=_TASKS, size=60, eval_fraction=0.2)
    train, held_out = sources.make_sources(cfg)
    everything = {e.id: e for e in [*train, *held_out]}
    assert len(everything) == 120
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    easy, hard = (
        everything["reasoning_gym:0-chain_sum:5"],
        everything["reasoning_gym:1-chain_sum:5"],
    )
    assert easy.difficulty == 0.0 and hard.difficulty == 1.0
    assert easy.prompt.count("+") + easy.prompt.count("-") == 1  # 2 terms
    assert hard.prompt.count("+") + hard.prompt.count("-") == 2  # 3 terms
    # The entry is reasoning_gym's own, for the spec's config and seed.
    entry = reasoning_gym.create_dataset(
        "chain_sum",
        size=60,
        seed=sources._spec_seed(0, 0),
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
    )[5]
    assert (easy.prompt, easy.answer) == (entry["question"], entry["answer"])
    assert easy.meta["task"] == "chain_sum" and easy.meta["answer"] == entry["answer"]
    assert easy.meta["entry"]["metadata"]["expression"] == entry["metadata"]["expression"]
    assert json.loads(json.dumps(easy.meta)) == easy.meta  # plain JSON data (tuples -> lists)
    # Deterministic, and the seed changes the problems.
    again, _ = sources.make_sources(cfg)
    assert [(e.id, e.prompt) for e in again] == [(e.id, e.prompt) for e in train]
    other, other_held = sources.make_sources(dataclasses.replace(cfg, seed=1))
    other_prompts = {e.prompt for e in [*other, *other_held] if e.difficulty == 1.0}
    hard_prompts = {e.prompt for e in everything.values() if e.difficulty == 1.0}
    assert len(other_prompts & hard_prompts) < 5  # not the same problems shifted by one


def test_reasoning_gym_specs_draw_different_problems():
    # The same task twice (e.g. two difficulty tags) must not repeat the same problems.
    train, held_out = sources.make_sources(_cfg(tasks="gcd:difficulty=0;gcd:difficulty=1", size=30))
    by_spec = [
        {e.prompt for e in [*train, *held_out] if e.id.startswith(f"reasoning_gym:{i}-")}
        for i in (0, 1)
    ]
    assert len(by_spec[0] & by_spec[1]) < 5


def test_reasoning_gym_errors():
    with raises_invalid("name", where="DataConfig.tasks[0]") as info:
        sources.make_sources(_cfg(tasks="chain_summ", size=5))
    assert "did you mean chain_sum" in info.value.valid
    with raises_invalid("settings", where="DataConfig.tasks[1]") as info:
        sources.make_sources(_cfg(tasks="chain_sum;chain_sum:max_term=3", size=5))
    assert "max_terms" in info.value.valid


# ---- TFDS (ArrayRecord, no TensorFlow) -----------------------------------------------------


def _build_tfds(data_dir):
    import tensorflow_datasets as tfds

    class TinyMathTfds(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")
        # tfds looks for a checksums file beside a builder in a dotted module (through
        # importlib_resources, not installed); a top-level module name skips that look-up.
        __module__ = "tiny_math_tfds"

        def _info(self):
            features = {"question": tfds.features.Text(), "answer": tfds.features.Text()}
            features["level"] = np.float32
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict(features)
            )

        def _split_generators(self, dl_manager):
            return {
                "train": self._generate_examples(0, 40),
                "test": self._generate_examples(100, 104),
            }

        def _generate_examples(self, start, stop):
            for i in range(start, stop):
                question = f"what is {i} + 1?" if i != 7 else ""  # record 7: an empty prompt
                yield i, {"question": question, "answer": str(i + 1), "level": (i % 4) / 4}

    # Files only (skip_registration): make_sources reads them as a training job would.
    TinyMathTfds(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def test_tfds_source(tmp_path):
    _build_tfds(tmp_path)
    cfg = _cfg(
        source="tfds",
        path="tiny_math_tfds",
        tfds_data_dir=str(tmp_path),
        prompt_field="question",
        difficulty_field="level",
        eval_path="test",
    )
    with raises_invalid("question", kind=sources.BadRecordError) as info:
        sources.make_sources(cfg)
    assert info.value.where.startswith("tfds 'tiny_math_tfds' split 'train': record ")
    train, held_out = sources.make_sources(dataclasses.replace(cfg, skip_bad_records=True))
    assert train.num_skipped == 1 and len(train) == 39
    assert sorted(e.prompt for e in held_out) == [f"what is {i} + 1?" for i in range(100, 104)]
    for e in [*train, *held_out]:
        i = int(e.prompt.split()[2])
        split = "train" if i < 100 else "test"
        assert e.id.startswith(f"tfds:tiny_math_tfds/{split}:")
        assert e.answer == str(i + 1) and e.difficulty == (i % 4) / 4
        assert e.meta["task"] == "tiny_math_tfds" and isinstance(e.meta["question"], str)
    # The record index in the id is the data source's index.
    import tensorflow_datasets as tfds

    raw = tfds.data_source("tiny_math_tfds", split="train", data_dir=str(tmp_path))
    e = train[0]
    assert raw[int(e.id.rsplit(":", 1)[1])]["question"].decode() == e.prompt
    # A hash split of one TFDS split, and a missing dataset.
    train, held_out = sources.make_sources(
        dataclasses.replace(cfg, eval_path="", split="test", eval_fraction=0.5)
    )
    assert len(train) + len(held_out) == 4
    with raises_invalid("path", where="DataConfig"):
        sources.make_sources(dataclasses.replace(cfg, path="nope"))
