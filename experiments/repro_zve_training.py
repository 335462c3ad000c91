"""Zero-variance elimination in training, with the real trainer: where the rollouts go.

Run:  python experiments/repro_zve_training.py [--preset default|quick] [--seeds 0,1,2]
                                               [--arms plain,resample,rl_zvp,full,offline]
                                               [--out DIR]

"Each Prompt Matters" spends no rollout on prompts whose group rewards are all equal. Four arms
train GRPO on the embedded default (`configs/default.py`, make run's settings) from one shared
warm start, adding the stages cumulatively (experiments/repro_zve.py measures the same stages on
a simulated policy):
- plain:    GRPO as it is: zero-variance groups reach the optimiser with advantage 0
            (zve.mode=rl_zvp with advantage.rl_zvp_alpha=0), no pre-filter, fixed G;
- resample: DAPO-style refill (zve.mode=resample): ZVP groups are dropped and more prompts drawn;
- rl_zvp:   ZVP groups kept with RL-ZVP's entropy-shaped advantages (alpha 0.1);
- full:     rl_zvp + the online pass-rate pre-filter (zve.prefilter=drop) + adaptive G (up to
            zve.max_group_size=16): the default pipeline;
- offline:  full, its pass-rate history seeded before the first step from an offline table of
            the pool (`espo.pass_rates`: OFFLINE_SAMPLES samples of every pool prompt from the
            warm start, OUT/pass_rates.json, `zve.pass_rate_table`), so the pre-filter and
            adaptive G act from step 1; the table's rollouts are counted as its cost.
The regime the stages exist for (issue 33): the training pool is cut to its first POOL prompts
(`data.train_max_samples`), so 30 steps of 16 prompts cycle it 3 times and the pre-filter and
adaptive G have pass-rate histories to act on; the held-out test set is make run's (its first
EVAL_PROMPTS prompts, evaluated every 5 steps). The metric, named before the runs: rollouts
generated (and training seconds) until held-out greedy pass@1 first reaches TARGET; then the
final pass@1 with its 95% t-interval over seeds, the ZVP rate of the generated groups and the
share of loss tokens with a gradient. Written to OUT (default runs/repro/zve_training):
results.md / results.json, heldout.png (held-out accuracy against rollouts spent: the x axis is
compute, not steps) and zve.png.
"""

from __future__ import annotations

import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

from espo import pass_rates, zero_variance  # noqa: E402

_PLAIN = {
    "loss.name": "grpo",
    "zve.mode": "rl_zvp",
    "advantage.rl_zvp_alpha": 0.0,
    "zve.prefilter": "off",
    "zve.max_group_size": 8,
}
ARMS = {
    "plain": repro_lib.Arm("plain", _PLAIN, "plain GRPO"),
    "resample": repro_lib.Arm("resample", {**_PLAIN, "zve.mode": "resample"}, "+ resample"),
    "rl_zvp": repro_lib.Arm("rl_zvp", {**_PLAIN, "advantage.rl_zvp_alpha": 0.1}, "+ RL-ZVP"),
    "full": repro_lib.Arm(
        "full",
        {
            **_PLAIN,
            "advantage.rl_zvp_alpha": 0.1,
            "zve.prefilter": "drop",
            "zve.max_group_size": 16,
        },
        "+ pre-filter + adaptive G",
    ),  # fmt: skip
}
ARMS["offline"] = repro_lib.Arm(
    "offline", ARMS["full"].overrides, "+ pre-filter + adaptive G, offline pass rates"
)  # its zve.pass_rate_table is set in main, once the table is estimated
# Samples of each pool prompt in the offline table: at least 10, or the history's Beta(0.5, 0.5)
# prior keeps an always-solved prompt's rate, (N + 0.5) / (N + 1), under prefilter_high (0.95).
OFFLINE_SAMPLES = 16
ROLLOUTS = "train/rollouts"  # rollouts generated in a step (refills included)
NAME = "default"  # configs/default.py, make run's task
POOL, EVAL_PROMPTS, TARGET = 160, 512, 0.85
COMMON = {
    "data.train_max_samples": POOL,  # 10 steps of 16 prompts an epoch
    "eval.every_steps": 5,
    "eval.num_prompts": EVAL_PROMPTS,  # +-4 points (95%) at pass@1 0.8
}

# The tiny warm start of --quick solves nothing: with the offline table, a pre-filter of rates
# <= 0.05 would drop the whole pool (the trainer stops: every prompt pre-filtered).
QUICK = {"zve.prefilter_low": 0.0}


def to_target(records: list[dict], x: str, target: float = TARGET) -> float:
    """The sum of per-step `x` (rollouts, seconds) up to the first eval whose held-out greedy
    pass@1 reaches `target`; inf when none does."""
    xs, ys = repro_lib.series(records, "eval/pass@1", x=x)
    hit = [float(a) for a, y in zip(xs, ys, strict=True) if y >= target]
    return hit[0] if hit else math.inf


def total(records: list[dict], key: str) -> float:
    return float(sum(r.get(key) or 0.0 for r in records))


def summarize(offline: float):
    """The tables, the offline arm's rollouts counted with its table's (`offline` of them)."""
    return lambda runs, arm_list: _summarize(runs, arm_list, offline)


def _summarize(runs, arm_list, offline: float) -> tuple[list[str], dict]:
    cost = {a.name: offline if a.name == "offline" else 0.0 for a in arm_list}
    cols = {
        f"rollouts to pass@1 {TARGET}": lambda r: to_target(r, ROLLOUTS),
        f"train s to pass@1 {TARGET}": lambda r: to_target(r, "perf/step_s"),
        "rollouts": lambda r: total(r, ROLLOUTS),
        "informative groups": lambda r: total(r, "zve/informative_groups_generated"),
        "rollouts / informative group": lambda r: (
            total(r, ROLLOUTS) / max(total(r, "zve/informative_groups_generated"), 1.0)
        ),
        "ZVP share of optimiser batch": lambda r: repro_lib.mean_over(
            r, "zve/zero_advantage_rollout_fraction"
        ),
        "tokens with gradient": lambda r: repro_lib.mean_over(r, "loss/grad_token_frac"),
        "rollout ZVP rate": lambda r: repro_lib.mean_over(r, "zve/rollout_zvp_rate"),
        **repro_lib.heldout_columns(),
    }
    table, data = repro_lib.arm_table(runs, arm_list, cols)
    for a in arm_list:  # the offline table's rollouts are spent before the first step
        key = f"rollouts to pass@1 {TARGET}"
        data[a.name][key] = [v + cost[a.name] for v in data[a.name][key]]
    notes = (
        "Totals over the run (rollouts, informative groups: groups whose verifier rewards "
        "differ) and means over the RL steps: the share of the optimiser's rollouts in ZVP "
        "groups (verifier advantage 0), the share of loss tokens with a nonzero gradient "
        "(`loss/grad_token_frac`: RL-ZVP gives ZVP groups one), the ZVP rate of the generated "
        "groups; ± is the std over seeds. Every arm optimises train.prompts_per_step groups a "
        "step, so arms that refill spend more rollouts a step. Rollouts to the target include "
        f"the offline table's ({offline:.0f}: {OFFLINE_SAMPLES} samples of each pool prompt) in "
        "the offline arm; the second table's do not."
    )
    target = repro_lib.markdown_table(
        ["arm", f"rollouts to pass@1 {TARGET} per seed", "final pass@1 (95% CI over seeds)",
         "pass@1 change (95% CI)"],
        [[a.title,
          " / ".join("not reached" if math.isinf(v) else f"{v:.0f}"
                     for v in data[a.name][f"rollouts to pass@1 {TARGET}"]),
          repro_lib.ci(data[a.name]["pass@1 end"]), repro_lib.ci(data[a.name]["pass@1 change"])]
         for a in arm_list],
    )  # fmt: skip
    return [target, table, notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    by_compute = lambda key: {
        a.title: [repro_lib.series(r, key, x=ROLLOUTS) for r in runs[a.name]] for a in arm_list
    }
    return [
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1")], by_compute,
                       xlabel="rollouts generated", title="Held-out accuracy against compute"),
        repro_lib.plot(out / "zve.png", [("zve/zero_advantage_rollout_fraction",
                                          "zero-advantage share (optimiser)"),
                                         ("loss/grad_token_frac", "tokens with gradient"),
                                         ("zve/rollouts_per_informative_group",
                                          "rollouts per informative group")],
                       repro_lib.curves_of(runs, arm_list)),
    ]  # fmt: skip


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/zve_training", arms=ARMS, preset="default", seeds="0,1,2"
    )
    # The offline table: OUT's, or the one beside the records a table is rebuilt from.
    where = pathlib.Path(args.records).parent if args.records else pathlib.Path(args.out)
    table = where / "pass_rates.json"
    if any(a.name == "offline" for a in arm_list) and not args.records:
        warm = repro_lib.warm_start(
            repro_lib.warm_dir(args), args.preset, seed=repro_lib.seeds_of(args)[0],
            progress=not args.no_progress, name=NAME,
        )  # fmt: skip
        cfg = repro_lib.config(args.preset, {**COMMON, "model.init_from": str(warm)}, name=NAME)
        table.parent.mkdir(parents=True, exist_ok=True)
        pass_rates.estimate(cfg, num_samples=OFFLINE_SAMPLES, out=table)
    offline = zero_variance.PassRateTable.load(table) if table.exists() else None
    arm_list = [
        repro_lib.Arm(a.name, {**a.overrides, "zve.pass_rate_table": str(table)}, a.label)
        if a.name == "offline" else a for a in arm_list
    ]  # fmt: skip
    rollouts = len(offline.pass_rates) * offline.num_samples if offline else 0.0
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_zve_training.py",
        title="Zero-variance elimination in training", summarize=summarize(rollouts),
        plots=plots, common=COMMON | (QUICK if args.preset == "quick" else {}), name=NAME,
    )  # fmt: skip


if __name__ == "__main__":
    main()
