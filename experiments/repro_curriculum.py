"""The multi-stage difficulty curriculum (Compass-Thinker-7B) against one stage, with the real
trainer, on issue 33's depth-extrapolation protocol.

Run:  python experiments/repro_curriculum.py [--preset default|quick] [--seeds 0,...,7]
                                             [--arms hard,uniform,staged,gated] [--out DIR]

Compass-Thinker-7B trains in stages of rising difficulty. A curriculum can only matter where
the hardest level is out of the policy's reach at first, so here the levels go past what the
warm start was taught: make run's warm start (`configs/default.py`, chains of 3-6 terms, the
shared `runs/repro/warm_start_default_<seed>`) is trained with RL on chains of 3 to 10 terms
(DEPTH: uniform over the lengths), and the hardest level is HARDEST_TERMS terms. Pilot (the
warm start evaluated on 1024 test prompts of 3-9 terms): greedy pass@1 0.75 / 0.74 / 0.57 /
0.70 at 3-6 terms, 0.04 / 0.06 / 0.00 at 7-9 (pass@8 0.16 / 0.24 / 0.14). Every arm
optimises the same steps, prompts per step and G (adaptive G off: equal rollouts) with the
same budget of new tokens; they differ in which levels a step draws from (difficulty =
(terms - 3) / 7):
- hard: the two hardest levels (9-10 terms) from the first step;
- uniform: every level from the first step;
- staged: levels up to 6 terms for the first third of the steps, up to 8 for the second, all
  for the rest (advance by steps);
- gated: the same stages, each left when the train accuracy's EMA reaches 0.8 (advance by
  accuracy, each capped at its staged length).
Metrics, named before the runs: held-out greedy pass@1 and pass@k (k = eval.samples, sampled
at the rollout temperature) on the hardest level at the end, with 95% t-intervals over the
seeds and each arm's difference from uniform paired by seed; rollouts and tokens spent.
Written to OUT (default runs/repro/curriculum): results.md / results.json and hardest.png.
"""

from __future__ import annotations

import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

NAME = "default"  # configs/default.py, make run's task
MAX_TERMS, HARDEST_TERMS = 10, 10
BUDGET = 144  # new tokens: a 10-term solution is at most ~110 (the overlong onset: 115)
DEPTH = {  # the RL arms' data and evaluation (the warm start keeps 3-6 terms)
    "default": {
        "data.max_terms": MAX_TERMS,
        "data.terms_decay": 1.0,  # every length equally likely
        "data.max_prompt_length": 64,  # a 10-term prompt is 48 characters (the default: 48)
        "zve.max_group_size": 8,  # adaptive G off: every arm generates the same rollouts
        "train.steps": 45,
        "eval.every_steps": 0,  # at the start and the end (an eval costs ~2.5 min, 45 steps ~5)
        "eval.num_prompts": 2048,  # about 256 test prompts a level
        "eval.sampled_prompts": 512,  # pass@k on about 64 prompts of the hardest level
        "eval.samples": 8,
        "checkpoint.every_steps": 15,
    },
    "quick": {"data.max_terms": 5, "data.terms_decay": 1.0, "zve.max_group_size": 4},
}


def _difficulty(terms: int, preset: str) -> float:
    top = DEPTH[preset]["data.max_terms"]
    return (terms - 3) / (top - 3)


def arms(preset: str, steps: int | None = None) -> dict[str, repro_lib.Arm]:
    """The arms at `preset`; `steps` (default the preset's) sets the length of the stages."""
    stage = repro_lib.config_module(NAME).stage
    if preset == "quick":
        steps, budget, G, cuts = steps or 2, 16, 4, (4, 4)  # the tiny config's budget and G
    else:
        steps, budget, G, cuts = steps or DEPTH[preset]["train.steps"], BUDGET, 8, (6, 8)
    third = max(1, steps // 3)
    common = dict(group_size=G, max_new_tokens=budget)
    staged = lambda advance: (
        stage("short", max_difficulty=_difficulty(cuts[0], preset), steps=third,
              advance=advance, **common),
        stage("longer", max_difficulty=_difficulty(cuts[1], preset), steps=third,
              advance=advance, **common),
        stage("all", max_difficulty=1.0, steps=10**9, **common),
    )  # fmt: skip
    hard = stage(
        "hard", min_difficulty=_difficulty(HARDEST_TERMS - 1, preset) if preset != "quick"
        else 1.0, max_difficulty=1.0, steps=10**9, **common,
    )  # fmt: skip
    one = lambda *stages: {"curriculum.stages": stages}
    return {
        "hard": repro_lib.Arm("hard", one(hard), "hardest levels only"),
        "uniform": repro_lib.Arm(
            "uniform",
            one(stage("all", max_difficulty=1.0, steps=10**9, **common)),
            "uniform mix",
        ),  # fmt: skip
        "staged": repro_lib.Arm("staged", one(*staged("steps")), "staged (by steps)"),
        "gated": repro_lib.Arm("gated", one(*staged("accuracy")), "staged (accuracy-gated)"),
    }


def hardest(records: list[dict], metric: str = "pass@1") -> str:
    """The per-length key of the hardest level present: eval/<metric>/<n>-terms."""
    keys = [k for r in records for k in r if k.startswith(f"eval/{metric}/")]
    if not keys:
        return f"eval/{metric}"
    return max(set(keys), key=lambda k: int(k.rsplit("/", 1)[1].split("-")[0]))


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    first = runs[arm_list[0].name][0]
    sampled = [k for k in first[0] if re.fullmatch(r"eval/pass@\d+", k) and k != "eval/pass@1"]
    pass_k = sampled[0].removeprefix("eval/") if sampled else "pass@1"
    cols = {
        "hardest pass@1 start": lambda r: repro_lib.series(r, hardest(r))[1][0],
        "hardest pass@1 end": lambda r: repro_lib.last(r, hardest(r)),
        f"hardest {pass_k} end": lambda r: repro_lib.last(r, hardest(r, pass_k)),
        **repro_lib.heldout_columns(),
        "rollouts": lambda r: sum(x.get("train/rollouts") or 0.0 for x in r),
        "generated tokens": lambda r: sum(x.get("train/generated_tokens") or 0.0 for x in r),
    }
    table, data = repro_lib.arm_table(runs, arm_list, cols)
    head = repro_lib.markdown_table(
        ["levels drawn", "hardest pass@1 end (95% CI)", "minus uniform, paired (95% CI)",
         f"hardest {pass_k} end (95% CI)", "minus uniform, paired (95% CI)",
         "minus hardest only, paired (95% CI)"],
        [[a.title, repro_lib.ci(data[a.name]["hardest pass@1 end"]),
          repro_lib.paired_ci(data, a.name, "uniform", "hardest pass@1 end"),
          repro_lib.ci(data[a.name][f"hardest {pass_k} end"]),
          repro_lib.paired_ci(data, a.name, "uniform", f"hardest {pass_k} end"),
          repro_lib.paired_ci(data, a.name, "hard", f"hardest {pass_k} end")]
         for a in arm_list],
    )  # fmt: skip
    notes = (
        f"Hardest level: `{hardest(first)}` (held-out greedy pass@1) and `{hardest(first, pass_k)}`"
        " (sampled). Every arm optimises the same number of groups of the same size a step; "
        "rollouts and tokens are what they generated. ± in the second table is the std over "
        "seeds."
    )
    return [head, table, notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    key = hardest(runs[arm_list[0].name][0])
    panels = [(key, "greedy pass@1, hardest level"), ("eval/pass@1", "greedy pass@1, all")]
    curves = repro_lib.curves_of(runs, arm_list)
    return [repro_lib.plot(out / "hardest.png", panels, curves, title="Curriculum")]


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/curriculum", arms=arms, preset="default",
        seeds="0,1,2,3,4,5,6,7",
    )  # fmt: skip
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_curriculum.py",
        title="Curriculum on depth extrapolation", summarize=summarize, plots=plots,
        common=DEPTH[args.preset] | ({"train.steps": 2} if args.preset == "quick" else {}),
        name=NAME,
    )  # fmt: skip


if __name__ == "__main__":
    main()
