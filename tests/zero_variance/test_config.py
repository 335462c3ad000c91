"""ZveConfig: every invalid value names its field and value; the config is frozen and drives
the adaptive group sizes (its zvp_target and rollout budget reach `group_sizes`).
"""

import dataclasses
import pathlib

import numpy as np
import pytest

from espo import testing
from espo import zero_variance as zv
from espo.testing import raises_invalid

# tests/ is not a package (pytest runs with --import-mode=importlib): the helpers load by path.
_helpers = testing.load_script(
    pathlib.Path(__file__).with_name("_helpers.py"), name="espo_tests_zero_variance_helpers"
)
QuantilePolicy, fill = _helpers.QuantilePolicy, _helpers.fill


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="grpo"), "mode"),
        (dict(max_resample_rounds=-1), "max_resample_rounds"),
        (dict(max_resample_rounds=1.5), "max_resample_rounds"),
        (dict(oversample=0.5), "oversample"),
        (dict(oversample="2"), "oversample"),
        (dict(oversample=4.0, max_oversample=2.0), "max_oversample"),
        (dict(max_carry_over_steps=-1), "max_carry_over_steps"),
        (dict(prefilter="maybe"), "prefilter"),
        (dict(prefilter_high=0.0), "prefilter_high"),
        (dict(prefilter_downweight=2.0), "prefilter_downweight"),
        (dict(group_size=0), "group_size"),
        (dict(group_size=8, max_group_size=4), "max_group_size"),
        (dict(zvp_target=1.0), "zvp_target"),
        (dict(rollout_budget=0), "rollout_budget"),
    ],
)
def test_config_errors_name_field_and_value(kwargs, field):
    with raises_invalid(field, where="ZveConfig") as info:
        zv.ZveConfig(**kwargs)
    assert info.value.value == kwargs[field]


def test_config_is_frozen_and_drives_group_sizes():
    config = zv.ZveConfig(group_size=4, max_group_size=32, rollout_budget=40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "drop"
    np.testing.assert_array_equal(config.group_sizes([0.05, 0.5, 0.01]), [16, 4, 20])
    with pytest.raises(ValueError, match="batch_size=0"):
        fill([0.5], policy=QuantilePolicy(), batch_size=0)


def test_config_group_sizes_use_its_zvp_target():
    # Sizes {2, 4, 6, 8}, p = 0.5: 2 * 0.5^G is 0.5 at G=2, 0.125 at G=4. Target 0.2 -> 4
    # (the default target 0.5 would give 2).
    config = zv.ZveConfig(group_size=2, max_group_size=8, zvp_target=0.2)
    np.testing.assert_array_equal(config.group_sizes([0.5]), [4])
