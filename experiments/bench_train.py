"""Time per RL step of the real trainer, its phase breakdown, tokens/s and peak memory.

  python experiments/bench_train.py                       # configs/default.py and its tiny variant
  python experiments/bench_train.py --configs default:tiny --steps 6

Each config runs `espo.trainer.train` for `--steps` RL steps (no warm start, no eval between
steps) in a fresh workdir; the first `--warmup` steps (compilation) are left out of the means.
Printed per config: mean seconds per step, each phase's share of the step (rollout, old
log-probs, update, checkpoint, and what is left: host work), generated tokens/s, and the peak
resident memory of the process so far. Phases come from the trainer's own `perf/*` metrics.
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import sys
import tempfile

import numpy as np

from espo import metrics, testing, trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("rollout", "old_logps", "update", "checkpoint")


def bench(spec: str, *, steps: int, warmup: int) -> dict[str, float]:
    file, _, variant = spec.partition(":")
    cfg = testing.load_script(ROOT / "configs" / f"{file}.py").get_config(variant)
    cfg.train.steps = steps
    cfg.sft.steps = 0
    cfg.eval.every_steps = 0
    cfg.checkpoint.every_steps = 10**6
    with tempfile.TemporaryDirectory() as workdir:
        trainer.train(cfg, workdir, progress=False)
        rows = [
            r
            for r in metrics.read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
            if r["step"] > warmup
        ]
    rows = [r for r in rows if r["step"] < steps]  # the last step also evaluates and saves
    step_s = float(np.mean([r["perf/step_s"] for r in rows]))
    out = {"step_s": step_s, "tokens_per_s": float(np.mean([r["perf/tokens_per_s"] for r in rows]))}
    for phase in PHASES:
        out[f"{phase}_share"] = (
            float(np.mean([r.get(f"perf/{phase}_s", 0.0) for r in rows])) / step_s
        )
    out["host_share"] = 1.0 - sum(out[f"{p}_share"] for p in PHASES)
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs", default="default:tiny,default", help="comma-separated file[:variant]"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 1:
        sys.exit(f"--steps={args.steps} must exceed --warmup + 1 = {args.warmup + 1}")
    header = "config | s/step | tokens/s | rollout | old log-probs | update | checkpoint | host"
    print(f"| {header} | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.configs.split(","):
        r = bench(spec, steps=args.steps, warmup=args.warmup)
        shares = " | ".join(f"{r[f'{ph}_share']:.0%}" for ph in (*PHASES, "host"))
        speed = f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f}"
        print(f"| {spec} | {speed} | {shares} | {r['peak_rss_gb']:.2f} |")


if __name__ == "__main__":
    main()
