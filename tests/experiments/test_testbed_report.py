"""The testbed's reference points and the tables rebuilt from stored records: the exact teacher's
ceiling counted on the prompts a run evaluates, the paired differences, the binomial width, and
the docs' results.md files equal to what their generators print from the stored results.json."""

import dataclasses
import json
import math
import pathlib

import pytest

from espo import config as config_lib
from espo import testing, trainer
from espo.data import examples as examples_lib
from espo.data import sources

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    return testing.load_script(ROOT / "experiments" / f"{name}.py")


lib = _load("repro_lib")


def _example(i: int, answer: int) -> examples_lib.Example:
    return examples_lib.Example(
        id=f"chains:3-terms:{i}", prompt=f"p{i}", answer=str(answer), difficulty=0.0,
        meta={"task": "chains", "answer": str(answer)},
    )  # fmt: skip


def test_teacher_ceiling_is_the_share_of_answers_the_exact_teacher_gets_right():
    examples = [_example(i, a) for i, a in enumerate([-3, 0, 4, -1, 7, -12, 2, 5])]
    c = lib.teacher_ceiling(examples, flaw="final_sign", error=0.7)
    assert c == {"prompts": 8, "negative": 3, "ceiling": 5 / 8}  # 0 keeps its (absent) sign
    # The teacher's majority keeps the sign below error 0.5; a perfect teacher has no ceiling.
    assert lib.teacher_ceiling(examples, flaw="final_sign", error=0.3)["ceiling"] == 1.0
    assert lib.teacher_ceiling(examples, flaw="none", error=0.7)["ceiling"] == 1.0
    for flaw, error in (("sign", 0.7), ("final_sign", 0.5)):  # not one sign flip / a tie
        with pytest.raises(ValueError, match="teacher_ceiling"):
            lib.teacher_ceiling(examples, flaw=flaw, error=error)
    assert math.isnan(lib.teacher_ceiling([], flaw="final_sign", error=0.7)["ceiling"])


def test_eval_examples_are_the_held_out_prompts_of_the_split():
    """The tiny config: distinct held-out prompts of eval.split only, none a training prompt,
    at most eval.num_prompts; dev gives the other half."""
    cfg = lib.config("quick", name="default")
    test = lib.eval_examples(cfg)
    dev = lib.eval_examples(cfg, split="dev", num_prompts=1000)
    train, _ = sources.make_sources(config_lib.Settings.from_config(cfg).data)
    train_prompts = {train[i].prompt for i in range(len(train))}
    assert 1 <= len(test) <= cfg.eval.num_prompts
    for split, chosen in (("test", test), ("dev", dev)):
        prompts = [e.prompt for e in chosen]
        assert len(set(prompts)) == len(prompts)
        assert all(sources.eval_split_of(p) == split for p in prompts), split
        assert not set(prompts) & train_prompts
    assert not {e.prompt for e in test} & {e.prompt for e in dev}


def test_the_default_test_prompts_give_the_documented_ceiling():
    """make run's 1024 test prompts: the per-length counts docs/testbed/README.md gives (so the
    selection is the trainer's), 336 negative answers, the ceiling 0.672."""
    cfg = lib.config("default", name="default")
    test = lib.eval_examples(cfg)
    lengths = [len(e.meta["terms"]) for e in test]
    assert [lengths.count(n) for n in (3, 4, 5, 6)] == [178, 305, 298, 243]
    c = lib.ceiling_of(cfg)
    assert (c["prompts"], c["negative"]) == (1024, 336)
    assert f"{c['ceiling']:.3f}" == "0.672"


def test_paired_difference_and_binomial_width():
    assert lib.paired_difference([0.5, 0.7, 0.6], [0.4, 0.5, 0.6]).endswith("(2 / 3 seeds > 0)")
    m, h = lib.interval([0.1, 0.2, 0.0])
    assert lib.paired_difference([0.5, 0.7, 0.6], [0.4, 0.5, 0.6]).startswith(f"{m:.3f} ± {h:.3f}")
    assert lib.binomial_half_width(0.5, 100) == pytest.approx(1.959964 * 0.05, rel=1e-5)
    assert f"{lib.binomial_half_width(0.65625, 64):.2f}" == "0.12"


def _body(text: str) -> str:
    """results.md without its title, the command that wrote it and its pictures."""
    lines = text.split("\n")[3:]
    return "\n".join(line for line in lines if not line.startswith("![")).strip()


@pytest.mark.parametrize(
    "script,doc", [("repro_testbed", "testbed"), ("repro_make_run", "make_run")]
)
def test_the_docs_tables_are_what_their_generators_print(tmp_path, script, doc):
    """Rebuilt from the stored results.json without training, each results.md is the one in
    docs/ (the doc and its generator agree), and the data round-trips."""
    stored, written = ROOT / "docs" / doc / "results.json", tmp_path / "results.md"
    data = _load(script).main(["--results", str(stored), "--out", str(tmp_path)])
    assert _body(written.read_text()) == _body((stored.parent / "results.md").read_text())
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(stored.read_text())
    assert data == json.loads(stored.read_text())


def test_testbed_paired_figures_from_the_stored_records(tmp_path):
    """The README's paired figures: SFT x2 against each seed's own warm start, RL minus RFT;
    an old results.json without own_start needs --own-starts (repro_make_run.py's)."""
    repro = _load("repro_testbed")
    data = json.loads((ROOT / "docs/testbed/results.json").read_text())
    text = "\n".join(repro.render(data))
    assert (
        "| SFT x2 minus each seed's own warm start | +0.030 / +0.013 / +0.048 | 0.030 ± 0.044"
        in text
    )
    assert "-0.010 ± 0.034 [-0.044, 0.024] (1 / 3 seeds > 0)" in text
    assert "336 of 1024 answers negative: 0.672" in text and "0.656 ± 0.116 (binomial)" in text
    old = {k: v for k, v in data.items() if k != "own_start"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit):
        repro.main(["--results", str(tmp_path / "old.json"), "--out", str(tmp_path / "a")])
    made = ROOT / "docs/make_run/results.json"
    argv = ["--results", str(tmp_path / "old.json"), "--own-starts", str(made)]
    again = repro.main([*argv, "--out", str(tmp_path / "b")])
    assert again["own_start"] == json.loads(made.read_text())["pass@1 start"]


def test_to_target_interpolated():
    figures = _load("repro_figures")
    records = [
        {"step": 0, "train/rollouts": 0, "eval/pass@1": 0.5},
        {"step": 1, "train/rollouts": 100},
        {"step": 2, "train/rollouts": 100, "eval/pass@1": 0.7},
        {"step": 3, "train/rollouts": 200, "eval/pass@1": 0.9},
    ]
    assert figures.to_target_interpolated(records, 0.8) == pytest.approx(300.0)  # 200 + 200 / 2
    assert figures.to_target_interpolated(records, 0.4) == 0.0  # reached at the start
    assert figures.to_target_interpolated(records, 0.95) == math.inf


def test_repro_figures_from_the_stored_records():
    """The figures the README quotes from repro_figures.py, recomputed from docs/repro's
    records: the curriculum's confirmatory seeds, the zero-variance saving amortised."""
    lines = "\n".join(_load("repro_figures").main([]))
    assert "the 1024 test prompts (make run, the controls): 0.672 (336 of 1024 negative)" in lines
    assert "all 30000 generated chains, training ones included: 0.693" in lines
    assert "staged minus hard, seeds 3-7: 0.031 ± 0.034 [-0.002, 0.065] (4 / 5" in lines
    assert "plain minus offline (rollouts the offline arm saves): 113 ± 107 [6, 220]" in lines


@pytest.mark.slow
def test_testbed_own_warm_starts_quick(tmp_path):
    """A run of two seeds trains the second seed's own warm start (the first seed's is the
    shared one) and pairs SFT x2 with each."""
    repro = _load("repro_testbed")
    argv = ["--quick", "--seeds", "0,1", "--arms", "rl", "--out", str(tmp_path), "--no-progress"]
    data = repro.main(argv)
    assert len(data["own_start"]) == 2 and data["own_start"][0] == data["start"]
    assert (tmp_path / "warm_start_seed1" / "summary.json").exists()
    cfg = json.loads((tmp_path / "warm_start_seed1" / "config.json").read_text())
    assert cfg["seed"] == 1 and cfg["train"]["steps"] == 0
    assert data["ceiling"]["prompts"] == data["num_prompts"]
    assert "SFT x2 minus each seed's own warm start" in (tmp_path / "results.md").read_text()


def test_min_difficulty_keeps_the_held_out_prompts_of_that_level_and_above():
    """eval.min_difficulty on the tiny config's chains (3-5 terms, difficulty (terms - 3) / 2):
    the same prompts in the same order as without it, less those below the level; at 1 only the
    longest chains; a source without levels (NaN) keeps nothing above 0 and everything at 0."""
    over = {"data.max_terms": 5, "data.terms_decay": 1.0, "eval.num_prompts": 1000}
    every = lib.eval_examples(lib.config("quick", over, name="default"))
    assert {len(e.meta["terms"]) for e in every} == {3, 4, 5}
    for floor, shortest in ((0.5, 4), (1.0, 5)):
        cfg = lib.config("quick", {**over, "eval.min_difficulty": floor}, name="default")
        got = [e.prompt for e in lib.eval_examples(cfg)]
        assert got == [e.prompt for e in every if len(e.meta["terms"]) >= shortest], floor
    s = config_lib.Settings.from_config(lib.config("quick", over, name="default"))
    examples = [dataclasses.replace(_example(i, i), difficulty=math.nan) for i in range(20)]
    unlevelled = sources.Source(name="x", examples=examples, num_skipped=0)
    at = lambda f: dataclasses.replace(s, eval=dataclasses.replace(s.eval, min_difficulty=f))
    one_token = lambda e: 1
    tests = [e.prompt for e in examples if sources.eval_split_of(e.prompt) == "test"]
    assert tests and len(tests) < len(examples)
    got = trainer.held_out_examples(at(0.0), unlevelled, one_token)
    assert [e.prompt for e in got] == tests
    assert trainer.held_out_examples(at(0.01), unlevelled, one_token) == []
