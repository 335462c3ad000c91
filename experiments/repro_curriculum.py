"""The multi-stage difficulty curriculum (Compass-Thinker-7B) vs one stage, with the real trainer.

Run:  python experiments/repro_curriculum.py [--preset quick|cpu|large] [--seeds 0]
                                             [--arms curriculum,single] [--out DIR]

Compass-Thinker-7B trains in stages of rising difficulty and length budget. Both arms train the
embedded default (`configs/default.py`: reasoning-gym chains of 3, 4 and 5 terms at difficulty
0, 0.5 and 1) from one shared warm start for the same steps, prompts per step and G, so the
same rollout budget:
- curriculum: the default's three stages scaled to the run: a quarter of the steps on the
  easiest level (32 new tokens), a quarter on the two easier levels (48), the rest on all (56);
- single: all levels from the first step (56 new tokens).
Written to OUT (default runs/repro/curriculum): results.md / results.json (held-out greedy pass@1
on the hardest level and overall, at the start and the end; rollouts and generated tokens
spent) and hardest.png (the hardest level's trajectory, and overall pass@1).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402


def arms(preset: str) -> dict[str, repro_lib.Arm]:
    cfg = repro_lib.config(preset)
    stage, steps = repro_lib.config_module().stage, cfg.train.steps
    top = cfg.curriculum.stages[-1]  # the last stage: every level, the largest budget
    quarter = max(1, steps // 4)
    staged = (
        stage("easy", max_difficulty=0.0, steps=quarter, max_new_tokens=32),
        stage("mixed", max_difficulty=0.5, steps=quarter, max_new_tokens=48),
        stage("all", max_difficulty=1.0, steps=10**9, max_new_tokens=top.max_new_tokens),
    )
    if preset == "quick":  # the tiny config's budgets and G
        staged = tuple(stage(s.name, max_difficulty=s.max_difficulty, steps=s.steps,
                             group_size=s.group_size, max_new_tokens=s.max_new_tokens)
                       for s in cfg.curriculum.stages)  # fmt: skip
    single = (
        stage("all", max_difficulty=1.0, steps=10**9, group_size=top.group_size,
              max_new_tokens=top.max_new_tokens),
    )  # fmt: skip
    return {
        "curriculum": repro_lib.Arm("curriculum", {"curriculum.stages": staged}, "curriculum"),
        "single": repro_lib.Arm("single", {"curriculum.stages": single}, "single stage"),
    }


def hardest_key(records: list[dict]) -> str:
    """The per-level pass@1 of the last (hardest) level: eval/pass@1/<index>-<task>."""
    keys = sorted(k for k in records[0] if k.startswith("eval/pass@1/"))
    return keys[-1] if keys else "eval/pass@1"


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    cols = {
        "hardest start": lambda r: repro_lib.series(r, hardest_key(r))[1][0],
        "hardest end": lambda r: repro_lib.last(r, hardest_key(r)),
        "hardest change": lambda r: repro_lib.change(r, hardest_key(r)),
        "hardest best": lambda r: max(repro_lib.series(r, hardest_key(r))[1]),
        **repro_lib.heldout_columns(),
        "rollouts": lambda r: sum(x.get("train/rollouts") or 0.0 for x in r),
        "generated tokens": lambda r: sum(x.get("train/generated_tokens") or 0.0 for x in r),
    }
    table, data = repro_lib.arm_table(runs, arm_list, cols)
    first = runs[arm_list[0].name][0]
    notes = (
        f"Hardest level: `{hardest_key(first)}` (held-out greedy pass@1 on it); ± is the std "
        "over seeds. Both arms optimise the same number of groups a step; rollouts and tokens "
        "are what they generated."
    )
    return [table, notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    key = hardest_key(runs[arm_list[0].name][0])
    panels = [(key, "greedy pass@1, hardest level"), ("eval/pass@1", "greedy pass@1, all")]
    curves = repro_lib.curves_of(runs, arm_list)
    return [repro_lib.plot(out / "hardest.png", panels, curves, title="Curriculum")]


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(__doc__, argv, out="runs/repro/curriculum", arms=arms)
    return repro_lib.experiment(
        args,
        argv,
        arm_list,
        script="repro_curriculum.py",
        title="Multi-stage curriculum vs one stage",
        summarize=summarize,
        plots=plots,
        common={"train.steps": 2} if args.preset == "quick" else {},  # both tiny stages
    )


if __name__ == "__main__":
    main()
