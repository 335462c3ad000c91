"""Every config file: both variants parse into validated `espo.config.Settings`; bad variants fail.

The tiny variants are trained end to end by tests/test_trainer.py (through experiments/run.py
too: bad overrides, SIGKILL and rerun).
"""

import pathlib

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
