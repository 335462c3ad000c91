"""ESPO vs GRPO vs GSPO over several warm starts (issue 55, experiment 3), on ~150-token
completions. Written, with its metric and its analysis, before the first run.

Run:  python experiments/repro_optimizers_warm.py [--warm-seeds 20,21,22] [--seeds 30,31,32]
                                                  [--arms grpo,gspo,espo] [--out DIR]
      (resumes; `--records docs/repro/optimizers_warm/records` re-summarizes)

Why: experiments/repro_optimizers.py ran every RL seed from one shared warm start on short
completions (~40 tokens), so its intervals say nothing of how a result varies with the warm
start, and ESPO's pooling over two warm starts was decided after the five-seed interval
included 0. This run fixes everything before it starts:
- Task: make run's (configs/default.py) with repro_system's long, heavy-tailed chains (14-32
  terms, P(n) ~ 0.9^n; the teacher's solutions: median 142 tokens, p90 216, in a 384-token
  budget). Each warm start learns them (supervised, `train.steps` = 0).
- Warm starts: 3, trained with seeds 20, 21, 22 (none used before). RL seeds: 30, 31, 32 under
  every warm start (each RL seed gives the three losses the same prompts and keys).
- Arms: the loss only (grpo, gspo, espo), in repro_optimizers' stale-data stress (20 RL steps
  of 8 optimiser updates a rollout batch, mini-batches of 16 of 128 rows, a constant learning
  rate of EDGE_LR = 2e-4, chosen there on short chains and not retuned here).
- Test set: the first 256 test prompts of the long-chain task, fixed across every run; greedy
  pass@1 at steps 0, 5, 10, 15, 20.
- **Primary metric**: the held-out area (the mean of the greedy pass@1 curve over the run).
  **Primary comparison**: ESPO minus GRPO, paired within (warm start, RL seed). **Analysis**
  (two levels, warm start a random effect): the mean difference of each warm start over its RL
  seeds, then the mean of those and its 95% Student-t interval over the warm starts (2 degrees
  of freedom). This interval covers warm-start variation; the between- and within-warm-start
  standard deviations are reported beside it. Verdict: "reproduced" if the interval lies above
  0, "reversed" if below, otherwise "not reproduced (the interval includes 0)".
- Secondary (reported, no verdict): ESPO minus GSPO on the same metric and analysis; collapses
  / runs per loss (repro_lib.collapsed); final greedy pass@1; gradient use by advantage.
Written to OUT (default runs/repro/optimizers_warm): results.md / results.json, heldout.png.

Added after the result (every stressed run collapsed; not pre-registered): `--unstressed 10
--warm-seeds 20 --seeds 30,31 --arms grpo,espo --warm-root runs/repro/optimizers_warm --out
runs/repro/optimizers_warm_control`, the same warm start and evaluation under make run's update
settings, to tell the stress's collapse from the task's.
"""

from __future__ import annotations

import math
import pathlib
import sys
from collections.abc import Mapping, Sequence

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402
import repro_optimizers  # noqa: E402
import repro_system  # noqa: E402

NAME = "default"
LOSSES = ("grpo", "gspo", "espo")
PRIMARY = ("espo", "grpo")  # arm minus base
SECONDARY = (("espo", "gspo"),)
WARM_SEEDS, SEEDS = "20,21,22", "30,31,32"
EVAL = {
    "eval.every_steps": 5,
    "eval.num_prompts": 256,  # the test split's first 256 long-chain prompts
    "eval.samples": 1,  # no sampled metric is read: the smallest sampled pass
    "eval.sampled_prompts": 1,
}


def common(preset: str, unstressed: int = 0) -> dict:
    """Every RL run's overrides on top of the warm start's (`repro_system.long_completions`).
    `unstressed` > 0: the control added after the result (not pre-registered), make run's
    update settings (one update a rollout batch at its learning rate and schedule) for that many
    steps, evaluated as the stressed runs."""
    evals = EVAL if preset != "quick" else {}
    if unstressed:
        return {**evals, "train.steps": unstressed}
    return {**repro_optimizers.STRESS[preset], **evals}


def two_level(differences: Mapping[int, Sequence[float]], confidence: float = 0.95) -> dict:
    """{warm start: [paired differences over its RL seeds]} -> the mean over warm starts of each
    one's mean difference, the half-width of its Student-t interval over the warm starts
    (W - 1 degrees of freedom: warm start as a random effect in a balanced design), and the
    between- (sd of the warm starts' means) and within-warm-start (pooled sd over seeds)
    standard deviations. nan where there are too few values."""
    means = [float(np.mean(v)) for v in differences.values() if len(v)]
    mean, half = repro_lib.interval(means, confidence)
    within = [np.var(v, ddof=1) for v in differences.values() if len(v) > 1]
    return dict(
        mean=mean,
        half=half,
        warm_starts=len(means),
        between_sd=float(np.std(means, ddof=1)) if len(means) > 1 else math.nan,
        within_sd=float(math.sqrt(np.mean(within))) if within else math.nan,
    )


def verdict(res: Mapping[str, float]) -> str:
    if math.isnan(res["half"]):
        return "no verdict (fewer than 2 warm starts)"
    if res["mean"] - res["half"] > 0:
        return "reproduced"
    if res["mean"] + res["half"] < 0:
        return "reversed"
    return "not reproduced (the interval includes 0)"


def _fmt(res: Mapping[str, float]) -> str:
    lo, hi = res["mean"] - res["half"], res["mean"] + res["half"]
    return (
        f"{res['mean']:+.3f} ± {res['half']:.3f} [{lo:.3f}, {hi:.3f}] over {res['warm_starts']} "
        f"warm starts (sd between {res['between_sd']:.3f}, within {res['within_sd']:.3f})"
    )


COLUMNS = {
    **repro_lib.stability_columns(),
    **repro_lib.heldout_columns(),
    "grad adv hi-H": lambda r: repro_lib.mean_over(r, "loss/grad_adv_frac_group0"),
    "grad adv rest": lambda r: repro_lib.mean_over(r, "loss/grad_adv_frac_group1"),
}


def summarize(runs: Mapping[int, Mapping[str, list[list[dict]]]], arms) -> tuple[list[str], dict]:
    """`runs`: {warm seed: {arm: [records of each RL seed]}}."""
    data = {
        w: {a.name: {c: repro_lib.per_seed(by[a.name], f) for c, f in COLUMNS.items()}
            for a in arms}
        for w, by in runs.items()
    }  # fmt: skip
    names = {a.name for a in arms}
    out: dict = {"runs": {str(w): d for w, d in data.items()}, "comparisons": {}}
    lines = []
    for k, (arm, base) in enumerate((PRIMARY, *SECONDARY)):
        if not {arm, base} <= names:
            continue
        diffs = {
            w: [a - b for a, b in zip(d[arm]["held-out area"], d[base]["held-out area"],
                                      strict=True)]
            for w, d in data.items()
        }  # fmt: skip
        res = two_level(diffs)
        res["verdict"] = verdict(res)
        res["per_warm_start"] = {str(w): v for w, v in diffs.items()}
        out["comparisons"][f"{arm} minus {base}"] = res
        what = "**Primary**" if k == 0 else "Secondary"
        tail = f": **{res['verdict']}**." if k == 0 else "."
        lines.append(f"{what} (held-out area, {arm} minus {base}, paired): {_fmt(res)}{tail}")
    rows = []
    for a in arms:
        pooled = {c: [v for w in data for v in data[w][a.name][c]] for c in COLUMNS}
        rows.append([
            a.title, f"{sum(pooled['collapsed']):.0f} / {len(pooled['collapsed'])}",
            repro_lib.spread(pooled["held-out area"]), repro_lib.spread(pooled["pass@1 end"]),
            " / ".join(repro_lib.spread(data[w][a.name]["held-out area"]) for w in data),
            f"{repro_lib.spread(pooled['grad adv hi-H'])} / "
            f"{repro_lib.spread(pooled['grad adv rest'])}",
        ])  # fmt: skip
    table = repro_lib.markdown_table(
        ["loss", "collapses / runs", "held-out area", "final pass@1",
         "held-out area by warm start (" + ", ".join(str(w) for w in data) + ")",
         "gradient use by advantage, hi-H / rest"], rows,
    )  # fmt: skip
    notes = (
        "± in the table: the std over all runs of a loss (warm starts x RL seeds), and by warm "
        "start over its RL seeds. The comparisons' intervals are over the warm starts' mean "
        "paired differences (two levels)."
    )
    return [*lines, table, notes], out


def run_all(args, arm_list) -> dict[int, dict[str, list[list[dict]]]]:
    out, seeds = pathlib.Path(args.out), repro_lib.seeds_of(args)
    runs = {}
    for w in [int(s) for s in args.warm_seeds.split(",")]:
        if args.records:
            runs[w] = repro_lib.read_records(pathlib.Path(args.records) / f"warm{w}", arm_list,
                                             seeds)  # fmt: skip
            continue
        warm = pathlib.Path(args.warm_root or out) / f"warm{w}" / "warm_start"
        runs[w] = repro_lib.run_arms(
            out / f"warm{w}", args.preset, arm_list, seeds, progress=not args.no_progress,
            common=common(args.preset, args.unstressed), warm=warm, name=NAME,
            shared=repro_system.long_completions(args.preset), warm_seed=w,
        )  # fmt: skip
        repro_lib.write_records(out / "records" / f"warm{w}", out / f"warm{w}", arm_list, seeds)
    return runs


def main(argv=None) -> dict:
    arms = {n: repro_optimizers.ARMS[n] for n in LOSSES}
    p = repro_lib.parser(__doc__, out="runs/repro/optimizers_warm", seeds=SEEDS)
    p.set_defaults(preset="default")
    p.add_argument("--warm-seeds", default=WARM_SEEDS, help="comma-separated warm-start seeds")
    p.add_argument("--arms", default=",".join(LOSSES), help="comma-separated losses")
    p.add_argument("--unstressed", type=int, default=0, metavar="STEPS",
                   help="the control added after the result: make run's update settings for "
                   "STEPS steps instead of the stress")  # fmt: skip
    p.add_argument("--warm-root", default=None,
                   help="the directory whose warm<W>/warm_start are the warm starts (default "
                   "--out): a control reuses the experiment's")  # fmt: skip
    args = p.parse_args(argv)
    arm_list = repro_lib.select_arms(p, args.arms, arms)
    runs = run_all(args, arm_list)
    sections, data = summarize(runs, arm_list)
    pooled = {a.name: [r for w in runs for r in runs[w][a.name]] for a in arm_list}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1")],
                       repro_lib.curves_of(pooled, arm_list), title="Held-out accuracy"),
    ]  # fmt: skip
    repro_lib.finish(
        args, argv, script="repro_optimizers_warm.py",
        title="GRPO vs GSPO vs ESPO over warm starts "
        + (f"(unstressed control, {args.unstressed} steps: not pre-registered)"
           if args.unstressed else "(pre-registered)"),
        sections=sections,
        files=files, data=data,
    )  # fmt: skip
    return data


if __name__ == "__main__":
    main()
