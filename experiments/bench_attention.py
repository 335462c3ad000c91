"""Attention over a whole sequence, per form: time and memory of its value and gradient.

    python experiments/bench_attention.py                       # CPU: dense vs blocked
    python experiments/bench_attention.py --impls dense,blocked,triton --lengths 2048,8192,32768
    python experiments/bench_attention.py --only model --lengths 8192,32768   # one Qwen3 layer

`attention`: `espo.model.attention.attend` on one row of T tokens with Qwen3-30B-A3B's heads (4
kv heads of 128, 8 query heads each), two packed segments and 5% padding, bf16: the jitted value
and gradient (q, k, v) of sum(out * w), per form. Printed per (T, form): temporaries from XLA's
memory analysis of the compiled program (exact, nothing run), the median time of `--reps` runs,
the causal FLOPs per second (forward 2 matmuls + backward 5, over the visible half of the
T x T tiles), and the largest difference from the reference form ("blocked", float32
statistics) on the real queries, relative to the reference's largest value.
`model`: the update's gradient (`train_step.token_logps(...).logps.sum()`) of one
Qwen3-30B-A3B-shaped layer with its embedding and head (V = 151,936), bf16, one row of T
tokens, remat full, head in chunks, per attention form: temporaries, time, tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_moe  # noqa: E402

from espo import train_step  # noqa: E402
from espo.model import attention, transformer  # noqa: E402
from espo.model.config import ModelConfig  # noqa: E402


def _gib(n: float) -> float:
    return n / 2**30


def _inputs(T: int, *, N=4, G=8, Dh=128, dtype=jnp.bfloat16, seed=0):
    """q [1, N, T*G, Dh], k, v [1, N, T, Dh], a weight w like q, and the positions of one packed
    row: two segments, the last 5% padding."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (1, N, T * G, Dh), dtype)
    k, v = (jax.random.normal(kk, (1, N, T, Dh), dtype) for kk in ks[1:3])
    w = jax.random.normal(ks[3], q.shape, dtype)
    seg = np.ones((1, T), np.int32)
    seg[:, T // 3 :] = 2
    seg[:, T - T // 20 :] = 0
    seg = jnp.asarray(seg)
    pos = transformer.segment_positions(seg)
    return (
        q,
        k,
        v,
        w,
        dict(
            q_positions=pos,
            kv_positions=jnp.where(seg > 0, pos, -1),
            q_segments=seg,
            kv_segments=seg,
            own_keys=True,
        ),
    )


def _timed(fn, *args, reps: int) -> float:
    """Median seconds of `reps` runs after a warm-up (bench_moe's timer)."""
    return bench_moe._steady_ms(fn, args, reps) / 1e3


def bench_attention(lengths, impls, *, reps: int) -> list[dict]:
    rows = []
    for T in lengths:
        q, k, v, w, kw = _inputs(T)
        real = jnp.repeat(kw["q_segments"] > 0, q.shape[2] // T, axis=1)[:, None, :, None]

        def loss(q, k, v, impl, kw=kw, real=real, w=w):
            out = attention.attend(q, k, v, dtype=q.dtype, impl=impl, **kw)
            return jnp.sum(jnp.where(real, out * w, 0).astype(jnp.float32)), out

        ref = None
        for impl in impls:
            fn = jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl), (0, 1, 2), True))
            try:
                compiled = fn.lower(q, k, v).compile()
            except Exception as e:  # noqa: BLE001 - a form that does not compile is a row
                rows.append(dict(T=T, impl=impl, error=f"{type(e).__name__}: {str(e)[:120]}"))
                print(rows[-1])
                continue
            temp = compiled.memory_analysis().temp_size_in_bytes
            row = dict(T=T, impl=impl, temp_gib=_gib(temp))
            if reps:
                (_, out), grads = compiled(q, k, v)
                seconds = _timed(compiled, q, k, v, reps=reps)
                visible = (T // 3) ** 2 / 2 + (T - T // 3 - T // 20) ** 2 / 2  # causal pairs
                flops = 7 * 2 * visible * q.shape[1] * (q.shape[2] // T) * q.shape[3]
                row.update(seconds=seconds, tflops=flops / seconds / 1e12)
                got = [np.asarray(a, np.float32) for a in (out, *grads)]
                if ref is None:
                    ref = got
                else:
                    mask = np.asarray(real)
                    errs = [
                        np.abs(np.where(mask, a - b, 0)).max() / max(np.abs(b).max(), 1e-30)
                        if a.shape[2] == mask.shape[2]  # out, dq: the real queries only
                        else np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
                        for a, b in zip(got, ref, strict=True)
                    ]
                    row["rel_err_out_dq_dk_dv"] = [float(e) for e in errs]
            rows.append(row)
            print(row, flush=True)
    return rows


def bench_model(lengths, impls, *, reps: int) -> list[dict]:
    rows = []
    for T in lengths:
        for impl in impls:
            cfg = ModelConfig.qwen3_30b_a3b(num_layers=1, attention_impl=impl, remat="full")
            params = transformer.param_shapes(cfg)
            tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
            mask = jax.ShapeDtypeStruct((1, T), jnp.bool_)

            def loss(params, tokens, mask, cfg=cfg):
                return train_step.token_logps(cfg, params, tokens, mask).logps.sum()

            compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()
            row = dict(T=T, impl=impl, temp_gib=_gib(compiled.memory_analysis().temp_size_in_bytes))
            if reps:
                real = transformer.init(cfg, jax.random.key(0))
                toks = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
                ones = jnp.ones((1, T), bool)
                seconds = _timed(compiled, real, toks, ones, reps=reps)
                row.update(seconds=seconds, tokens_per_s=T / seconds)
                del real
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="attention", help="attention,model")
    ap.add_argument("--impls", default="blocked,dense", help="forms; the first is the reference")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--dense_max", type=int, default=8192, help="longest T for 'dense'")
    ap.add_argument("--reps", type=int, default=3, help="0: compile only (memory)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    impls = args.impls.split(",")
    print("backend", jax.default_backend(), jax.devices()[0].device_kind, jax.__version__)
    out = {}
    # 'dense' past dense_max would only measure the quadratic wall
    per_t = lambda T: [i for i in impls if i != "dense" or not args.dense_max < T]
    if "attention" in args.only:
        out["attention"] = [
            r for T in lengths for r in bench_attention([T], per_t(T), reps=args.reps)
        ]
    if "model" in args.only:
        out["model"] = [r for T in lengths for r in bench_model([T], per_t(T), reps=args.reps)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
