"""The testbed's offline controls (issue 55, experiment 1; experiments/repro_testbed.py
--offline): the verifier's filter of the warm start's demonstrations (`sft.verified_only`), the
Welch interval the arms are compared with RL by, the pre-registered readings applied to known
numbers, and the two arms run at the tiny size."""

import json
import pathlib

import numpy as np
import pytest
from scipy import stats

from espo import config as config_lib
from espo import testing, trainer
from espo.data import chains, sources
from espo.data import tokenizer as tokenizer_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    return testing.load_script(ROOT / "experiments" / f"{name}.py")


lib, repro = _load("repro_lib"), _load("repro_testbed")


def _settings(**over):
    return config_lib.Settings.from_config(lib.config("quick", over, name="default"))


def test_verified_keeps_exactly_the_demonstrations_whose_answer_is_true():
    """The filter is the verifier's: a demonstration is kept iff its last line is the true answer
    (`ChainReward` > success_threshold); the flawed teacher's dropped signs are the ones left
    out; off (the default), there is no filter."""
    s = _settings(**{"sft.verified_only": True})
    assert trainer.verified(_settings(), trainer.reward_fn_of(s)) is None
    accept = trainer.verified(s, trainer.reward_fn_of(s))
    train, _ = sources.make_sources(s.data)
    pool = [train[i] for i in range(len(train))]
    kept = [e for e in pool if accept(e)]
    true = [e for e in pool if chains.final_answer(e.demonstration) == e.answer]
    assert [e.id for e in kept] == [e.id for e in true]
    assert 0 < len(kept) < len(pool)  # the tiny pool has flawed demonstrations to drop
    assert all(int(e.answer) < 0 for e in pool if e not in kept)  # only dropped signs
    # A threshold above the verifier's 1.0 keeps none (it is the threshold rft counts by).
    strict = _settings(**{"sft.verified_only": True, "advantage.success_threshold": 1.0})
    assert not any(trainer.verified(strict, trainer.reward_fn_of(strict))(e) for e in pool)


def test_welch_interval_is_scipys():
    xs, ys = [0.21, 0.25, 0.18], [0.22, 0.24, 0.25, 0.23]
    d, h = lib.welch_interval(xs, ys)
    ci = stats.ttest_ind(xs, ys, equal_var=False).confidence_interval(0.95)
    assert d == pytest.approx(np.mean(xs) - np.mean(ys))
    assert (d - h, d + h) == pytest.approx((ci.low, ci.high))
    assert lib.welch_difference(xs, ys).endswith("(Welch)")
    assert lib.welch_difference([0.1], ys).startswith("-0.")  # one seed: no interval


def _data(filtered, x4, *, rl=(0.22, 0.24, 0.25)):
    own = [0.657, 0.665, 0.623]
    return dict(
        seeds=[0, 1, 2],
        end={"sft-filtered": list(filtered), "sft-x4": list(x4)},
        fidelity={"sft-filtered": [0.9] * 3, "sft-x4": [0.6] * 3},
        right_answer_wrong_process={"sft-filtered": [0.0] * 3, "sft-x4": [0.0] * 3},
        own_start=own,
        baselines={
            "file": "stored.json",
            "shared_start": 0.657,
            "change": {"rl": list(rl), "rft": [0.247, 0.247, 0.251]},
            "end": {
                "rl": [0.88, 0.896, 0.911],
                "rft": [0.904, 0.904, 0.908],
                "sft-longer": [0.688, 0.678, 0.671],
            },
        },  # fmt: skip
        ceiling={"prompts": 1024, "negative": 336, "ceiling": 0.672},
        kept={"pool": 100, "kept": 78, "pool_negative": 31, "kept_negative": 9},
    )


@pytest.mark.parametrize(
    "filtered,reading",
    [
        ([0.90, 0.91, 0.86], "fixes the flaw as RL does"),  # as large a change as RL's
        ([0.75, 0.76, 0.72], "fixes part of the flaw, RL more"),  # above 0, well below RL
        ([0.667, 0.655, 0.623], "do not teach the sign"),  # no change
    ],
)
def test_the_pre_registered_readings(filtered, reading):
    text = "\n".join(repro.offline_render(_data(filtered, [0.69, 0.675, 0.68])))
    assert reading in text
    assert "plateaued by 840 steps" in text  # x4 - x2: +0.003, an interval around 0
    assert "keeps 78 of the 100 training demonstrations (78.0%): 9 of the 31" in text
    climbing = "\n".join(repro.offline_render(_data(filtered, [0.74, 0.73, 0.72])))
    assert "still climbing at 840 steps" in climbing


def test_the_tables_pair_each_seed_with_its_own_warm_start():
    data = _data([0.90, 0.91, 0.86], [0.69, 0.675, 0.68])
    text = "\n".join(repro.offline_render(data))
    own = data["own_start"]
    assert "| filtered SFT (verified demonstrations only) minus each seed's own warm start | " \
        "+0.243 / +0.245 / +0.237 | " in text  # fmt: skip
    assert lib.paired_difference(data["end"]["sft-filtered"], own) in text
    change = [f - o for f, o in zip(data["end"]["sft-filtered"], own, strict=True)]
    assert lib.welch_difference(change, data["baselines"]["change"]["rl"]) in text
    assert "SFT x2 steps (fresh runs; stored)" in text and "RL (stored)" in text


@pytest.mark.slow
def test_offline_controls_quick(tmp_path, monkeypatch):
    """Both arms at the tiny size, seeds 0 and 1, against stored baselines: the filtered arm
    trains on verified demonstrations only and the warm start's steps, SFT x4 on 4x them, no RL
    step; the records are written per run and a rerun trains nothing; --records rebuilds the
    same data without training."""
    base = _data([0.5] * 3, [0.5] * 3)["baselines"] | {"start": 0.5}
    stored = {"start": 0.5, "own_start": [0.4, 0.45, 0.5], "change": base["change"],
              "end": base["end"]}  # fmt: skip
    (tmp_path / "stored.json").write_text(json.dumps(stored))
    seen, batch_fn = [], trainer.sft.demonstration_batch
    spy = lambda prompts, completions, **kw: (
        seen.extend(completions) or batch_fn(prompts, completions, **kw)
    )
    monkeypatch.setattr(trainer.sft, "demonstration_batch", spy)
    out, report = tmp_path / "runs", tmp_path / "report"
    argv = ["--quick", "--seeds", "0,1", "--out", str(out), "--report", str(report),
            "--baselines", str(tmp_path / "stored.json"), "--no-progress"]  # fmt: skip
    repro.main([*argv, "--offline", "sft-filtered"])
    s = _settings()
    tok = tokenizer_lib.CharTokenizer()
    train, _ = sources.make_sources(s.data)
    truth = {train[i].demonstration: train[i].answer for i in range(len(train))}
    texts = [tok.decode(c) for c in seen]
    assert len(texts) == 2 * s.sft.steps * s.sft.batch_size  # two seeds
    assert all(chains.final_answer(t) == truth[t] for t in texts)  # verified only
    seen.clear()
    data = repro.main([*argv, "--offline"])  # both arms: the filtered runs are skipped
    assert len(seen) == 2 * 4 * s.sft.steps * s.sft.batch_size  # sft-x4 only, 4x the steps
    for arm, steps, verified in (("sft-filtered", 2, True), ("sft-x4", 8, False)):
        for seed in (0, 1):
            cfg = json.loads((out / arm / f"seed{seed}" / "config.json").read_text())
            assert (cfg["seed"], cfg["train"]["steps"]) == (seed, 0)
            assert (cfg["sft"]["steps"], cfg["sft"]["verified_only"]) == (steps, verified)
            assert (report / "records" / arm / f"seed{seed}.jsonl.gz").stat().st_size > 0
    assert data["own_start"] == [0.4, 0.45] and set(data["end"]) == {"sft-filtered", "sft-x4"}
    text = (report / "results.md").read_text()
    assert "minus each seed's own warm start" in text and "(Welch)" in text
    assert data["kept"]["kept"] < data["kept"]["pool"]
    again = repro.main([*argv, "--offline", "--records", str(report / "records")])
    assert (
        again
        == json.loads((report / "results.json").read_text())
        == json.loads(json.dumps(data, default=float))
    )
