"""From an ml_collections ConfigDict to frozen, validated dataclasses: the one validation helper.

Library modules never read the ConfigDict. `Settings.from_config(config)` turns every section
into the dataclass of the module that owns it (`LossConfig`, `ZveConfig`, `DataConfig`, ...) or
one of the trainer's own below, before anything compiles. Every error, whichever dataclass raised
it, comes out in one wording that names the command-line key:

    ConfigError: --config.loss.name='ppo' is invalid: one of ('grpo', 'gspo', 'espo', 'cispo')

Unknown keys never get here: the ConfigDict is locked, so `--config.loss.nmae=x` already fails
in flag parsing naming the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import ml_collections

from espo import advantages, curriculum, errors, evaluate, losses, zero_variance
from espo.data import examples as data_examples
from espo.data import sources
from espo.model import config as model_config
from espo.rewards import model_rewards, reward_model

SCHEDULES = ("cosine", "constant")
OLD_LOGPS = ("recompute", "sampler")


ConfigError = errors.ConfigError  # the error every section raises, naming its --config key
check, _is_int, _is_num = errors.check, errors.is_int, errors.is_real


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The RL loop: batch sizes, epochs, router replay and where pi_old comes from."""

    steps: int
    prompts_per_step: int
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # rows per optimiser update; 0 = the whole batch
    micro_batch_size: int = 64  # rows per forward / backward
    packing: bool = False  # packed updates: micro-batches of max_tokens_per_micro_batch tokens
    max_tokens_per_micro_batch: int = 4096  # token budget of a packed micro-batch (train.packing)
    router_replay: bool = True
    old_logps: str = "recompute"
    espo_entropy: str = "old"
    rl_zvp_entropy: str = "current"
    log_every: int = 1

    def __post_init__(self):
        check(
            self,
            {
                "steps": (_is_int(self.steps) and self.steps >= 0, "an int >= 0"),
                "prompts_per_step": (
                    _is_int(self.prompts_per_step) and self.prompts_per_step >= 1,
                    "an int >= 1",
                ),
                "ppo_epochs": (_is_int(self.ppo_epochs) and self.ppo_epochs >= 1, "an int >= 1"),
                "mini_batch_size": (
                    _is_int(self.mini_batch_size) and self.mini_batch_size >= 0,
                    "an int >= 0 (0: the whole batch)",
                ),
                "micro_batch_size": (
                    _is_int(self.micro_batch_size) and self.micro_batch_size >= 1,
                    "an int >= 1",
                ),
                "packing": (isinstance(self.packing, bool), "True or False"),
                "max_tokens_per_micro_batch": (
                    _is_int(self.max_tokens_per_micro_batch)
                    and self.max_tokens_per_micro_batch >= 1,
                    "an int >= 1",
                ),
                "router_replay": (isinstance(self.router_replay, bool), "True or False"),
                "old_logps": (self.old_logps in OLD_LOGPS, f"one of {OLD_LOGPS}"),
                "log_every": (_is_int(self.log_every) and self.log_every >= 1, "an int >= 1"),
            },
        )

    def batch_rows(self, max_group_size: int) -> tuple[int, int, int]:
        """(rows, mini-batch rows, micro-batch rows) of the fixed-shape optimiser batch."""
        rows = self.prompts_per_step * max_group_size
        mini = self.mini_batch_size or rows
        micro = min(self.micro_batch_size, mini)
        rows = -(-rows // mini) * mini  # pad the batch up to whole mini-batches
        if mini % micro:
            raise errors.InvalidValue(
                "TrainConfig", "micro_batch_size", self.micro_batch_size,
                f"a divisor of the mini-batch ({mini} rows)",
            )  # fmt: skip
        return rows, mini, micro


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """optax AdamW with linear warmup then cosine (or constant), global-norm clipped."""

    learning_rate: float
    warmup_steps: int = 0
    schedule: str = "cosine"
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    def __post_init__(self):
        check(
            self,
            {
                "learning_rate": (_is_num(self.learning_rate) and self.learning_rate > 0, "> 0"),
                "warmup_steps": (_is_int(self.warmup_steps) and self.warmup_steps >= 0, ">= 0"),
                "schedule": (self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
                "end_lr_ratio": (
                    _is_num(self.end_lr_ratio) and 0 <= self.end_lr_ratio <= 1,
                    "[0, 1]",
                ),
                "weight_decay": (_is_num(self.weight_decay) and self.weight_decay >= 0, ">= 0"),
                "b1": (_is_num(self.b1) and 0 <= self.b1 < 1, "[0, 1)"),
                "b2": (_is_num(self.b2) and 0 <= self.b2 < 1, "[0, 1)"),
                "eps": (_is_num(self.eps) and self.eps > 0, "> 0"),
                "max_grad_norm": (_is_num(self.max_grad_norm) and self.max_grad_norm >= 0, ">= 0"),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftConfig:
    """The supervised warm start: token NLL on task demonstrations."""

    steps: int = 0
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    packing: bool = False  # demonstrations packed end to end (espo.sft.packed_batch)

    def __post_init__(self):
        check(
            self,
            {
                "steps": (_is_int(self.steps) and self.steps >= 0, "an int >= 0"),
                "packing": (isinstance(self.packing, bool), "True or False"),
                "batch_size": (_is_int(self.batch_size) and self.batch_size >= 1, "an int >= 1"),
                "learning_rate": (_is_num(self.learning_rate) and self.learning_rate > 0, "> 0"),
                "warmup_steps": (_is_int(self.warmup_steps) and self.warmup_steps >= 0, ">= 0"),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Sampling settings and scheduling of the rollout engine (the `rollout` section)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    fp8: bool = True
    dtype: str = ""  # sampler activation / matmul dtype; "" = the model's
    max_chunk_size: int = 64
    schedule: str = "length_aware"
    overlap_rewards: bool = True  # score finished samples while later chunks decode
    detokenize: str = "workers"  # where completions are detokenized: workers | host (serial)
    reward_workers: int = 2
    reward_timeout_s: float = 10.0

    def __post_init__(self):
        check(
            self,
            {
                "temperature": (_is_num(self.temperature) and self.temperature >= 0, ">= 0"),
                "top_p": (_is_num(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
                "top_k": (_is_int(self.top_k) and self.top_k >= 0, "an int >= 0"),
                "fp8": (isinstance(self.fp8, bool), "True or False"),
                "dtype": (self.dtype in ("", "float32", "bfloat16", "float16"),
                          "'' (the model's), float32, bfloat16 or float16"),
                "max_chunk_size": (_is_int(self.max_chunk_size) and self.max_chunk_size >= 1,
                                   "an int >= 1"),
                "schedule": (self.schedule in ("length_aware", "fifo"), "length_aware or fifo"),
                "overlap_rewards": (isinstance(self.overlap_rewards, bool), "True or False"),
                "detokenize": (self.detokenize in ("workers", "host"), "workers or host"),
                "reward_workers": (_is_int(self.reward_workers) and self.reward_workers >= 1,
                                   "an int >= 1"),
                "reward_timeout_s": (_is_num(self.reward_timeout_s) and self.reward_timeout_s > 0,
                                     "> 0"),
            },
        )  # fmt: skip


# How a reward model's scores become rewards: the modes espo.rewards.model_rewards defines.
REWARD_MODEL_MODES = model_rewards.MODES


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Reward shaping weights (L_max of the overlong penalty is the stage's max_new_tokens)."""

    overlong_weight: float = 1.0
    overlong_cache_fraction: float = 0.5
    repetition_weight: float = 0.0
    ngram_size: int = 4
    repetition_threshold: float = 0.0
    function: str = ""  # "module:name" of a reward fn(prompt, completion, meta) -> float
    model_path: str = ""  # a saved reward model (espo.rewards.model_rewards) scoring rollouts
    model_mode: str = "adjusted"  # how its scores become rewards: naive | adjusted | judge
    # RM score gaps below it are ties (adjusted, judge)
    model_dead_zone: float = reward_model.DEFAULT_DEAD_ZONE
    # A control: the rewards of each rollout call permuted over its rows (a policy that learns
    # from them learns from something other than the reward); metrics keep the true rewards.
    shuffle: bool = False

    def __post_init__(self):
        frac = self.overlong_cache_fraction
        dz = self.model_dead_zone
        spec = re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.function or "x:y")
        check(
            self,
            {
                "overlong_cache_fraction": (_is_num(frac) and 0 < frac <= 1, "in (0, 1]"),
                "function": (
                    isinstance(self.function, str) and spec is not None,
                    "'' (the data source's verifier) or 'module:name'",
                ),
                "model_path": (isinstance(self.model_path, str), "a directory or ''"),
                "model_mode": (
                    self.model_mode in REWARD_MODEL_MODES,
                    " | ".join(REWARD_MODEL_MODES),
                ),
                "model_dead_zone": (_is_num(dz) and dz >= 0, ">= 0"),
                "shuffle": (isinstance(self.shuffle, bool), "True or False"),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSchedule:
    """When and on how many held-out prompts the trainer evaluates."""

    every_steps: int = 0
    num_prompts: int = 256
    split: str = "test"  # half of the held-out set: test (report) | dev (tune)

    def __post_init__(self):
        check(
            self,
            {
                "every_steps": (_is_int(self.every_steps) and self.every_steps >= 0, ">= 0"),
                "num_prompts": (_is_int(self.num_prompts) and self.num_prompts >= 1, ">= 1"),
                "split": (self.split in sources.EVAL_SPLITS, " | ".join(sources.EVAL_SPLITS)),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 25
    keep: int = 2

    def __post_init__(self):
        check(
            self,
            {
                "every_steps": (_is_int(self.every_steps) and self.every_steps >= 1, ">= 1"),
                "keep": (_is_int(self.keep) and self.keep >= 1, ">= 1"),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes (`espo.sharding.make_mesh`); their product is the device count."""

    data: int = -1  # data parallelism; -1 = the devices the other axes leave
    fsdp: int = 1  # parameters and optimizer state sharded along the model dimension
    expert: int = 1  # experts split over devices

    def __post_init__(self):
        valid = "an int >= 1, or -1 (the devices the other axes leave)"
        ok = lambda x: _is_int(x) and (x >= 1 or x == -1)
        check(self, {f: (ok(getattr(self, f)), valid) for f in ("data", "fsdp", "expert")})
        rest = [f for f in ("data", "fsdp", "expert") if getattr(self, f) == -1]
        if len(rest) > 1:
            raise errors.InvalidValue("MeshConfig", rest[1], -1, f"at most one axis -1 ({rest[0]})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """`jax.distributed.initialize` arguments: an empty coordinator = one process, or what the
    environment says (JAX_COORDINATOR_ADDRESS; TPU pod slices and SLURM / Open MPI)."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        n = self.num_processes
        check(
            self,
            {
                "coordinator": (isinstance(self.coordinator, str), "a 'host:port' string"),
                "num_processes": (_is_int(n) and n >= 1, "an int >= 1"),
                "process_id": (
                    _is_int(self.process_id) and 0 <= self.process_id < max(n, 1),
                    f"an int in [0, num_processes={n})",
                ),
            },
        )


def build(cls, section: Mapping[str, Any] | ml_collections.ConfigDict, key: str, **extra):
    """`cls(**section, **extra)`; an InvalidValue comes out as a ConfigError of `--config.<key>`."""
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
    rollout: RolloutConfig
    train: TrainConfig
    optimizer: OptimizerConfig
    sft: SftConfig
    curriculum: curriculum.Curriculum
    eval: evaluate.EvalConfig
    eval_schedule: EvalSchedule
    checkpoint: CheckpointConfig
    loss: dict  # LossConfig fields; the LossConfig needs the model's vocab size (see loss_config)
    advantage: advantages.AdvantageConfig
    zve: zero_variance.ZveConfig
    reward: RewardConfig
    mesh: MeshConfig
    distributed: DistributedConfig

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
        if not (_is_int(max_prompt_length) and max_prompt_length >= 1):
            raise ConfigError(
                "--config.data", "max_prompt_length", max_prompt_length, "an int >= 1"
            )
        stages = [dict(s) for s in c.curriculum.stages]
        try:
            curr = curriculum.Curriculum.from_config(stages)
        except errors.InvalidValue as e:
            raise e.moved(f"--config.{e.where}", ConfigError) from None
        ev = dict(c.eval.to_dict())
        schedule = build(
            EvalSchedule,
            dict(
                every_steps=ev.pop("every_steps"),
                num_prompts=ev.pop("num_prompts"),
                **({"split": ev.pop("split")} if "split" in ev else {}),
            ),
            "eval",
        )
        if schedule.split == "dev" and data.get("eval_path"):
            raise ConfigError(
                "--config.eval", "split", "dev",
                "'test' with data.eval_path: that file is the test set, whole; the dev half is "
                "cut from a held-out set split by data.eval_fraction",
            )  # fmt: skip
        train = build(TrainConfig, c.train, "train")
        longest = max_prompt_length + curr.max_new_tokens
        if train.packing and train.max_tokens_per_micro_batch < longest:
            raise ConfigError(
                "--config.train", "max_tokens_per_micro_batch", train.max_tokens_per_micro_batch,
                f">= data.max_prompt_length + the largest max_new_tokens ({longest}) with "
                "train.packing (a packed micro-batch holds whole sequences)",
            )  # fmt: skip
        loss = dict(c.loss.to_dict())
        build(losses.LossConfig, loss, "loss", vocab_size=model.get("vocab_size") or 2)
        adv = dict(c.advantage.to_dict(), rl_zvp=c.zve.mode == "rl_zvp")
        return cls(
            seed=c.seed,
            workdir=c.workdir,
            hf_path=hf_path,
            init_from=init_from,
            model=None if hf_path else build(model_config.ModelConfig, model, "model"),
            # The data's own seed (data.seed; the run's seed when the config has none): the
            # examples and the held-out set stay the same when the run's seed changes.
            data=build(data_examples.DataConfig, {"seed": c.seed, **data}, "data"),
            max_prompt_length=max_prompt_length,
            rollout=build(RolloutConfig, c.rollout, "rollout"),
            train=train,
            optimizer=build(OptimizerConfig, c.optimizer, "optimizer"),
            sft=build(SftConfig, c.sft, "sft"),
            curriculum=curr,
            eval=build(evaluate.EvalConfig, ev, "eval", max_new_tokens=curr.max_new_tokens),
            eval_schedule=schedule,
            checkpoint=build(CheckpointConfig, c.checkpoint, "checkpoint"),
            loss=loss,
            advantage=build(advantages.AdvantageConfig, adv, "advantage"),
            zve=build(zero_variance.ZveConfig, c.zve, "zve"),
            reward=build(RewardConfig, c.reward, "reward"),
            mesh=build(MeshConfig, c.get("mesh") or {}, "mesh"),
            distributed=build(DistributedConfig, c.get("distributed") or {}, "distributed"),
        )

    def loss_config(self, vocab_size: int) -> losses.LossConfig:
        return build(losses.LossConfig, self.loss, "loss", vocab_size=vocab_size)
