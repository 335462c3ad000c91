"""`train(config, workdir)`: the whole RL run in one readable file (in the style of big_vision).

Sections: settings -> model and tokenizer -> data -> jitted steps -> resume or warm start ->
the loop (curriculum stage -> prompts, pre-filtered -> adaptive G -> FP8 rollout with
length-aware scheduling and overlapped rewards -> shaping -> zero-variance elimination ->
old log-probs with router replay and advantages -> ppo_epochs of mini-batch updates -> metrics ->
eval -> checkpoint) -> export and summary.

Exactness: everything a step depends on is either in the checkpoint (params, optimizer state,
the data iterator, the curriculum, the pass-rate history, the length predictor, the resample
buffer of carried-over groups with their rollout arrays) or a pure
function of (seed, step): the step's keys are `fold_in(key(seed), step)`. So a rerun of the same
command after a kill -9 restores the newest checkpoint, truncates metrics.jsonl back to it, and
continues exactly as an uninterrupted run (test_trainer checks it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import pathlib
import shutil
import time
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import logging

from espo import (
    batching,
    checkpoint,
    curriculum,
    errors,
    evaluate,
    generation,
    metrics,
    packing,
    quant,
    scheduling,
    sft,
    sharding,
    train_step,
    zero_variance,
)
from espo import config as config_lib
from espo import model as model_lib
from espo.data import examples as examples_lib
from espo.data import sources
from espo.data import stream as stream_lib
from espo.data import tokenizer as tokenizer_lib
from espo.rewards import pool as pool_lib

HOST_FORMAT = "espo.trainer.v2"  # v2: + the resample buffer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def initial_model(
    s: config_lib.Settings, key, *, mesh: jax.sharding.Mesh | None = None
) -> tuple[model_lib.ModelConfig, dict]:
    """The model a run of settings `s` starts from: a Hugging Face checkpoint (`model.hf_path`),
    an espo run's newest params (`model.init_from`), or a random init from `key`.

    With `mesh`, a checkpoint is read straight into the run's parameter shardings
    (`sharding.param_shardings`, as `state_shardings` places them): each process reads only
    the slices its devices hold, never the whole checkpoint."""
    if s.hf_path:  # the architecture from the checkpoint, how to compute it from the run
        shardings = None
        if mesh is not None:
            shardings = lambda cfg: sharding.param_shardings(mesh, model_lib.param_shapes(cfg))
        cfg, params = model_lib.load_hf_checkpoint(s.hf_path, shardings=shardings)
        return cfg.replace(**s.compute), params
    if s.init_from:
        return s.model, params_of_run(s.init_from, s.model)
    return s.model, model_lib.init(s.model, key)


def params_of_run(workdir: str, model_cfg) -> dict:
    """The params of the newest checkpoint of the espo run in `workdir` (read only), e.g. one
    warm start shared by the arms of an experiment; its model config must equal this run's."""
    directory = pathlib.Path(workdir) / "checkpoints"
    if not directory.is_dir():
        raise config_lib.ConfigError(
            "--config.model", "init_from", workdir, f"an espo workdir (no {directory})"
        )
    with checkpoint.Checkpointer(directory, every_steps=1, keep=1, read_only=True) as ckpt:
        if ckpt.latest_step() is None:
            valid = f"a workdir with a checkpoint (none in {directory})"
            raise config_lib.ConfigError("--config.model", "init_from", workdir, valid)
        params, host = ckpt.restore_params()
    _check_model_config(host["model_config"], model_cfg)
    return params


def reward_fn_of(s: config_lib.Settings):
    """reward.function ("module:name", e.g. your own verifier), else the data source's."""
    if s.reward.function:
        module, _, name = s.reward.function.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise config_lib.ConfigError(
                "--config.reward", "function", s.reward.function,
                f"a picklable fn(prompt, completion, meta) -> float at module level of an "
                f"importable module ({e})",
            ) from None  # fmt: skip
    if s.data.source == "chains":
        from espo.data import chains

        return chains.ChainReward()
    if s.data.source == "reasoning_gym":
        from espo.rewards import gym

        return gym.ReasoningGymReward(last_line=s.data.worked_solutions)
    from espo.rewards import math as math_reward

    return math_reward.MathReward()


def held_out_examples(
    s: config_lib.Settings,
    eval_src,
    prompt_tokens,
    *,
    split: str | None = None,
    num_prompts: int | None = None,
) -> list[examples_lib.Example]:
    """The held-out examples a run evaluates, in order: the first eval.num_prompts distinct
    prompts (`sources.eval_subset`) of eval.split (test: report; dev: tune; a held-out file of
    the user's, data.eval_path, is the test set whole) whose `prompt_tokens(example)` fit
    data.max_prompt_length and whose level is at least eval.min_difficulty. `split` /
    `num_prompts` replace eval.split / eval.num_prompts."""
    split = s.eval.split if split is None else split
    floor = s.eval.min_difficulty
    return sources.eval_subset(
        eval_src,
        s.eval.num_prompts if num_prompts is None else num_prompts,
        keep=lambda e: (
            prompt_tokens(e) <= s.max_prompt_length
            and (s.data.eval_path or sources.eval_split_of(e.prompt) == split)
            and (floor == 0 or e.difficulty >= floor)  # NaN (no level) is not >= floor
        ),
    )


def _reward_model(s: config_lib.Settings, tok):
    """reward.model_path: the reward-model stage of the rollouts (None without one), loaded and
    checked against the tokenizer at start."""
    if not s.reward.model_path:
        return None
    from espo.rewards import model_rewards

    r = s.reward
    try:
        rm = model_rewards.RewardModelRewards.load(
            r.model_path, mode=r.model_mode, dead_zone=r.model_dead_zone
        )
        tokenizer_lib.check_vocab(tok, rm.cfg.vocab_size)
    except (OSError, ValueError) as e:
        valid = f"a reward model saved by model_rewards.save ({e})"
        raise config_lib.ConfigError("--config.reward", "model_path", r.model_path, valid) from None
    return rm


def sampler_model_config(s: config_lib.Settings, model_cfg):
    """The rollout engine's model: activations in rollout.dtype, its experts split over the
    mesh axes of rollout.param_layout (`sharding.EXPERT_AXES`; the training ones otherwise)."""
    layout = s.rollout.param_layout
    return dataclasses.replace(
        model_cfg,
        dtype=s.rollout.dtype or model_cfg.dtype,
        expert_axes=sharding.EXPERT_AXES.get(layout, model_cfg.expert_axes),
    )


def rollout_converts(s: config_lib.Settings) -> bool:
    """Does the sampler decode from its own copy of the weights (FP8, or another layout)? If
    not, it reads the training params themselves (rollout.offload_state keeps them on the
    device)."""
    return s.rollout.fp8 or s.rollout.param_layout != "training"


def _rollout_params(s: config_lib.Settings, mesh, abstract_params, *, dtype: str):
    """params -> the sampler's weights, once a step: FP8 with `rollout.fp8`, in the rollout's
    own layout with a `rollout.param_layout` other than "training"
    (`sharding.rollout_rules`); the identity when neither applies."""
    if not rollout_converts(s):
        return lambda p: p
    layout = None
    if s.rollout.param_layout != "training":
        rules = sharding.rollout_rules(s.rollout.param_layout)
        layout = sharding.param_shardings(mesh, abstract_params, rules)
    return _jit(_to_rollout, s.rollout.fp8, dtype, layout)


def _to_rollout(fp8: bool, dtype: str, layout, params):
    if layout is not None:  # gathered here, once, instead of at every decode step
        params = jax.lax.with_sharding_constraint(params, layout)
    return quant.quantize_fp8(params, keep_dtype=dtype) if fp8 else params


def _history(s: config_lib.Settings, train_src) -> zero_variance.PassRateHistory:
    """A fresh run's pass-rate history: empty, or zve.pass_rate_table's offline pass rates (a
    table of this run's training prompts, scored at its advantage.success_threshold)."""
    path, threshold = s.zve.pass_rate_table, s.advantage.success_threshold
    if not path:
        return zero_variance.PassRateHistory(success_threshold=threshold)
    bad = lambda valid: config_lib.ConfigError("--config.zve", "pass_rate_table", path, valid)
    try:
        table = zero_variance.PassRateTable.load(path)
    except (OSError, ValueError, TypeError) as e:
        raise bad(f"a pass-rate table written by experiments/pass_rates.py ({e})") from None
    if table.success_threshold != threshold:
        raise bad(
            f"a table scored at advantage.success_threshold={threshold} (this one: "
            f"{table.success_threshold})"
        )
    if not any(train_src[i].id in table.pass_rates for i in range(len(train_src))):
        raise bad(f"a table of this run's training prompts (none of its {len(table.pass_rates)})")
    return zero_variance.PassRateHistory.from_table(table)


@dataclasses.dataclass
class _Host:
    """The host-side state of a run (JSON, the buffer's arrays encoded exactly; checkpointed
    beside the device arrays)."""

    stream: stream_lib.PromptStream
    curriculum: curriculum.CurriculumState
    history: zero_variance.PassRateHistory
    predictor: scheduling.LengthPredictor
    buffer: zero_variance.Groups  # resample leftovers (zve.max_carry_over_steps > 0), with rows
    start_eval: dict

    def state_dict(self, model_cfg) -> dict:
        return dict(
            format=HOST_FORMAT,
            model_config=_model_dict(model_cfg),
            stream=self.stream.state_dict(),
            curriculum=self.curriculum.state_dict(),
            history=self.history.state_dict(),
            predictor=self.predictor.state_dict(),
            buffer=checkpoint.arrays_to_json(self.buffer.state_dict()),
            start_eval=self.start_eval,
        )

    def load(self, d: dict) -> None:
        if d.get("format") != HOST_FORMAT:
            raise checkpoint.CheckpointMismatchError(
                "host state", "format", d.get("format"),
                f"{HOST_FORMAT!r}, what this trainer reads; start a fresh run in another workdir",
            )  # fmt: skip
        self.stream.load_state_dict(d["stream"])
        self.curriculum = curriculum.CurriculumState.from_state_dict(d["curriculum"])
        self.history = zero_variance.PassRateHistory.from_state_dict(d["history"])
        self.predictor = scheduling.LengthPredictor.from_state_dict(d["predictor"])
        self.buffer = zero_variance.Groups.from_state_dict(checkpoint.arrays_from_json(d["buffer"]))
        self.start_eval = d["start_eval"]


def _check_routes(step: int, metrics: dict) -> None:
    """Router replay is strict: a real token with no recorded expert to replay is an error."""
    if metrics.get("mismatch/unrecorded_routes"):
        raise RuntimeError(
            f"step {step}: {metrics['mismatch/unrecorded_routes']} tokens had no recorded "
            "expert to replay"
        )


def _model_dict(model_cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(model_cfg), default=str))


def _check_model_config(saved: dict, model_cfg) -> None:
    """`checkpoint.check_model_config` of a checkpoint's model config against this run's; a
    field added to ModelConfig since the checkpoint was written matches at its default."""
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(model_cfg)
        if f.default is not dataclasses.MISSING
    }
    checkpoint.check_model_config(saved, _model_dict(model_cfg), defaults)


def _jit(fn, *args, donate_argnums: tuple = (), out_shardings=None):
    """`jax.jit(functools.partial(fn, *args), ...)`, one jit object per distinct (fn, args,
    donation, output placement) in this process: a later run with the same settings (a notebook
    training again, a sweep, the test suite's many runs) reuses its traced and compiled program
    instead of tracing and lowering it again. `args` and `out_shardings` are keyed by their
    pytree leaves and structure, so the leaves must hash (configs are frozen dataclasses,
    `train_step.make_optimizer` returns one object per settings, placements' dicts flatten to
    shardings)."""
    leaves, tree = jax.tree.flatten((args, out_shardings))
    return _jitted(fn, tuple(leaves), tree, tuple(donate_argnums))


@functools.lru_cache(maxsize=16)
def _jitted(fn, leaves, tree, donate_argnums):
    args, out_shardings = jax.tree.unflatten(tree, leaves)
    return jax.jit(
        functools.partial(fn, *args), donate_argnums=donate_argnums, out_shardings=out_shardings
    )


def step_config(s: config_lib.Settings, model_cfg, *, micro_batch_size: int, one_update=False):
    """The `train_step.StepConfig` of settings `s` for `model_cfg`; `one_update`: a step makes
    one optimiser update over its whole batch (pi_old is then that update's own forward)."""
    return train_step.StepConfig(
        model=model_cfg,
        loss=s.loss_config(model_cfg.vocab_size),
        advantage=s.advantage,
        entropy=train_step.EntropyConfig(espo=s.train.espo_entropy, rl_zvp=s.train.rl_zvp_entropy),
        num_groups=s.train.prompts_per_step,
        micro_batch_size=micro_batch_size,
        packing_budget=s.train.max_tokens_per_micro_batch if s.train.packing else None,
        router_replay=s.train.router_replay,
        old_logps=s.train.old_logps,
        temperature=s.rollout.temperature or 1.0,
        fused_old_logps=one_update and s.train.old_logps == "recompute",
        scan_layers=s.train.scan_layers,
        replay_counterfactual=s.train.replay_counterfactual,
    )


def train(config, workdir: str | None = None, *, progress: bool = True) -> dict:
    """Runs (or resumes) the RL run of `config`; returns the summary written to summary.json."""
    t_start = time.perf_counter()
    # ---- settings: every section validated before anything compiles --------------------------
    s = config_lib.Settings.from_config(config)
    initialize_distributed(s.distributed)
    # Everything traced inside runs on the mesh: MoE blocks split their experts over its
    # "expert" axis (`experts.expert_parallel_dispatch`), batches go along (data, fsdp, expert).
    mesh = sharding.make_mesh(**dataclasses.asdict(s.mesh))
    with jax.set_mesh(mesh):
        return _train(config, s, mesh, workdir, progress=progress, t_start=t_start)


def initialize_distributed(d: sharding.DistributedConfig) -> None:
    """`jax.distributed.initialize` once per process, before the first computation: from
    `config.distributed` when it names a coordinator, else from the environment when it has
    one (JAX_COORDINATOR_ADDRESS; TPU pod slices and SLURM / Open MPI are detected by JAX);
    nothing for one process. CPU devices of several processes talk through gloo."""
    env = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if jax.distributed.is_initialized() or not (d.coordinator or env):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if d.coordinator:
        jax.distributed.initialize(d.coordinator, d.num_processes, d.process_id)
    else:
        jax.distributed.initialize()


def _train(config, s, mesh, workdir, *, progress: bool, t_start: float) -> dict:
    workdir = pathlib.Path(workdir or s.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    main = jax.process_index() == 0  # the one process that writes logs, plots and exports
    progress = progress and main
    if main:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    root = jax.random.key(s.seed)

    # ---- model and tokenizer ------------------------------------------------------------------
    tok = tokenizer_lib.load_tokenizer(s.hf_path)
    model_cfg, params = initial_model(s, jax.random.fold_in(root, 0), mesh=mesh)
    tokenizer_lib.check_vocab(tok, model_cfg.vocab_size)
    loss_cfg = s.loss_config(model_cfg.vocab_size)
    handle = model_lib.Model(model_cfg)
    stop = dict(stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)

    # ---- data -----------------------------------------------------------------------------------
    try:
        train_src, eval_src = sources.make_sources(s.data)
    except errors.InvalidValue as e:  # a data setting (DataConfig / data): name its --config key
        if type(e) is not errors.InvalidValue:
            raise  # a malformed record (DataError) names its file and line
        key = "--config.data" + e.where.removeprefix("DataConfig").removeprefix("data")
        raise e.moved(key, errors.ConfigError) from None
    encoded: dict[str, list[int]] = {}
    encode = lambda e: encoded.setdefault(e.id, tok.encode_prompt(e.prompt))
    evals = held_out_examples(s, eval_src, lambda e: len(encode(e)))
    if not evals:
        raise ValueError(
            f"no held-out prompt of eval.split={s.eval.split!r} and level >= "
            f"eval.min_difficulty={s.eval.min_difficulty} fits "
            f"data.max_prompt_length={s.max_prompt_length}"
        )
    reward_fn = reward_fn_of(s)
    reward_model = _reward_model(s, tok)
    curr = s.curriculum
    max_g = max(max(st.group_size for st in curr.stages), s.zve.max_group_size)
    num_rows, mini_rows, micro_rows = s.train.batch_rows(max_g)
    widths = generation.buckets(s.max_prompt_length, curr.max_new_tokens)  # `batching.trim`'s
    Tp, Tg = s.max_prompt_length, widths.generation_bucket(curr.max_new_tokens)

    # ---- jitted steps: explicit shardings, donated state ----------------------------------------
    for rows, what in (
        (mini_rows, "train.mini_batch_size"),
        (micro_rows, "train.micro_batch_size"),
    ):
        sharding.check_batch(mesh, rows, what=f"--config.{what}")
    optimizer, lr_schedule = train_step.make_optimizer(
        total_steps=s.train.steps * s.train.ppo_epochs * (num_rows // mini_rows),
        **dataclasses.asdict(s.optimizer),
    )
    one_update = s.train.ppo_epochs == 1 and mini_rows == num_rows
    sc = step_config(s, model_cfg, micro_batch_size=micro_rows, one_update=one_update)
    rep = sharding.replicated(mesh)
    prepare = _jit(train_step.prepare, sc)
    # The rollout engine's model: activations in rollout.dtype (e.g. bfloat16 while training in
    # float32), weights in FP8 with rollout.fp8; the train-inference mismatch this makes is
    # measured by `prepare` (mismatch/*) and corrected by router replay and loss.rollout_is.
    sampler_handle = model_lib.Model(sampler_model_config(s, model_cfg))

    # ---- resume, or warm start ------------------------------------------------------------------
    # Resume order: 1. the newest checkpoint step; 2. its model config must match; 3. arrays
    # (params, optimizer state, step); 4. host state (data iterator, curriculum, pass-rate
    # history, length predictor, resample buffer, start eval); 5. metrics.jsonl truncated back
    # to that step.
    ckpt = checkpoint.Checkpointer(
        workdir / "checkpoints", every_steps=s.checkpoint.every_steps, keep=s.checkpoint.keep
    )
    host = _Host(
        stream=stream_lib.PromptStream(train_src, seed=s.seed),
        curriculum=curriculum.CurriculumState(),
        history=_history(s, train_src),  # a resume replaces it with the checkpoint's
        predictor=scheduling.LengthPredictor(),
        buffer=zero_variance.Groups.empty(),
        start_eval={},
    )
    make_state = lambda p: train_step.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=p,
        opt_state=optimizer.init(p),
        ref_params=p if loss_cfg.kl_coef > 0 else None,
    )
    # Params, reference params and optimizer state placed by espo.sharding's rules; `update`
    # returns the state where it found it (no resharding, no recompiles after step 1).
    abstract = jax.eval_shape(make_state, params)
    state_sharding = sharding.state_shardings(mesh, optimizer, abstract)
    update = _jit(
        train_step.train_step,
        sc,
        optimizer,
        donate_argnums=(0,),
        out_shardings=(state_sharding, rep),
    )
    rollout_params = _rollout_params(s, mesh, abstract.params, dtype=sampler_handle.cfg.dtype)
    parked = None  # rollout.offload_state: where the training state waits while it decodes
    if s.rollout.offload_state:
        sharding.check_host_memory("--config.rollout", "offload_state")
        parked = sharding.in_memory(state_sharding, sharding.HOST_MEMORY)

    def park(state, *, keep_params: bool):
        """rollout.offload_state: `state` to host memory, but for params the device still reads
        (`unpark` brings it back); the identity without it."""
        if parked is None:
            return state
        return jax.device_put(
            state, parked.replace(params=state_sharding.params) if keep_params else parked
        )

    unpark = lambda state: state if parked is None else jax.device_put(state, state_sharding)
    latest = ckpt.latest_step()
    evaluate_params = functools.partial(
        _evaluate, handle, evals=evals, encode=encode, reward_fn=reward_fn, tok=tok, s=s, stop=stop
    )

    def evaluate_now(state) -> tuple[dict, train_step.TrainState]:
        """The held-out eval of `state.params` (the same key every time), the optimiser's
        moments parked meanwhile."""
        state = park(state, keep_params=True)
        return evaluate_params(state.params, jax.random.fold_in(root, 1)), unpark(state)

    if latest is not None:
        # Restored straight into this run's shardings: a checkpoint of another mesh or process
        # count (orbax reshards) resumes here, and `update` finds the state where it leaves it.
        target = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            abstract,
            state_sharding,
        )
        state, saved = ckpt.restore(latest, abstract_state=target)
        _check_model_config(saved["model_config"], model_cfg)
        host.load(saved)
        start_step = latest
        logging.info("resumed from %s step %d", ckpt, latest)
    else:
        if s.sft.steps and not (s.hf_path or s.init_from):
            params = _warm_start(
                s, model_cfg, params, train_src, tok, encode, Tp, curr, progress=progress,
                reward_fn=reward_fn, mesh=mesh,
            )  # fmt: skip
        state = jax.jit(make_state, out_shardings=state_sharding)(params)  # created sharded
        host.start_eval, state = evaluate_now(state)
        start_step = 0
        ckpt.save(0, state=state, host=host.state_dict(model_cfg), force=True)
    del params  # the state holds the run's params from here: no second copy on the devices
    if main:
        metrics.truncate_jsonl(workdir / "metrics.jsonl", last_step=start_step)
    log = metrics.MetricsLogger(
        workdir, total_steps=s.train.steps, start_step=start_step, progress=progress,
        is_main_process=main,
    )  # fmt: skip
    if latest is None:
        log.write(0, host.start_eval)

    # ---- the loop -------------------------------------------------------------------------------
    pool = pool_lib.RewardPool(
        reward_fn,
        num_workers=s.rollout.reward_workers,
        timeout_s=s.rollout.reward_timeout_s,
        detokenize=tok.decode,
    )
    timer, compiles = metrics.PhaseTimer(), metrics.CompileCounter()
    final_eval = host.start_eval
    if 0 < start_step == s.train.steps:  # a finished run rerun: its final eval (same key) again
        final_eval, state = evaluate_now(state)
    try:
        for step in range(start_step, s.train.steps):
            timer.reset()
            t0 = time.perf_counter()
            key = jax.random.fold_in(jax.random.fold_in(root, 2), step)
            stage = curr.stage(host.curriculum)
            with timer.phase("rollout"):
                params_r = rollout_params(state.params)
                state = park(state, keep_params=not rollout_converts(s))
                gen = generation.Generator(
                    s=s, stage=stage, handle=sampler_handle, params=params_r, pool=pool,
                    host=host, encode=encode, stop=stop, key=key, Tp=Tp, Tg=Tg,
                    reward_model=reward_model,
                )  # fmt: skip
                zcfg = dataclasses.replace(
                    s.zve,
                    group_size=stage.group_size,
                    max_group_size=max(stage.group_size, s.zve.max_group_size),
                )
                fill = zero_variance.fill_batch(
                    prompts=_prompts(s, curr, host, encode, stage_seed=step),
                    generate=gen,
                    batch_size=s.train.prompts_per_step,
                    group_size=functools.partial(_group_sizes, zcfg, host.history),
                    config=zcfg,
                    buffer=host.buffer,
                    history=host.history,
                )
                host.buffer = fill.buffer
                del params_r  # the sampler's weights are freed before pi_old and the update
                gen.params = None
                state = unpark(state)
            if not fill.batch.num_groups:
                raise RuntimeError(
                    f"step {step}: no group for the batch of stage {stage.name!r}: data "
                    "exhausted, every prompt pre-filtered, or (zve.mode='resample') no "
                    f"informative group in 1 + max_resample_rounds calls; metrics {fill.metrics}"
                )
            with timer.phase("old_logps"):
                batch = batching.make_train_batch(fill.batch, num_rows=num_rows, pad_id=tok.pad_id)
                batch = batching.trim(batch, prompt_length=Tp, buckets=widths)
                layout, host_mask = None, batch.attention_mask  # host arrays, every process
                if sc.packing_budget:  # planned on the host: a bounded set of packed shapes
                    layout = packing.layout(host_mask, budget=sc.packing_budget)
                batch = sharding.put_batch(batch, mesh)
                batch, prep = prepare(state.params, state.ref_params, batch, layout)
                prep = jax.device_get(prep)
            _check_routes(step, prep)
            with timer.phase("update"):
                step_metrics = []
                for mini in batching.minibatches(
                    batch, mini_batch_size=mini_rows, micro_batch_size=micro_rows,
                    epochs=s.train.ppo_epochs, key=jax.random.fold_in(key, 1),
                    packing_budget=sc.packing_budget, host_attention_mask=host_mask,
                ):  # fmt: skip
                    state, m = update(state, mini)
                    step_metrics.append(m)
                step_metrics = jax.device_get(step_metrics)
            out = {k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]}
            _check_routes(step, out)  # one update over the batch: pi_old's forward was its own
            out.update({k: float(v) for k, v in prep.items()})
            out.update(fill.metrics)
            out.update(gen.metrics(fill.batch))
            out.update(host.stream.metrics())  # epochs drawn, draws the filters rejected
            out["zve/zvp_rate"] = out.get("zve/rollout_zvp_rate", 0.0)
            out["optim/lr"] = float(lr_schedule(int(state.step) - 1))
            metrics.check_finite(step + 1, out, ["loss/loss", "optim/grad_norm"])
            host.curriculum, cm = curr.update(host.curriculum, train_accuracy=out["train/accuracy"])
            out.update(cm)
            done = step + 1
            if done == s.train.steps or (s.eval.every_steps and done % s.eval.every_steps == 0):
                with timer.phase("eval"):
                    final_eval, state = evaluate_now(state)
                out.update(final_eval)
            if ckpt.should_save(done) or done == s.train.steps:
                with timer.phase("checkpoint"):
                    ckpt.save(done, state=state, host=host.state_dict(model_cfg), force=True)
            out.update(timer.metrics())
            out["perf/step_s"] = time.perf_counter() - t0
            out["perf/compiles"] = float(compiles.take())  # 0 after the first step
            out["perf/tokens_per_s"] = out.get("train/generated_tokens", 0.0) / out["perf/step_s"]
            if done % s.train.log_every == 0 or done == s.train.steps or "eval/pass@1" in out:
                log.write(done, out)  # every log_every steps, every eval step and the last
    finally:
        pool.close()
        log.close()
        ckpt.close()
    wall_s = time.perf_counter() - t_start
    return _finish(s, workdir, host, final_eval, handle, state, tok, wall_s, rep)


def _group_sizes(zcfg, history, exs) -> np.ndarray:
    """Adaptive G of each prompt from its online pass rate (group_size when unknown)."""
    return zcfg.group_sizes(history.pass_rates([e.id for e in exs]))


def _prompts(s, curr, host: _Host, encode, *, stage_seed: int) -> Iterator[examples_lib.Example]:
    """Training prompts of the current stage, pre-filtered on the online pass-rate history."""
    z = s.zve

    def accept(e: examples_lib.Example) -> bool:
        if len(encode(e)) > s.max_prompt_length:
            return False
        rate = float(host.history.pass_rates([e.id])[0])
        known = not np.isnan(rate)
        if not curr.accepts(host.curriculum, e.difficulty, rate if known else None):
            return False
        low, high = z.prefilter_low, z.prefilter_high
        if z.prefilter == "off" or not zero_variance.predicted_zero_variance(
            rate, low=low, high=high
        ):
            return True
        if z.prefilter == "drop":
            return False
        u = zlib.crc32(f"{e.id}:{stage_seed}".encode()) / 2**32  # deterministic coin
        return u < z.prefilter_downweight

    while True:
        got = host.stream.take(1, accept=accept)
        if not got:
            return
        yield got[0]


def verified(s: config_lib.Settings, reward_fn):
    """`sft.verified_only`'s test of an example: its demonstration's reward (`reward_fn`, the
    verifier RL scores rollouts with) > advantage.success_threshold; None when every
    demonstration is kept."""
    if not s.sft.verified_only:
        return None
    threshold = s.advantage.success_threshold
    return lambda e: reward_fn(e.prompt, e.demonstration or e.answer, e.meta) > threshold


def _warm_start(
    s, model_cfg, params, train_src, tok, encode, Tp, curr, *, progress: bool, mesh,
    reward_fn=None,
):  # fmt: skip
    """`sft.steps` of token NLL on demonstrations drawn from every level (its own stream); with
    `sft.verified_only`, only those `reward_fn` accepts (`verified`). The params and Adam's
    moments are placed by the run's rules (`sharding.state_shardings`) and every step returns
    them there: the step compiles once (params left where the init put them, replicated, came
    back from the first step expert-sharded: a second compile), and no device holds more of the
    model than in the RL steps."""
    stream = stream_lib.PromptStream(train_src, seed=s.seed + 1)
    opt, _ = train_step.make_optimizer(
        learning_rate=s.sft.learning_rate, total_steps=s.sft.steps, warmup_steps=s.sft.warmup_steps
    )
    abstract = jax.eval_shape(
        lambda p: train_step.TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p)
        ),
        params,
    )
    where = sharding.state_shardings(mesh, opt, abstract)
    params, opt_state = jax.jit(
        lambda p: (p, opt.init(p)), out_shardings=(where.params, where.opt_state)
    )(params)
    step = _jit(
        sft.sft_step, model_cfg, opt, donate_argnums=(0, 1),
        out_shardings=(where.params, where.opt_state, sharding.replicated(mesh)),
    )  # fmt: skip
    width = curr.max_new_tokens
    target = lambda e: tok.encode_completion(e.demonstration or e.answer)
    accepted = verified(s, reward_fn or reward_fn_of(s)) or (lambda e: True)
    fits = lambda e: len(encode(e)) <= Tp and len(target(e)) <= width and accepted(e)
    bar = tqdm.tqdm(total=s.sft.steps, desc="warm start (SFT)", disable=not progress)
    for _ in range(s.sft.steps):
        exs = stream.take(s.sft.batch_size, accept=fits)
        if not exs:
            raise ValueError(
                f"sft: no demonstration fits: prompts <= data.max_prompt_length={Tp} tokens and "
                f"demonstrations <= the curriculum's largest max_new_tokens={width} (with the stop "
                f"id) in {100 * s.sft.batch_size} draws"
                + (", and the verifier accepts (sft.verified_only)" if s.sft.verified_only else "")
                + "; raise them, or set sft.steps=0"
            )
        batch = sft.demonstration_batch(
            [encode(e) for e in exs], [target(e) for e in exs],
            prompt_length=Tp, completion_length=width, pad_id=tok.pad_id,
        )  # fmt: skip
        if s.sft.packing:
            batch = sft.packed_batch(batch)
        params, opt_state, loss = step(params, opt_state, batch)
        bar.update(1)
        bar.set_postfix(nll=f"{float(loss):.3f}")
    bar.close()
    return params


def _evaluate(handle, params, key, *, evals, encode, reward_fn, tok, s, stop) -> dict:
    hooks = {}
    if s.data.source == "chains":  # the task's process check and answer (maj@k)
        from espo.data import chains

        hooks = dict(process_fn=chains.process_faithful, answer_fn=chains.final_answer)
    return evaluate.evaluate(
        handle,
        params,
        prompts=[encode(e) for e in evals],
        metas=[e.meta for e in evals],
        prompt_texts=[e.prompt for e in evals],
        groups=[sources.group_of(e).split(":", 1)[-1] for e in evals],
        reward_fn=reward_fn,
        detokenize=tok.decode,
        key=key,
        cfg=s.eval,
        sampling_kw=stop,
        **hooks,
    )


def _finish(s, workdir, host, final_eval, handle, state, tok, wall_s, replicated) -> dict:
    """summary.json, plots, the Hugging Face export, and the before/after table."""
    from espo import plots

    summary = dict(start=host.start_eval, final=final_eval, steps=s.train.steps, wall_s=wall_s)
    # One process: the sharded params as they are (save_hf_checkpoint brings one layer slice at
    # a time to the host). Several: every process takes part in gathering them (sharded over all
    # of them); process 0 alone writes.
    params = None
    if s.hf_path and not (workdir / "export").exists():
        params = state.params
        if jax.process_count() > 1:
            params = jax.device_get(jax.jit(lambda p: p, out_shardings=replicated)(params))
    if jax.process_index() != 0:
        return summary
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_files = plots.plot_run(workdir)
    export = None
    if s.hf_path:
        export = workdir / "export"
        if params is not None:
            model_lib.save_hf_checkpoint(handle.cfg, params, export)
            for name in TOKENIZER_FILES:
                if (pathlib.Path(s.hf_path) / name).exists():
                    shutil.copy(pathlib.Path(s.hf_path) / name, export / name)
    rows = [(k, host.start_eval.get(k), final_eval.get(k)) for k in sorted(final_eval)]
    table = ["| metric | start | final |", "|---|---|---|"]
    table += [f"| {k} | {a:.3f} | {b:.3f} |" for k, a, b in rows if a is not None]
    print("\n".join(table))
    print(f"logs: {workdir / 'metrics.jsonl'}  tensorboard: {workdir / 'tensorboard'}")
    print(f"plots: {workdir / 'plots'} ({len(plot_files)} files)")
    print(f"checkpoints: {workdir / 'checkpoints'}")
    if export is not None:
        print(f"export (Hugging Face format): {export}")
    return summary
