"""`generate_and_score`: prompts -> G scored samples each, chunk by chunk, rewards overlapped.

One rollout step:
  1. one `scheduling.Request` per sample; `plan_chunks` orders them by predicted length into
     chunks with bounded compiled shapes (or `plan_fifo`, the naive baseline);
  2. chunk i+1 is dispatched to the device (JAX dispatch is asynchronous) before chunk i is
     copied to the host, so the device keeps decoding while the host works;
  3. each finished sample (EOS, or `max_new_tokens`) is handed to the `RewardPool` at once as
     token ids; the pool's workers detokenize and score it while later chunks decode, so
     detokenization is parallel and off the host's decode loop (`detokenize=` on the host
     is the serial alternative, for a pool without a detokenizer);
  4. rows that hit their chunk's budget without EOS are continued from their prefix in the next
     wave (`continuation_plan`): the scheduler never truncates;
  5. the length predictor learns this step's lengths, keyed by `prompt_ids` (stable ids from
     the data pipeline: a batch position is not a prompt, so a predictor needs them).

Every chunk draws from its own key, `fold_in(key, chunk number)`: samples of one prompt in
different chunks at the same row are independent, and the same key reproduces the rollout.
With `num_shards` > 1 the plan assigns chunks to data-parallel shards by LPT on their cost
(`rollout/shard_imbalance` reports the realised max / mean load); this host decodes them all.
The result is a `types.Rollout` with sampler log-probs, entropies, the router trace for replay,
rewards (failed ones flagged in `reward_ok`) and per-phase timings and scheduling metrics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from espo import sampler, scheduling, types
from espo.model import config as config_lib
from espo.rewards import pool as pool_lib

SCHEDULES = ("length_aware", "fifo")


@dataclasses.dataclass
class _Buffers:
    """Per-request host buffers in the final [N, ...] layout."""

    tokens: np.ndarray
    logps: np.ndarray
    entropies: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    ids: np.ndarray
    weights: np.ndarray


def generate_and_score(
    model: config_lib.ModelConfig | sampler.SamplingModel,
    params,
    *,
    prompts: Sequence[Sequence[int]],
    prompt_texts: Sequence[str],
    metas: Sequence[Mapping],
    group_sizes: int | Sequence[int],
    key: jax.Array,
    sampling: sampler.SamplingParams,
    buckets: scheduling.LengthBuckets,
    max_chunk_size: int,
    reward_pool: pool_lib.RewardPool,
    detokenize: Callable[[Sequence[int]], str] | None = None,
    predictor: scheduling.LengthPredictor | None = None,
    prompt_ids: Sequence[str | int] | None = None,
    schedule: str = "length_aware",
    num_shards: int = 1,
) -> types.Rollout:
    """Sample `group_sizes[p]` completions of each prompt and score them (see module doc).

    Args:
      prompts: token ids of each prompt; `prompt_texts` / `metas` go to the reward function.
      group_sizes: G for every prompt, or one G per prompt (adaptive group size).
      detokenize: None (default): the reward pool's workers detokenize (the pool needs
        `RewardPool(detokenize=...)`); a callable: detokenize on the host, serially.
      predictor: learns lengths across steps (updated in place); needs `prompt_ids`. None: a
        fresh one for this call (no history).
      prompt_ids: stable ids of the prompts, the keys of the predictor's history.
      num_shards: data-parallel shards the plan balances chunks over (1 on one device).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is invalid; valid: {SCHEDULES}")
    if not len(prompts) == len(prompt_texts) == len(metas):
        raise ValueError(
            f"prompts ({len(prompts)}), prompt_texts ({len(prompt_texts)}) and metas "
            f"({len(metas)}) must have the same length"
        )
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
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} is invalid: >= 1")
    if isinstance(model, config_lib.ModelConfig):
        model = sampler.EspoModel(model)
    buckets.check_max_new_tokens(sampling.max_new_tokens)
    sizes = [group_sizes] * len(prompts) if isinstance(group_sizes, int) else list(group_sizes)
    ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    predictor = predictor if predictor is not None else scheduling.LengthPredictor()
    requests = [
        scheduling.Request(prompt_id=ids[p], sample_index=j, prompt_length=len(prompts[p]))
        for p in range(len(prompts))
        for j in range(sizes[p])
    ]
    row_prompt = np.repeat(np.arange(len(prompts)), sizes)
    plan_kw = dict(
        buckets=buckets,
        max_chunk_size=max_chunk_size,
        max_new_tokens=sampling.max_new_tokens,
        num_shards=num_shards,
    )
    if schedule == "fifo":
        wave = scheduling.plan_fifo(requests, **plan_kw)
    else:
        wave = scheduling.plan_chunks(requests, predictor_or_predictions=predictor, **plan_kw)

    N, L, K = len(requests), model.num_layers, model.top_k
    Tp = max(buckets.prompt_bucket(r.prompt_length) for r in requests)
    Tg = buckets.generation_bucket(sampling.max_new_tokens)
    buf = _Buffers(
        tokens=np.full((N, Tg), sampling.pad_id, np.int32),
        logps=np.zeros((N, Tg), np.float32),
        entropies=np.zeros((N, Tg), np.float32),
        lengths=np.zeros(N, np.int32),
        finished=np.zeros(N, bool),
        ids=np.full((N, L, Tp + Tg, K), -1, np.int32),
        weights=np.zeros((N, L, Tp + Tg, K), np.float32),
    )
    completions: list[str] = [""] * N
    task_of_row: dict[int, int] = {}
    records: list[scheduling.ChunkRecord] = []
    compiles0, pool0 = sampler.compile_count(), reward_pool.metrics()
    t0 = time.perf_counter()
    handoff_s = 0.0
    num_chunks = 0

    def dispatch(chunk: scheduling.Chunk):
        nonlocal num_chunks
        rows = list(chunk.request_indices)
        rows += [rows[0]] * (chunk.batch_size - len(rows))  # batch padding, outputs dropped
        tokens, mask = sampler.left_pad(
            [prompts[row_prompt[r]] for r in rows],
            [len(prompts[row_prompt[r]]) for r in rows],
            width=chunk.prompt_bucket,
            pad_id=sampling.pad_id,
        )
        prefix = None
        if any(chunk.start_lengths):
            gb = chunk.generation_bucket
            starts = list(chunk.start_lengths) + [chunk.start_lengths[0]] * (
                len(rows) - len(chunk.start_lengths)
            )
            prefix = sampler.Prefix(
                tokens=jnp.asarray(buf.tokens[rows, :gb]),
                lengths=jnp.asarray(starts, jnp.int32),
                logps=jnp.asarray(buf.logps[rows, :gb]),
                entropies=jnp.asarray(buf.entropies[rows, :gb]),
            )
        num_chunks += 1
        return sampler.sample_chunk(
            model, params, jnp.asarray(tokens), jnp.asarray(mask),
            jax.random.fold_in(key, num_chunks), jnp.asarray(chunk.budget, jnp.int32), prefix,
            num_samples=1, gen_len=chunk.generation_bucket,
            temperature=float(sampling.temperature), top_p=float(sampling.top_p),
            top_k=int(sampling.top_k), ids=(sampling.eos_id, sampling.pad_id),
        )  # fmt: skip

    def handoff(chunk: scheduling.Chunk, out: sampler.SampleOutput) -> list[scheduling.Unfinished]:
        """Copy a decoded chunk to the host, submit its finished rows, return the unfinished."""
        nonlocal handoff_s
        out = jax.device_get(out)  # blocks until this chunk is decoded
        t = time.perf_counter()
        n, tp, gb = len(chunk.request_indices), chunk.prompt_bucket, chunk.generation_bucket
        rows = np.asarray(chunk.request_indices)
        buf.tokens[rows, :gb] = out.tokens[:n]
        buf.logps[rows, :gb] = out.logps[:n]
        buf.entropies[rows, :gb] = out.entropies[:n]
        buf.lengths[rows] = out.lengths[:n]
        buf.finished[rows] = out.finished[:n]
        buf.ids[rows, :, Tp - tp : Tp + gb] = out.router.expert_ids[:n]
        buf.weights[rows, :, Tp - tp : Tp + gb] = out.router.expert_weights[:n]
        new = tuple(int(x) for x in out.lengths[:n] - np.asarray(chunk.start_lengths))
        records.append(
            scheduling.ChunkRecord(chunk=chunk, num_steps=int(out.num_steps), num_new_tokens=new)
        )
        done, unfinished = [], []
        for r in rows.tolist():
            length = int(buf.lengths[r])
            if buf.finished[r] or length >= sampling.max_new_tokens:
                done.append(r)
            else:
                unfinished.append(
                    scheduling.Unfinished(
                        index=r, prompt_length=requests[r].prompt_length, num_generated=length
                    )
                )
        items = []
        for r in done:
            completion = buf.tokens[r, : buf.lengths[r]].tolist()
            if detokenize is not None:
                completions[r] = completion = detokenize(completion)
            p = row_prompt[r]
            items.append((prompt_texts[p], completion, metas[p]))
        task_of_row.update(zip(done, reward_pool.submit(items), strict=True))
        handoff_s += time.perf_counter() - t
        return unfinished

    while wave:
        unfinished, previous = [], None
        for chunk in wave:
            current = (chunk, dispatch(chunk))
            if previous is not None:
                unfinished += handoff(*previous)
            previous = current
        unfinished += handoff(*previous)
        wave = scheduling.continuation_plan(unfinished, **plan_kw)
    t_generated = time.perf_counter()
    scores = reward_pool.results([task_of_row[r] for r in range(N)])
    if detokenize is None:
        completions = list(scores.completions)
    t_end = time.perf_counter()
    predictor.observe_requests(requests, buf.lengths.tolist())

    prompt_rows = [prompts[p] for p in row_prompt]
    prompt_tokens, prompt_mask = sampler.left_pad(
        prompt_rows,
        [len(x) for x in prompt_rows],
        width=Tp,
        pad_id=sampling.pad_id,
    )
    pool1 = reward_pool.metrics()
    useful = int(buf.lengths.sum())
    metrics = {
        **{
            f"rollout/{k}": v
            for k, v in scheduling.schedule_metrics(records, num_shards=num_shards).items()
        },
        "rollout/generate_s": t_generated - t0,
        "rollout/host_handoff_s": handoff_s,
        "rollout/reward_wait_s": t_end - t_generated,
        "rollout/total_s": t_end - t0,
        "rollout/tokens_per_s": useful / max(t_generated - t0, 1e-9),
        "rollout/new_compiles": float(sampler.compile_count() - compiles0),
        "rollout/truncated_fraction": float(np.mean(~buf.finished)),
        "rollout/mean_length": float(buf.lengths.mean()),
        **{k: pool1[k] - pool0[k] for k in pool1},
    }
    return types.Rollout(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        tokens=buf.tokens,
        mask=np.arange(Tg)[None] < buf.lengths[:, None],
        lengths=buf.lengths,
        finished=buf.finished,
        logps=buf.logps,
        entropies=buf.entropies,
        router=types.RouterTrace(expert_ids=buf.ids, expert_weights=buf.weights),
        group_ids=row_prompt.astype(np.int32),
        rewards=scores.rewards,
        reward_ok=scores.ok,
        prompts=tuple(prompt_texts[p] for p in row_prompt),
        completions=tuple(completions),
        metrics=metrics,
    )
