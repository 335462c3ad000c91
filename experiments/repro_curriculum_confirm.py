"""The curriculum, confirmatory (issue 55, experiment 2): staged vs uniform vs hardest-only on
fresh seeds, pass@16 on every ten-term test prompt, three times the steps. Written, with its
metric and its analysis, before the first run.

Run:  python experiments/repro_curriculum_confirm.py [--seeds 8,9,10,11,12,13] [--out DIR]
      (resumes; `--records docs/repro/curriculum_confirm/records` re-summarizes)

Why: experiments/repro_curriculum.py (seeds 0-7, 45 steps, pass@8 on about 64 ten-term
prompts) left staged minus uniform at +0.018 ± 0.043 on pass@8, and the hardest-only comparison
was added after seeds 0-2. This run fixes everything before it starts:
- Task and arms: repro_curriculum's depth protocol (make run's warm start on 3-6 terms, RL on
  3-10 terms, 144 new tokens, G = 8, equal rollouts in every arm) with its arms `staged` (levels
  up to 6 terms for the first third of the steps, up to 8 for the second, all for the rest),
  `uniform` (every level from the first step) and `hard` (9-10 terms only).
- Steps: 135, three times the exploratory 45 (stages of 45 steps).
- Seeds: 8-13, none used before; one shared warm start (warm_start_default_8, trained with
  seed 8), so the interval is over RL seeds from that warm start, not over warm starts.
- Test set: every ten-term prompt of the test half, 188 of them (`eval.min_difficulty` = 1),
  fixed across seeds and arms; nothing was tuned on it. Evaluated at the start and the end.
- **Primary metric**: pass@16 (16 samples at temperature 1) on the 188 ten-term test prompts at
  the last step. **Primary comparison**: staged minus uniform, paired by seed, mean and 95%
  Student-t interval over the 6 seeds. Verdict: "confirmed" if the interval lies above 0,
  "contradicted" if below, otherwise "not confirmed (the interval includes 0)".
- Secondary (reported, no verdict): staged minus hardest-only and uniform minus hardest-only
  on the same metric; greedy pass@1 on the same prompts; new tokens generated.
Written to OUT (default runs/repro/curriculum_confirm): results.md / results.json, hardest.png.
"""

from __future__ import annotations

import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_curriculum  # noqa: E402
import repro_lib  # noqa: E402

SEEDS = "8,9,10,11,12,13"
ARMS = "staged,uniform,hard"
PRIMARY = ("staged", "uniform")  # arm minus base, paired by seed
K = 16
HARDEST_ONLY = {  # the evaluation: every prompt of the hardest level, each sampled
    "eval.min_difficulty": 1.0,  # the ten-term level only (difficulty (terms - 3) / 7)
    "eval.num_prompts": 4096,  # more than there are: every ten-term test prompt (188)
    "eval.sampled_prompts": 0,  # pass@k on all of them
}
CONFIRM = {
    **repro_curriculum.DEPTH["default"],
    "train.steps": 135,
    "checkpoint.every_steps": 15,
    **HARDEST_ONLY,
    "eval.samples": K,
}
QUICK = {**repro_curriculum.DEPTH["quick"], **HARDEST_ONLY, "train.steps": 2}


def verdict(differences: list[float]) -> str:
    """The pre-registered reading of the primary comparison's per-seed differences."""
    mean, half = repro_lib.interval(differences)
    if math.isnan(half):  # fewer than 2 seeds
        return "no verdict (fewer than 2 seeds)"
    if mean - half > 0:
        return "confirmed"
    if mean + half < 0:
        return "contradicted"
    return "not confirmed (the interval includes 0)"


def warm_start_groups(runs: list[list[dict]]) -> dict[float, list[int]]:
    """{step-0 greedy mean length: the indices of the seeds with it}: the seeds grouped by warm
    start (each seed's step-0 eval is its warm start's greedy decodes: identical within one warm
    start, different across the two this experiment had; docs/repro/README.md)."""
    groups: dict[float, list[int]] = {}
    for i, records in enumerate(runs):
        start = next(r for r in records if r["step"] == 0 and "eval/greedy_mean_length" in r)
        groups.setdefault(start["eval/greedy_mean_length"], []).append(i)
    return groups


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    sections, data = repro_curriculum.summarize(runs, arm_list)
    sampled = [c for c in data[arm_list[0].name] if c.startswith("hardest pass@")]
    key = next(c for c in sampled if c.endswith(" end") and c != "hardest pass@1 end")
    arm, base = PRIMARY
    if arm in data and base in data:
        diffs = [a - b for a, b in zip(data[arm][key], data[base][key], strict=True)]
        said = verdict(diffs)
        line = (
            f"**Primary** ({key.removesuffix(' end')} at the end, {arm} minus {base}, paired by "
            f"seed): {repro_lib.paired_difference(data[arm][key], data[base][key])}: "
            f"**{said}**."
        )
        data["primary"] = {"column": key, "differences": diffs, "verdict": said}
        groups = warm_start_groups(runs[arm])
        if len(groups) > 1:  # seeds from more than one warm start: each group's mean apart
            parts = [
                f"warm start {w + 1} (step-0 greedy length {length:.2f}, {len(idx)} seeds): "
                f"{repro_lib.ci([diffs[i] for i in idx])}"
                for w, (length, idx) in enumerate(groups.items())
            ]
            line += " By warm start (no verdict): " + "; ".join(parts) + "."
            data["primary"]["by_warm_start"] = {
                f"{length:.4f}": [diffs[i] for i in idx] for length, idx in groups.items()
            }
        sections = [line, *sections]
    sections.append(
        "Every evaluated prompt has ten terms (`eval.min_difficulty` = 1), so `eval/pass@1` and "
        f"`eval/pass@{K}` are the hardest level's."
    )
    return sections, data


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/curriculum_confirm", preset="default", seeds=SEEDS,
        arms=lambda preset: repro_curriculum.arms(
            preset, steps=None if preset == "quick" else CONFIRM["train.steps"]
        ),
        default=ARMS,
    )  # fmt: skip
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_curriculum_confirm.py",
        title="Curriculum, confirmatory (pre-registered)", summarize=summarize,
        plots=repro_curriculum.plots, common=QUICK if args.preset == "quick" else CONFIRM,
        name=repro_curriculum.NAME,
    )  # fmt: skip


if __name__ == "__main__":
    main()
