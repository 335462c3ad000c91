"""espo.plots and experiments/plot.py: which curves go where, the PNGs, the CLI, the errors."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from espo import plots

_REPO = pathlib.Path(__file__).resolve().parents[1]
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(*, steps=12, eval_every=5):
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "train/reward_mean": step / steps,
            "train/accuracy": step / (2 * steps),
            "train/entropy": 1.0 - step / 100,
            "loss/value": 1.0 / step,
            "loss/clip_frac": 0.05,
            "zve/zvp_rate": 0.3,
            "zve/resample_rate": 0.1,
            "zve/num_dropped_groups": 2,
            "mismatch/k3_kl": 1e-3,
            "mismatch/extreme_frac": 0.01,
            "mismatch/router_agreement": 0.97,
            "perf/step_s": 2.0,
            "perf/rollout_s": 1.5,
            "perf/update_s": 0.4,
            "perf/tokens_per_s": 900.0,
            "data/skipped_records": 0,
        }
        if step == 4:
            record["loss/value"] = None  # a non-finite value, written as null
        if step % eval_every == 0 or step == 1:
            record["eval/pass@1"] = step / 20
            record["eval/avg@4"] = step / 25
        records.append(record)
    return records


def _write_run(workdir, **kwargs):
    records = _records(**kwargs)
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write('{"step": 13, "train/rew')  # a run still writing (or killed mid-line)
    return records


def test_collect_series_skips_nulls_and_keeps_eval_steps():
    records = _records()
    records[5]["loss/value"] = math.inf  # Python's json reads Infinity / NaN tokens
    series = plots.collect_series(records[::-1])  # any order in, step order out
    assert series["eval/pass@1"] == ([1, 5, 10], [0.05, 0.25, 0.5])
    assert series["loss/value"][0] == [1, 2, 3, 5, 7, 8, 9, 10, 11, 12]
    assert series["zve/num_dropped_groups"] == (list(range(1, 13)), [2.0] * 12)
    assert "step" not in series


def test_layout_groups_metrics_into_panels():
    keys = list(plots.collect_series(_records()))
    panels = dict(plots.layout(keys))
    assert list(panels) == ["train", "eval", "loss", "zve", "mismatch", "entropy", "perf", "other"]
    assert panels["train"] == [
        ("reward", ["train/reward_mean"]),
        ("accuracy", ["train/accuracy"]),
        ("train/entropy", ["train/entropy"]),
    ]
    assert panels["eval"] == [("pass@1 and avg@k", ["eval/avg@4", "eval/pass@1"])]
    assert panels["loss"] == [
        ("loss/clip_frac", ["loss/clip_frac"]),
        ("loss/value", ["loss/value"]),
    ]
    assert panels["zve"] == [
        ("rates", ["zve/resample_rate", "zve/zvp_rate"]),
        ("zve/num_dropped_groups", ["zve/num_dropped_groups"]),
    ]
    assert [keys for _, keys in panels["mismatch"]] == [
        ["mismatch/extreme_frac"],
        ["mismatch/k3_kl"],
        ["mismatch/router_agreement"],
    ]
    assert panels["entropy"] == [("entropy", ["train/entropy"])]
    assert panels["perf"] == [
        ("seconds per step", ["perf/rollout_s", "perf/step_s", "perf/update_s"]),
        ("perf/tokens_per_s", ["perf/tokens_per_s"]),
    ]
    assert panels["other"] == [("data/skipped_records", ["data/skipped_records"])]
    # A panel none of whose metrics is present is left out.
    assert [name for name, _ in plots.layout(["train/accuracy", "perf/step_s"])] == [
        "train",
        "perf",
    ]


@pytest.mark.slow
def test_plot_run_writes_one_png_per_present_panel(tmp_path):
    _write_run(tmp_path)
    paths = plots.plot_run(tmp_path)
    names = ["train", "eval", "loss", "zve", "mismatch", "entropy", "perf", "other"]
    assert paths == [tmp_path / "plots" / f"{name}.png" for name in names]
    for path in paths:
        assert path.read_bytes()[:8] == _PNG_MAGIC and path.stat().st_size > 5000


def test_plot_run_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no metrics file {tmp_path / 'metrics.jsonl'}"):
        plots.plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path / 'metrics.jsonl'} has no metric values"):
        plots.plot_run(tmp_path)


@pytest.mark.slow
def test_cli_prints_the_pngs(tmp_path):
    _write_run(tmp_path / "run", steps=3)
    cmd = [sys.executable, str(_REPO / "experiments" / "plot.py")]
    done = subprocess.run([*cmd, str(tmp_path / "run")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    printed = [pathlib.Path(line) for line in done.stdout.split()]
    assert tmp_path / "run" / "plots" / "eval.png" in printed
    assert all(path.read_bytes()[:8] == _PNG_MAGIC for path in printed)
    missing = subprocess.run([*cmd, str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 1
    assert f"no metrics file {tmp_path / 'nope' / 'metrics.jsonl'}" in missing.stderr
