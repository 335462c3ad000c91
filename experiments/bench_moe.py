"""MoE and decode on the accelerator: what XLA compiles each dispatch path to, and what it costs.

  python experiments/bench_moe.py [--quick] [--json FILE] [--only hlo,gmm,decode]

Sections (one run, the same weights; every number a ratio against a bound measured or computed
in the same run):
  hlo:    per dispatch path (`espo.model.experts.expert_ffn` impls), the optimized HLO of the
          experts' forward at decode and update row counts: the compiler's FLOP count
          (`cost_analysis`) over the useful FLOPs of the rows (2 R D F x 3), whether a
          ragged-dot survives (a grouped GEMM) or was rewritten, and the dots / GEMM calls left.
          A ratio near E says every row is multiplied by every expert (dense).
  gmm:    the same paths timed, forward at decode rows (B=8 and B=64 tokens x K) and forward +
          backward at update rows, the Mosaic GPU grouped matmul (`mosaic_gpu`,
          espo.model.grouped; its reference form off Hopper) and the Triton one (`triton`:
          programs only for the touched experts' rows; interpret mode off a GPU) among them;
          each checked against `ragged` (XLA's ragged_dot, the suite's reference) before it is
          timed. Reported: ms, useful TFLOP/s, and at decode the touched experts' weight bytes /
          time against the HBM peak.
  tiles:  the Triton path's forward at decode rows, bf16 and FP8 experts, per tile setting
          (TILES: grouped.TRITON_TILES' block widths, warps, pipeline stages).
  decode: kernels per decode step (the top-level ops of the sampler's `while_loop` body, loops
          inside it counted by their trip counts), tokens/s and ms a step, bf16 and FP8 weights,
          B=8 and B=64, the layers as a scan over stacked [L, ...] weights (the GPU layout
          before issue 35) or unrolled over per-layer weights (`Model.decode_params` now), and
          XLA's ragged_dot against the "auto" dispatch (`DECODE_RUNS`).
  attention: decode tokens/s with attention over the whole cache buffer against the filled
          slots only (`layers.decode_attention`: XLA's block loop on CPU, on a GPU
          `gpu_attention`'s Triton kernel), at 1024 and 4096 new tokens, B=8, alternated in one
          process.
  --tpu v5e:2x2: the hlo section compiled for a TPU of that topology without one (JAX's
          deviceless AOT: `pip install libtpu==0.0.42.1`, jax[tpu]'s pin for jax 0.10.2), the
          bench MoE in bf16, XLA's paths and megablox's (`experts.expert_ffn(impl="megablox")`),
          and the model's value and gradient (one layer, 8 x 512 tokens) per path.
          A Pallas kernel's FLOPs there are its declared `CostEstimate` (megablox: the useful
          ones), XLA's own ops' FLOPs the compiler's count.
On a GPU the model is bench_rollout.py's 1.2B MoE (D=2048, F=1408, 16 experts top-2, 12 layers,
bf16); elsewhere configs/default.py's model class in float32 (--quick: the tiny one).
`experiments/gpu_check.sh` runs this first on a lent GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import re
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from espo import model, quant, sampler
from espo.model import experts, grouped, layers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_rollout  # noqa: E402

SECTIONS = ("hlo", "gmm", "tiles", "fp8", "decode", "attention")
# The Triton grouped matmul's tiles tried by the tiles section (grouped.TRITON_TILES fields).
TILES = (  # run 5 (docs/gpu): 128/64/4/4 fastest at 128 rows; 64-wide and 256-wide blocks slower
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4),
    dict(block_n=128, block_k=128, num_warps=4, num_stages=3),
    dict(block_n=128, block_k=128, num_warps=8, num_stages=3),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4, split_k=2),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4, split_k=4),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4, fp8_operand="float16"),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4, fp8_operand="float8"),
    dict(block_n=128, block_k=64, num_warps=4, num_stages=4, split_k=4, fp8_operand="float8"),
)
GPU_MODEL = dict(
    vocab_size=32000, d_model=2048, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=128,
    num_experts=16, top_k=2, moe_ffn_dim=1408, qk_norm=True, param_dtype="bfloat16",
    dtype="bfloat16",
)  # fmt: skip
CPU_MODEL = dict(
    vocab_size=128, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    num_experts=16, top_k=4, moe_ffn_dim=128, qk_norm=True,
)  # fmt: skip
# Ops that launch nothing (views, tuples, parameters) in an optimized HLO computation.
_FREE = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "get-dimension-size",
}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\b([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


# ---- optimized HLO: computations, kernels per loop iteration -----------------------------------
def computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """{computation: [(opcode, line)]} of an optimized HLO module's text, and the entry's name."""
    comps, entry, current = {}, "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and " = " not in line.split("{")[0]:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None and (op := _INSTRUCTION.match(line)):
            comps[current].append((op.group(1), line))
    return comps, entry


def _called(line: str, attr: str) -> list[str]:
    m = re.search(r"\b" + attr + r"=(\{[^}]*\}|%?[\w.\-]+)", line)
    return [n.strip(" %{}") for n in m.group(1).split(",")] if m else []


def _trip_count(line: str) -> int | None:
    m = re.search(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)', line)
    return int(m.group(1)) if m else None


def kernels(comps, name: str, unknown_trip: int = 1) -> int:
    """Kernels one execution of computation `name` launches: its top-level ops (a fusion or a
    custom call is one), a while loop's body times its known trip count (`unknown_trip` if none),
    a conditional's largest branch, a call's callee."""
    total = 0
    for op, line in comps.get(name, ()):
        if op in _FREE:
            continue
        if op == "while":
            trip = _trip_count(line) or unknown_trip
            body, cond = _called(line, "body"), _called(line, "condition")
            total += trip * sum(kernels(comps, b, unknown_trip) for b in body)
            total += (trip + 1) * sum(kernels(comps, c, unknown_trip) for c in cond)
        elif op == "conditional":
            branches = _called(line, "branch_computations") or (
                _called(line, "true_computation") + _called(line, "false_computation")
            )
            total += max((kernels(comps, b, unknown_trip) for b in branches), default=0)
        elif op == "call":
            total += sum(kernels(comps, c, unknown_trip) for c in _called(line, "to_apply"))
        else:
            total += 1
    return total


def loop_kernels(hlo: str) -> dict:
    """The entry's heaviest while loop (the decode loop of a sampler chunk): kernels per
    iteration (body + condition), and the opcodes of its body."""
    comps, entry = computations(hlo)
    loops = [line for op, line in comps.get(entry, ()) if op == "while"]
    if not loops:
        return {"per_iteration": 0, "opcodes": {}}
    per = [
        sum(kernels(comps, b) for b in _called(line, "body"))
        + sum(kernels(comps, c) for c in _called(line, "condition"))
        for line in loops
    ]
    line = loops[int(np.argmax(per))]
    ops: dict[str, int] = {}
    for b in _called(line, "body"):
        for op, _ in comps[b]:
            if op not in _FREE:
                ops[op] = ops.get(op, 0) + 1
    return {"per_iteration": max(per), "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def _flops(compiled) -> float:
    """The compiler's FLOP count of a compiled function (`cost_analysis`), NaN if it has none."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", float("nan")))


def hlo_summary(compiled, useful_flops: float) -> dict:
    """What the compiler made of a function: its FLOPs against the useful ones, grouped-GEMM ops
    left, dots and GEMM custom calls (with their output shapes)."""
    text = compiled.as_text()
    flops = _flops(compiled)
    comps, _ = computations(text)
    lines = [(op, line) for comp in comps.values() for op, line in comp]
    targets = [
        m.group(1) for _, ln in lines if (m := re.search(r'custom_call_target="([^"]+)"', ln))
    ]
    dots = [  # TPU HLO multiplies in convolutions
        re.search(r"=\s*(\S+)", ln).group(1) for op, ln in lines if op in ("dot", "convolution")
    ]
    return {
        "flops_over_useful": flops / useful_flops,
        "ragged_dot_ops": sum(op == "ragged-dot" for op, _ in lines),
        "dots": dots[:12],
        "custom_calls": sorted(set(targets)),
    }


def tpu_topology(topology: str):
    """The devices of a TPU `topology` ("v5p:2x2x1"; JAX's deviceless AOT, libtpu installed)."""
    from jax.experimental import topologies

    shape = topology.split(":")[1]
    bounds = tuple(int(n) for n in shape.split("x")) + (1,) * (3 - len(shape.split("x")))
    return topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chip_config_name="default",
        chips_per_host_bounds=bounds, num_slices=1,
    )  # fmt: skip


def _tpu_device(topology: str):
    """The first device of a TPU `topology` and a replicated sharding on it."""
    topo = tpu_topology(topology)
    one = jax.sharding.Mesh(topo.devices[:1], ("x",))
    spec = jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec())
    return topo.devices[0].device_kind, spec


def _as_tpu():
    """Traces as on a TPU: the Pallas kernels lowered for Mosaic TPU, not interpreted (they
    choose by `jax.default_backend()`, which is this host's)."""
    return mock.patch.object(jax, "default_backend", lambda: "tpu")


def tpu_hlo_rows(topology: str, impls, *, d, f, experts, top_k, dtype, row_counts) -> list:
    """`gmm_rows`' HLO summaries compiled for a TPU `topology` (e.g. "v5e:2x2") on this host:
    abstract arguments on the topology's first device, nothing run."""
    kind, spec = _tpu_device(topology)
    arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=spec)  # noqa: E731
    weights = (
        arg((experts, d, f), dtype),
        arg((experts, d, f), dtype),
        arg((experts, f, d), dtype),
    )
    out = []
    for tokens, backward in row_counts:
        rows = tokens * top_k
        useful = _useful_flops(rows, d, f, backward)
        for impl in impls:
            row = {"impl": impl, "tokens": tokens, "rows": rows, "backward": backward,
                   "device": kind}  # fmt: skip
            fn = _experts_fn(impl, backward)
            try:
                with _as_tpu():
                    traced = fn.trace(arg((rows, d), dtype), arg((experts,), jnp.int32), *weights)
                row.update(hlo_summary(traced.lower().compile(), useful))
            except Exception as err:  # as gmm_rows: say why, go on
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def tpu_model_rows(topology: str, cfg, impls, *, batch: int = 8, length: int = 512) -> list:
    """The model's value and gradient (logsumexp of the logits, every parameter) on [batch,
    length] tokens per dispatch path, compiled for a TPU `topology`: the compiler's TFLOPs."""
    kind, spec = _tpu_device(topology)
    params = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spec), params)
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=spec)
    out = []
    for impl in impls:

        def loss(p, t, impl=impl):
            logits = model.forward(cfg, p, t, dispatch_impl=impl).logits.astype(jnp.float32)
            return jnp.mean(jax.nn.logsumexp(logits, -1))

        with _as_tpu():
            traced = jax.jit(jax.value_and_grad(loss)).trace(params, tokens)
        row = {"impl": impl, "device": kind, "layers": cfg.num_layers, "tokens": batch * length,
               "tflops": _flops(traced.lower().compile()) / 1e12}  # fmt: skip
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


# ---- the grouped matmul paths -------------------------------------------------------------------
def routed_rows(key, *, tokens: int, d: int, experts: int, top_k: int, dtype):
    """Rows sorted by expert, as `experts.dispatch` hands them to `expert_ffn`: top-k of random
    router logits per token, so group sizes are uneven and some may be empty."""
    k1, k2 = jax.random.split(key)
    ids = jax.lax.top_k(jax.random.normal(k1, (tokens, experts)), top_k)[1].reshape(-1)
    group_sizes = jnp.bincount(ids, length=experts).astype(jnp.int32)
    xs = jax.random.normal(k2, (tokens * top_k, d), dtype)
    return xs, group_sizes, int(np.unique(np.asarray(ids)).size)


def expert_weights(key, *, d: int, f: int, experts: int, dtype):
    k = jax.random.split(key, 3)
    w = lambda i, shape: jax.random.normal(k[i], shape, jnp.float32) / np.sqrt(shape[1])
    return tuple(
        a.astype(dtype)
        for a in (w(0, (experts, d, f)), w(1, (experts, d, f)), w(2, (experts, f, d)))
    )


def ffn_of(impl: str):
    return functools.partial(experts.expert_ffn, impl=impl)


def _steady_ms(fn, args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))


def _loss(ffn):
    return lambda xs, gs, *w: jnp.sum(ffn(xs, gs, *w).astype(jnp.float32) ** 2)


def _experts_fn(impl: str, backward: bool):
    """The experts' forward, or the gradients of `_loss` in xs and the three weights, jitted."""
    ffn = ffn_of(impl)
    return jax.jit(jax.grad(_loss(ffn), argnums=(0, 2, 3, 4)) if backward else ffn)


def _useful_flops(rows: int, d: int, f: int, backward: bool) -> float:
    """The SwiGLU experts' FLOPs on their own rows: 3 matmuls, 3x that with the backward."""
    return 2.0 * rows * d * f * 3 * (3 if backward else 1)


def gmm_rows(impls, *, d, f, experts, top_k, dtype, row_counts, peak_gbs, timed=True):
    """Per (impl, tokens): HLO summary, error against `ragged`, time, useful TFLOP/s, GB/s."""
    weights = expert_weights(jax.random.key(1), d=d, f=f, experts=experts, dtype=dtype)
    reference = _experts_fn("ragged", backward=False)
    ref_grads = _experts_fn("ragged", backward=True)
    out = []
    for tokens, backward in row_counts:
        xs, gs, touched = routed_rows(
            jax.random.key(tokens), tokens=tokens, d=d, experts=experts, top_k=top_k, dtype=dtype
        )  # fmt: skip
        rows = xs.shape[0]
        useful = _useful_flops(rows, d, f, backward)
        ref = np.asarray(reference(xs, gs, *weights), np.float32)
        for impl in impls:
            row = {"impl": impl, "tokens": tokens, "rows": rows, "backward": backward}
            try:
                ffn = ffn_of(impl)
                fn = _experts_fn(impl, backward)
                row.update(hlo_summary(fn.lower(xs, gs, *weights).compile(), useful))
                y = np.asarray(jax.jit(ffn)(xs, gs, *weights), np.float32)
                row["max_rel_err"] = _rel_err(y, ref)
                if backward:  # the gradients against ragged's
                    grads = fn(xs, gs, *weights)
                    row["grad_max_rel_err"] = max(
                        _rel_err(g, r)
                        for g, r in zip(grads, ref_grads(xs, gs, *weights), strict=True)
                    )
                if timed:
                    ms = _steady_ms(fn, (xs, gs, *weights))
                    row.update(ms=ms, tflops=useful / ms / 1e9)
                    if not backward:  # the touched experts' weights, read once
                        nbytes = touched * 3 * d * f * jnp.dtype(dtype).itemsize
                        row.update(gbs=nbytes / ms / 1e6, hbm=nbytes / ms / 1e6 / peak_gbs)
            except Exception as err:  # a candidate that does not build here: say why, go on
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def tile_rows(*, d, f, experts, top_k, dtype, peak_gbs, tokens_list=(8, 64), tiles=TILES):
    """The Triton path's forward (bf16 and FP8 experts) at decode rows per tile setting: ms and
    the touched experts' weight bytes / time against the HBM peak."""
    weights = expert_weights(jax.random.key(1), d=d, f=f, experts=experts, dtype=dtype)
    names = ("gate_proj", "up_proj", "down_proj")
    q = quant.quantize_fp8(dict(zip(names, weights, strict=True)), granularity="channel")
    fp8 = [quant.compute_weight(q[n], dtype) for n in names]
    out = []
    for tokens in tokens_list:
        xs, gs, touched = routed_rows(
            jax.random.key(tokens), tokens=tokens, d=d, experts=experts, top_k=top_k, dtype=dtype
        )  # fmt: skip
        ref = np.asarray(jax.jit(ffn_of("ragged"))(xs, gs, *weights), np.float32)
        for tile in tiles:
            for name, ws, itemsize in (
                ("bf16", weights, jnp.dtype(dtype).itemsize),
                ("fp8", fp8, 1),
            ):
                row = {"tokens": tokens, "weights": name, **tile}
                try:
                    with mock.patch.dict(grouped.TRITON_TILES, tile):
                        fn = jax.jit(ffn_of("triton"))
                        row["max_rel_err"] = _rel_err(fn(xs, gs, *ws), ref)
                        ms = _steady_ms(fn, (xs, gs, *ws))
                    nbytes = touched * 3 * d * f * itemsize
                    row.update(ms=ms, gbs=nbytes / ms / 1e6, hbm=nbytes / ms / 1e6 / peak_gbs)
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


# ---- FP8 weights at decode rows: where the dequantization happens, and what it costs --------
def _fp8_forms():
    """x [M, D] times each of a list of [D, N] weights, per form: the bf16 weights; FP8 as the
    model reads it now (`Fp8Tensor.astype`: values x scales, then the dot); FP8 values converted
    in the dot and the per-channel scale applied to its output; FP8 x FP8 (activations scaled
    per row, one f32-accumulated FP8 dot, both scales on the output)."""
    bf16, f32 = jnp.bfloat16, jnp.float32

    def scale_after(x, q):
        y = jnp.dot(x, q.values.astype(bf16), preferred_element_type=f32)
        return (y * q.scales).astype(bf16)

    def fp8_x_fp8(x, q):
        sx = jnp.maximum(jnp.max(jnp.abs(x.astype(f32)), -1, keepdims=True), 1e-6) / quant.FP8_MAX
        xq = (x.astype(f32) / sx).astype(quant.FP8_DTYPE)
        y = jax.lax.dot(xq, q.values, preferred_element_type=f32)
        return (y * sx * q.scales).astype(bf16)

    return {
        "bf16": lambda x, w: jnp.dot(x, w, preferred_element_type=f32).astype(bf16),
        "fp8_dequant": lambda x, q: jnp.dot(x, q.astype(bf16), preferred_element_type=f32).astype(
            bf16
        ),
        "fp8_scale_after": scale_after,
        "fp8_x_fp8": fp8_x_fp8,
    }


def fp8_rows(*, d, n, sets, rows_list, peak_gbs, timed=True):
    """Per (form, M): the optimized HLO's custom calls, the ops writing a whole [D, N] bf16 weight
    (a dequantized copy materialized outside the matmul), the error against float32 dots on
    the dequantized weights, time for `sets` weights (more bytes than the L2 holds), the form's
    own weight bytes / time against the HBM peak, and the speed-up over bf16."""
    keys = jax.random.split(jax.random.key(3), sets)
    ws = [jax.random.normal(k, (d, n), jnp.float32) / np.sqrt(d) for k in keys]
    qs = [
        quant.quantize_tensor(w, num_in_axes=1, num_out_axes=1, granularity="channel") for w in ws
    ]
    out = []
    for m in rows_list:
        x = jax.random.normal(jax.random.key(m), (m, d), jnp.bfloat16)
        ref = np.stack([np.asarray(x, np.float32) @ np.asarray(q.astype(jnp.float32)) for q in qs])
        bf16_ms = None
        for name, form in _fp8_forms().items():
            weights = [w.astype(jnp.bfloat16) for w in ws] if name == "bf16" else qs
            fn = jax.jit(lambda x, weights, form=form: jnp.stack([form(x, w) for w in weights]))
            row = {"form": name, "rows": m, "d": d, "n": n, "sets": sets}
            try:
                text = fn.lower(x, weights).compile().as_text()
                comps, _ = computations(text)
                lines = [line for comp in comps.values() for _, line in comp]
                row["custom_calls"] = sorted(
                    {c.group(1) for ln in lines if (c := re.search(r'target="([^"]+)"', ln))}
                )
                whole = re.compile(rf"=\s*bf16\[{d},{n}\]")
                row["bf16_weight_copies"] = sum(
                    bool(whole.search(ln)) and "parameter(" not in ln for ln in lines
                )
                row["max_rel_err"] = _rel_err(fn(x, weights), ref)
                if timed:
                    ms = _steady_ms(fn, (x, weights), repeats=30)
                    nbytes = quant.tree_bytes({"w": weights})
                    row.update(ms=ms, gbs=nbytes / ms / 1e6, hbm=nbytes / ms / 1e6 / peak_gbs)
                    bf16_ms = ms if name == "bf16" else bf16_ms
                    row["speedup_over_bf16"] = bf16_ms / ms if bf16_ms else float("nan")
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


# ---- decode: kernels per step, tokens/s, layer layouts, dispatch paths ------------------------
# (weights, layers, batch, dispatch impl, decode steps per loop check) of the decode section:
# the layout before issue 35 (scanned layers, XLA's ragged_dot), per-layer weights, the "auto"
# dispatch (the Mosaic GPU grouped matmul on Hopper), and 8 decode steps per check of the loop's
# condition (`sampler.sample(steps_per_check=)`), bf16 and FP8. `--decode` picks others.
DECODE_RUNS = (
    ("base", "scan", 8, "ragged", 1), ("base", "per-layer", 8, "ragged", 1),
    ("base", "per-layer", 8, "ragged", 8), ("base", "per-layer", 8, "auto", 1),
    ("base", "per-layer", 64, "ragged", 1), ("base", "per-layer", 64, "ragged", 8),
    ("fp8", "per-layer", 8, "ragged", 8), ("fp8", "per-layer", 64, "ragged", 8),
)  # fmt: skip


def parse_runs(spec: str) -> tuple:
    """`weights:layers:batch:impl:steps` entries, comma-separated (weights base | fp8, layers
    scan | per-layer), as DECODE_RUNS."""
    runs = []
    for entry in filter(None, spec.split(",")):
        parts = entry.split(":")
        ok = len(parts) == 5 and parts[0] in ("base", "fp8") and parts[1] in ("scan", "per-layer")
        if not ok or not (parts[2].isdigit() and parts[4].isdigit()):
            raise SystemExit(
                f"--decode entry {entry!r}: want weights:layers:batch:impl:steps, e.g. "
                "base:per-layer:8:ragged:8 (weights base|fp8, layers scan|per-layer)"
            )
        runs.append((parts[0], parts[1], int(parts[2]), parts[3], int(parts[4])))
    return tuple(runs)


def decode_rows(cfg, *, runs=DECODE_RUNS, new_tokens, peak_gbs, repeats=2):
    """Per (weights, layers, batch, impl, steps per check): kernels per decode step, tokens/s,
    ms a step, and the weights' bytes read per step against the HBM peak ("base": the
    param_dtype weights)."""
    base = jax.tree.map(
        lambda x: x.astype(jnp.dtype(cfg.param_dtype)), model.init(cfg, jax.random.key(0))
    )
    fp8 = quant.quantize_fp8(base)
    out = []
    for weights, layout, batch, impl, steps in runs:
        p = fp8 if weights == "fp8" else base
        m = bench_rollout.WithDispatch(cfg, impl, per_layer_params=layout == "per-layer")
        row = {"weights": weights if weights == "fp8" else cfg.param_dtype, "layers": layout,
               "batch": batch, "impl": impl, "steps_per_check": steps,
               "new_tokens": new_tokens}  # fmt: skip
        try:
            prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, 16))
            row["kernels_per_step"] = _decode_kernels(m, p, prompts, new_tokens, steps) / steps
            run = bench_rollout._sample_fixed_length(
                cfg, p, prompts, new_tokens=new_tokens, steps_per_check=steps, model=m
            )
            seconds = bench_rollout._timed(lambda run=run: run().tokens, repeats)
            row["tokens_per_s"] = batch * new_tokens / seconds
            row["ms_per_step"] = 1e3 * seconds / new_tokens
            row["hbm"] = quant.tree_bytes(p) / 1e9 * new_tokens / seconds / peak_gbs
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def attention_rows(cfg, *, lengths, batch, alternations=2):
    """Decode tokens/s with attention over the whole cache buffer against the filled slots only
    (`layers.decode_attention`, in blocks of DECODE_BLOCK), per generation length, the two
    alternated in this process (a machine under other load slows both alike)."""
    params = model.init(cfg, jax.random.key(0))
    prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, 16))
    out = []
    for n in lengths:
        for i in range(alternations):
            for arm, block in (("whole", 10**9), ("blocked", layers.DECODE_BLOCK)):
                with (
                    mock.patch.object(layers, "DECODE_BLOCK", block),
                    mock.patch.object(layers, "GPU_BLOCKED_DECODE", True),  # the Triton kernel
                ):
                    jax.clear_caches()  # the block size is read while tracing
                    run = bench_rollout._sample_fixed_length(cfg, params, prompts, new_tokens=n)
                    seconds = bench_rollout._timed(lambda run=run: run().tokens, 1)
                row = {"arm": arm, "alternation": i, "batch": batch, "new_tokens": n,
                       "tokens_per_s": batch * n / seconds,
                       "ms_per_step": 1e3 * seconds / n}  # fmt: skip
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def _decode_kernels(m, params, prompts, new_tokens, steps_per_check=1) -> int:
    """Kernels per iteration of the compiled sampler chunk's decode loop (`steps_per_check`
    decode steps)."""
    batch, length = prompts.shape
    p = m.decode_params(params)
    compiled = sampler._sample_chunk.lower(
        m, p, jnp.asarray(prompts), jnp.ones((batch, length), bool), jax.random.key(0),
        jnp.int32(new_tokens), None, num_samples=1, gen_len=new_tokens, temperature=1.0,
        top_p=1.0, top_k=0, stop_ids=(m.cfg.vocab_size,), pad_id=0,
        steps_per_check=steps_per_check,
    ).compile()  # fmt: skip
    return loop_kernels(compiled.as_text())["per_iteration"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, fewer rows (tests)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections among {SECTIONS}")
    ap.add_argument("--json", default="", help="write every row here")
    ap.add_argument("--decode", default="", help="decode runs (parse_runs), default DECODE_RUNS")
    ap.add_argument(
        "--cache",
        default="",
        help="a persistent compilation cache directory (the "
        "decode section compiles each sampler twice: once for its HLO, once to run)",
    )
    ap.add_argument(
        "--tiles", default="", help='JSON: grouped.TRITON_TILES fields for every section, e.g. '
        '\'{"block_k": 64, "fp8_operand": "float16"}\''
    )  # fmt: skip
    ap.add_argument("--tpu", default="", help="a TPU topology (v5e:2x2): the hlo section for it")
    args = ap.parse_args(argv)
    if args.tpu:  # the bench MoE compiled for a TPU here; nothing else
        cfg = model.ModelConfig(**GPU_MODEL)
        shapes = dict(d=cfg.d_model, f=cfg.moe_ffn_dim, experts=cfg.num_experts,
                      top_k=cfg.top_k, dtype=jnp.dtype(cfg.dtype))  # fmt: skip
        rows = tpu_hlo_rows(
            args.tpu, ["ragged", "capacity", "blocked", "megablox"],
            row_counts=[(8, False), (64, False), (4096, False), (4096, True)], **shapes,
        )  # fmt: skip
        one = dataclasses.replace(cfg, num_layers=1)  # its cost analysis counts a scan body once
        result = {"backend": "tpu (compiled here)", "topology": args.tpu, "gmm": rows,
                  "model": tpu_model_rows(args.tpu, one, ["ragged", "megablox"])}  # fmt: skip
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        return result
    grouped.TRITON_TILES.update(json.loads(args.tiles or "{}"))
    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    only = set(args.only.split(","))
    gpu = jax.default_backend() == "gpu"
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in bench_rollout.PEAK_BANDWIDTH_GBS.items() if k in kind), 0.0)
    fields = GPU_MODEL if gpu else CPU_MODEL
    cfg = model.ModelConfig.tiny() if args.quick else model.ModelConfig(**fields)
    dtype = jnp.dtype(cfg.dtype)
    d, f, e, k = cfg.d_model, cfg.moe_ffn_dim, cfg.num_experts, cfg.top_k
    print(f"backend {jax.default_backend()} ({kind}), jax {jax.__version__}: D={d} F={f} E={e} "
          f"K={k} {dtype.name}", flush=True)  # fmt: skip
    # mosaic_gpu: its reference off Hopper; triton: its interpret mode off a GPU
    impls = ["ragged", "capacity", "blocked", "mosaic_gpu", "triton"]
    row_counts = [(8, False), (64, False), (64 if args.quick else 4096, True)]
    result: dict = {"backend": jax.default_backend(), "device": kind, "jax": jax.__version__,
                    "model": dataclasses.asdict(cfg)}  # fmt: skip
    shapes = dict(d=d, f=f, experts=e, top_k=k, dtype=dtype, row_counts=row_counts,
                  peak_gbs=peak or float("nan"))  # fmt: skip
    if "hlo" in only or "gmm" in only:
        result["gmm"] = gmm_rows(impls, timed="gmm" in only, **shapes)
    if "tiles" in only:
        result["tiles"] = tile_rows(
            **{k: v for k, v in shapes.items() if k != "row_counts"},
            tokens_list=(8,) if args.quick else (8, 64),
            tiles=TILES[:2] if args.quick else TILES,
        )
    if "fp8" in only:
        dims = dict(d=64, n=128, sets=2) if args.quick else dict(d=d, n=4 * d, sets=8)
        result["fp8"] = fp8_rows(
            **dims, rows_list=(8,) if args.quick else (8, 64), peak_gbs=peak or float("nan")
        )
    if "attention" in only:
        result["attention"] = attention_rows(
            cfg, lengths=(32,) if args.quick else (1024, 4096), batch=2 if args.quick else 8,
            alternations=1 if args.quick else 2,
        )  # fmt: skip
    if "decode" in only:
        runs = parse_runs(args.decode) or DECODE_RUNS
        if args.quick:
            runs = tuple((w, layers, 2, impl, n) for w, layers, b, impl, n in runs if b == 8)
        result["decode"] = decode_rows(
            cfg, runs=runs, new_tokens=8 if args.quick else 128,
            peak_gbs=peak or float("nan"), repeats=1 if args.quick else 2,
        )  # fmt: skip
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
