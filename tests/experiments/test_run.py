"""The entry point and the configs: every config parses, the tiny variant runs end to end."""

import pathlib
import subprocess
import sys

import pytest

from espo import losses, model, sampler, testing, zero_variance
from espo.rewards import reward_model, shaping

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_parses_and_its_model_builds(path):
    for variant in ("", "tiny"):
        config = testing.load_script(path).get_config(variant)
        fields = {k: v for k, v in config.model.to_dict().items() if k != "hf_path"}
        model.ModelConfig(**fields)  # validated
        # Every section maps one to one onto its module's validated dataclass.
        losses.LossConfig(**config.loss.to_dict(), vocab_size=config.model.vocab_size)
        zero_variance.ZveConfig(**config.zve.to_dict())
        shaping.ShapingConfig(**config.reward.shaping.to_dict())
        reward_model.RmAdjustConfig(**config.reward.rm_adjust.to_dict())
        sampling = {k: config.rollout[k] for k in ("max_new_tokens", "temperature", "top_p")}
        sampler.SamplingParams(**sampling, top_k=config.rollout.top_k, stop_ids=(1,), pad_id=0)
    with pytest.raises(ValueError, match="variant 'huge' is invalid"):
        testing.load_script(path).get_config("huge")


def test_run_tiny_prints_a_summary():
    result = subprocess.run(
        [
            sys.executable, "experiments/run.py", "--config", "configs/default.py:tiny",
            "--config.demo.new_tokens=3",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "expert load per MoE layer" in result.stdout
    assert "router replay" in result.stdout or "replayed" in result.stdout


def test_run_reports_bad_overrides_by_name():
    result = subprocess.run(
        [sys.executable, "experiments/run.py", "--config", "configs/default.py:tiny",
         "--config.model.top_k=99"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode != 0
    assert "ModelConfig.top_k=99" in result.stderr
