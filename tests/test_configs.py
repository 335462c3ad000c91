"""The shipped configs: one default per setting. configs/default.py sets every field of every
section, and a value differs from the library's default (the section's dataclass) only where its
DEVIATIONS says why."""

import dataclasses
import pathlib

from espo import config as config_lib
from espo import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_default_config_deviates_only_where_it_says_why():
    module = testing.load_script(ROOT / "configs" / "default.py")
    config = module.get_config()
    differ = set()
    for section, cls in config_lib.sections().items():
        for field, default in _defaults(cls).items():
            value = config[section].get(field, default)
            if isinstance(value, tuple | list) or isinstance(default, tuple | list):
                value, default = list(value), list(default)
            if value != default:
                differ.add(f"{section}.{field}")
    assert differ - set(module.DEVIATIONS) == set(), "deviations without a reason"
    assert set(module.DEVIATIONS) - differ == set(), "DEVIATIONS lists library defaults"
    assert all(isinstance(why, str) and why for why in module.DEVIATIONS.values())


def test_every_section_field_is_in_the_default_config():
    """A user reads every setting in configs/default.py (placeholders hold None defaults)."""
    config = testing.load_script(ROOT / "configs" / "default.py").get_config()
    for section, cls in config_lib.sections().items():
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        injected = {"loss": {"vocab_size"}, "advantage": {"rl_zvp", "atol"}}.get(
            section, {"max_new_tokens"}
        )  # set from another section: the model's vocabulary, zve.mode and zve.atol, a stage
        missing = names - set(config[section]) - injected - {"seed"}
        assert not missing, f"{section}: {sorted(missing)}"
