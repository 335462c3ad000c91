"""Decoding at a reasoning trace's length: the sampler's step time with 1k to 32k tokens of context.

  python experiments/bench_long_decode.py                                  # CPU, default model
  python experiments/bench_long_decode.py --contexts 1024,8192,32768 --rows 4 --new 128
  python experiments/bench_long_decode.py --model qwen3_L4 --rows 16 --moe-chunk 4096  # a GPU

Per context C: `--rows` prompts of C real tokens (random ids, no padding) written into a KV
cache of C + `--new` + 1 slots by the prefill (`model.forward` with the cache, as
`sampler.sample_chunk` runs it), then `--new` decode steps (`model.forward` of one token per
row over the cache, the cache donated: what the sampler's loop runs, less the sampling), timed
apart; medians of `--reps` runs. Output tokens/s = rows / step time. Also printed: the KV
cache's bytes (layers x 2 x rows x kv heads x slots x head dim x itemsize), the bytes a step
must read (`bench_rollout.decode_step_bytes`: the weights, at most rows x top-k experts a
layer, and the cache's filled slots) and that per step time against the machine's read
bandwidth measured in the same run (`bench_rollout.read_bandwidth_gbs`).

What should hold: a step reads every layer's weights once and the filled part of the cache
(`layers.decode_attention` visits the slots written so far, in blocks, not the buffer), so the
step time grows with C only through the cache's bytes; the prefill over the cache takes the
blocked attention (linear memory) from 1,024 slots up.

Models (`--model`): "default" = configs/default.py's model (float32); "qwen3_L<n>" = n layers
of `ModelConfig.qwen3_30b_a3b` (bf16; too slow for this CPU at long contexts).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_memory  # noqa: E402
import bench_rollout  # noqa: E402

from espo.model import handle, transformer  # noqa: E402


def kv_cache_gib(cfg, rows: int, slots: int) -> float:
    """The KV cache's size: layers x (k, v) x rows x kv heads x slots x head dim x itemsize."""
    itemsize = jnp.dtype(cfg.jnp_dtype).itemsize
    n = cfg.num_layers * 2 * rows * cfg.num_kv_heads * slots * cfg.head_dim
    return n * itemsize / 2**30


def measure(cfg, context: int, *, rows: int, new: int, reps: int, seed: int = 0) -> dict:
    """One context's prefill and decode step (module docstring)."""
    model = handle.Model(cfg)
    params = transformer.init(cfg, jax.random.key(seed))
    if hasattr(model, "decode_params"):  # as sampler.sample_chunk does
        params = model.decode_params(params)
    prompts = jax.random.randint(jax.random.key(seed + 1), (rows, context), 1, cfg.vocab_size)
    mask = jnp.ones((rows, context), bool)
    slots = context + new + 1
    prefill = jax.jit(
        lambda p, c: model.forward(p, prompts, attention_mask=mask, cache=c).cache
    )  # fmt: skip
    step = jax.jit(
        lambda p, tok, c: model.forward(p, tok, attention_mask=jnp.ones_like(tok, bool), cache=c),
        donate_argnums=2,
    )  # fmt: skip
    tokens = jax.random.randint(jax.random.key(seed + 2), (new, rows, 1), 1, cfg.vocab_size)
    t0 = time.perf_counter()
    cache = jax.block_until_ready(prefill(params, model.init_cache(batch=rows, max_length=slots)))
    compile_s = time.perf_counter() - t0
    prefill_s, step_s = [], []
    for _ in range(reps):
        empty = jax.block_until_ready(model.init_cache(batch=rows, max_length=slots))
        t0 = time.perf_counter()
        cache = jax.block_until_ready(prefill(params, empty))
        prefill_s.append(time.perf_counter() - t0)
        jax.block_until_ready(step(params, tokens[0], cache).cache)  # compiled once, then timed
        cache = jax.block_until_ready(
            prefill(params, model.init_cache(batch=rows, max_length=slots))
        )
        t0 = time.perf_counter()
        for i in range(new):
            cache = step(params, tokens[i], cache).cache
        jax.block_until_ready(cache)
        step_s.append((time.perf_counter() - t0) / new)
    step_ms = 1e3 * float(np.median(step_s))
    touched = min(cfg.num_experts, rows * cfg.top_k)  # at most: every row's own experts
    read = bench_rollout.decode_step_bytes(
        cfg, batch=rows, touched_experts=touched, mean_length=context + new // 2
    )  # the weights a step reads and the filled cache
    return dict(
        read_gb=read / 1e9, read_gbs=read / step_ms / 1e6,
        context=context, rows=rows, new=new, compile_s=compile_s,
        prefill_s=float(np.median(prefill_s)), step_ms=step_ms,
        tokens_per_s=rows / step_ms * 1e3, kv_cache_gib=kv_cache_gib(cfg, rows, slots),
    )  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="default", help="default | qwen3_L<n>")
    p.add_argument("--contexts", default="1024,8192,32768", help="tokens of context, comma-sep.")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--new", type=int, default=128, help="decode steps timed")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--moe-chunk", type=int, default=0, help="model.moe_chunk (the prefill's)")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    cfg = bench_memory.model_config(args.model).replace(moe_chunk=args.moe_chunk)
    heads = f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}"
    kind = jax.devices()[0].device_kind
    print(f"{args.model}: {kind}, {cfg.num_layers} layers, {heads}, {cfg.dtype}, {args.rows} rows")
    bandwidth = bench_rollout.read_bandwidth_gbs()
    print(f"memory read bandwidth (a jitted 1 GiB row sum): {bandwidth:.1f} GB/s")
    print("| context | prefill s | decode ms/step | output tokens/s | x step vs first | "
          "KV cache GiB | GB a step reads | of the bandwidth | compile s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for c in (int(x) for x in args.contexts.split(",")):
        r = measure(cfg, c, rows=args.rows, new=args.new, reps=args.reps)
        rows.append(r)
        print(
            f"| {c} | {r['prefill_s']:.2f} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['step_ms'] / rows[0]['step_ms']:.2f} | {r['kv_cache_gib']:.3f} | "
            f"{r['read_gb']:.4f} | {r['read_gbs'] / bandwidth:.2f} | {r['compile_s']:.1f} |",
            flush=True,
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
