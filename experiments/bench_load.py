"""Loading and exporting a real-size checkpoint: the host memory one process needs.

  python experiments/bench_load.py                                   # ~1 GB, 8 devices
  python experiments/bench_load.py --layers 4 --experts 16 --vocab 32768 --shard-mb 128
  python experiments/bench_load.py --mesh 1,2,4                      # data,fsdp,expert

Writes a synthetic Qwen3-MoE checkpoint (`ModelConfig.qwen3_30b_a3b` at `--layers` layers,
`--experts` experts and a `--vocab` vocabulary; random bf16 weights, `save_hf_checkpoint` in
shard files of `--shard-mb`), then measures in fresh subprocesses, each its own:

  (a) whole: `load_hf_checkpoint(path)`, one process of 1 device, then the export of those
      params (`save_hf_checkpoint`);
  (b) sharded, 8 emulated devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) in one
      process: the same load with `shardings=` `sharding.param_shardings` over the `--mesh`
      (default: experts split 8 ways), then the export of the sharded params;
  (c) one process of 8: 8 processes of 1 CPU device each (`jax.distributed`, localhost), one
      mesh over the 8 devices: each process's callback is asked only for its own device's
      blocks, as on a real multi-host job; the largest and the mean of the 8.

Per step: "peak" = peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, its high-water mark
reset first through /proc/self/clear_refs) minus the RSS just before the call (after one
`param_shapes` trace, whose ~50 MB of interpreter state any first trace costs); "held after" =
the bytes of the process's device buffers when the load returns (on CPU devices are this
process's RAM: in (b) that is all 8 devices' shares, replicated parameters 8 times); "extra"
= peak - held after, the transient host memory the loader (or exporter) needed beyond what it
returns; "read" = the tensor bytes copied out of the files (every `get_slice` block counted by
wrapping the safetensors handle).

What should hold: a process reads from the files exactly its devices' blocks ((c): the share,
every replicated parameter whole plus its part of each expert weight), and its transient
memory scales with one parameter's share, not the checkpoint: "extra" is about the largest
leaf's local block two or three times over (the host block, jax's staging copy and the device
copy of `device_put`) plus one HF tensor. An export's extra is about one shard file twice
(safetensors' numpy `save_file` copies each tensor to bytes) plus one layer slice of a leaf.
On this 2-core CPU box (976 MiB checkpoint, defaults): (a) extra 570-630 MiB (the largest leaf
is 192 MiB; the loader before shardings held the whole numpy tree beside the device copies:
1,088 MiB), (c) read 472 MiB = the share, extra 168 MiB; with --mesh 1,2,4 read 272 MiB,
extra 113 MiB; exports 256-320 MiB at 128 MiB shards (the old exporter: 823 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pathlib
import resource
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _rss() -> int:
    """This process's resident set, bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS in /proc/self/status")


def measured(fn):
    """(fn(), peak RSS during fn minus RSS before, seconds): the peak reset before the call."""
    gc.collect()
    # Reset the high-water mark; where that is refused the peak is since the process started.
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    before, t0 = _rss(), time.perf_counter()
    out = fn()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    return out, peak - before, time.perf_counter() - t0


def count_reads():
    """A list whose [0] counts the tensor bytes the loader copies out of the files from now."""
    from espo import testing
    from espo.model import hf

    n, opened = [0], hf._open_safetensors
    hf._open_safetensors = lambda file: testing.CountingSafetensors(opened(file), n)
    return n


def held_bytes(params) -> int:
    """Bytes of the device buffers of `params` this process holds."""
    import jax

    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)


def config(args):
    from espo import model

    return model.ModelConfig.qwen3_30b_a3b(
        num_layers=args.layers, num_experts=args.experts, vocab_size=args.vocab
    )


# ---- the subprocesses -----------------------------------------------------------------------


def write(args) -> dict:
    """The synthetic checkpoint: random bf16 params, leaf by leaf, saved in shards."""
    import jax
    import ml_dtypes

    from espo import model

    cfg = config(args)
    rng = np.random.default_rng(0)
    draw = lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)).astype(ml_dtypes.bfloat16)
    params = jax.tree.map(draw, model.param_shapes(cfg))
    _, peak, seconds = measured(
        lambda: model.save_hf_checkpoint(
            cfg, params, args.path, max_shard_bytes=args.shard_mb * MIB
        )
    )
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return dict(model=total, export_peak=peak, export_s=seconds)


def load(args, *, mesh: tuple[int, int, int] | None, export: bool) -> dict:
    """(a) with `mesh` None, (b) or one process of (c) with it."""
    import jax

    from espo import model, sharding

    shardings = None
    if mesh is not None:
        m = sharding.make_mesh(**dict(zip(sharding.AXES, mesh, strict=True)))
        shardings = lambda cfg: sharding.param_shardings(m, model.param_shapes(cfg))
    model.param_shapes(config(args))  # the process's first trace (~50 MB, any model) not counted
    read = count_reads()

    def load_all():  # transfers to devices are asynchronous: count them in
        cfg, params = model.load_hf_checkpoint(args.path, shardings=shardings)
        return cfg, jax.block_until_ready(params)

    (cfg, params), peak, seconds = measured(load_all)
    out = dict(held=held_bytes(params), peak=peak, read=read[0], s=seconds)
    out["devices"] = len(jax.local_devices())
    if mesh is not None:  # one device's share, from the shardings alone
        tree = shardings(cfg)
        shapes = model.param_shapes(cfg)
        out["share"] = sum(
            int(np.prod(sh.shard_shape(s.shape))) * s.dtype.itemsize
            for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(tree), strict=True)
        )
    if export:
        with tempfile.TemporaryDirectory(dir=pathlib.Path(args.path).parent) as tmp:
            save = lambda: model.save_hf_checkpoint(
                cfg, params, pathlib.Path(tmp) / "export", max_shard_bytes=args.shard_mb * MIB
            )
            _, out["export_peak"], out["export_s"] = measured(save)
    return out


def worker(args) -> None:
    if args.worker == "write":
        result = write(args)
    elif args.worker == "whole":
        result = load(args, mesh=None, export=True)
    elif args.worker == "sharded":
        result = load(args, mesh=args.mesh, export=True)
    else:  # "process": one of args.processes, jax.distributed over localhost
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
        result = load(args, mesh=args.mesh, export=False)
    print("RESULT " + json.dumps(result), flush=True)


# ---- the driver -----------------------------------------------------------------------------


def _env(args, devices: int) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    if args.mmap_threshold_kb:  # glibc: blocks this big are mmapped, so freeing them unmaps
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold_kb << 10)
    return env


def _command(args, worker: str, *extra: str) -> list[str]:
    mesh = ",".join(map(str, args.mesh))
    return [sys.executable, __file__, "--worker", worker, "--path", str(args.path),
            "--layers", str(args.layers), "--experts", str(args.experts), "--vocab",
            str(args.vocab), "--shard-mb", str(args.shard_mb), "--mesh", mesh, *extra]  # fmt: skip


def _result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"a worker printed no result:\n{out[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def run(args, worker: str, devices: int) -> dict:
    out = subprocess.run(
        _command(args, worker), env=_env(args, devices), capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"{worker} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return _result(out.stdout)


def run_processes(args) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    n = args.processes
    procs = [
        subprocess.Popen(
            _command(
                args,
                "process",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--processes",
                str(n),
                "--process-id",
                str(i),
            ),
            env=_env(args, 1),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(n)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a process failed:\n" + "\n".join(o[-3000:] for o in outs))
    return [_result(o) for o in outs]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--shard-mb", type=int, default=128)
    p.add_argument("--mesh", default="1,1,8", help="data,fsdp,expert of (b) and (c)")
    p.add_argument(
        "--mmap-threshold-kb", type=int, default=0,
        help="MALLOC_MMAP_THRESHOLD_ of the workers (0: glibc's default, which keeps freed "
        "blocks of up to 32 MiB in the heap, where the RSS still counts them)",
    )  # fmt: skip
    p.add_argument("--path", default="", help="where to write the checkpoint (default: a tmp dir)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mesh = tuple(int(x) for x in args.mesh.split(","))
    if args.worker:
        sys.path.insert(0, str(ROOT))
        return worker(args)
    args.processes = int(np.prod(args.mesh))
    with tempfile.TemporaryDirectory() as tmp:
        args.path = pathlib.Path(args.path or tmp) / "checkpoint"
        written = run(args, "write", 1)
        files = sorted(args.path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        whole = run(args, "whole", 1)
        sharded = run(args, "sharded", args.processes)
        procs = run_processes(args)
    mib = lambda b: f"{b / MIB:,.0f}"
    share = sharded["share"]
    print(
        f"checkpoint: {mib(size)} MiB in {len(files)} files ({args.layers} layers, "
        f"{args.experts} experts, vocab {args.vocab}); mesh data,fsdp,expert = {args.mesh}; "
        f"one device's share {mib(share)} MiB ({share / written['model']:.1%})\n"
    )
    rows = [
        ("(a) load, whole, 1 device", whole),
        (f"(b) load, sharded, {args.processes} devices in 1 process", sharded),
        (f"(c) load, 1 of {args.processes} processes (largest)",
         max(procs, key=lambda r: r["peak"])),
        (f"(c) load, 1 of {args.processes} processes (mean)",
         {k: float(np.mean([r[k] for r in procs])) for k in ("held", "peak", "read", "s")}),
    ]  # fmt: skip
    print("| step | held after (MiB) | peak - before (MiB) | extra (MiB) | read (MiB) | s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        extra = r["peak"] - r["held"]
        print(f"| {name} | {mib(r['held'])} | {mib(r['peak'])} | {mib(extra)} | "
              f"{mib(r['read'])} | {r['s']:.1f} |")  # fmt: skip
    for name, r in (("synthetic params (host numpy)", written), ("(a)'s params", whole),
                    ("(b)'s sharded params", sharded)):  # fmt: skip
        print(f"| export of {name} | | {mib(r['export_peak'])} | {mib(r['export_peak'])} | "
              f"| {r['export_s']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
