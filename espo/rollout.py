"""`generate_and_score`: prompts -> G scored samples each, chunk by chunk, rewards overlapped.

One rollout step, one helper per stage:
  1. `_plan`: one `scheduling.Request` per sample; `plan_chunks` orders them by predicted length
     into chunks with bounded compiled shapes (or `plan_fifo`, the naive baseline);
  2. `_dispatch`: chunk i+1 is dispatched to the device (JAX dispatch is asynchronous) before
     chunk i is copied to the host, so the device keeps decoding while the host works;
  3. `_hand_off`: each finished sample (a stop id, or `max_new_tokens`) is handed to the
     `RewardPool` at once as token ids (`overlap_rewards=False`, the baseline: only after the
     last chunk decodes); the pool's workers detokenize and score it while later
     chunks decode, so detokenization is parallel and off the host's decode loop
     (`detokenize=` on the host is the serial alternative, for a pool without a detokenizer);
  4. rows that hit their chunk's budget without a stop id are continued from their prefix in
     the next wave (`continuation_plan`): the scheduler never truncates;
  5. `_assemble`: the length predictor learns this step's lengths, keyed by `prompt_ids` (stable
     ids from the data pipeline: a batch position is not a prompt, so a predictor needs them),
     and the rows become one `types.Rollout` plus texts and metrics.

Every chunk draws from its own key, `fold_in(key, chunk number)` (1, 2, ... in dispatch order):
samples of one prompt in different chunks at the same row are independent, and the same key
reproduces the rollout. With `num_shards` > 1 the plan assigns chunks to data-parallel shards by
LPT on their cost (`rollout/shard_imbalance` reports the realised max / mean load); this host
decodes them all. How to sample and schedule is one `RolloutSpec`.

The result is a `RolloutResult`: the `types.Rollout` (arrays only: sampler log-probs, entropies,
the router trace for replay, rewards with failed ones flagged in `reward_ok`), the completion
texts the reward function saw, and per-phase timings and scheduling metrics:
  rollout/{generate_s, host_handoff_s, reward_wait_s, total_s}: time to decode every chunk
    (hand-offs included), host time spent handing chunks off, time waiting on rewards after
    decoding, and the whole call; rollout/tokens_per_s = useful tokens / generate_s;
  rollout/new_compiles: sampler compilations during the call (0 after warm-up);
  rollout/truncated_fraction, rollout/mean_length: over the samples;
  rollout/* from `scheduling.schedule_metrics` (chunks, padding waste, shard imbalance, ...);
  reward/*: the reward pool's counters for this call (ok, errors, retries, ...).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from espo import errors, sampler, scheduling, sharding, types
from espo.model import config as config_lib
from espo.model import handle
from espo.rewards import pool as pool_lib

SCHEDULES = ("length_aware", "fifo")
PARAM_LAYOUTS = ("training", *sharding.EXPERT_AXES)  # the update's, or a rollout layout


_is_int = errors.is_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Sampling settings and scheduling of the rollout engine (the `rollout` section)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    fp8: bool = True
    dtype: str = ""  # sampler activation / matmul dtype; "" = the model's
    # The sampler's weights on the mesh: "training" = the update's layout (with fsdp > 1 every
    # decode step all-gathers every layer's weights); "experts" = experts over the expert axis,
    # everything else replicated; "experts_all" = experts over every mesh axis (expert
    # parallelism over all the devices: for experts too large for the expert axis alone), the
    # rest replicated (`sharding.rollout_rules`); resharded once a step, as verl reshards FSDP
    # weights for its rollout engine.
    param_layout: str = "training"
    # While the rollout decodes, the training state (params, the optimiser's moments, reference
    # params) waits in host memory (`sharding.HOST_MEMORY`), leaving the device to the sampler's
    # weights and KV cache; copied back before pi_old's forward (as verl's param_offload and
    # optimizer_offload free the GPU for vLLM). Costs two copies of the state over PCIe a step.
    offload_state: bool = False
    max_chunk_size: int = 64
    schedule: str = "length_aware"
    # length_aware: a re-prefilled position costs this many decode slot-steps (CPU ~1, GPU less);
    # a chunk ends below its rows' longest predicted length only when that saves more.
    prefill_cost: float = 1.0
    # decode steps between checks of the decode loop's condition (`sampler.sample_chunk`): on a
    # GPU each check is a device-to-host copy the next step waits for.
    steps_per_check: int = 1
    overlap_rewards: bool = True  # score finished samples while later chunks decode
    detokenize: str = "workers"  # where completions are detokenized: workers | host (serial)
    reward_workers: int = 2
    reward_timeout_s: float = 10.0

    def __post_init__(self):
        num, dtypes = errors.is_real, ("", "float32", "bfloat16", "float16")
        errors.check(
            self,
            {
                "temperature": (num(self.temperature) and self.temperature >= 0, ">= 0"),
                "top_p": (num(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
                "top_k": (_is_int(self.top_k) and self.top_k >= 0, "an int >= 0"),
                "fp8": (isinstance(self.fp8, bool), "True or False"),
                "dtype": (self.dtype in dtypes, "'' (the model's), float32, bfloat16 or float16"),
                "param_layout": (self.param_layout in PARAM_LAYOUTS, " | ".join(PARAM_LAYOUTS)),
                "offload_state": (isinstance(self.offload_state, bool), "True or False"),
                "max_chunk_size": (
                    _is_int(self.max_chunk_size) and self.max_chunk_size >= 1,
                    "an int >= 1",
                ),
                "schedule": (self.schedule in SCHEDULES, " | ".join(SCHEDULES)),
                "prefill_cost": (num(self.prefill_cost) and self.prefill_cost >= 0, ">= 0"),
                "steps_per_check": (
                    _is_int(self.steps_per_check) and self.steps_per_check >= 1,
                    "an int >= 1",
                ),
                "overlap_rewards": (isinstance(self.overlap_rewards, bool), "True or False"),
                "detokenize": (self.detokenize in ("workers", "host"), "workers or host"),
                "reward_workers": (
                    _is_int(self.reward_workers) and self.reward_workers >= 1,
                    "an int >= 1",
                ),
                "reward_timeout_s": (
                    num(self.reward_timeout_s) and self.reward_timeout_s > 0,
                    "> 0",
                ),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """How a rollout step samples and schedules: the one settings object of `generate_and_score`."""

    sampling: sampler.SamplingParams  # decoding settings, max_new_tokens, stop and pad ids
    buckets: scheduling.LengthBuckets  # compiled prompt / generation (/ batch) lengths
    max_chunk_size: int  # rows decoded together (before batch-bucket padding)
    schedule: str = "length_aware"  # "length_aware" (predicted length) or "fifo" (baseline)
    num_shards: int = 1  # data-parallel shards the plan balances chunks over (1 on one device)
    overlap_rewards: bool = True  # False: score after the last chunk decodes (the baseline)
    prefill_cost: float = 1.0  # a re-prefilled position in decode slot-steps (`plan_chunks`)
    steps_per_check: int = 1  # decode steps between loop-condition checks (`sample_chunk`)

    def __post_init__(self):
        checks = {
            "sampling": (
                isinstance(self.sampling, sampler.SamplingParams),
                "an espo.sampler.SamplingParams",
            ),
            "buckets": (
                isinstance(self.buckets, scheduling.LengthBuckets),
                "an espo.scheduling.LengthBuckets",
            ),
            "max_chunk_size": (
                _is_int(self.max_chunk_size) and self.max_chunk_size >= 1,
                "an int >= 1",
            ),
            "schedule": (self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
            "num_shards": (_is_int(self.num_shards) and self.num_shards >= 1, "an int >= 1"),
            "prefill_cost": (
                errors.is_real(self.prefill_cost) and self.prefill_cost >= 0,
                "a number >= 0",
            ),
            "overlap_rewards": (isinstance(self.overlap_rewards, bool), "True or False"),
            "steps_per_check": (
                _is_int(self.steps_per_check) and self.steps_per_check >= 1,
                "an int >= 1",
            ),
        }
        errors.check(self, checks)
        if self.sampling.max_new_tokens > self.buckets.generation_buckets[-1]:
            raise errors.InvalidValue(
                "RolloutSpec.sampling", "max_new_tokens", self.sampling.max_new_tokens,
                "<= the largest generation bucket, "
                f"buckets.generation_buckets={self.buckets.generation_buckets}",
            )  # fmt: skip

    def plan_kwargs(self) -> dict:
        """The keyword arguments every `scheduling` planner takes."""
        return dict(
            buckets=self.buckets,
            max_chunk_size=self.max_chunk_size,
            max_new_tokens=self.sampling.max_new_tokens,
            num_shards=self.num_shards,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutResult:
    """A scored rollout step: device-ready arrays, and the texts and metrics beside them."""

    rollout: types.Rollout  # N rows, prompt-major (group_ids = prompt index)
    completions: tuple[str, ...]  # [N] the text each reward call scored
    metrics: dict[str, float]  # see the module docstring


# ---------------------------------------------------------------- the step's inputs and state


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Step:
    """One call's inputs, checked, and its plan of requests (row r is requests[r])."""

    prompts: Sequence[Sequence[int]]
    prompt_texts: Sequence[str]
    metas: Sequence[Mapping]
    config: RolloutSpec
    requests: tuple[scheduling.Request, ...]
    row_prompt: np.ndarray  # [N] the prompt index of each row
    prompt_width: int  # Tp: the largest prompt bucket of the step
    gen_width: int  # Tg: the generation bucket of max_new_tokens


@dataclasses.dataclass(kw_only=True)
class _Buffers:
    """Per-row host arrays in the final [N, ...] layout, filled chunk by chunk."""

    tokens: np.ndarray  # [N, Tg]
    logps: np.ndarray  # [N, Tg]
    entropies: np.ndarray  # [N, Tg]
    lengths: np.ndarray  # [N]
    finished: np.ndarray  # [N]
    expert_ids: np.ndarray  # [N, L, Tp + Tg, K], `types.expert_id_dtype` (ids only: replay)

    @classmethod
    def empty(cls, step: _Step, *, num_layers: int, top_k: int, id_dtype) -> _Buffers:
        N, Tp, Tg = len(step.requests), step.prompt_width, step.gen_width
        trace = (N, num_layers, Tp + Tg, top_k)
        return cls(
            tokens=np.full((N, Tg), step.config.sampling.pad_id, np.int32),
            logps=np.zeros((N, Tg), np.float32),
            entropies=np.zeros((N, Tg), np.float32),
            lengths=np.zeros(N, np.int32),
            finished=np.zeros(N, bool),
            expert_ids=np.full(trace, -1, id_dtype),
        )

    def write(self, chunk: scheduling.Chunk, out: types.SampleOutput, *, prompt_width: int):
        """Copy a decoded chunk's real rows (host arrays) into their slots.

        The chunk's prompt bucket tp <= Tp is right-aligned: its trace lands at [Tp - tp, Tp + gb).
        """
        n, tp, gb = len(chunk.request_indices), chunk.prompt_bucket, chunk.generation_bucket
        rows = np.asarray(chunk.request_indices)
        self.tokens[rows, :gb] = out.tokens[:n]
        self.logps[rows, :gb] = out.logps[:n]
        self.entropies[rows, :gb] = out.entropies[:n]
        self.lengths[rows] = out.lengths[:n]
        self.finished[rows] = out.finished[:n]
        self.expert_ids[rows, :, prompt_width - tp : prompt_width + gb] = out.router.expert_ids[:n]

    def prefix(self, rows: list[int], starts: list[int], *, width: int) -> sampler.Prefix:
        """What `rows` generated so far ([R, width], `starts` tokens each), for a continuation."""
        return sampler.Prefix(
            tokens=jnp.asarray(self.tokens[rows, :width]),
            lengths=jnp.asarray(starts, jnp.int32),
            logps=jnp.asarray(self.logps[rows, :width]),
            entropies=jnp.asarray(self.entropies[rows, :width]),
        )


@dataclasses.dataclass(kw_only=True)
class _Progress:
    """What the decode loop has produced so far (explicit state, passed to the helpers)."""

    buffers: _Buffers
    records: list[scheduling.ChunkRecord] = dataclasses.field(default_factory=list)
    task_of_row: dict[int, int] = dataclasses.field(default_factory=dict)  # reward pool task
    host_texts: dict[int, str] = dataclasses.field(default_factory=dict)  # detokenize= on host
    deferred: list[tuple[int, tuple]] = dataclasses.field(default_factory=list)  # no overlap
    handoff_s: float = 0.0  # host time spent in `_hand_off`


# ---------------------------------------------------------------- stages


def _check_inputs(
    *, prompts, prompt_texts, metas, group_sizes, predictor, prompt_ids, reward_pool, detokenize
) -> list[int]:
    """Raise on inconsistent arguments; return one group size per prompt."""
    if not len(prompts) == len(prompt_texts) == len(metas):
        raise ValueError(
            f"prompts ({len(prompts)}), prompt_texts ({len(prompt_texts)}) and metas "
            f"({len(metas)}) must have the same length"
        )
    if not prompts:
        raise ValueError("prompts is empty: a rollout needs at least one prompt")
    empty = [p for p, tokens in enumerate(prompts) if len(tokens) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:8]} have no tokens: every prompt needs >= 1 token")
    try:
        sizes = [group_sizes] * len(prompts) if _is_int(group_sizes) else list(group_sizes)
    except TypeError:  # neither an int nor a sequence (a bool, a float): refused below
        sizes = []
    if len(sizes) != len(prompts) or not all(_is_int(g) and g >= 1 for g in sizes):
        raise errors.InvalidValue(
            "", "group_sizes", group_sizes,
            f"an int >= 1, or one int >= 1 per prompt ({len(prompts)} prompts)",
        )  # fmt: skip
    if predictor is not None and prompt_ids is None:
        raise ValueError(
            "prompt_ids=None with a predictor: its history is keyed by prompt id, and batch "
            "positions would share history between different prompts; pass the data "
            "pipeline's stable prompt ids (or predictor=None for no history)"
        )
    if prompt_ids is not None and len(prompt_ids) != len(prompts):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} ids for {len(prompts)} prompts")
    if detokenize is None and getattr(reward_pool, "detokenize", None) is None:
        raise ValueError(
            "detokenize=None needs a reward pool that detokenizes: "
            "RewardPool(reward_fn, detokenize=tokenizer.decode), or pass detokenize="
        )
    return sizes


def _plan(
    *, prompts, prompt_texts, metas, sizes: list[int], prompt_ids, config: RolloutSpec
) -> _Step:
    """One request per sample (prompt-major rows) and the step's buffer widths."""
    ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    requests = tuple(
        scheduling.Request(prompt_id=ids[p], sample_index=j, prompt_length=len(prompts[p]))
        for p in range(len(prompts))
        for j in range(sizes[p])
    )
    return _Step(
        prompts=prompts,
        prompt_texts=prompt_texts,
        metas=metas,
        config=config,
        requests=requests,
        row_prompt=np.repeat(np.arange(len(prompts)), sizes),
        prompt_width=max(config.buckets.prompt_bucket(r.prompt_length) for r in requests),
        gen_width=config.buckets.generation_bucket(config.sampling.max_new_tokens),
    )


def _first_wave(step: _Step, predictor: scheduling.LengthPredictor) -> list[scheduling.Chunk]:
    config = step.config
    if config.schedule == "fifo":
        return scheduling.plan_fifo(step.requests, **config.plan_kwargs())
    return scheduling.plan_chunks(
        step.requests, predictor_or_predictions=predictor, prefill_cost=config.prefill_cost,
        **config.plan_kwargs(),
    )  # fmt: skip


def _dispatch(
    model: sampler.SamplingModel,
    params,
    *,
    key: jax.Array,
    step: _Step,
    buffers: _Buffers,
    chunk: scheduling.Chunk,
) -> types.SampleOutput:
    """Start decoding `chunk` on the device (asynchronous: returns before it is decoded).

    Rows past the chunk's requests are batch padding (copies of its first row), dropped later.
    """
    sampling = step.config.sampling
    pad = chunk.batch_size - len(chunk.request_indices)
    rows = list(chunk.request_indices) + [chunk.request_indices[0]] * pad
    prompt_rows = [step.prompts[step.row_prompt[r]] for r in rows]
    tokens, mask = sampler.left_pad(
        prompt_rows,
        [len(p) for p in prompt_rows],
        width=chunk.prompt_bucket,
        pad_id=sampling.pad_id,
    )
    prefix = None
    if any(chunk.start_lengths):
        starts = list(chunk.start_lengths) + [chunk.start_lengths[0]] * pad
        prefix = buffers.prefix(rows, starts, width=chunk.generation_bucket)
    return sampler.sample_chunk(
        model, params, jnp.asarray(tokens), jnp.asarray(mask), key,
        jnp.asarray(chunk.budget, jnp.int32), prefix, num_samples=1,
        gen_len=chunk.generation_bucket, sampling=sampling,
        steps_per_check=step.config.steps_per_check, trace_weights=False,
    )  # fmt: skip


def _hand_off(
    progress: _Progress,
    out: types.SampleOutput,
    *,
    step: _Step,
    chunk: scheduling.Chunk,
    reward_pool: pool_lib.RewardPool,
    detokenize: Callable[[Sequence[int]], str] | None,
) -> list[scheduling.Unfinished]:
    """Copy a decoded chunk to the host, submit its finished rows, return the unfinished."""
    out = jax.device_get(out)  # blocks until this chunk is decoded
    t = time.perf_counter()
    buf, max_new_tokens = progress.buffers, step.config.sampling.max_new_tokens
    buf.write(chunk, out, prompt_width=step.prompt_width)
    n = len(chunk.request_indices)
    new = tuple(int(x) for x in out.lengths[:n] - np.asarray(chunk.start_lengths))
    progress.records.append(
        scheduling.ChunkRecord(chunk=chunk, num_steps=int(out.num_steps), num_new_tokens=new)
    )
    done, unfinished = [], []
    for r in chunk.request_indices:
        length = int(buf.lengths[r])
        if buf.finished[r] or length >= max_new_tokens:
            done.append(r)
        else:
            prompt_length = step.requests[r].prompt_length
            unfinished.append(
                scheduling.Unfinished(index=r, prompt_length=prompt_length, num_generated=length)
            )
    items = []
    for r in done:
        completion = buf.tokens[r, : buf.lengths[r]].tolist()
        if detokenize is not None:
            progress.host_texts[r] = completion = detokenize(completion)
        p = step.row_prompt[r]
        items.append((step.prompt_texts[p], completion, step.metas[p]))
    if step.config.overlap_rewards:
        progress.task_of_row.update(zip(done, reward_pool.submit(items), strict=True))
    else:
        progress.deferred.extend(zip(done, items, strict=True))
    progress.handoff_s += time.perf_counter() - t
    return unfinished


def _decode(
    model: sampler.SamplingModel,
    params,
    *,
    key: jax.Array,
    step: _Step,
    wave: list[scheduling.Chunk],
    reward_pool: pool_lib.RewardPool,
    detokenize: Callable[[Sequence[int]], str] | None,
) -> _Progress:
    """Decode every wave of chunks, handing each off while the next one decodes."""
    buffers = _Buffers.empty(
        step, num_layers=model.num_layers, top_k=model.top_k,
        id_dtype=sampler.trace_id_dtype(model),
    )  # fmt: skip
    progress = _Progress(buffers=buffers)
    hand_off = dict(step=step, reward_pool=reward_pool, detokenize=detokenize)
    number = 0  # chunks dispatched so far: chunk `number` draws from fold_in(key, number)
    while wave:
        unfinished, pending = [], None
        for chunk in wave:
            number += 1
            out = _dispatch(
                model, params, key=jax.random.fold_in(key, number), step=step,
                buffers=progress.buffers, chunk=chunk,
            )  # fmt: skip
            if pending is not None:  # the previous chunk, while this one decodes
                unfinished += _hand_off(progress, pending[1], chunk=pending[0], **hand_off)
            pending = (chunk, out)
        unfinished += _hand_off(progress, pending[1], chunk=pending[0], **hand_off)
        wave = scheduling.continuation_plan(unfinished, **step.config.plan_kwargs())
    return progress


def _assemble(step: _Step, progress: _Progress, scores: pool_lib.RewardResults) -> types.Rollout:
    """The rows as one `types.Rollout` (host numpy arrays)."""
    buf, pad_id = progress.buffers, step.config.sampling.pad_id
    prompt_rows = [step.prompts[p] for p in step.row_prompt]
    prompt_tokens, prompt_mask = sampler.left_pad(
        prompt_rows, [len(x) for x in prompt_rows], width=step.prompt_width, pad_id=pad_id
    )
    samples = types.Samples(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        tokens=buf.tokens,
        mask=np.arange(step.gen_width)[None] < buf.lengths[:, None],
        lengths=buf.lengths,
        finished=buf.finished,
        logps=buf.logps,
        entropies=buf.entropies,
        router=types.RouterTrace(expert_ids=buf.expert_ids, expert_weights=None),
    )
    return types.Rollout.from_samples(
        samples,
        group_ids=step.row_prompt.astype(np.int32),
        rewards=np.asarray(scores.rewards),
        reward_ok=np.asarray(scores.ok),
    )


def _metrics(
    step: _Step,
    progress: _Progress,
    *,
    times: tuple[float, float, float],
    new_compiles: int,
    pool_before: Mapping[str, float],
    pool_after: Mapping[str, float],
) -> dict[str, float]:
    t0, t_generated, t_end = times
    lengths, finished = progress.buffers.lengths, progress.buffers.finished
    schedule = scheduling.schedule_metrics(progress.records, num_shards=step.config.num_shards)
    return {
        **{f"rollout/{k}": v for k, v in schedule.items()},
        "rollout/generate_s": t_generated - t0,
        "rollout/host_handoff_s": progress.handoff_s,
        "rollout/reward_wait_s": t_end - t_generated,
        "rollout/total_s": t_end - t0,
        "rollout/tokens_per_s": int(lengths.sum()) / max(t_generated - t0, 1e-9),
        "rollout/new_compiles": float(new_compiles),
        "rollout/truncated_fraction": float(np.mean(~finished)),
        "rollout/mean_length": float(lengths.mean()),
        **{k: pool_after[k] - pool_before[k] for k in pool_after},
    }


# ---------------------------------------------------------------- the entry point


def generate_and_score(
    model: handle.Model | sampler.SamplingModel | config_lib.ModelConfig,
    params,
    *,
    prompts: Sequence[Sequence[int]],
    prompt_texts: Sequence[str],
    metas: Sequence[Mapping],
    group_sizes: int | Sequence[int],
    key: jax.Array,
    config: RolloutSpec,
    reward_pool: pool_lib.RewardPool,
    predictor: scheduling.LengthPredictor | None = None,
    prompt_ids: Sequence[str | int] | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
) -> RolloutResult:
    """Sample `group_sizes[p]` completions of each prompt and score them (see module doc).

    Args:
      model: an `espo.model.Model`, any `sampler.SamplingModel`, or a `ModelConfig`.
      prompts: token ids of each prompt; `prompt_texts` / `metas` go to the reward function.
      group_sizes: G for every prompt, or one G per prompt (adaptive group size).
      config: sampling and scheduling settings.
      predictor: learns lengths across steps (updated in place); needs `prompt_ids`. None: a
        fresh one for this call (no history).
      prompt_ids: stable ids of the prompts, the keys of the predictor's history.
      detokenize: None (default): the reward pool's workers detokenize (the pool needs
        `RewardPool(detokenize=...)`); a callable: detokenize on the host, serially.
    """
    if not isinstance(config, RolloutSpec):
        raise errors.InvalidValue("", "config", config, "an espo.rollout.RolloutSpec")
    sizes = _check_inputs(
        prompts=prompts, prompt_texts=prompt_texts, metas=metas, group_sizes=group_sizes,
        predictor=predictor, prompt_ids=prompt_ids, reward_pool=reward_pool,
        detokenize=detokenize,
    )  # fmt: skip
    model = sampler.sampling_model(model)
    predictor = predictor if predictor is not None else scheduling.LengthPredictor()
    step = _plan(
        prompts=prompts, prompt_texts=prompt_texts, metas=metas, sizes=sizes,
        prompt_ids=prompt_ids, config=config,
    )  # fmt: skip
    wave = _first_wave(step, predictor)
    compiles_before, pool_before = sampler.compile_count(), reward_pool.metrics()
    t0 = time.perf_counter()
    progress = _decode(
        model, params, key=key, step=step, wave=wave, reward_pool=reward_pool,
        detokenize=detokenize,
    )  # fmt: skip
    t_generated = time.perf_counter()
    if progress.deferred:  # overlap_rewards=False: every sample is scored only now
        rows, items = zip(*progress.deferred, strict=True)
        progress.task_of_row.update(zip(rows, reward_pool.submit(list(items)), strict=True))
    N = len(step.requests)
    scores = reward_pool.results([progress.task_of_row[r] for r in range(N)])
    if detokenize is None:
        completions = tuple(scores.completions)  # the workers' texts
    else:
        completions = tuple(progress.host_texts[r] for r in range(N))
    t_end = time.perf_counter()
    predictor.observe_requests(step.requests, progress.buffers.lengths.tolist())
    metrics = _metrics(
        step, progress, times=(t0, t_generated, t_end),
        new_compiles=sampler.compile_count() - compiles_before, pool_before=pool_before,
        pool_after=reward_pool.metrics(),
    )  # fmt: skip
    return RolloutResult(
        rollout=_assemble(step, progress, scores),
        completions=completions,
        metrics=metrics,
    )
