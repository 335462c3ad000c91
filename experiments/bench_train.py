"""Time per RL step of the real trainer, its phase breakdown, tokens/s and peak memory.

  python experiments/bench_train.py                       # configs/default.py and its tiny variant
  python experiments/bench_train.py --configs default:tiny --steps 6
  python experiments/bench_train.py --packing                # packed vs padded update

Each config runs `espo.trainer.train` for `--steps` RL steps (no warm start, no eval between
steps) in a fresh workdir; the first `--warmup` steps (compilation) are left out of the means.
Printed per config: mean seconds per step, each phase's share of the step (rollout, old
log-probs, update, checkpoint, and what is left: host work), generated tokens/s, and the peak
resident memory of the process so far. Phases come from the trainer's own `perf/*` metrics.

`--packing` times the update alone (`train_step.train_step`, jitted, after warm-up) on one
length-skewed batch of the config's shape (prompts_per_step x zve.group_size rows; sequence
lengths log-uniform from 16 to max_prompt_length + the largest max_new_tokens), padded
(`train.micro_batch_size` rows per micro-batch) and packed (`train.packing`, micro-batches of
`train.max_tokens_per_micro_batch` tokens, per budget in `--budgets`): seconds per update,
real tokens/s, the share of padding computed, the compiled step's temporary memory (XLA's
memory analysis) and the loss (equal up to the router aux loss, a mean per micro-batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import resource
import sys
import tempfile
import time

import jax
import numpy as np
import optax

from espo import batching, metrics, testing, train_step, trainer
from espo import config as config_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("rollout", "old_logps", "update", "checkpoint")


def bench(spec: str, *, steps: int, warmup: int, overrides=()) -> dict[str, float]:
    """`steps` RL steps of config `spec` ("file[:variant]"), `overrides` ((dotted key, value)
    pairs, e.g. ("train.prompts_per_step", 32)) applied first; means over steps after warmup."""
    file, _, variant = spec.partition(":")
    cfg = testing.load_script(ROOT / "configs" / f"{file}.py").get_config(variant)
    repro_lib.set_fields(cfg, dict(overrides))
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
    out["rows"] = float(np.mean([r["train/rollouts"] for r in rows]))  # rollouts per step
    for phase in PHASES:
        out[f"{phase}_share"] = (
            float(np.mean([r.get(f"perf/{phase}_s", 0.0) for r in rows])) / step_s
        )
    out["host_share"] = 1.0 - sum(out[f"{p}_share"] for p in PHASES)
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def skewed_lengths(rng, n: int, *, prompt: int, generation: int, low: int = 16):
    """(prompt, completion) lengths of n rows: totals log-uniform in [low, prompt + generation],
    the prompt uniform within what the totals and the two budgets allow."""
    total = np.exp(rng.uniform(np.log(low), np.log(prompt + generation), n)).round().astype(int)
    plen = rng.integers(np.maximum(1, total - generation), np.minimum(prompt, total - 1) + 1)
    return plen, total - plen


def bench_packing(spec: str, *, budgets: list[int], repeats: int) -> list[dict]:
    """Update seconds, tokens/s, padding share, temp memory and loss: padded, then per budget."""
    file, _, variant = spec.partition(":")
    cfg = testing.load_script(ROOT / "configs" / f"{file}.py").get_config(variant)
    s = config_lib.Settings.from_config(cfg)
    model_cfg = s.model  # the procedural configs (no model.hf_path)
    n = s.train.prompts_per_step * s.zve.group_size
    tp, tg = s.max_prompt_length, s.curriculum.max_new_tokens
    lengths = skewed_lengths(np.random.default_rng(0), n, prompt=tp, generation=tg)
    batch, params = testing.random_train_batch(
        model_cfg, num_rows=n, prompt_length=tp, generation_length=tg, lengths=lengths
    )
    real = int(np.asarray(batch.attention_mask).sum())
    opt = optax.adamw(1e-5)
    state = train_step.TrainState(
        step=np.zeros((), np.int32), params=params, opt_state=opt.init(params)
    )
    micro = min(s.train.micro_batch_size, n)
    arms = [("padded", None, batching.split(batch, n // micro), n * (tp + tg))]
    for budget in budgets:
        (mini,) = batching.minibatches(
            batch, mini_batch_size=n, micro_batch_size=micro, epochs=1, key=jax.random.key(0),
            packing_budget=budget,
        )  # fmt: skip
        seg = np.asarray(mini.layout.segment_ids)  # [M, R, L]; all-padding micro-batches skipped
        computed = int(seg.any((1, 2)).sum()) * seg.shape[1] * seg.shape[2]
        arms.append((f"packed {budget}", budget, mini, computed))
    out = []
    for name, budget, mini, computed in arms:
        sc = trainer.step_config(s, model_cfg, micro_batch_size=micro)
        sc = dataclasses.replace(sc, packing_budget=budget)
        update = jax.jit(functools.partial(train_step.train_step, sc, opt))
        compiled = update.lower(state, mini).compile()
        _, m = jax.block_until_ready(compiled(state, mini))  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(compiled(state, mini))
            times.append(time.perf_counter() - t)
        sec = float(np.median(times))
        mem = compiled.memory_analysis()
        out.append(dict(
            arm=name, update_s=sec, tokens_per_s=real / sec, padding=1 - real / computed,
            temp_mb=(mem.temp_size_in_bytes if mem else float("nan")) / 2**20,
            loss=float(m["loss/loss"]), aux=float(m["loss/router_aux_loss"]),
        ))  # fmt: skip
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs", default="default:tiny,default", help="comma-separated file[:variant]"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--packing", action="store_true", help="packed vs padded update instead")
    p.add_argument("--budgets", default="256,512", help="packing budgets (tokens), comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed updates per arm (--packing)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--set",
        default="{}",
        help="config overrides as JSON, e.g. '{\"rollout.steps_per_check\": 8}'",
    )
    args = p.parse_args(argv)
    if args.packing:
        return print_packing(args)
    if args.steps <= args.warmup + 1:
        sys.exit(f"--steps={args.steps} must exceed --warmup + 1 = {args.warmup + 1}")
    header = "config | s/step | tokens/s | rollout | old log-probs | update | checkpoint | host"
    print(f"| {header} | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.configs.split(","):
        r = bench(
            spec, steps=args.steps, warmup=args.warmup, overrides=json.loads(args.set).items()
        )
        shares = " | ".join(f"{r[f'{ph}_share']:.0%}" for ph in (*PHASES, "host"))
        speed = f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f}"
        print(f"| {spec} | {speed} | {shares} | {r['peak_rss_gb']:.2f} |")


def print_packing(args) -> None:
    budgets = [int(b) for b in args.budgets.split(",")]
    print("| config | arm | update s | x padded | tokens/s | padding | temp MB | loss | aux loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.configs.split(","):
        rows = bench_packing(spec, budgets=budgets, repeats=args.repeats)
        for r in rows:
            print(
                f"| {spec} | {r['arm']} | {r['update_s']:.3f} | "
                f"{r['update_s'] / rows[0]['update_s']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['padding']:.0%} | {r['temp_mb']:.1f} | {r['loss']:.6f} | {r['aux']:.4f} |"
            )


if __name__ == "__main__":
    main()
