"""Figures the README quotes that no table prints, recomputed from the stored records.

Run:  python experiments/repro_figures.py [--curriculum DIR] [--zve DIR]

Nothing trains: every figure is recomputed from the gzipped curves kept beside a table
(`repro_lib.write_records`), with the same interval as the tables (mean ± the two-sided 95%
Student-t half-width over seeds [its ends], paired seed by seed):
- the testbed's ceiling: the greedy pass@1 of a model that has learnt make run's flawed teacher
  exactly, counted on each prompt set the docs measure on (generated, not trained);
- curriculum (docs/repro/curriculum/records): the hardest level's pass@k at the end, staged
  (and accuracy-gated, and uniform) minus hardest-only, on seeds 0-2 (run before that pairing
  was named) and on seeds 3-7 alone (run after it: the confirmatory seeds);
- zero-variance elimination (docs/repro/zve_training/records): the RL rollouts to held-out
  pass@1 TARGET, interpolated linearly between evaluations, with the offline table's rollouts
  not counted (amortised over the table's reuse): plain GRPO minus the offline arm, and the
  online pipeline minus the offline arm.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_curriculum  # noqa: E402
import repro_lib  # noqa: E402
import repro_zve_training  # noqa: E402

EXPLORATORY, CONFIRMATORY = (0, 1, 2), (3, 4, 5, 6, 7)


def ceilings(preset: str = "default") -> list[str]:
    """Lines: the greedy pass@1 of a model that has learnt make run's teacher exactly, counted on
    each prompt set a number in the docs is measured on (`repro_lib.teacher_ceiling`)."""
    cfg = repro_lib.config(preset, name="default")
    d, n = cfg.data, cfg.eval.num_prompts
    test = repro_lib.eval_examples(cfg)
    sets = [
        (f"the {len(test)} test prompts (make run, the controls)", test),
        (f"their first {cfg.eval.sampled_prompts} (maj@k, pass@k)",
         test[: cfg.eval.sampled_prompts]),
        ("the first 512 dev prompts (the pilots)",
         repro_lib.eval_examples(cfg, split="dev", num_prompts=512)),
        (f"the first {n} dev prompts (the teacher sweep)",
         repro_lib.eval_examples(cfg, split="dev", num_prompts=n)),
        (f"all {d.size} generated chains, training ones included", _generated(cfg)),
    ]  # fmt: skip
    lines = ["the exact teacher's greedy ceiling (answers >= 0 / prompts)"]
    for label, examples in sets:
        c = repro_lib.teacher_ceiling(examples, flaw=d.teacher_flaw, error=d.teacher_error)
        lines.append(f"  {label}: {c['ceiling']:.3f} ({c['negative']} of {c['prompts']} negative)")
    return lines


def _generated(cfg) -> list:
    from espo import config as config_lib
    from espo.data import sources

    train, held_out = sources.make_sources(config_lib.Settings.from_config(cfg).data)
    return [*(train[i] for i in range(len(train))), *(held_out[i] for i in range(len(held_out)))]


def _runs(records: pathlib.Path, names, seeds) -> dict[str, list[list[dict]]]:
    return repro_lib.read_records(records, [repro_lib.Arm(n, {}) for n in names], seeds)


def curriculum(records: pathlib.Path) -> list[str]:
    """Lines: each arm's hardest-level pass@k minus hardest-only's, per group of seeds."""
    seeds = EXPLORATORY + CONFIRMATORY
    runs = _runs(records, ["hard", "uniform", "staged", "gated"], seeds)
    pass_k = "pass@8"
    end = {a: [repro_lib.last(r, repro_curriculum.hardest(r, pass_k)) for r in rs]
           for a, rs in runs.items()}  # fmt: skip
    lines = [f"curriculum: the hardest level's {pass_k} at the end, minus hardest-only, paired"]
    for arm in ("staged", "gated", "uniform"):
        for label, group in (("seeds 0-2", EXPLORATORY), ("seeds 3-7", CONFIRMATORY),
                             ("seeds 0-7", seeds)):  # fmt: skip
            pick = lambda xs, group=group: [xs[seeds.index(s)] for s in group]
            diff = repro_lib.paired_difference(pick(end[arm]), pick(end["hard"]))
            lines.append(f"  {arm} minus hard, {label}: {diff}")
    return lines


def to_target_interpolated(records: list[dict], target: float) -> float:
    """The RL rollouts generated when held-out pass@1 first reaches `target`, linearly
    interpolated between the evaluation below it and the one at or above it (inf when none is;
    the start when the first evaluation is)."""
    xs, ys = repro_lib.series(records, "eval/pass@1", x=repro_zve_training.ROLLOUTS)
    for i, y in enumerate(ys):
        if y >= target:
            if i == 0:
                return float(xs[0])
            return float(xs[i - 1] + (xs[i] - xs[i - 1]) * (target - ys[i - 1]) / (y - ys[i - 1]))
    return math.inf


def zve(records: pathlib.Path) -> list[str]:
    """Lines: rollouts to the target per arm, and the offline arm's saving paired by seed."""
    target, seeds = repro_zve_training.TARGET, (0, 1, 2)
    runs = _runs(records, ["plain", "full", "offline"], seeds)
    hit = {a: [to_target_interpolated(r, target) for r in rs] for a, rs in runs.items()}
    lines = [f"zve: RL rollouts to held-out pass@1 {target}, interpolated between evaluations, "
             "the offline table's rollouts not counted"]  # fmt: skip
    for arm, values in hit.items():
        lines.append(f"  {arm}: " + " / ".join(f"{v:.0f}" for v in values))
    for base in ("plain", "full"):
        diff = repro_lib.paired_difference(hit[base], hit["offline"], digits=0)
        lines.append(f"  {base} minus offline (rollouts the offline arm saves): {diff}")
    return lines


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--curriculum", default="docs/repro/curriculum/records")
    p.add_argument("--zve", default="docs/repro/zve_training/records")
    args = p.parse_args(argv)
    lines = ceilings() + curriculum(pathlib.Path(args.curriculum)) + zve(pathlib.Path(args.zve))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
