"""Rollout benchmark: one table from one run on the same weights.

  python experiments/bench_rollout.py [--batch 64] [--new_tokens 128] [--quick]
      [--only throughput,moe,fp8read,scaling,update,fp8,waste,detok,overlap]
      [--peers transformers,vllm] [--vllm_python .venv-vllm/bin/python] [--sizes E16,E8,...]
      [--rounds R]   # moe: only these sizes; the engines alternate R times, medians kept

  # issue 14's table: MoE sizes vs peers, roofline, FP8 read check, update, B/length scaling
  python experiments/bench_rollout.py --only moe,fp8read,update,scaling --new_tokens 64

Rows:
  0. moe: per size (d128 E16; d256 E8/E32/E128 at fixed active parameters; `MOE_SIZES`),
     B=64, --prompt_len 16, --new_tokens, temperature 1, each engine in its own process, back
     to back on the same Hugging Face weights: espo f32 / f32 before issue 14 (blocked
     dispatch, scanned layers) / bf16, transformers `generate`, and vLLM's CPU engine (f32 and
     bf16) from its own virtualenv (`vllm_peer.py`; reported ABSENT when not installed). The
     memory read bandwidth (`read_bandwidth_gbs`: the fastest of 1 GiB row sums), per size the
     bytes a decode step must
     read (`decode_step_bytes`) and the achieved fraction; the E=8 -> E=128 slowdown.
     fp8read: does XLA:CPU's matmul read e4m3 bytes (the dot's operand dtype) and its time vs
     f32 / bf16 at the E=128 decode shape. update: tokens/s of a forward + backward at E=8/32/
     128, capacity vs blocked. scaling: E=128 tokens/s and peak memory, B and length;
  1. decode throughput: espo (f32, bf16, fp8 weights) vs Hugging Face transformers `generate`
     (torch CPU) on the same tiny Qwen3-MoE checkpoint, batch B, fixed-length completions;
  2. FP8 train-infer mismatch: mean |dlogp| of FP8 sampling vs the bf16 forward on the same
     tokens, greedy-token agreement and router-id disagreement;
  3. padding waste, FIFO vs length-aware, on a heavy-tailed (lognormal) length workload: decode
     slots, plus the re-prefill of continued rows (each re-prefill position counted as one
     slot-step), and decode slots alone. The workload runs the real espo model (a small random
     MoE whose embedding and LM head are set so that greedy decoding counts t -> t + 1, see
     `counting_model`), so every completion length is known in advance;
  4. detokenization: host time per rollout step (`rollout/host_handoff_s`) and step time with
     a pure-Python byte-level decoder run serially on the host vs in the reward workers;
  5. overlap: wall time of generate_and_score with a slow reward vs generation-only and
     reward-only time (efficiency = max(gen, reward) / wall; 1.0 is perfect overlap);
  6. on a GPU only: FP8 vs bf16 decode throughput on a memory-bound >= 1B-parameter config and
     the achieved weight-read bandwidth against the card's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from espo import model, quant, rollout, sampler, scheduling, testing, train_step
from espo.rewards import pool as pool_lib

PEAK_BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0}


def _timed(fn, repeats):
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def _never_stop(cfg) -> tuple[int, ...]:
    """A stop id outside the vocabulary: the model cannot emit it, so every row decodes
    exactly max_new_tokens tokens (fixed-length throughput)."""
    return (cfg.vocab_size,)


@dataclasses.dataclass(frozen=True)
class WithDispatch:
    """`model.Model(cfg)` with its MoE dispatch implementation bound (a SamplingModel)."""

    cfg: model.ModelConfig
    impl: str = "auto"
    per_layer_params: bool = True  # False: the scanned [L, ...] layout (`Model.decode_params`)

    num_layers = property(lambda self: self.cfg.num_layers)
    top_k = property(lambda self: self.cfg.top_k)

    def decode_params(self, params):
        return model.Model(self.cfg).decode_params(params) if self.per_layer_params else params

    def forward(self, params, tokens, **options):
        return model.forward(self.cfg, params, tokens, dispatch_impl=self.impl, **options)

    def init_cache(self, *, batch, max_length):
        return model.init_cache(self.cfg, batch=batch, max_length=max_length)


def _sample_fixed_length(
    cfg, params, prompts, *, new_tokens, impl="auto", key=0, steps_per_check=1, model=None
):
    """The fixed-length sampler call; impl "blocked+stacked" is espo before issue 14 (blocked
    dispatch, scanned [L, ...] weights in the decode loop). `model`: a module to call instead
    (its dispatch and layout then come from it, not from `impl`)."""
    impl, _, layout = impl.partition("+")
    m = model or WithDispatch(cfg, impl, per_layer_params=layout != "stacked")
    lengths = np.full(len(prompts), prompts.shape[1])
    return functools.partial(
        sampler.sample, m, params, prompts, lengths, key=jax.random.key(key),
        num_samples=1, max_new_tokens=new_tokens, stop_ids=_never_stop(cfg), pad_id=0,
        buckets=scheduling.LengthBuckets(
            prompt_buckets=(prompts.shape[1],), generation_buckets=(new_tokens,)
        ),
        steps_per_check=steps_per_check,
    )  # fmt: skip


def espo_decode_tokens_per_s(cfg, params, prompts, *, new_tokens, repeats=2, impl="auto"):
    run = _sample_fixed_length(cfg, params, prompts, new_tokens=new_tokens, impl=impl)
    return len(prompts) * new_tokens / _timed(lambda: run().tokens, repeats)


def hf_decode_tokens_per_s(path, prompts, *, new_tokens, repeats=2):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long)

    def run():
        with torch.no_grad():
            return hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=0,
            )  # fmt: skip

    return len(prompts) * new_tokens / _timed(run, repeats)


def _as_bf16(cfg, params):
    """The bf16 copy of a model: (config, params) with bfloat16 storage and compute."""
    cfg16 = cfg.replace(param_dtype="bfloat16", dtype="bfloat16")
    return cfg16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def _greedy_agreement(cfg, params_a, params_b, tokens, mask):
    fwd = jax.jit(model.Model(cfg).forward)
    a = jnp.argmax(fwd(params_a, tokens, attention_mask=mask).logits, -1)
    b = jnp.argmax(fwd(params_b, tokens, attention_mask=mask).logits, -1)
    return float(jnp.sum((a == b) * mask) / jnp.sum(mask))


def fp8_mismatch(cfg, params, prompts, *, new_tokens):
    """FP8-sampled tokens scored by the bf16 model: |dlogp|, greedy agreement, router flips."""
    cfg16, bf16 = _as_bf16(cfg, params)
    q = quant.quantize_fp8(bf16)
    lengths = np.full(len(prompts), prompts.shape[1])
    m16 = model.Model(cfg16)
    out = sampler.sample(
        m16, q, prompts, lengths, key=jax.random.key(1), num_samples=1,
        max_new_tokens=new_tokens, stop_ids=_never_stop(cfg), pad_id=0,
    )  # fmt: skip
    tokens, mask = out.training_inputs()
    ref = jax.jit(m16.forward)(bf16, tokens, attention_mask=mask)  # its free routing
    scored = jax.jit(train_step.token_logps, static_argnums=0)(cfg16, bf16, tokens, mask)
    ref_logps = train_step.completion(scored.logps, prompt_length=out.prompt_tokens.shape[1])
    m = out.mask
    real = np.asarray(mask)[:, None, :, None] & (np.asarray(out.router.expert_ids) >= 0)
    flips = np.sort(out.router.expert_ids, -1) != np.sort(ref.router.expert_ids, -1)
    return {
        "mean_abs_dlogp": float(jnp.sum(jnp.abs(out.logps - ref_logps) * m) / jnp.sum(m)),
        "greedy_agreement": _greedy_agreement(cfg16, bf16, q, tokens, mask),
        "router_disagreement": float(np.sum(flips & real) / max(np.sum(real), 1)),
        "weight_bytes_ratio": quant.tree_bytes(q, only_quantized_paths=True)
        / quant.tree_bytes(bf16, only_quantized_paths=True),
    }


class ByteLevelDecoder:
    """A pure-Python byte-level BPE decode, as slow tokenizers do it: each id maps to a string
    of byte symbols (1-6 per token), joined, then mapped symbol by symbol back to bytes and
    UTF-8 decoded. Picklable, so reward workers can run it."""

    def __init__(self, vocab_size: int, seed: int = 0):
        rng = np.random.RandomState(seed)
        symbols = [chr(0x100 + b) for b in range(256)]  # GPT-2's bytes_to_unicode idea
        self.table = [
            "".join(symbols[b] for b in rng.randint(32, 127, rng.randint(1, 7)))
            for _ in range(vocab_size)
        ]
        self.byte_of = {c: b for b, c in enumerate(symbols)}

    def __call__(self, tokens) -> str:
        text = "".join(self.table[t] for t in tokens)
        return bytearray(self.byte_of[c] for c in text).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=4)
def counting_model(vocab: int, *, seed: int = 0) -> tuple[model.Model, dict]:
    """A small random espo MoE (`ModelConfig.tiny`, `vocab` tokens) whose greedy decode counts:
    after token t comes (t + 1) % vocab, whatever the context.

    Every other weight (attention, router, experts) is the random init, so the sampler does a
    real model's work per token; only the embedding and LM head are set: the embedding rows are
    scaled x8 (attention and expert outputs, computed from normalised inputs, barely turn the
    residual), and LM-head column j is row j - 1 of the embedding, normalised, times 50 / sqrt(D),
    so the next-token logit of t + 1 beats every other by > 20 (checked here on all tokens).
    """
    m = model.Model(model.ModelConfig.tiny(vocab_size=vocab))
    params = m.init(jax.random.key(seed))
    embed = np.asarray(params["embed"], np.float64)  # [V, D]
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)  # [V, D]
    lm_head = 50.0 * np.roll(unit, 1, axis=0).T / np.sqrt(embed.shape[1])  # [D, V]
    params = dict(
        params,
        embed=jnp.asarray(8.0 * embed, jnp.float32),
        lm_head=jnp.asarray(lm_head, jnp.float32),
    )
    logits = np.asarray(jax.jit(m.forward)(params, jnp.arange(vocab)[None]).logits[0])  # [V, V]
    top2 = np.sort(logits, axis=-1)[:, -2:]  # [V, 2]
    if not (
        (logits.argmax(-1) == (np.arange(vocab) + 1) % vocab).all()
        and (top2[:, 1] - top2[:, 0]).min() > 20
    ):
        raise RuntimeError(f"counting_model(vocab={vocab}, seed={seed}) does not count")
    return m, params


def _lognormal_workload(*, num_prompts, group_size, max_new_tokens, seed=0, step=0):
    """(model, params, prompt rows, prompt ids, rollout config) for one rollout step.

    Prompt p has a typical length lognormal(median max_new_tokens / 12, sigma 1); each of its
    G samples, redrawn every step, is that times lognormal(0, 0.25). The counting model decodes
    greedily exactly n tokens after a prompt ending in vocab - 1 - n (the stop id is vocab - 1),
    so every sample is its own prompt row (group size 1) and the G rows of prompt p share the
    id "prompt-p": the predictor sees what it would see from a real policy, a per-prompt length
    with spread across samples and steps.
    """
    vocab = max_new_tokens + 64
    typical = np.random.RandomState(seed).lognormal(np.log(max_new_tokens / 12), 1.0, num_prompts)
    spread = np.random.RandomState([seed, step + 1]).lognormal(0.0, 0.25, (num_prompts, group_size))
    lengths = np.clip(typical[:, None] * spread, 1, vocab - 2).astype(int).ravel()
    prompts = [[1, int(vocab - 1 - n)] for n in lengths]
    ids = [f"prompt-{p}" for p in range(num_prompts) for _ in range(group_size)]
    gens = tuple(b for b in (16, 32, 64, 128, 256, 512, 1024, 2048) if b < max_new_tokens)
    buckets = scheduling.LengthBuckets(
        prompt_buckets=(8,), generation_buckets=(*gens, max_new_tokens)
    )
    sampling = sampler.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=(vocab - 1,), pad_id=0
    )
    config = rollout.RolloutSpec(sampling=sampling, buckets=buckets, max_chunk_size=16)
    return (*counting_model(vocab), prompts, ids, config)


def _run_step(pool, workload, *, schedule="length_aware", **kw):
    m, params, prompts, ids, config = workload
    n = len(prompts)
    config = dataclasses.replace(config, schedule=schedule)
    return rollout.generate_and_score(
        m, params, prompts=prompts, prompt_texts=["p"] * n, metas=[{}] * n, group_sizes=1,
        key=jax.random.key(0), config=config,
        reward_pool=pool, prompt_ids=ids, **kw,
    ).metrics  # fmt: skip


def padding_waste(*, num_prompts, group_size, max_new_tokens, seed=0):
    """FIFO vs length-aware (budget at the mean / max EMA) on the second of two steps of the
    lognormal workload, through the real sampler and rollout loop."""
    steps = [
        _lognormal_workload(
            num_prompts=num_prompts,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            seed=seed,
            step=k,
        )  # fmt: skip
        for k in range(2)
    ]
    out = {}
    with pool_lib.RewardPool(testing.length_reward, num_workers=1, timeout_s=60) as pool:
        run = functools.partial(_run_step, pool, detokenize=lambda t: "")
        out["fifo"] = run(steps[1], schedule="fifo")
        for statistic in ("mean", "max"):
            predictor = scheduling.LengthPredictor(
                default_length=max_new_tokens / 4, budget_statistic=statistic
            )
            run(steps[0], predictor=predictor)  # one step of length history
            out[f"length_aware_{statistic}"] = run(steps[1], predictor=predictor)
    return out


def detokenization(*, num_prompts, group_size, max_new_tokens, decoder, repeats=3):
    """Host time per step and step time: detokenizing on the host vs in 2 reward workers."""
    workload = _lognormal_workload(
        num_prompts=num_prompts, group_size=group_size, max_new_tokens=max_new_tokens
    )
    out = {}
    for where in ("host", "workers"):
        kw = {"detokenize": decoder} if where == "host" else {}
        with pool_lib.RewardPool(
            testing.length_reward, num_workers=2, timeout_s=60,
            detokenize=None if where == "host" else decoder,
        ) as pool:  # fmt: skip
            _run_step(pool, workload, schedule="fifo", **kw)  # compile, start workers
            steps = [_run_step(pool, workload, schedule="fifo", **kw) for _ in range(repeats)]
        failed = sum(m["reward/num_ok"] != len(workload[2]) for m in steps)
        if failed:  # e.g. workers that cannot unpickle the decoder: the timing would be void
            raise RuntimeError(f"detokenize in {where}: {failed} steps had failed rewards")
        out[where] = {
            k: float(np.median([m[f"rollout/{k}"] for m in steps]))
            for k in ("host_handoff_s", "total_s", "generate_s", "reward_wait_s")
        }
    return out


def overlap(cfg, params, *, num_prompts, group_size, new_tokens, sleep_s):
    """Wall time of generate_and_score with a slow reward vs its two halves alone."""
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(2, cfg.vocab_size, 12)) for _ in range(num_prompts)]
    config = rollout.RolloutSpec(
        sampling=sampler.SamplingParams(
            max_new_tokens=new_tokens, stop_ids=_never_stop(cfg), pad_id=0
        ),
        buckets=scheduling.LengthBuckets(prompt_buckets=(16,), generation_buckets=(new_tokens,)),
        max_chunk_size=8,
        schedule="fifo",
    )
    n = num_prompts * group_size

    def run(pool, meta):
        return rollout.generate_and_score(
            model.Model(cfg), params, prompts=prompts, prompt_texts=["p"] * num_prompts,
            metas=[meta] * num_prompts, group_sizes=group_size, key=jax.random.key(0),
            config=config, reward_pool=pool, detokenize=lambda t: "x",
        ).metrics["rollout/total_s"]  # fmt: skip

    with pool_lib.RewardPool(testing.length_reward, num_workers=2, timeout_s=60) as pool:
        run(pool, {})  # compile, start workers
        gen = run(pool, {})
        t0 = time.perf_counter()
        pool.score([("p", "x", {"sleep": sleep_s})] * n, timeout=600)
        reward = time.perf_counter() - t0
        wall = run(pool, {"sleep": sleep_s})
    return {"generate_s": gen, "reward_s": reward, "wall_s": wall,
            "efficiency": max(gen, reward) / wall}  # fmt: skip


def gpu_decode_bandwidth(cfg, *, batch, new_tokens, repeats=3):
    """bf16 vs FP8 decode tokens/s and the achieved weight-read bandwidth (GB/s)."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.init(cfg, jax.random.key(0)))
    prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, 16))
    out = {}
    for name, p in (("bf16", params), ("fp8", quant.quantize_fp8(params))):
        tps = espo_decode_tokens_per_s(cfg, p, prompts, new_tokens=new_tokens, repeats=repeats)
        steps_per_s = tps / batch
        out[name] = {"tokens_per_s": tps, "GB_per_s": quant.tree_bytes(p) * steps_per_s / 1e9}
    return out


# ---- MoE sizes: espo vs peers, each engine in its own process; the roofline ------------------
# name -> Hugging Face Qwen3-MoE fields; all have 4 layers, top-4 of the experts, 4 query and 2
# kv heads, expert width F=128 and 128 tokens. The first is configs/default.py's model class.
MOE_SIZES = {
    "d128 L4 E16 K4 h32": dict(hidden_size=128, num_experts=16, head_dim=32),
    "d256 L4 E8 K4 h64": dict(hidden_size=256, num_experts=8, head_dim=64),
    "d256 L4 E32 K4 h64": dict(hidden_size=256, num_experts=32, head_dim=64),
    "d256 L4 E128 K4 h64": dict(hidden_size=256, num_experts=128, head_dim=64),
}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _size_checkpoint(tmp, name):
    return testing.make_hf_checkpoint(
        pathlib.Path(tmp) / name.replace(" ", "_"), vocab_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=4,
        moe_intermediate_size=128, init_std=0.02, max_position_embeddings=2048,
        **MOE_SIZES[name],
    )  # fmt: skip


def decode_step_bytes(cfg, *, batch, touched_experts, mean_length):
    """Bytes one decode step must read: per layer attention, norms, router, the touched experts
    (mean distinct experts per MoE layer and step) and the KV cache up to the mean valid length;
    then the LM head and B embedding rows. A lower bound: cache padding is not counted."""
    p, a = jnp.dtype(cfg.param_dtype).itemsize, jnp.dtype(cfg.dtype).itemsize
    D, hd, H, N = cfg.d_model, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attention = (2 * D * H * hd + 2 * D * N * hd + 2 * D + 2 * hd) * p
    router = D * cfg.num_experts * p
    experts = touched_experts * 3 * D * cfg.moe_ffn_dim * p
    kv = batch * 2 * N * hd * mean_length * a
    return (
        cfg.num_layers * (attention + router + experts + kv)
        + (D * cfg.vocab_size + batch * D + D) * p
    )


def _touched_experts(expert_ids):
    """Mean number of distinct experts per (MoE layer, decode step) of a [B, L, T, K] trace."""
    ids = np.moveaxis(np.asarray(expert_ids), 0, 2)  # [L, T, B, K]
    ids = np.sort(ids.reshape(*ids.shape[:2], -1), axis=-1)  # [L, T, B*K]
    return float(np.mean(1 + np.sum(np.diff(ids, axis=-1) != 0, axis=-1)))


def _peak_rss_gb():
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss over
    `exec`, so a worker would report its parent's peak (the 1 GiB bandwidth array)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) / 2**20


def espo_worker(path, *, batch, prompt_len, new_tokens, dtype, impl):
    """tokens/s, touched experts and decode step bytes of espo's sampler on a checkpoint."""
    cfg, params = model.load_hf_checkpoint(path)
    if dtype == "bfloat16":
        cfg, params = _as_bf16(cfg, params)
    prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, prompt_len))
    run = _sample_fixed_length(cfg, params, prompts, new_tokens=new_tokens, impl=impl)
    seconds = _timed(lambda: run().tokens, 2)
    ids = np.asarray(run().router.expert_ids)[:, list(cfg.moe_layers)]  # [B, L, T, K]
    touched = _touched_experts(ids)
    step = decode_step_bytes(
        cfg, batch=batch, touched_experts=touched, mean_length=prompt_len + new_tokens / 2
    )
    return {"tokens_per_s": batch * new_tokens / seconds, "touched_experts": touched,
            "step_bytes": step, "steps_per_s": new_tokens / seconds,
            "peak_rss_gb": _peak_rss_gb()}  # fmt: skip


def transformers_worker(path, *, batch, prompt_len, new_tokens, dtype, impl):
    del dtype, impl  # float32 only, as a new user runs it
    cfg, _ = model.load_hf_checkpoint(path)
    prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, prompt_len))
    tps = hf_decode_tokens_per_s(path, prompts, new_tokens=new_tokens)
    return {"tokens_per_s": tps, "peak_rss_gb": _peak_rss_gb()}


WORKERS = {"espo": espo_worker, "transformers": transformers_worker}


def run_engine(engine, path, *, batch, prompt_len, new_tokens, dtype, impl="auto",
               vllm_python=None):  # fmt: skip
    """One engine's measurement in its own process: a dict, or None (the reason printed)."""
    shape = ["--path", str(path), "--batch", str(batch), "--prompt_len", str(prompt_len),
             "--new_tokens", str(new_tokens), "--dtype", dtype]  # fmt: skip
    if engine == "vllm":
        argv = [str(vllm_python), str(ROOT / "experiments" / "vllm_peer.py"), *shape]
    else:
        argv = [sys.executable, __file__, "--worker", engine, "--impl", impl, *shape]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"tokens_per_s"')]
    if proc.returncode != 0 or not lines:  # (vLLM logs to stdout too)
        print(f"{engine} {dtype} failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
        return None
    print(f"  {path.name}: {engine} {dtype} {impl}: {lines[-1]}", file=sys.stderr, flush=True)
    return json.loads(lines[-1])


# Rows of the read's row sums: XLA reads the same bytes at different speeds by layout. Over 64
# long rows (the only layout until 2026-11-30) it reached ~0.5 of what 2^16 rows of 4096 read
# on the 2-core CPU (15-16 against 26-32 GB/s, alternated) and on an H200 2,822 GB/s, where
# the decode kernel's cache reads ran at ~3,900 (docs/gpu run 8): ratios against it read high.
BANDWIDTH_ROWS = (64, 2**12, 2**16)


def read_bandwidth_gbs(*, gib=1.0, repeats=5):
    """The machine's memory read bandwidth: the fastest of jitted row sums over `gib` GiB of
    float32 laid out as each of BANDWIDTH_ROWS rows."""
    n, best = int(gib * 2**30) // 4, 0.0
    total = jax.jit(lambda a: jnp.sum(a, axis=1))
    for rows in BANDWIDTH_ROWS:
        x = jnp.ones((rows, n // rows), jnp.float32)
        best = max(best, x.nbytes / _timed(lambda x=x: total(x), repeats) / 1e9)
        del x
    return best


def moe_sizes(*, peers, vllm_python, batch, prompt_len, new_tokens, sizes=None, rounds=1):
    """Per size (`sizes`: MOE_SIZES names, default all), back to back: espo (capacity f32,
    blocked f32, bf16) and the peers; with rounds > 1 the engines alternate that many times and
    each keeps its median run: (table, per size the espo f32 / best vLLM ratio of each round)."""
    table, ratios = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sizes or MOE_SIZES:
            run = functools.partial(
                run_engine, path=_size_checkpoint(tmp, name), batch=batch,
                prompt_len=prompt_len, new_tokens=new_tokens, vllm_python=vllm_python,
            )  # fmt: skip
            engines = {"espo f32": dict(engine="espo", dtype="float32"),
                       "espo f32 before (blocked, scanned layers)":
                           dict(engine="espo", dtype="float32", impl="blocked+stacked"),
                       "espo bf16": dict(engine="espo", dtype="bfloat16")}  # fmt: skip
            if "transformers" in peers:
                engines["transformers f32"] = dict(engine="transformers", dtype="float32")
            if "vllm" in peers:
                engines["vLLM f32"] = dict(engine="vllm", dtype="float32")
                engines["vLLM bf16"] = dict(engine="vllm", dtype="bfloat16")
            runs = {key: [] for key in engines}
            for _ in range(rounds):
                for key, spec in engines.items():
                    runs[key].append(run(**spec))
                ratio = _espo_over_vllm({key: results[-1] for key, results in runs.items()})
                if ratio is not None:
                    ratios.setdefault(name, []).append(ratio)
            table[name] = {key: _median_run(results) for key, results in runs.items()}
    return table, ratios


def _median_run(results):
    """The run of median tokens/s among `results` (failed runs, None, left out; none: None)."""
    done = sorted((r for r in results if r), key=_tps)
    return done[(len(done) - 1) // 2] if done else None


def _tps(result):
    return float("nan") if result is None else result["tokens_per_s"]


def _espo_over_vllm(row):
    """espo f32's tokens/s over vLLM's better dtype in `row` ({engine: run}); None without a
    vLLM run."""
    vllm = [_tps(row[k]) for k in ("vLLM f32", "vLLM bf16") if row.get(k)]
    return _tps(row["espo f32"]) / max(vllm) if vllm else None


def moe_size_rows(table, ratios, *, bandwidth):
    rows = []
    for name, r in table.items():
        espo = _tps(r["espo f32"])
        for key, result in r.items():
            ratio = "" if key == "espo f32" else f"espo f32 = {espo / _tps(result):.2f}x this"
            rows.append((f"{name}: {key} tokens/s", f"{_tps(result):,.0f}", ratio))
        if (over := _espo_over_vllm(r)) is not None:
            per_round = ", ".join(f"{x:.2f}" for x in ratios.get(name, ()))
            rows.append((f"{name}: espo f32 / vLLM (its better dtype)", f"{over:.2f}x",
                         f"per round {per_round}"))  # fmt: skip
        if r["espo f32"]:
            e = r["espo f32"]
            gbs = e["step_bytes"] * e["steps_per_s"] / 1e9
            rows.append((f"{name}: f32 decode step reads (touched experts/layer "
                         f"{e['touched_experts']:.1f})", f"{e['step_bytes'] / 1e6:.1f} MB",
                         f"{gbs:.1f} GB/s = {gbs / bandwidth:.0%} of measured"))  # fmt: skip
    first, last = list(MOE_SIZES)[1], list(MOE_SIZES)[-1]  # E=8 and E=128 at d256
    for key in ("espo f32", "vLLM f32", "vLLM bf16", "transformers f32"):
        if table.get(first, {}).get(key) and table.get(last, {}).get(key):
            slow = _tps(table[first][key]) / _tps(table[last][key])
            rows.append((f"slowdown E=8 -> E=128 (fixed active params), {key}", f"{slow:.2f}x", ""))
    return rows


def update_tokens_per_s(*, batch=16, length=80, repeats=2):
    """The update's MoE cost at fixed active parameters: tokens/s of the gradient of the mean
    token log-prob (one forward + backward, free routing) at the d256 sizes, capacity vs
    blocked dispatch, in this process (the trainer's step adds the optimizer and the loss)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in list(MOE_SIZES)[1:]:
            cfg, params = model.load_hf_checkpoint(_size_checkpoint(tmp, name))
            tokens = jnp.asarray(np.random.RandomState(0).randint(2, 128, (batch, length)))
            mask = jnp.ones((batch, length), bool)
            for impl in ("capacity", "blocked"):
                logps = functools.partial(train_step.token_logps, cfg, dispatch_impl=impl)
                grad = jax.jit(jax.grad(lambda p: jnp.mean(logps(p, tokens, mask).logps)))  # noqa: B023
                out[(name, impl)] = batch * length / _timed(lambda: grad(params), repeats)  # noqa: B023
    return out


def fp8_read_check(*, experts=128, d=256, f=128, capacity=4):
    """Does XLA:CPU's matmul read e4m3 bytes, or a dequantized copy? The decode-shaped expert
    matmul [E, C, D] x [E, D, F] with float32, bfloat16 and FP8 (dequantized in the jitted
    function, as the model does) weights: time, and the dtype of the dot's weight operand."""
    k = jax.random.split(jax.random.key(0), 2)
    w = jax.random.normal(k[0], (experts, d, f)) / 16
    x = jax.random.normal(k[1], (experts, capacity, d))
    q = quant.quantize_tensor(w, num_in_axes=1, num_out_axes=1, granularity="channel")
    cases = {
        "f32": (lambda x, w: jnp.einsum("ecd,edf->ecf", x, w), (x, w)),
        "bf16": (lambda x, w: jnp.einsum("ecd,edf->ecf", x, w, preferred_element_type=jnp.float32),
                 (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))),
        "fp8 -> f32": (lambda x, q: jnp.einsum("ecd,edf->ecf", x, q.astype(jnp.float32)), (x, q)),
    }  # fmt: skip
    out = {}
    for name, (fn, args) in cases.items():
        jitted = jax.jit(fn)
        hlo = jitted.lower(*args).compile().as_text()
        dots = [ln for ln in hlo.splitlines() if " dot(" in ln or "custom-call(" in ln]
        weight_bytes = args[1].nbytes
        seconds = _timed(lambda: jitted(*args), 20)  # noqa: B023
        out[name] = {
            "ms": seconds * 1e3,
            "reads_e4m3": any("f8e4m3" in ln for ln in dots),
            "GB_per_s": weight_bytes / seconds / 1e9,
        }
    return out


def scaling(*, batches, lengths, prompt_len, name="d256 L4 E128 K4 h64"):
    """espo f32 tokens/s and peak RSS at the E=128 size: B at 64 new tokens, then lengths at
    B=64; each point in its own process."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = _size_checkpoint(tmp, name)
        points = [(b, 64) for b in batches] + [(64, n) for n in lengths if n != 64]
        for b, n in points:
            out[(b, n)] = run_engine(
                "espo", path, batch=b, prompt_len=prompt_len, new_tokens=n, dtype="float32"
            )
    return out


def _config_model(variant):
    """The `model` section of configs/default.py (variant "" or "tiny")."""
    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py"
    return testing.load_script(path).get_config(variant).model


def _hf_checkpoint_like(tmp, m):
    return testing.make_hf_checkpoint(
        tmp, vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.moe_ffn_dim, init_std=0.02,
    )  # fmt: skip


def throughput_rows(variant, *, batch, new_tokens):
    """espo (f32, bf16, fp8) vs transformers generate on configs/default.py's model."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = _hf_checkpoint_like(tmp, _config_model(variant))
        cfg, params = model.load_hf_checkpoint(path)
        prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, 32))
        hf_tps = hf_decode_tokens_per_s(path, prompts, new_tokens=new_tokens)
        cfg16, bf16 = _as_bf16(cfg, params)
        name = f"config {variant or 'default'}, B={batch}, {new_tokens} new"
        for dtype, c, p in (
            ("espo f32", cfg, params),
            ("espo bf16", cfg16, bf16),
            ("espo fp8 (bf16 compute)", cfg16, quant.quantize_fp8(bf16)),
            # On XLA:CPU bf16 dots are slower than f32 ones: dequantizing into f32 is faster.
            ("espo fp8 (f32 compute)", cfg, quant.quantize_fp8(params, keep_dtype="float32")),
        ):
            tps = espo_decode_tokens_per_s(c, p, prompts, new_tokens=new_tokens)
            rows.append((f"decode tokens/s, {dtype} ({name})", f"{tps:,.0f}",
                         f"{tps / hf_tps:.2f}x transformers"))  # fmt: skip
        rows.append((f"decode tokens/s, transformers f32 ({name})", f"{hf_tps:,.0f}", "1.00x"))
    return rows, cfg, params


SECTIONS = (
    "throughput",
    "moe",
    "fp8read",
    "scaling",
    "update",
    "fp8",
    "waste",
    "detok",
    "overlap",
    "gpu",
)
PEERS = ("transformers", "vllm")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--prompt_len", type=int, default=16, help="moe and scaling sections")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (for tests)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections among {SECTIONS}")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"moe section peers among {PEERS}")
    ap.add_argument("--sizes", default="", help="moe section: sizes by expert count (E16,E8,...)")
    ap.add_argument("--rounds", type=int, default=1, help="moe section: engines alternate R times")
    ap.add_argument(
        "--vllm_python",
        default=os.environ.get("ESPO_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
        help="the interpreter of vLLM's own virtualenv (env ESPO_VLLM_PYTHON)",
    )
    ap.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # one engine's measurement, in this process, as one JSON line
        result = WORKERS[args.worker](
            args.path, batch=args.batch, prompt_len=args.prompt_len,
            new_tokens=args.new_tokens, dtype=args.dtype, impl=args.impl,
        )  # fmt: skip
        print(json.dumps(result))
        return
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        ap.error(f"--only={args.only!r}: sections must be among {SECTIONS}")
    peers = set(args.peers.split(",")) - {""}
    if not peers <= set(PEERS):
        ap.error(f"--peers={args.peers!r}: peers must be among {PEERS}")
    if "vllm" in peers and not pathlib.Path(args.vllm_python).exists():
        print(f"vLLM peer: ABSENT, no interpreter at {args.vllm_python} (see vllm_peer.py)")
        peers.discard("vllm")
    by_experts = {name.split()[2]: name for name in MOE_SIZES}  # "E16" -> its name
    if not set(args.sizes.split(",")) - {""} <= set(by_experts):
        ap.error(f"--sizes={args.sizes!r}: sizes must be among {','.join(by_experts)}")
    sizes = [by_experts[e] for e in args.sizes.split(",") if e]
    B, T = (8, 16) if args.quick else (args.batch, args.new_tokens)
    rows = []
    if only & {"moe", "fp8read"}:
        bandwidth = read_bandwidth_gbs()
        rows.append(("memory read bandwidth (fastest 1 GiB f32 row sums)",
                     f"{bandwidth:.1f} GB/s", ""))  # fmt: skip
    if "moe" in only:
        table, ratios = moe_sizes(
            peers=peers, vllm_python=args.vllm_python, batch=B, prompt_len=args.prompt_len,
            new_tokens=T, sizes=sizes, rounds=args.rounds,
        )  # fmt: skip
        rows += moe_size_rows(table, ratios, bandwidth=bandwidth)
        if "vllm" in peers:  # vLLM keeps one of this box's cores for its scheduler unless 0
            reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "unset (vLLM's default)")
            rows.append(("vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU", reserved, ""))
    if "fp8read" in only:
        for name, r in fp8_read_check().items():
            rows.append((f"E=128 decode expert matmul [128,4,256]x[128,256,128], {name} weights",
                         f"{r['ms']:.2f} ms", f"{r['GB_per_s']:.1f} GB/s of stored weight bytes; "
                         f"dot reads e4m3: {r['reads_e4m3']}"))  # fmt: skip
    if "update" in only:
        for (name, impl), tps in update_tokens_per_s().items():
            rows.append((f"update (grad of mean log-prob, B=16 T=80) {name}, {impl}",
                         f"{tps:,.0f}", "tokens/s"))  # fmt: skip
    if "scaling" in only:
        batches, lengths = ((8, 16), (64,)) if args.quick else ((16, 64, 256), (64, 256, 1024))
        for (b, n), r in scaling(
            batches=batches, lengths=lengths, prompt_len=args.prompt_len
        ).items():
            rows.append((f"E=128 espo f32, B={b}, {n} new tokens", f"{_tps(r):,.0f}",
                         "" if r is None else f"peak RSS {r['peak_rss_gb']:.2f} GB"))  # fmt: skip
    if "throughput" in only:
        rows += throughput_rows("tiny", batch=B, new_tokens=T)[0]
        if not args.quick:
            rows += throughput_rows("", batch=B, new_tokens=T)[0]
    if only & {"fp8", "overlap"}:
        with tempfile.TemporaryDirectory() as tmp:
            path = _hf_checkpoint_like(tmp, _config_model("tiny"))
            cfg, params = model.load_hf_checkpoint(path)
    if "fp8" in only:
        prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (B, 32))
        mm = fp8_mismatch(cfg, params, prompts, new_tokens=T)
        rows += [
            ("fp8 vs bf16: mean |dlogp| on fp8-sampled tokens", f"{mm['mean_abs_dlogp']:.4f}", ""),
            ("fp8 vs bf16: greedy-token agreement", f"{mm['greedy_agreement']:.4f}", ""),
            ("fp8 vs bf16: router-id disagreement", f"{mm['router_disagreement']:.4f}", ""),
            ("fp8 weight bytes / bf16 bytes (matmul weights)",
             f"{mm['weight_bytes_ratio']:.3f}", ""),
        ]  # fmt: skip
    if "waste" in only:
        pw = padding_waste(
            num_prompts=16 if args.quick else 64, group_size=4,
            max_new_tokens=128 if args.quick else 1024,
        )  # fmt: skip
        for key, label in (("padding_waste", "+ re-prefill"), ("decode_padding_waste", "decode")):
            fifo = pw["fifo"][f"rollout/{key}"]
            rows.append((f"padding waste ({label}), FIFO (lognormal lengths)", f"{fifo:.3f}", ""))
            for statistic in ("mean", "max"):
                aware = pw[f"length_aware_{statistic}"][f"rollout/{key}"]
                rows.append((f"padding waste ({label}), length-aware, budget {statistic}",
                             f"{aware:.3f}", f"{aware / fifo:.2f}x FIFO"))  # fmt: skip
    if "detok" in only:
        new_tokens = 128 if args.quick else 1024
        dt = detokenization(
            num_prompts=16 if args.quick else 64, group_size=4, max_new_tokens=new_tokens,
            decoder=ByteLevelDecoder(new_tokens + 64),  # the workload's vocabulary
        )  # fmt: skip
        host, workers = dt["host"], dt["workers"]
        for k in ("host_handoff_s", "total_s"):
            rows.append((f"detokenize on host / in workers: rollout/{k}",
                         f"{host[k]:.3f} / {workers[k]:.3f}",
                         f"{host[k] / workers[k]:.2f}x"))  # fmt: skip
    if "overlap" in only:
        ov = overlap(
            cfg, params, num_prompts=4 if args.quick else 16, group_size=4, new_tokens=T,
            sleep_s=0.02 if args.quick else 0.1,
        )  # fmt: skip
        rows.append(("overlap: generation only / reward only (s)",
                     f"{ov['generate_s']:.2f} / {ov['reward_s']:.2f}", ""))  # fmt: skip
        rows.append(("overlap: wall with both (s)", f"{ov['wall_s']:.2f}",
                     f"efficiency {ov['efficiency']:.2f} of ideal max(gen, reward)"))  # fmt: skip
    if "gpu" in only and jax.default_backend() == "gpu":
        kind = jax.devices()[0].device_kind
        big = model.ModelConfig(
            vocab_size=32000, d_model=2048, num_layers=12, num_heads=16, num_kv_heads=4,
            head_dim=128, num_experts=16, top_k=2, moe_ffn_dim=1408, qk_norm=True,
            param_dtype="bfloat16", dtype="bfloat16",
        )  # fmt: skip
        bw = gpu_decode_bandwidth(big, batch=8, new_tokens=256)
        peak = next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in kind), float("nan"))
        for name in ("bf16", "fp8"):
            tps, gbs = bw[name]["tokens_per_s"], bw[name]["GB_per_s"]
            note = f"{gbs:.0f} GB/s = {gbs / peak:.0%} of peak"
            rows.append((f"GPU {kind} decode {name} (1.2B MoE, B=8)", f"{tps:,.0f}", note))
        ratio = bw["fp8"]["tokens_per_s"] / bw["bf16"]["tokens_per_s"]
        rows.append(("GPU fp8 / bf16 decode throughput", f"{ratio:.2f}x", ""))
    width = max((len(r[0]) for r in rows), default=0)
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
