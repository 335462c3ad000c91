"""Scaling of the sampler and the RL step: batch, generation length, and 1 vs 8 devices.

  python experiments/bench_scale.py                          # every section, configs/default.py
  python experiments/bench_scale.py --only sampler --batches 16,64 --lengths 128,1024
  python experiments/bench_scale.py --quick                  # tiny shapes (the test runs it)

Sections (each point in its own process, so peak memory is that point's):
- sampler: espo's sampler (float32, the default config's model as a Hugging Face checkpoint,
  `bench_rollout.espo_worker`) at B in --batches with --new_tokens, then at B=--length_batch
  for every length in --lengths: tokens/s, milliseconds per decode step, peak RSS. A decode
  step reads the weights once for the whole batch, so tokens/s should grow with B until the
  step turns compute-bound; a step's cost should grow only with the cache it attends over.
- train: the real trainer's RL step (`bench_train.bench`: no warm start, compilation left out)
  at each train.prompts_per_step in --prompts: seconds per step, seconds per rollout row, and
  the phases. Linear in the batch once the batch fills the machine.
- devices: the same RL step on 1 device and on 8 emulated CPU devices
  (`--xla_force_host_platform_device_count=8`) with the meshes in --meshes (data x fsdp x
  expert). Emulated devices share the same 2 cores: this measures what sharding costs (the
  collectives, the expert all-to-all / gather, per-device dispatch), not a speed-up; a real
  mesh divides the per-device work by its size.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from espo import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("sampler", "train", "devices")
bench_rollout = testing.load_script(ROOT / "experiments" / "bench_rollout.py")
bench_train = testing.load_script(ROOT / "experiments" / "bench_train.py")


def sampler(
    *, variant: str, batches, lengths, new_tokens: int, prompt_len: int, length_batch: int
) -> list[dict]:
    """espo sampler tokens/s, ms per decode step and peak RSS per (batch, new tokens) point:
    each batch at `new_tokens`, then each length at `length_batch` rows."""
    points = [(b, new_tokens) for b in batches]
    points += [(length_batch, n) for n in lengths if (length_batch, n) not in points]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = bench_rollout._hf_checkpoint_like(tmp, bench_rollout._config_model(variant))
        for b, n in points:
            r = bench_rollout.run_engine(
                "espo", path, batch=b, prompt_len=prompt_len, new_tokens=n, dtype="float32"
            )
            if r is not None:
                ms = 1e3 / r["steps_per_s"]
                rows.append(dict(batch=b, new_tokens=n, tokens_per_s=r["tokens_per_s"],
                                 step_ms=ms, peak_rss_gb=r["peak_rss_gb"]))  # fmt: skip
    return rows


def train_point(spec: str, *, steps: int, overrides, devices: int = 1) -> dict:
    """One `bench_train.bench` in its own process (with `devices` emulated CPU devices)."""
    env = dict(os.environ)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    argv = [sys.executable, __file__, "--worker", json.dumps(dict(spec=spec, steps=steps,
            overrides=[list(kv) for kv in overrides]))]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"step_s"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec} {overrides} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")  # fmt: skip
    return json.loads(lines[-1])


def _worker(payload: str) -> None:
    job = json.loads(payload)
    overrides = [tuple(kv) for kv in job["overrides"]]
    print(json.dumps(bench_train.bench(job["spec"], steps=job["steps"], warmup=2,
                                       overrides=overrides)))  # fmt: skip


def _mesh(text: str) -> list[tuple[str, int]]:
    data, fsdp, expert = (int(x) for x in text.split("x"))
    return [("mesh.data", data), ("mesh.fsdp", fsdp), ("mesh.expert", expert)]


def _phases(r: dict) -> str:
    names = (*bench_train.PHASES, "host")
    return " | ".join(f"{r[f'{p}_share']:.0%}" for p in names)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections among {SECTIONS}")
    p.add_argument("--batches", default="16,64,256")
    p.add_argument("--lengths", default="128,512,1024,4096", help="new tokens, at --length_batch")
    p.add_argument("--length_batch", type=int, default=16, help="rows of the length points")
    p.add_argument("--new_tokens", type=int, default=128, help="of the batch points")
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--prompts", default="4,8,16,32", help="train.prompts_per_step values")
    p.add_argument("--meshes", default="8x1x1,2x1x4", help="data x fsdp x expert on 8 devices")
    p.add_argument("--steps", type=int, default=6, help="RL steps per train point (2 warm-up)")
    p.add_argument("--quick", action="store_true", help="tiny config and shapes (tests)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    only = args.only.split(",")
    if bad := sorted(set(only) - set(SECTIONS)):
        sys.exit(f"--only: unknown sections {bad}; valid: {SECTIONS}")
    ints = lambda text: [int(x) for x in text.split(",")]
    variant, spec = ("tiny", "default:tiny") if args.quick else ("", "default")

    if "sampler" in only:
        rows = sampler(variant=variant, batches=ints(args.batches), lengths=ints(args.lengths),
                       new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                       length_batch=args.length_batch)  # fmt: skip
        print(f"\nsampler, configs/{spec} model, float32, {args.prompt_len}-token prompts")
        print("| B | new tokens | tokens/s | ms / decode step | peak RSS GB |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['new_tokens']} | {r['tokens_per_s']:,.0f} | "
                  f"{r['step_ms']:.2f} | {r['peak_rss_gb']:.2f} |")  # fmt: skip
    if "train" in only:
        print(f"\nRL step vs batch, configs/{spec} (train.prompts_per_step x group size rows)")
        print("| prompts / step | s / step | ms / row | rollout | old log-probs | update | "
              "checkpoint | host | peak RSS GB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for prompts in ints(args.prompts):
            r = train_point(spec, steps=args.steps, overrides=[("train.prompts_per_step", prompts)])
            print(f"| {prompts} | {r['step_s']:.3f} | {1e3 * r['step_s'] / r['rows']:.1f} | "
                  f"{_phases(r)} | {r['peak_rss_gb']:.2f} |")  # fmt: skip
    if "devices" in only:
        print(f"\nRL step on 1 vs 8 emulated CPU devices, configs/{spec}")
        print("| devices | mesh (data x fsdp x expert) | s / step | x 1 device | rollout | "
              "old log-probs | update | checkpoint | host |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        one = train_point(spec, steps=args.steps, overrides=_mesh("1x1x1"))
        print(f"| 1 | 1x1x1 | {one['step_s']:.3f} | 1.00 | {_phases(one)} |")
        for mesh in args.meshes.split(","):
            r = train_point(spec, steps=args.steps, overrides=_mesh(mesh), devices=8)
            print(f"| 8 | {mesh} | {r['step_s']:.3f} | {r['step_s'] / one['step_s']:.2f} | "
                  f"{_phases(r)} |")  # fmt: skip


if __name__ == "__main__":
    main()
