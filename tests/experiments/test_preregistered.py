"""The pre-registered experiments of issue 55 (repro_curriculum_confirm.py,
repro_optimizers_warm.py): their fixed test sets and their analyses, by hand."""

import math
import pathlib

import pytest

from espo import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    return testing.load_script(ROOT / "experiments" / f"{name}.py")


lib = _load("repro_lib")


def test_the_confirmatory_curriculum_evaluates_every_ten_term_test_prompt():
    """repro_curriculum_confirm's pre-registered test set: the 188 ten-term prompts of the test
    half, all sampled; and its verdict rule at the interval's edges."""
    confirm = _load("repro_curriculum_confirm")
    cfg = lib.config("default", confirm.CONFIRM, name="default")
    test = lib.eval_examples(cfg)
    assert len(test) == 188 and {len(e.meta["terms"]) for e in test} == {10}
    assert cfg.eval.sampled_prompts == 0 and cfg.eval.samples == 16
    assert confirm.verdict([0.05, 0.06, 0.04]) == "confirmed"
    assert confirm.verdict([-0.05, -0.06, -0.04]) == "contradicted"
    assert confirm.verdict([0.05, -0.04, 0.02]).startswith("not confirmed")
    assert confirm.verdict([0.05]).startswith("no verdict")


def test_two_level_interval_is_over_the_warm_starts_means_by_hand():
    """Warm starts' mean differences 0.2, 0.1, 0.3: mean 0.2, sd 0.1, t(0.975, 2) = 4.3027;
    every warm start's seeds differ by 0.2 (variance 0.02)."""
    warm = _load("repro_optimizers_warm")
    res = warm.two_level({20: [0.1, 0.3], 21: [0.0, 0.2], 22: [0.2, 0.4]})
    assert res["mean"] == pytest.approx(0.2)
    assert res["half"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    assert res["between_sd"] == pytest.approx(0.1)
    assert res["within_sd"] == pytest.approx(math.sqrt(0.02))
    assert res["warm_starts"] == 3
    assert warm.verdict(res) == "not reproduced (the interval includes 0)"
    assert warm.verdict(dict(res, half=0.1)) == "reproduced"
    assert warm.verdict(dict(res, mean=-0.2, half=0.1)) == "reversed"
    assert warm.verdict(warm.two_level({20: [0.1, 0.3]})).startswith("no verdict")


def test_the_warm_start_experiment_pairs_within_warm_start_and_seed():
    """summarize on made-up runs: ESPO's area is GRPO's + 0.1 + 0.01 x warm start index in every
    run, so the primary comparison is those means exactly, GSPO's is its own."""
    warm = _load("repro_optimizers_warm")
    arms = [lib.Arm(n, {}) for n in ("grpo", "gspo", "espo")]

    def run(acc):  # two evals: area = mean of start and end
        return [{"step": 0, "eval/pass@1": 0.5}, {"step": 10, "eval/pass@1": acc}]

    runs = {
        w: {"grpo": [run(0.5 + s / 10) for s in range(3)],
            "gspo": [run(0.6) for s in range(3)],
            "espo": [run(0.5 + s / 10 + 0.2 + 0.02 * k) for s in range(3)]}
        for k, w in enumerate((20, 21, 22))
    }  # fmt: skip
    sections, data = warm.summarize(runs, arms)
    primary = data["comparisons"]["espo minus grpo"]
    assert primary["per_warm_start"]["21"] == pytest.approx([0.11, 0.11, 0.11])
    assert primary["mean"] == pytest.approx(0.11) and primary["between_sd"] == pytest.approx(0.01)
    assert primary["verdict"] == "reproduced"
    assert "espo minus gspo" in data["comparisons"]
    assert sections[0].startswith("**Primary**")


def test_the_confirmatory_curriculum_reports_each_warm_start_apart():
    """Seeds 8-10's records twice, the copies with another step-0 greedy length (a second warm
    start) and staged's final pass@16 0.1 higher: the primary comparison pools the six paired
    differences, and each warm start's mean difference is given apart (docs/repro/README.md:
    seeds 11-13 come from a second warm start)."""
    confirm = _load("repro_curriculum_confirm")
    arms = [lib.Arm(n, {}) for n in ("staged", "uniform", "hard")]
    records = ROOT / "docs" / "repro" / "curriculum_confirm" / "records"
    runs = lib.read_records(records, arms, [8, 9, 10])
    _, first = confirm.summarize(runs, arms)
    assert "by_warm_start" not in first["primary"]  # one warm start: nothing apart

    def second_warm_start(seed_runs, shift):
        out = []
        for recs in seed_runs:
            recs = [dict(r) for r in recs]
            recs[0]["eval/greedy_mean_length"] += 1.0  # step 0: another warm start's decodes
            last = max(i for i, r in enumerate(recs) if any("pass@16" in k for k in r))
            recs[last] = {k: (v + shift if "pass@16" in k else v) for k, v in recs[last].items()}
            out.append(recs)
        return out

    both = {a.name: runs[a.name] + second_warm_start(runs[a.name], 0.1 * (a.name == "staged"))
            for a in arms}  # fmt: skip
    sections, data = confirm.summarize(both, arms)
    diffs, by = data["primary"]["differences"], data["primary"]["by_warm_start"]
    assert len(diffs) == 6 and diffs[3:] == pytest.approx([d + 0.1 for d in diffs[:3]])
    assert list(by.values()) == [pytest.approx(diffs[:3]), pytest.approx(diffs[3:])]
    assert "By warm start (no verdict): warm start 1" in sections[0]


def test_the_unstressed_control_drops_the_stress_and_keeps_the_evaluation():
    warm = _load("repro_optimizers_warm")
    stressed, control = warm.common("default"), warm.common("default", unstressed=10)
    assert stressed["train.mini_batch_size"] == 16 and stressed["train.steps"] == 20
    assert control["train.steps"] == 10
    assert not {"train.mini_batch_size", "optimizer.learning_rate", "optimizer.schedule"} & set(
        control
    )
    assert {k: control[k] for k in warm.EVAL} == warm.EVAL
    assert {k: stressed[k] for k in warm.EVAL} == warm.EVAL
