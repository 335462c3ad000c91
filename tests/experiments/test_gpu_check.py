"""experiments/gpu_check.sh, the script a lent GPU runs first (device time is minutes a session):
its sections exist, are documented and default in the order they run, and its budget skips."""

import os
import pathlib
import re
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "gpu_check.sh"
TEXT = SCRIPT.read_text()
BLOCKS = re.findall(r"^if on (\w+); then", TEXT, re.M)  # the sections, in the order they run


def test_every_section_is_documented_and_the_default_ones_exist_in_run_order():
    default = re.search(r"^ONLY=\$\{ONLY:-([\w,]+)\}", TEXT, re.M).group(1).split(",")
    assert len(set(BLOCKS)) == len(BLOCKS) and {"machine", "tests"} <= set(default)
    assert re.findall(r"^#   (\w+):", TEXT, re.M) == BLOCKS  # the header lists them in order
    assert default == [b for b in BLOCKS if b in default], default  # a typo would never run


def test_with_no_budget_left_every_section_is_skipped_and_named(tmp_path):
    env = dict(os.environ, ONLY=",".join(BLOCKS), BUDGET="0", PYTHON="false")
    r = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert re.findall(r"^== (\w+) skipped: BUDGET spent", r.stdout, re.M) == BLOCKS
