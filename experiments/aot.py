"""Does one RL step fit, and how fast would it go? Compiled for hardware that is not here.

  PYTHONPATH=<libtpu dir> python experiments/aot.py --config configs/qwen3_moe.py:30b_a3b \\
      --tpu v5p:2x2x4                       # a v5p slice of 16 chips, deviceless (libtpu)
  python experiments/aot.py --config configs/qwen3_moe.py:30b_a3b --gpus 8 --chip h100
      # a GPU node: the mesh over 8 emulated CPU devices (XLA:CPU's per-device program)
  python experiments/aot.py --config configs/default.py --gpus 2 --mesh data=2   # one mesh

Nothing runs and no weight is read: every program is lowered from shape structs placed by
espo's shardings and compiled for the target. The programs of one RL step, each the function
the trainer jits (`trainer.train`):
  update   `train_step.train_step` on one micro-batch (value and gradient, accumulation, the
           optimiser's apply; the state donated): the update's memory whatever the number of
           micro-batches (the scan reuses one body), its FLOPs per micro-batch;
  old      `train_step.prepare`: pi_old's forward (router replay) over one micro-batch;
  rollout  `sampler._sample_chunk` on one chunk (`rollout.max_chunk_size` rows, FP8 weights in
           the decode layout when `rollout.fp8`): the prefill, the KV cache of prompt + every
           new token, and the decode loop;
  eval     the held-out eval's larger sampler call (`evaluate._run_pass`: eval.batch_size rows,
           the training model and params, copied to the decode layout): not every step (eval.
           every_steps), so outside the step's time, but its memory must fit like the rest.
Shapes: a trace is T = data.max_prompt_length + the curriculum's largest max_new_tokens
tokens; a micro-batch gives each device `--rows-per-device` rows of T (default: one packed
row of train.max_tokens_per_micro_batch tokens, `// T` rows of it, with train.packing; else
train.micro_batch_size over the devices). A packed micro-batch is compiled as padded rows of
the same tokens. The training state is resident during every program: the rollout and pi_old
rows count the params and optimiser state they do not take as arguments ("resident"), less
what rollout.offload_state parks in host memory: the whole state during the rollout (its copy
out and back over the chip's host link is added to the step), Adam's moments during the eval.

Per device, per program: params, optimiser state, other inputs (batch / prompts), temporaries,
outputs not aliased to an input, resident state, their total against the chip's HBM. On a TPU
the sizes are the compiler's buffer assignment's (what its HBM check adds up, also when it
refuses the program: `bench_memory.allocation_sizes`); on the emulated GPU node they are
XLA:CPU's `memory_analysis()` of one device's program, which is an estimate for a GPU: XLA:CPU
runs bf16 dots in float32 and keeps some bf16 temporaries (the stacked expert gradients) in
float32 (bench_memory.py's docstring), so its temporaries are an upper bound, and it lays out
and fuses differently; the parameter, optimiser and input sizes are exact (they are the
shardings'). Check against a real GPU's compile when one is lent.

Work per program, per device: the matmuls of the traced program (`roofline.jaxpr_dots`: every
dot and grouped matmul with its loop trip counts, remat's recomputation included, traced with
the XLA implementations: the blocked attention for splash / Triton, the MoE's ragged_dot for
every grouped matmul, a decode step's attention over the whole cache as on a TPU or GPU),
divided evenly over the devices; the blocked attention's tiles are counted visible or not (a
per-tile cond, counted by its larger branch: a causal row's attention about 2x what the
kernels, which skip hidden tiles, compute); the collectives of the compiled, partitioned
program (`roofline.hlo_collectives`, bytes each device sends per program run). Roofline: per
matmul max(FLOPs / peak, bytes / HBM bandwidth), summed (elementwise work not counted), and
the collectives' bytes over the chip's link bandwidth; the program's time is the larger of the
two (full overlap: optimistic).
MFU = model FLOPs (6 x active params per token for the update, + attention's 12 x layers x
heads x head_dim x mean context) / (time x peak).

One RL step (`step`): prompts_per_step x G rows of T tokens (every trace at its maximum length:
an upper bound on work); the update's micro-batches x train.ppo_epochs, pi_old's, and the
rollout's chunks of prefill + max_new_tokens decode steps (each decode step at the full cache:
an upper bound); tokens per second per chip = rows x T / (step time x chips).

Meshes (`--mesh`, else searched): every data x fsdp x expert of the device count whose expert
size divides the experts and fsdp the model width, whose static memory (params + optimiser
state per device, exact) fits; the `--max-meshes` with the least of it (among equals the widest
expert axis) are compiled, and of those that fit every program the fastest projected step is
reported, with every compiled mesh's rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import traceback

from aot_programs import (  # the compiling subprocess's half
    DECODING,
    PROGRAMS,
    PROGRESS,
    ROOT,
    GiB,
    measure,
    model_flops_per_token,
    per_device_bytes,
    place,
    settings_of,
)


# ---- the driver ---------------------------------------------------------------------------------
def static_bytes(s, model_cfg, sizes: tuple[int, int, int]) -> float:
    """Params + optimiser state per device on a mesh of `sizes` (exact: their shardings)."""
    import jax
    import jax.numpy as jnp

    from espo import sharding, train_step
    from espo.model import transformer

    mesh = sharding.abstract_mesh(sizes)
    optimizer, _ = train_step.make_optimizer(total_steps=1000, **dataclasses.asdict(s.optimizer))
    params = transformer.param_shapes(model_cfg)
    abstract = jax.eval_shape(
        lambda p: train_step.TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)), params
    )
    placed = place(abstract, sharding.state_shardings(mesh, optimizer, abstract))
    return per_device_bytes(placed.params) + per_device_bytes(placed.opt_state)


def candidate_meshes(s, model_cfg, devices: int, hbm: float) -> list[dict]:
    """Every data x fsdp x expert of `devices` that divides the model (expert | experts, fsdp |
    width) and whose params + optimiser state fit `hbm`, most sharded first."""
    out = []
    for e in (d for d in range(1, devices + 1) if devices % d == 0):
        for f in (d for d in range(1, devices // e + 1) if (devices // e) % d == 0):
            if model_cfg.num_experts % e or model_cfg.d_model % f:
                continue
            sizes = (devices // (e * f), f, e)
            static = static_bytes(s, model_cfg, sizes)
            if static < hbm:
                mesh = dict(zip(("data", "fsdp", "expert"), sizes, strict=True))
                out.append(dict(mesh=mesh, static=static))
    # Least state first (to 1%); among equals the widest expert axis (the MoE's own parallelism:
    # fsdp alone gathers every expert's weights for every layer), then the least data.
    key = lambda c: (round(c["static"] / hbm, 2), -c["mesh"]["expert"], c["mesh"]["data"])  # noqa: E731
    return sorted(out, key=key)


def parse_mesh(text: str) -> dict:
    """ "data=2,fsdp=1,expert=4" -> its sizes (missing axes 1)."""
    sizes = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in ("data", "fsdp", "expert") or not value.isdigit():
            raise SystemExit(f"--mesh: {item!r} is not data=N, fsdp=N or expert=N")
        sizes[name] = int(value)
    return {a: sizes.get(a, 1) for a in ("data", "fsdp", "expert")}


def _raised_at(e: BaseException, frames: int = 3) -> str:
    """Where `e` was raised: its innermost `frames` frames as file:line, innermost first (an
    error inside JAX or a library names the library's line, not only the program)."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    return " <- ".join(f"{pathlib.Path(f.filename).name}:{f.lineno}" for f in reversed(tb))


def run_point(point: dict, timeout: float, extra_env: dict | None = None) -> dict:
    """`measure(point)` in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | (extra_env or {})
    env.setdefault("JAX_TRACEBACK_FILTERING", "off")  # an error's frames inside JAX: `_raised_at`
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "experiments"), env.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--point", json.dumps(point)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the subprocess is killed; where it was, if known
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        done = [ln.removeprefix(PROGRESS) for ln in err.splitlines() if ln.startswith(PROGRESS)]
        return {
            "error": f"timeout after {timeout:.0f} s" + (f" ({'; '.join(done)})" if done else "")
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {}
    if not res:
        res = {"error": f"rc {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}"}
    res["wall_s"] = time.perf_counter() - t
    return res


EXTRAPOLATE_FROM = (2, 4)  # layers compiled when a model is deeper (`mesh_result`)
MEMORY = ("temporaries", "outputs", "total")  # bytes a device; checked for growth with depth


def extrapolate(a, b, la: int, lb: int, layers: int):
    """Numbers measured at `la` and `lb` layers (`a`, `b`: numbers, or dicts / lists of them)
    taken linearly to `layers`; anything else (a flag, a message) as `b` has it."""
    if isinstance(b, dict):
        return {k: extrapolate(a.get(k), v, la, lb, layers) for k, v in b.items()}
    if isinstance(b, bool) or not isinstance(b, int | float) or not isinstance(a, int | float):
        return b
    return b + (layers - lb) * (b - a) / (lb - la)


def mesh_result(point: dict, layers: int, timeout: float, env: dict, *, full: bool) -> dict:
    """One mesh's programs, each compiled in its own subprocess (`timeout` each). A model deeper
    than EXTRAPOLATE_FROM's second depth is compiled at both depths unless `full`, and every
    number (memory, FLOPs, collectives) taken linearly to its `layers`: each layer adds the same
    parameters, buffers, matmuls and collectives (the scanned update's stacked residuals, the
    rollout's unrolled layers: tests/experiments/test_aot.py checks it against a whole
    compile); the embedding, head and loop buffers are the intercept."""
    res = dict(programs={})
    la, lb = EXTRAPOLATE_FROM
    for prog in point["programs"]:
        one = dict(point, programs=[prog])
        if full or layers <= lb:
            got = run_point(one, timeout, env)
            row = got.get("programs", {}).get(prog)
        else:
            a, got = (run_point(dict(one, layers=n), timeout, env) for n in (la, lb))
            rows = [r.get("programs", {}).get(prog) for r in (a, got)]
            row = None if None in rows else extrapolate(*rows, la, lb, layers)
            if row:
                row["compile_s"] = rows[0]["compile_s"] + rows[1]["compile_s"]
                row["extrapolated_from"] = [la, lb]
                row["at_depths"] = {
                    str(n): {k: r[k] for k in MEMORY} for n, r in zip((la, lb), rows, strict=True)
                }
                # Buffer assignment that shrinks with depth: no line to extend (`fits`).
                row["shrinks"] = [k for k in MEMORY if rows[1][k] < rows[0][k] - 2**20]
                got["shapes"] = a["shapes"]  # the shapes do not depend on depth
        if row is None:
            return dict(error=f"{prog}: {got.get('error', 'no result')}")
        res["programs"][prog] = row
        res.update(shapes=got["shapes"], devices=got["devices"])
    return res


def step_projection(res: dict, cfg, chip, s) -> dict:
    """One RL step's time, tokens/s per chip and the update's MFU from the programs' rooflines
    (module docstring)."""
    shp, n, progs = res["shapes"], res["devices"], res["programs"]

    def seconds(row, matmul_s, collective_bytes):
        return max(matmul_s, collective_bytes / chip.link_bw)

    coll = lambda row: sum(c["bytes"] for c in row["collectives"].values())  # noqa: E731
    rows, T = shp["step_rows"], shp["T"]
    out = {}
    if "update" in progs:
        u = progs["update"]
        micro = math.ceil(rows / shp["micro_rows"]) * shp["epochs"]
        out["update_s"] = micro * seconds(u, u["matmul_s"], coll(u))
        model = model_flops_per_token(cfg, context=T / 2)["forward"] * 3 * shp["micro_rows"] * T
        out["update_mfu"] = model / (n * chip.peak_flops * seconds(u, u["matmul_s"], coll(u)))
    if "old" in progs:
        o = progs["old"]
        out["old_s"] = math.ceil(rows / shp["micro_rows"]) * seconds(o, o["matmul_s"], coll(o))
    if "rollout" in progs:
        r = progs["rollout"]
        matmul = program_seconds(res, "rollout")
        out["rollout_s"] = math.ceil(rows / shp["chunk_rows"]) * seconds(r, matmul, coll(r))
        if r.get("offloaded"):  # rollout.offload_state: out to host memory and back, a step
            out["offload_s"] = 2 * r["offloaded"] / chip.host_bw if chip.host_bw else None
    parts = ("update_s", "old_s", "rollout_s", "offload_s")
    out["step_s"] = sum(out.get(k) or 0.0 for k in parts)
    out["tokens_per_s_per_chip"] = rows * T / (out["step_s"] * n) if out["step_s"] else None
    return out


def _offload_line(proj: dict, chip) -> str:
    if "offload_s" not in proj:
        return ""
    if proj["offload_s"] is None:
        return f", the state to host and back not counted ({chip.name}'s host link unknown)"
    return f", the state to host and back {proj['offload_s']:.1f} s"


def this_cpu():
    """This host as a roofline `Chip`: float32 matmul FLOP/s and memory read bandwidth measured
    now (a jitted [2048, 2048] product, median of 5; `bench_rollout.read_bandwidth_gbs`), for
    checking the projection against a step measured here."""
    import bench_rollout
    import jax
    import jax.numpy as jnp
    import roofline

    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(mm(a))
        times.append(time.perf_counter() - t)
    peak = 2 * 2048**3 / sorted(times)[2]
    bw = bench_rollout.read_bandwidth_gbs() * 1e9
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"this CPU: {peak / 1e9:.1f} GFLOP/s (f32 matmul), {bw / 1e9:.1f} GB/s read")
    return roofline.Chip(
        name="cpu", peak_flops=peak, hbm_bytes=ram, hbm_bw=bw, link_bw=bw,
        source="measured in this run (aot.this_cpu)",
    )  # fmt: skip


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.3g}"


def fits(res: dict, hbm: float) -> dict[str, bool]:
    """Per program of one mesh's result: does it fit `hbm` bytes a device (and was it not
    refused by the chip's compiler, nor extrapolated from memory that shrinks with depth)?
    Empty when the mesh failed to compile."""
    programs = {} if res.get("error") else res["programs"]
    ok = lambda r: r["total"] <= hbm and not r.get("refused") and not r.get("shrinks")
    return {k: ok(r) for k, r in programs.items()}


def flops_per_token(res: dict, prog: str) -> float:
    """A program's matmul FLOPs per token it processes: a micro-batch's rows x T for the update
    and pi_old, a chunk's rows x T (prefill + every decode step) for the rollout and the eval."""
    r, shp = res["programs"][prog], res["shapes"]
    if prog in DECODING:
        total = r["flops"] + (shp["Tg"] - 1) * r["decode_flops"]
        return total / (shp[DECODING[prog]] * shp["T"])
    return r["flops"] / (shp["micro_rows"] * shp["T"])


def program_seconds(res: dict, prog: str) -> float:
    """A program's roofline matmul seconds for one run of it (the rollout and the eval: prefill
    and every decode step of its chunk)."""
    r = res["programs"][prog]
    if prog in DECODING:
        return r["matmul_s"] + (res["shapes"]["Tg"] - 1) * r["decode_matmul_s"]
    return r["matmul_s"]


def print_rows(res: dict, mesh: dict, hbm: float) -> bool:
    """The table rows of one mesh; True when every program fits."""
    name = ",".join(f"{k}={v}" for k, v in mesh.items())
    if res.get("error"):
        print(f"| {name} | {res['error'][:300]} |", flush=True)
        return False
    verdicts = fits(res, hbm)
    for prog, r in res["programs"].items():
        ok = verdicts[prog]
        coll = sum(c["bytes"] for c in r["collectives"].values())
        verdict = ("fits" if ok else "does not fit") + f" ({(hbm - r['total']) / GiB:+.3g})"
        if r.get("refused"):
            verdict += " refused"
        if r.get("shrinks"):  # e.g. the compiler's choices differ at 2 and 4 layers
            verdict = f"unknown: {', '.join(r['shrinks'])} shrink(s) with depth, use --full"
        print(
            f"| {name} | {prog} | {_gib(r['params'])} | {_gib(r['opt_state'])} | "
            f"{_gib(r['inputs'])} | {_gib(r['temporaries'])} | {_gib(r['outputs'])} | "
            f"{_gib(r['resident'])} | {_gib(r['total'])} | {verdict} | "
            f"{flops_per_token(res, prog):.3g} | "
            f"{coll / GiB:.3g} | {r['matmul_s'] * 1e3:.3g} | {r['compile_s']:.0f} |",
            flush=True,
        )
        unknown = r.get("unknown_loops", 0) + sum(
            c.get("in_unknown_loop", 0) for c in r["collectives"].values()
        ) * (prog not in DECODING)
        if r.get("measured_s"):
            model = program_seconds(res, prog)
            print(f"|   | {prog}: run here {r['measured_s'] * 1e3:.4g} ms against its roofline "
                  f"{model * 1e3:.4g} ms ({model / r['measured_s']:.2f} of it) |")  # fmt: skip
        if unknown or r.get("opaque"):
            print(f"|   | {prog}: {r.get('opaque', 0)} kernels not counted, {unknown} matmuls / "
                  "collectives in loops of unknown trip count counted once |")  # fmt: skip
    return all(verdicts.values())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="", help="path[:variant] of a config file (required)")
    p.add_argument(
        "--set", action="append", default=[], help="a config override key=value (repeatable)"
    )
    p.add_argument("--tpu", default="", help="a TPU topology (v5p:2x2x4; libtpu on PYTHONPATH)")
    p.add_argument("--gpus", type=int, default=0, help="a GPU node of this many devices")
    p.add_argument(
        "--local", action="store_true",
        help="with --gpus: compile on this machine's own devices (a real GPU) instead of "
        "emulated CPU ones: the check of the emulated estimate",
    )  # fmt: skip
    p.add_argument(
        "--chip", default="", help="roofline chip: roofline.CHIPS or cpu (measured; default: the "
        "TPU's, or h100)",
    )  # fmt: skip
    p.add_argument("--hbm-gib", type=float, default=0.0, help="HBM per device (default: chip's)")
    p.add_argument("--mesh", default="", help="one mesh (data=N,fsdp=N,expert=N); else searched")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated")
    p.add_argument(
        "--run", action="store_true",
        help="with --local: also run each compiled program (random inputs) and time it against "
        "its roofline: the projection checked against this machine",
    )  # fmt: skip
    p.add_argument("--rows-per-device", type=int, default=0, help="rows of T per micro-batch")
    p.add_argument(
        "--max-meshes", type=int, default=3, help="search: compile this many, keep the fastest fit"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile")
    p.add_argument("--max-rss-gb", type=float, default=18.0, help="stop a compile past this RSS")
    p.add_argument(
        "--full", action="store_true",
        help=f"compile the whole depth (default: at {EXTRAPOLATE_FROM} layers, extrapolated)",
    )  # fmt: skip
    p.add_argument("--json", default="", help="write every mesh's result here")
    p.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one mesh
    args = p.parse_args(argv)
    if args.point:
        try:
            print(json.dumps(measure(json.loads(args.point))), flush=True)
        except Exception as e:  # noqa: BLE001  # reported in the table with where it was raised
            print(
                json.dumps({"error": f"{_raised_at(e)}: {type(e).__name__}: {e}"[:600]}), flush=True
            )
        return {}
    # This process only reads shapes: the CPU backend (libtpu, if on the path, would take the
    # TPU lockfile the compiling subprocess needs; a GPU's memory is left to it).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    child_env = {} if args.local else {"JAX_PLATFORMS": "cpu"}
    if not args.config:
        raise SystemExit("--config is required: path[:variant] of a config file")
    if bool(args.tpu) == bool(args.gpus):
        raise SystemExit("give one target: --tpu <topology> or --gpus <count>")
    sys.path.insert(0, str(ROOT / "experiments"))
    import roofline

    if args.tpu:
        gen, _, dims = args.tpu.partition(":")
        devices = math.prod(int(d) for d in dims.split("x"))
    else:
        gen, devices = "h100", args.gpus
    chip = this_cpu() if args.chip == "cpu" else roofline.CHIPS[args.chip or gen]
    hbm = args.hbm_gib * GiB if args.hbm_gib else chip.hbm_bytes
    s, cfg = settings_of(args.config, tuple(args.set))
    if args.mesh:
        meshes = [dict(mesh=parse_mesh(args.mesh), static=static_bytes(
            s, cfg, tuple(parse_mesh(args.mesh).values())))]  # fmt: skip
    else:
        meshes = candidate_meshes(s, cfg, devices, hbm)
        listed = ", ".join(f"{tuple(m['mesh'].values())} {m['static'] / GiB:.1f}" for m in meshes)
        print(f"{len(meshes)} meshes whose state fits {hbm / GiB:.1f} GiB: {listed}")
    emulated = "this machine's devices" if args.local else "emulated: XLA:CPU"
    target = args.tpu or f"{args.gpus} x {chip.name} ({emulated})"
    print(f"\n{args.config} on {target}, {hbm / GiB:.1f} GiB a device; GiB per device\n")
    print("| mesh | program | params | opt state | inputs | temporaries | outputs | resident |"
          " total | vs HBM | FLOPs/token | collectives GiB | matmul ms | compile s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results, chosen = [], None
    for m in meshes[: args.max_meshes]:
        point = dict(
            config=args.config, set=args.set, tpu=args.tpu, gpus=args.gpus,
            chip=dataclasses.asdict(chip),
            mesh=m["mesh"],
            programs=args.programs.split(","), rows_per_device=args.rows_per_device,
            max_rss_gb=args.max_rss_gb, local=args.local, run=args.run,
        )  # fmt: skip
        res = mesh_result(point, cfg.num_layers, args.timeout, child_env, full=args.full)
        res["mesh"] = m["mesh"]
        results.append(res)
        if print_rows(res, m["mesh"], hbm):
            res["projection"] = step_projection(res, cfg, chip, s)
            best = chosen and chosen["projection"]["tokens_per_s_per_chip"]
            if not best or res["projection"]["tokens_per_s_per_chip"] > best:
                chosen = res
    summary = dict(config=args.config, target=target, hbm=hbm, results=results)
    if chosen is None:
        print("\nno mesh tried fits every program")
    else:
        proj = chosen["projection"]
        summary["projection"] = dict(mesh=chosen["mesh"], **proj)
        shp = chosen["shapes"]
    if chosen is not None and proj["tokens_per_s_per_chip"]:
        print(
            f"\nfits: mesh {chosen['mesh']}. One RL step ({shp['step_rows']} rows of "
            f"{shp['T']} tokens): update {proj.get('update_s', 0):.1f} s, pi_old "
            f"{proj.get('old_s', 0):.1f} s, rollout {proj.get('rollout_s', 0):.1f} s"
            f"{_offload_line(proj, chip)}; "
            f"{proj['tokens_per_s_per_chip']:.0f} tokens/s per chip; the update's MFU "
            f"{proj.get('update_mfu', 0):.2f} (roofline: an upper bound)"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    main()
