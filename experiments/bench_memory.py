"""Memory of the update's gradient on long rows, compiled, not run: XLA's memory analysis.

  python experiments/bench_memory.py                                # defaults below
  python experiments/bench_memory.py --models qwen3_layer --settings materialised,long
  python experiments/bench_memory.py --before --models default,qwen3_layer --settings long
  python experiments/bench_memory.py --models qwen3_30b --lengths 32768 \\
      --settings long,long+remat=none,long+remat=dots_with_no_batch_dims_saveable
  python experiments/bench_memory.py --models qwen3_L1,qwen3_L2,qwen3_L4 --lengths 4096 \\
      --settings long,long+remat=none                               # the scan check
  python experiments/bench_memory.py --models default --lengths 512,1024 \
      --settings long,long+remat=none --unrolled       # remat in the unrolled loop (see above)
  PYTHONPATH=<libtpu dir> python experiments/bench_memory.py --tpu v5p:2x2x1 --models qwen3_30b
      # compiled for one v5p chip without a TPU (deviceless AOT; `pip install libtpu==0.0.42.1
      # --target <libtpu dir>`, as bench_moe.py --tpu): splash attention, megablox experts
  PYTHONPATH=<libtpu dir> python experiments/bench_memory.py --tpu v5p:2x2x1 --mesh expert=4 \
      --rows 4 --models qwen3_30b --lengths 32768 --settings long+moe_chunk=4096
      # the topology's 4 chips as espo's mesh (params by sharding.RULES, a row per chip)

For a TPU the sizes printed are the compiler's buffer assignment's (`allocation_sizes`: what
its HBM check adds up, also when it refuses the program), "total" their sum and "XLA temp"
`memory_analysis()`'s temp_size, which differs from it on a TPU.

Program: `jax.jit(jax.grad(f))` with f(params) = `train_step.token_logps(cfg, params, tokens,
attention_mask, routing=None).logps.sum()` (FREE routing; `--replay`: REPLAY_IDS with a
RouterTrace [B, L, T, K] as an input), `--rows` rows of T tokens, all real, int32. It is lowered
from shape structs (`transformer.param_shapes`: nothing allocated) and compiled for this
machine's backend; `compiled.memory_analysis()` gives, per point: temporaries (activations,
residuals kept for the backward, the backward's buffers), arguments (the params, tokens, mask,
trace) and outputs (the gradient, the params' size and dtype), so parameters and gradients are
counted apart from activations. Printed per point: those three in GiB, temporaries' growth per
doubling of T (temp(2T) / temp(T)), lowering and compile seconds and the compiling process' peak
RSS. Each point compiles in its own subprocess (`--timeout`, `--max-rss-gb` stop it).

Models (`--models`): "default" = configs/default.py's model; "qwen3_layer" = one layer of
`ModelConfig.qwen3_30b_a3b` (bf16, with its embedding and head, V = 151,936); "qwen3_30b" = all
48 layers; "qwen3_L<n>" = n layers of it. Settings (`--settings`, `name[+field=value...]`):
"materialised" = dense attention ([B, N, T, G, S] logits), no remat, the head's log-softmax in
one chunk (the behaviour before the long-row changes); "long" = blocked attention, remat "full",
`logits_chunk` 0 (sized from V). `--before`: the same program on commit 39f835f's tree (a git
worktree under /tmp; its ModelConfig has none of the three fields, so its defaults: setting
"before").

The layer loop is the scan `forward` runs over the stacked [L, ...] params. XLA's memory
analysis of a while loop counts the body's temporaries once (one buffer set reused by every
iteration); what crosses iterations is counted whole: the residuals the forward scan stacks for
the backward ([L, B, T, D] layer inputs under remat "full", every activation under "none") and
the backward scan's stacked per-layer gradients. Checked at T = 4096, 1 / 2 / 4 layers of the
Qwen3 shape (`--models qwen3_L1,qwen3_L2,qwen3_L4`): temporaries 8.66 / 12.86 / 17.57 GiB with
remat "full" (+2.35 GiB a layer, 2.25 of them the stacked expert-weight gradients, f32 on CPU),
9.29 / 17.02 / 26.30 GiB with "none" (+4.3 GiB a layer); the body's own temporaries (the MoE
dispatch buffers, the head's float32 gradient) do not grow with L. A value hoisted out of
the loop (below) is counted once whatever L.

Caveats. These are XLA:CPU's numbers. Its optimised bf16 program keeps the backward scan's
stacked expert-weight gradients as f32 [L, E, D, F] temporaries converted after the loop (the
jaxpr's are bf16): 108 GiB of the 48-layer model's temporaries at any T. In float32
(`--settings long+param_dtype=float32+dtype=float32`) they alias the output instead (48 layers,
T = 32768: 45 GiB, against 151 in bf16), and a bf16 layer's activations are as large as a
float32 one's (CPU dots run in f32): on an accelerator expect less; compile there to know.
`--no-scan-hoisting` (diagnostic) turns off JAX's loop-invariant residual hoisting in the partial
evaluation of `scan` (jax/_src/lax/control_flow/loops.py `_scan_known_hoisting`). While the
layer scan took the positions as loop-invariant constants, that hoisting moved the blocked
attention's position-only values (visibility masks, -inf fills) out of the layer loop, stacked
over every (query block, key block) tile, [nq, nk, B, N, bq, G, bk]: quadratic in T (128 GiB at
T = 32768); positions are per-layer scan inputs since, and the flag shows no difference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "39f835f"
BEFORE_TREE = pathlib.Path("/tmp/espo_before")
GiB = 2**30
SETTINGS = {
    "materialised": dict(attention_impl="dense", remat="none", logits_chunk=-1),  # -1: B * T
    "long": dict(attention_impl="blocked", remat="full", logits_chunk=0),
}
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
# Per model, the lengths run when --lengths is not given.
DEFAULT_LENGTHS = {"default": LENGTHS, "qwen3_layer": LENGTHS, "qwen3_30b": (8192, 32768)}
# One value of a buffer-assignment dump: "value: <id name @0> (size=S,offset=O): shape".
_VALUE = re.compile(r"^\s*value: <\d+ (\S+)[^>]*> \(size=(\d+),offset=(\d+)\): (.*)$")


# ---- one point (runs in a subprocess whose PYTHONPATH is the measured tree) --------------------
def model_config(name: str):
    """The ModelConfig of a --models name (module docstring), from the imported espo's tree."""
    import espo
    from espo import model as model_lib

    if name == "default":
        from espo import config as config_lib
        from espo import testing

        cfg = testing.load_script(
            pathlib.Path(espo.__file__).parents[1] / "configs" / "default.py"
        ).get_config("")
        return config_lib.Settings.from_config(cfg).model
    layers = {"qwen3_layer": 1, "qwen3_30b": 48}.get(name)
    if layers is None and (m := re.fullmatch(r"qwen3_L(\d+)", name)):
        layers = int(m.group(1))
    if layers is None:
        raise SystemExit(f"unknown model {name!r}: default, qwen3_layer, qwen3_30b, qwen3_L<n>")
    return model_lib.ModelConfig.qwen3_30b_a3b(num_layers=layers)


def parse_setting(spec: str) -> dict:
    """`name[+field=value...]` -> ModelConfig overrides (values parsed as int when they are)."""
    name, *extra = spec.split("+")
    if name not in SETTINGS:
        raise SystemExit(f"unknown setting {name!r}: one of {sorted(SETTINGS)}")
    out = dict(SETTINGS[name])
    for item in extra:
        field, _, value = item.partition("=")
        out[field] = int(value) if value.lstrip("-").isdigit() else value
    return out


def largest_temps(dump_dir: str, n: int) -> list[dict]:
    """The n largest slots of the gradient's temporary allocation in XLA's buffer assignment (its
    dump): per offset, the slot's size and the shapes of the values placed there over the
    program (as XLA's memory-usage report groups them, restricted to the temporaries)."""
    pattern = "*jit_loss*after_optimizations-buffer-assignment.txt"
    files = sorted(pathlib.Path(dump_dir).glob(pattern))
    slots, in_temp = {}, False
    for line in files[-1].read_text().splitlines() if files else ():
        if line.startswith("allocation "):
            in_temp = "preallocated-temp" in line and "color" not in line  # the main one
        elif in_temp and (m := _VALUE.match(line)):
            _, size, offset, shape = m.groups()
            if shape.startswith("("):  # a tuple: pointers only
                continue
            slot = slots.setdefault(int(offset), dict(size=0, shapes={}))
            slot["size"] = max(slot["size"], int(size))
            shape = shape.split("{")[0]
            slot["shapes"][shape] = slot["shapes"].get(shape, 0) + 1
    top = sorted(slots.values(), key=lambda r: -r["size"])[:n]
    return [
        dict(gib=r["size"] / GiB,
             shapes=", ".join(f"{c}x{sh}" if c > 1 else sh for sh, c in r["shapes"].items()))
        for r in top
    ]  # fmt: skip


def allocation_sizes(dump_dir: str, module: str = "jit_loss") -> dict:
    """The allocations of program `module` (the gradient's by default) in XLA's buffer
    assignment (its dump), in GiB: temporaries
    (the preallocated temp allocations), arguments (the entry parameters') and outputs (the
    live-out ones, which also hold temporaries before the gradient is written: counted once,
    as outputs). Their sum is what XLA:TPU checks against the chip's HBM (its refusal calls it
    all "HLO temporaries"); `memory_analysis()` is not available when it refuses, and on a TPU
    its temp_size differs from this sum's temporaries (it is printed beside them)."""
    files = sorted(
        pathlib.Path(dump_dir).glob(f"*{module}*after_optimizations-buffer-assignment.txt")
    )
    if not files:  # not zeros: a program measured as empty would "fit"
        raise FileNotFoundError(f"no buffer assignment of module {module!r} in {dump_dir}")
    sizes = dict(temp_gib=0.0, args_gib=0.0, out_gib=0.0)
    for line in files[-1].read_text().splitlines():
        if m := re.match(r"allocation \d+: size (\d+), (.*)$", line):
            size, kind = int(m.group(1)) / GiB, m.group(2)
            key = (
                "temp_gib"
                if "preallocated-temp" in kind
                else "args_gib"
                if "parameter" in kind
                else "out_gib"
                if "live-out" in kind
                else None
            )
            if key:
                sizes[key] += size
    return sizes  # fmt: skip


def _rss_watchdog(limit_gib: float) -> None:
    """Exit the process (a JSON error line) once its resident memory passes limit_gib."""

    def watch():
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GiB
            if rss > limit_gib:
                print(json.dumps({"error": f"RSS {rss:.1f} GiB > {limit_gib} GiB"}), flush=True)
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _on_topology_mesh(args, topology: str, sizes: str):
    """`args` (params, tokens, mask, trace) as shape structs on the chips of a TPU `topology`
    arranged as espo's mesh `sizes` ("data=1,fsdp=1,expert=4"): params sharded by
    `sharding.RULES` (`param_shardings`), the rows along the batch axes; and the mesh as the
    context mesh to trace under (`jax.set_mesh`: the MoE's expert-parallel shard_map)."""
    import bench_moe
    import jax
    import numpy as np

    from espo import sharding

    topo = bench_moe.tpu_topology(topology)
    given = dict(kv.split("=") for kv in sizes.split(","))
    dims = tuple(int(given.get(a, 1)) for a in sharding.AXES)
    if int(np.prod(dims)) != len(topo.devices):
        raise ValueError(f"mesh {sizes} is not the {len(topo.devices)} chips of {topology}")
    auto = (jax.sharding.AxisType.Auto,) * len(dims)
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(dims), sharding.AXES, axis_types=auto)
    params, *rest = args
    shard = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)  # noqa: E731
    params = jax.tree.map(shard, params, sharding.param_shardings(mesh, params))
    rows = sharding.batch_sharding(mesh)
    rest = jax.tree.map(lambda a: shard(a, rows), rest)
    return [params, *rest], jax.set_mesh(mesh)


def measure(point: dict) -> dict:
    """Lower and compile the gradient of one point; its memory analysis, times and peak RSS."""
    _rss_watchdog(point["max_rss_gb"])
    dump = tempfile.mkdtemp(prefix="bench_memory_") if point["buffers"] or point.get("tpu") else ""
    if dump:  # XLA's buffer assignment of every compiled module, for largest_temps
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}"
    import jax
    import jax.numpy as jnp

    if point.get("no_scan_hoisting"):  # diagnostic: JAX's loop-invariant residual hoisting off
        from jax._src.lax.control_flow import loops

        loops._scan_known_hoisting = lambda jaxpr, consts, n: (jaxpr, consts, [False] * n, [])

    import espo
    from espo import train_step, types
    from espo.model import transformer

    cfg = model_config(point["model"])
    B, T = point["rows"], point["length"]
    fields = {f.name for f in dataclasses.fields(cfg)}
    over = dict(point["overrides"])  # empty on the before tree, which has fewer fields
    if unknown := set(over) - fields:
        raise ValueError(f"not ModelConfig fields in this tree: {sorted(unknown)}")
    if over.get("logits_chunk") == -1:
        over["logits_chunk"] = B * T  # the head in one chunk
    cfg = cfg.replace(**over)
    mode = train_step.RoutingMode.REPLAY_IDS if point["replay"] else train_step.RoutingMode.FREE

    def loss(params, tokens, mask, trace):
        out = train_step.token_logps(cfg, params, tokens, mask, routing=trace, routing_mode=mode)
        return out.logps.sum()

    params = transformer.param_shapes(cfg)
    if point.get("unrolled"):  # per-layer params: the unrolled layer loop
        params = jax.eval_shape(lambda p: transformer.unstack_layers(cfg, p), params)
    args = [params, jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T), bool)]
    if point["replay"]:
        shape = (B, cfg.num_layers, T, cfg.top_k)
        trace = types.RouterTrace(  # ids only, as the rollout records them
            expert_ids=jax.ShapeDtypeStruct(shape, types.expert_id_dtype(cfg.num_experts)),
            expert_weights=None,
        )
        args.append(trace)
    else:
        args.append(None)
    backend, mesh = contextlib.nullcontext(), contextlib.nullcontext()
    if point.get("tpu"):  # deviceless AOT for a TPU topology, traced as on a TPU (bench_moe)
        sys.path.insert(0, str(ROOT / "experiments"))
        import bench_moe

        _, spec = bench_moe._tpu_device(point["tpu"])
        backend = bench_moe._as_tpu()
        if point.get("mesh"):  # the topology's chips as espo's mesh, params by sharding.RULES
            args, mesh = _on_topology_mesh(args, point["tpu"], point["mesh"])
        else:
            on_tpu = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spec)  # noqa: E731
            args = jax.tree.map(on_tpu, args)
    t0 = time.perf_counter()
    with backend, mesh:
        lowered = jax.jit(jax.grad(loss)).trace(*args).lower()
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
        mem = compiled.memory_analysis()
        sizes = dict(
            temp_gib=mem.temp_size_in_bytes / GiB,
            args_gib=mem.argument_size_in_bytes / GiB,
            out_gib=mem.output_size_in_bytes / GiB,
            alias_gib=mem.alias_size_in_bytes / GiB,
        )
    except Exception as e:  # noqa: BLE001
        if not (point.get("tpu") and "RESOURCE_EXHAUSTED" in str(e)):
            raise
        sizes = dict(refused=str(e).split("\n")[0][:200])  # the chip's HBM check
    if point.get("tpu"):  # the sizes the chip's check adds up (allocation_sizes)
        sizes.update(xla_temp_gib=sizes.get("temp_gib"), **allocation_sizes(dump))
        sizes["total_gib"] = sizes["temp_gib"] + sizes["args_gib"] + sizes["out_gib"]
    t2 = time.perf_counter()
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    out = dict(
        espo=str(pathlib.Path(espo.__file__).parents[1]),
        config={
            k: getattr(cfg, k) for k in ("attention_impl", "remat", "logits_chunk") if k in fields
        },  # fmt: skip
        **sizes,
        params_gib=param_bytes / GiB,
        lower_s=t1 - t0,
        compile_s=t2 - t1,
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )
    if dump:
        out["largest"] = largest_temps(dump, point["buffers"])
        shutil.rmtree(dump, ignore_errors=True)
    return out


# ---- the driver ------------------------------------------------------------------------------
def before_tree() -> pathlib.Path:
    """A git worktree of BEFORE_COMMIT under /tmp (made once)."""
    if not (BEFORE_TREE / "espo").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(BEFORE_TREE),
             BEFORE_COMMIT],
            check=True,
        )  # fmt: skip
    return BEFORE_TREE


def run_point(point: dict, tree: pathlib.Path, timeout: float) -> dict:
    """`measure(point)` in a subprocess importing espo from `tree`."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)  # the tree first (libtpu may follow: --tpu)
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--point", json.dumps(point)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - t}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {}
    if not res:
        res = {"error": f"rc {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    elif not res.get("error") and pathlib.Path(res["espo"]) != tree.resolve():
        res = {"error": f"imported espo from {res['espo']}, not {tree}"}
    res["wall_s"] = time.perf_counter() - t
    return res


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="default,qwen3_layer,qwen3_30b", help="comma-separated")
    p.add_argument("--settings", default="long", help="comma-separated name[+field=value...]")
    p.add_argument("--lengths", default="", help="T values, comma-separated (default per model)")
    p.add_argument("--rows", type=int, default=1, help="B")
    p.add_argument("--replay", action="store_true", help="REPLAY_IDS with a RouterTrace input")
    p.add_argument("--before", action="store_true", help=f"also commit {BEFORE_COMMIT}'s tree")
    p.add_argument("--before-only", action="store_true", help="only commit 39f835f's tree")
    p.add_argument("--tree", default="", help="measure this tree instead of the working one")
    p.add_argument(
        "--tpu", default="", help="compile for this TPU topology (v5p:2x2x1; libtpu on PYTHONPATH)"
    )
    p.add_argument(
        "--mesh", default="", help="with --tpu: its chips as this mesh (data=1,fsdp=1,expert=4)"
    )
    p.add_argument("--buffers", type=int, default=0, help="list N largest temporaries")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    p.add_argument("--max-rss-gb", type=float, default=16.0, help="stop a point past this RSS")
    p.add_argument(
        "--no-scan-hoisting",
        action="store_true",
        help="diagnostic: JAX's scan partial eval without loop-invariant hoisting (docstring)",
    )
    p.add_argument(
        "--unrolled",
        action="store_true",
        help="the unrolled layer loop (per-layer params; train.scan_layers=False) for the scan",
    )
    p.add_argument("--json", default="", help="write every row here")
    p.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one point
    args = p.parse_args(argv)
    if args.point:
        try:
            print(json.dumps(measure(json.loads(args.point))), flush=True)
        except Exception as e:  # noqa: BLE001  # reported in the table, not a traceback
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        return

    trees = [] if args.before_only else [("after", pathlib.Path(args.tree or ROOT))]
    if args.before or args.before_only:
        trees.append(("before", before_tree()))
    settings = args.settings.split(",")
    rows = []
    print("| tree | model | setting | T | temp GiB | x per 2T | args GiB | out GiB | lower s |"
          " compile s | peak RSS GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tree_name, tree in trees:
        for model in args.models.split(","):
            lengths = args.lengths or ",".join(map(str, DEFAULT_LENGTHS.get(model, LENGTHS)))
            for setting in ["before"] if tree_name == "before" else settings:
                prev = {}
                for T in sorted(int(t) for t in lengths.split(",")):
                    point = dict(
                        model=model, length=T, rows=args.rows, replay=args.replay,
                        overrides={} if setting == "before" else parse_setting(setting),
                        buffers=args.buffers, max_rss_gb=args.max_rss_gb, tpu=args.tpu,
                        mesh=args.mesh,
                        no_scan_hoisting=args.no_scan_hoisting, unrolled=args.unrolled,
                    )  # fmt: skip
                    r = run_point(point, tree, args.timeout)
                    r.update(tree=tree_name, model=model, setting=setting, length=T)
                    rows.append(r)
                    if r.get("error"):
                        print(f"| {tree_name} | {model} | {setting} | {T} | {r['error']} "
                              f"({r['wall_s']:.0f} s) |", flush=True)  # fmt: skip
                        continue
                    growth = r["temp_gib"] / prev[T // 2] if prev.get(T // 2) else None
                    r["growth"] = growth
                    prev[T] = r["temp_gib"]
                    print(
                        f"| {tree_name} | {model} | {setting} | {T} | {r['temp_gib']:.3f} | "
                        f"{_fmt(growth, '.2f')} | {r['args_gib']:.3f} | {r['out_gib']:.3f} | "
                        f"{r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['peak_rss_gib']:.2f} |"
                        + (f" total {r['total_gib']:.2f}" if "total_gib" in r else "")
                        + (f" (XLA temp {r['xla_temp_gib']:.2f})" if r.get("xla_temp_gib") else "")
                        + (f" refused: {r['refused']}" if r.get("refused") else ""),
                        flush=True,
                    )
    if args.buffers:
        for r in rows:
            if r.get("largest"):
                print(f"\nlargest temporaries: {r['tree']} {r['model']} {r['setting']} "
                      f"T={r['length']}")  # fmt: skip
                print("| GiB | values placed there |\n|---|---|")
                for v in r["largest"]:
                    print(f"| {v['gib']:.3f} | {v['shapes'][:200]} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
