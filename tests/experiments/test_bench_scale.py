"""bench_scale.py runs its sampler and train sections on the tiny config (its own processes)
and prints one table row per point (the numbers are the benchmark's, not asserted here), and an
override naming no config key is an error naming the key."""

import pathlib

import pytest

from espo import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_sampler_and_train_sections_print_a_row_per_point(capsys):
    bench = testing.load_script(ROOT / "experiments" / "bench_scale.py")
    bench.main(["--quick", "--only", "sampler,train", "--batches", "4", "--lengths", "8,16",
                "--length_batch", "4", "--new_tokens", "8", "--prompts", "2",
                "--steps", "4"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln]
    sampler = [r for r in rows if len(r) == 5 and r[0] != "| B"]
    assert [(r[0], r[1]) for r in sampler] == [("| 4", "8"), ("| 4", "16")]
    assert all(float(r[2].replace(",", "")) > 0 for r in sampler)
    train = [r for r in rows if r[0] == "| 2"]
    assert len(train) == 1 and float(train[0][1]) > 0 and float(train[0][2]) > 0


def test_an_unknown_override_names_the_key():
    bench = testing.load_script(ROOT / "experiments" / "bench_train.py")
    with pytest.raises(KeyError, match="no config key 'train.prompts_per_stp'"):
        bench.bench("default:tiny", steps=4, warmup=2, overrides=[("train.prompts_per_stp", 2)])
