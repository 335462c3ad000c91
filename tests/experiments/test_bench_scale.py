"""bench_scale.py runs its sampler section on the tiny config (a process per point) and prints
one table row per point (the numbers are the benchmark's, not asserted here); an override naming
no config key is an error naming the key. (The train and devices sections run the trainer in a
process per point, a minute each even on the tiny config: left to the benchmark run.)"""

import pathlib

import pytest

from espo import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sampler_section_prints_a_row_per_point(capsys):
    bench = testing.load_script(ROOT / "experiments" / "bench_scale.py")
    bench.main(["--quick", "--only", "sampler", "--batches", "4", "--lengths", "8,16",
                "--length_batch", "4", "--new_tokens", "8"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln]
    sampler = [r for r in rows if len(r) == 5 and r[0] != "| B"]
    assert [(r[0], r[1]) for r in sampler] == [("| 4", "8"), ("| 4", "16")]
    assert all(float(r[2].replace(",", "")) > 0 for r in sampler)


def test_an_unknown_override_names_the_key():
    bench = testing.load_script(ROOT / "experiments" / "bench_train.py")
    with pytest.raises(KeyError, match="override 'train.prompts_per_stp': no such config field"):
        bench.bench("default:tiny", steps=4, warmup=2, overrides=[("train.prompts_per_stp", 2)])
