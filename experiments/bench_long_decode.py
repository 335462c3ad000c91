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
must read (`bench_rollout.decode_step_bytes`: the weights, of each MoE layer the distinct
experts the first decode steps' routing touched, and the cache's filled slots) and that per
step time against the machine's read bandwidth measured in the same run
(`bench_rollout.read_bandwidth_gbs`).

What should hold: a step reads every layer's weights once and the filled part of the cache
(`layers.decode_attention` visits the slots written so far, in blocks, not the buffer), so the
step time grows with C only through the cache's bytes; the prefill over the cache takes the
blocked attention (linear memory) from 1,024 slots up.

Attention arms (`--attention`, alternated within each repetition over one prefilled cache):
"auto" = the step as the sampler takes it by default (`layers.decode_attention` over the filled
slots: on CPU XLA's block loop, on a GPU `gpu_attention`'s Triton kernel); on a GPU only:
"kernel" = that kernel named (`layers.GPU_BLOCKED_DECODE` on), "dense" = the softmax over the
whole cache buffer, two batched matmuls (the flag off: what "auto" took in session 42), and
"blocked" = `model.attention_impl="blocked"`, XLA's FlashAttention loop over the buffer's key
blocks (the default until run 7). On an H200 at 16 rows x 32k tokens (docs/gpu run 8): kernel
2.4 ms a step, dense 4.0, blocked 15.1.

Models (`--model`): "default" = configs/default.py's model (float32); "qwen3_L<n>" = n layers
of `ModelConfig.qwen3_30b_a3b` (bf16; too slow for this CPU at long contexts).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_memory  # noqa: E402
import bench_rollout  # noqa: E402

from espo.model import handle, layers, transformer  # noqa: E402


def kv_cache_gib(cfg, rows: int, slots: int) -> float:
    """The KV cache's size: layers x (k, v) x rows x kv heads x slots x head dim x itemsize."""
    itemsize = jnp.dtype(cfg.jnp_dtype).itemsize
    n = cfg.num_layers * 2 * rows * cfg.num_kv_heads * slots * cfg.head_dim
    return n * itemsize / 2**30


# arm: (model.attention_impl, layers.GPU_BLOCKED_DECODE) of its decode step (module docstring;
# None: the flag as it is set)
ARMS = {
    "auto": ("auto", None),
    "kernel": ("auto", True),
    "dense": ("dense", False),
    "blocked": ("blocked", False),
}


def measure(
    cfg, context: int, *, rows: int, new: int, reps: int, seed: int = 0, arms=("auto",)
) -> list[dict]:
    """One context's prefill and decode step, one row per attention arm (module docstring)."""
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
    tokens = jax.random.randint(jax.random.key(seed + 2), (new, rows, 1), 1, cfg.vocab_size)
    fresh = lambda: model.init_cache(batch=rows, max_length=slots)  # noqa: E731
    t0 = time.perf_counter()
    cache = jax.block_until_ready(prefill(params, fresh()))
    compile_s = time.perf_counter() - t0

    def decode_step(arm):
        """The arm's step compiled ahead of the timing, with its settings (GPU_BLOCKED_DECODE is
        read while tracing), so the timed loop runs the compiled program alone."""
        impl, gpu_blocked = ARMS[arm]
        arm_model = handle.Model(cfg.replace(attention_impl=impl))

        def forward(p, tok, c):
            return arm_model.forward(p, tok, attention_mask=jnp.ones_like(tok, bool), cache=c)

        if gpu_blocked is None:
            gpu_blocked = layers.GPU_BLOCKED_DECODE
        with mock.patch.object(layers, "GPU_BLOCKED_DECODE", gpu_blocked):
            return jax.jit(forward, donate_argnums=2).lower(params, tokens[0], cache).compile()

    steps = {arm: decode_step(arm) for arm in arms}
    prefill_s, step_s, routes = [], {arm: [] for arm in arms}, []
    for _ in range(reps):
        empty = jax.block_until_ready(fresh())
        t0 = time.perf_counter()
        cache = jax.block_until_ready(prefill(params, empty))
        prefill_s.append(time.perf_counter() - t0)
        for arm, step in steps.items():  # alternated: a machine under other load slows both
            first = step(params, tokens[0], cache)  # a first run, untimed
            routes.append(np.asarray(first.router.expert_ids)[:, list(cfg.moe_layers)])
            cache = jax.block_until_ready(prefill(params, fresh()))
            t0 = time.perf_counter()
            for i in range(new):
                cache = step(params, tokens[i], cache).cache
            jax.block_until_ready(cache)
            step_s[arm].append((time.perf_counter() - t0) / new)
    # The distinct experts a step's routing touched, per MoE layer (the first steps' traces),
    # spread over every layer as decode_step_bytes counts them.
    touched = float(np.mean([bench_rollout._touched_experts(r) for r in routes]))
    per_layer = touched * len(cfg.moe_layers) / cfg.num_layers
    read = bench_rollout.decode_step_bytes(
        cfg, batch=rows, touched_experts=per_layer, mean_length=context + new // 2
    )  # the weights a step reads and the filled cache
    out = []
    for arm in arms:
        step_ms = 1e3 * float(np.median(step_s[arm]))
        out.append(dict(
            attention=arm, read_gb=read / 1e9, read_gbs=read / step_ms / 1e6,
            touched_experts=touched,
            context=context, rows=rows, new=new, compile_s=compile_s,
            prefill_s=float(np.median(prefill_s)), step_ms=step_ms,
            tokens_per_s=rows / step_ms * 1e3, kv_cache_gib=kv_cache_gib(cfg, rows, slots),
        ))  # fmt: skip
    return out


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
    p.add_argument("--attention", default="auto", help=f"comma-separated arms among {[*ARMS]}")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    arms = tuple(args.attention.split(","))
    if not set(arms) <= set(ARMS) or len(set(arms)) < len(arms):
        p.error(f"--attention: {args.attention!r}; valid: distinct arms among {[*ARMS]}")
    if set(arms) - {"auto"} and jax.default_backend() != "gpu":
        p.error(f"--attention: {args.attention!r}: arms other than 'auto' need a GPU "
                f"(this backend: {jax.default_backend()})")  # fmt: skip
    cfg = bench_memory.model_config(args.model).replace(moe_chunk=args.moe_chunk)
    heads = f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}"
    kind = jax.devices()[0].device_kind
    print(f"{args.model}: {kind}, {cfg.num_layers} layers, {heads}, {cfg.dtype}, {args.rows} rows")
    bandwidth = bench_rollout.read_bandwidth_gbs()
    print(f"memory read bandwidth (the fastest of 1 GiB row sums): {bandwidth:.1f} GB/s")
    print("| context | attention | prefill s | decode ms/step | output tokens/s | x step vs first "
          "| KV cache GiB | GB a step reads | of the bandwidth | compile s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for c in (int(x) for x in args.contexts.split(",")):
        for r in measure(cfg, c, rows=args.rows, new=args.new, reps=args.reps, arms=arms):
            first = next(x for x in rows + [r] if x["attention"] == r["attention"])
            rows.append(r)
            print(
                f"| {c} | {r['attention']} | {r['prefill_s']:.2f} | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s']:.1f} | {r['step_ms'] / first['step_ms']:.2f} | "
                f"{r['kv_cache_gib']:.3f} | {r['read_gb']:.4f} | {r['read_gbs'] / bandwidth:.2f} | "
                f"{r['compile_s']:.1f} |",
                flush=True,
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
