"""From an ml_collections ConfigDict to the frozen, validated dataclasses of the modules.

Library modules never read the ConfigDict. `Settings.from_config(config)` turns every section
into the dataclass of the module that owns it, before anything compiles:

    model       espo.model.ModelConfig          train       espo.train_step.TrainConfig
    data        espo.data.examples.DataConfig   optimizer   espo.train_step.OptimizerConfig
    rollout     espo.rollout.RolloutConfig      sft         espo.sft.SftConfig
    loss        espo.losses.LossConfig          eval        espo.evaluate.EvalConfig
    advantage   espo.advantages.AdvantageConfig checkpoint  espo.checkpoint.CheckpointConfig
    zve         espo.zero_variance.ZveConfig    reward      espo.rewards.model_rewards.RewardConfig
    curriculum  espo.curriculum.Stage (a list)  mesh / distributed  espo.sharding's

An error any of them raises (`espo.errors.InvalidValue`) comes out as a ConfigError naming the
command-line key:

    ConfigError: --config.loss.name='ppo' is invalid: one of ('grpo', 'gspo', 'espo', 'cispo')

Unknown keys never get here: the ConfigDict is locked, so `--config.loss.nmae=x` already fails
in flag parsing naming the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from espo import (
    advantages,
    checkpoint,
    curriculum,
    errors,
    evaluate,
    losses,
    rollout,
    sft,
    sharding,
    train_step,
    zero_variance,
)
from espo.data import examples as data_examples
from espo.model import config as model_config
from espo.rewards import model_rewards

ConfigError = errors.ConfigError  # the error every section raises, naming its --config key


# The config section -> the dataclass it becomes (curriculum: a list of espo.curriculum.Stage).
_SECTIONS: dict[str, type] = {
    "model": model_config.ModelConfig, "data": data_examples.DataConfig,
    "rollout": rollout.RolloutConfig, "train": train_step.TrainConfig,
    "optimizer": train_step.OptimizerConfig, "sft": sft.SftConfig,
    "eval": evaluate.EvalConfig, "checkpoint": checkpoint.CheckpointConfig,
    "loss": losses.LossConfig, "advantage": advantages.AdvantageConfig,
    "zve": zero_variance.ZveConfig, "reward": model_rewards.RewardConfig,
    "mesh": sharding.MeshConfig, "distributed": sharding.DistributedConfig,
}  # fmt: skip


def sections() -> dict[str, type]:
    """The config section -> the dataclass it becomes (curriculum: a list of Stage dicts)."""
    return dict(_SECTIONS)


def build(key: str, section: Mapping[str, Any] | ml_collections.ConfigDict, **extra):
    """Section `key`'s dataclass from `section` (and `extra`); an InvalidValue comes out as a
    ConfigError of `--config.<key>`."""
    cls = _SECTIONS[key]
    fields = dict(section.to_dict() if hasattr(section, "to_dict") else section)
    fields.update(extra)
    try:
        return cls(**fields)
    except TypeError as e:  # an unexpected or missing field
        raise ConfigError("--config", key, valid=f"the fields of {cls.__name__} ({e})") from None
    except errors.InvalidValue as e:
        raise e.moved(f"--config.{key}", ConfigError) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Every section of a run's config as its validated dataclass."""

    seed: int
    workdir: str
    hf_path: str
    init_from: str  # an espo workdir whose newest checkpoint's params start the run ("" = none)
    model: model_config.ModelConfig | None  # None with hf_path (read from the checkpoint)
    data: data_examples.DataConfig
    max_prompt_length: int
    rollout: rollout.RolloutConfig
    train: train_step.TrainConfig
    optimizer: train_step.OptimizerConfig
    sft: sft.SftConfig
    curriculum: curriculum.Curriculum
    eval: evaluate.EvalConfig
    checkpoint: checkpoint.CheckpointConfig
    loss: dict  # LossConfig fields; the LossConfig needs the model's vocab size (see loss_config)
    advantage: advantages.AdvantageConfig
    zve: zero_variance.ZveConfig
    reward: model_rewards.RewardConfig
    mesh: sharding.MeshConfig
    distributed: sharding.DistributedConfig
    # model.attention_impl / moe_impl / remat / logits_chunk / moe_chunk (COMPUTE_FIELDS): how
    # to compute the model, with hf_path too (the checkpoint gives the architecture, the run these)
    compute: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> Settings:
        c = config
        model = dict(c.model.to_dict())
        hf_path = model.pop("hf_path", "")
        init_from = model.pop("init_from", "")
        if init_from and hf_path:
            raise ConfigError(
                "--config.model", "init_from", init_from,
                "'' with model.hf_path set: the weights come from one of them",
            )  # fmt: skip
        data = dict(c.data.to_dict())
        max_prompt_length = data.pop("max_prompt_length")
        if not (errors.is_int(max_prompt_length) and max_prompt_length >= 1):
            raise ConfigError(
                "--config.data", "max_prompt_length", max_prompt_length, "an int >= 1"
            )
        stages = [dict(s) for s in c.curriculum.stages]
        try:
            curr = curriculum.Curriculum.from_config(stages)
        except errors.InvalidValue as e:
            raise e.moved(f"--config.{e.where}", ConfigError) from None
        ev = build("eval", c.eval, max_new_tokens=curr.max_new_tokens)
        if ev.split == "dev" and data.get("eval_path"):
            raise ConfigError(
                "--config.eval", "split", "dev",
                "'test' with data.eval_path: that file is the test set, whole; the dev half is "
                "cut from a held-out set split by data.eval_fraction",
            )  # fmt: skip
        train = build("train", c.train)
        longest = max_prompt_length + curr.max_new_tokens
        if train.packing and train.max_tokens_per_micro_batch < longest:
            raise ConfigError(
                "--config.train", "max_tokens_per_micro_batch", train.max_tokens_per_micro_batch,
                f">= data.max_prompt_length + the largest max_new_tokens ({longest}) with "
                "train.packing (a packed micro-batch holds whole sequences)",
            )  # fmt: skip
        loss = dict(c.loss.to_dict())
        build("loss", loss, vocab_size=model.get("vocab_size") or 2)
        # One tie tolerance (zve.atol) for the optimiser stage and the advantage's zero-variance
        # groups; RL-ZVP is zve.mode's choice.
        zve_mode = zero_variance.ZVE_MODES.get(c.zve.mode, zero_variance.ZveMode())
        built_model = build("model", model)  # validated with hf_path too: its compute fields
        adv = dict(c.advantage.to_dict(), rl_zvp=zve_mode.rl_zvp, atol=c.zve.atol)
        return cls(
            seed=c.seed,
            workdir=c.workdir,
            hf_path=hf_path,
            init_from=init_from,
            model=None if hf_path else built_model,
            compute={f: getattr(built_model, f) for f in model_config.COMPUTE_FIELDS},
            # The data's own seed (data.seed; the run's seed when the config has none): the
            # examples and the held-out set stay the same when the run's seed changes.
            data=build("data", {"seed": c.seed, **data}),
            max_prompt_length=max_prompt_length,
            rollout=build("rollout", c.rollout),
            train=train,
            optimizer=build("optimizer", c.optimizer),
            sft=build("sft", c.sft),
            curriculum=curr,
            eval=ev,
            checkpoint=build("checkpoint", c.checkpoint),
            loss=loss,
            advantage=build("advantage", adv),
            zve=build("zve", c.zve),
            reward=build("reward", c.reward),
            mesh=build("mesh", c.get("mesh") or {}),
            distributed=build("distributed", c.get("distributed") or {}),
        )

    def loss_config(self, vocab_size: int) -> losses.LossConfig:
        return build("loss", self.loss, vocab_size=vocab_size)
