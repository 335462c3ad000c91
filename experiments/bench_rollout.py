"""Rollout benchmark: one table from one run on the same weights.

  python experiments/bench_rollout.py [--batch 64] [--new_tokens 128] [--quick]
      [--only throughput,fp8,waste,detok,overlap]

Rows:
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
import pathlib
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


def espo_decode_tokens_per_s(cfg, params, prompts, *, new_tokens, repeats=2):
    lengths = np.full(len(prompts), prompts.shape[1])
    run = functools.partial(
        sampler.sample, model.Model(cfg), params, prompts, lengths, key=jax.random.key(0),
        num_samples=1, max_new_tokens=new_tokens, stop_ids=_never_stop(cfg), pad_id=0,
        buckets=scheduling.LengthBuckets(
            prompt_buckets=(prompts.shape[1],), generation_buckets=(new_tokens,)
        ),
    )  # fmt: skip
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
    config = rollout.RolloutConfig(sampling=sampling, buckets=buckets, max_chunk_size=16)
    return (*counting_model(vocab), prompts, ids, config)


def _run_step(pool, workload, *, schedule="length_aware", **kw):
    m, params, prompts, ids, config = workload
    n = len(prompts)
    return rollout.generate_and_score(
        m, params, prompts=prompts, prompt_texts=["p"] * n, metas=[{}] * n, group_sizes=1,
        key=jax.random.key(0), config=dataclasses.replace(config, schedule=schedule),
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
    config = rollout.RolloutConfig(
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


SECTIONS = ("throughput", "fp8", "waste", "detok", "overlap", "gpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (for tests)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections among {SECTIONS}")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        ap.error(f"--only={args.only!r}: sections must be among {SECTIONS}")
    B, T = (8, 16) if args.quick else (args.batch, args.new_tokens)
    rows = []
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
