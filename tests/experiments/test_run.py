"""Every config file: both variants parse into validated `espo.config.Settings`; bad variants fail.

The tiny variants are trained end to end by tests/test_trainer.py (through experiments/run.py
too: bad overrides, SIGKILL and rerun).
"""

import pathlib
import subprocess
import sys

import pytest

from espo import config as config_lib
from espo import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_parses_into_settings(path):
    for variant in ("", "tiny"):
        config = testing.load_script(path).get_config(variant)
        s = config_lib.Settings.from_config(config)
        assert s.train.steps >= 2 and s.curriculum.num_stages >= 1
        if not s.hf_path:
            s.loss_config(s.model.vocab_size)
    with pytest.raises(ValueError, match="variant 'huge' is invalid"):
        testing.load_script(path).get_config("huge")


def test_every_config_field_has_a_comment():
    """The house rule: one comment per config field (`c.section.field = value  # ...`); the
    tiny variant's overrides below `if variant == "tiny":` are commented by the fields they set."""
    for path in CONFIGS:
        text = path.read_text().split('if variant == "tiny":')[0]
        for n, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            field = s.startswith("c.") and " = " in s and "ConfigDict()" not in s
            if field and "update(" not in s and not s.endswith(("(", "[")):
                assert "#" in s, f"{path.name}:{n} has no comment: {s}"


def _run_cli(tmp_path, *flags):
    """experiments/run.py on the tiny default with `flags`: (exit status, stderr's last line,
    stderr)."""
    cmd = [sys.executable, str(ROOT / "experiments" / "run.py"),
           "--config", str(ROOT / "configs" / "default.py") + ":tiny",
           "--workdir", str(tmp_path / "run"), *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return done.returncode, done.stderr.strip().splitlines()[-1], done.stderr


@pytest.mark.slow
def test_a_malformed_data_file_is_one_line_naming_the_file_and_line(tmp_path):
    """experiments/run.py prints a user's bad data file as one 'data error:' line (the file, the
    line), exit status 1, no traceback; the file is left as it was."""
    bad = tmp_path / "bad.jsonl"
    text = '{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"\n'
    bad.write_text(text)
    rc, last, err = _run_cli(tmp_path, "--config.data.source=jsonl", f"--config.data.path={bad}")
    assert rc == 1 and "Traceback" not in err
    assert last.startswith("data error:") and str(bad) in last and "line 2" in last
    assert bad.read_text() == text


@pytest.mark.slow
def test_a_hugging_face_dir_without_its_files_is_one_line(tmp_path):
    """model.hf_path pointing at a directory without the checkpoint's files: one line naming
    the missing file, exit status 1, no traceback."""
    rc, last, err = _run_cli(tmp_path, f"--config.model.hf_path={tmp_path}")
    assert rc == 1 and "Traceback" not in err
    assert last.startswith("checkpoint error:") and str(tmp_path) in last


@pytest.mark.slow
def test_a_missing_data_file_is_one_line_naming_the_key(tmp_path):
    missing = tmp_path / "nope.jsonl"
    rc, last, err = _run_cli(
        tmp_path, "--config.data.source=jsonl", f"--config.data.path={missing}"
    )
    assert rc == 1 and "Traceback" not in err
    assert last.startswith(f"config error: --config.data.path='{missing}' is invalid")
