"""The testbed's controls: does RL teach what the flawed teacher's demonstrations do not?

Run:  python experiments/repro_testbed.py [--preset default|quick] [--seeds 0,1,2] [--out DIR]

Every arm runs `configs/default.py` (`make run`'s settings at the default preset) from one
shared warm start: the supervised warm start on the flawed teacher (`data.teacher_flaw`), whose
held-out numbers are every arm's step 0.
- rl: the default RL run (ESPO, zero-variance elimination, router replay, FP8 rollouts).
- rft: online rejection-sampling fine-tuning at the same rollout budget: the same prompts a
  step, G and steps, advantage 1 on the correct samples and 0 elsewhere
  (`advantage.estimator=rft`), no pass-rate pre-filter, so it also trains on solved prompts.
- shuffled: the rl arm with each rollout call's rewards permuted over its rows
  (`reward.shuffle`); it must not gain (at most 2 points).
- sft-longer: the warm start's recipe trained for twice its steps (`sft.steps` x 2, a fresh run
  per seed), at least the rl arm's training time; its wall time is in the table.
- maj@k: the warm start's majority vote over its k sampled answers (`eval/maj@k`), the baseline
  a reviewer compares RL's greedy pass@1 with.
The metric, named before running: the change in held-out greedy pass@1 on the test split
(`eval.split=test`, which depends on `data.seed` only) from the warm start to the end of the
run, mean over seeds with its 95% Student-t interval. Written to OUT (default
runs/repro/testbed): results.md / results.json and heldout.png.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

NAME = "default"  # configs/default.py
ARMS = {
    "rl": repro_lib.Arm("rl", {}, "RL (default)"),
    "rft": repro_lib.Arm(
        "rft", {"advantage.estimator": "rft", "zve.prefilter": "off"}, "rejection-sampling FT"
    ),
    "shuffled": repro_lib.Arm("shuffled", {"reward.shuffle": True}, "shuffled rewards"),
}
KEY = "eval/pass@1"
# Every arm's evaluations (not the warm start's): greedy pass@1 on all eval.num_prompts test
# prompts, the sampled pass on 16 of them only (the arms are compared by greedy pass@1; the
# warm start's maj@k keeps the default's 128).
COMMON = {"eval.sampled_prompts": 16}


def _maj_key(records: list[dict]) -> str:
    return next((k for k in records[0] if k.startswith("eval/maj@")), "eval/maj@8")


def sft_longer(args, seeds, warm_steps: int) -> list[list[dict]]:
    """Fresh warm starts of twice the steps, one per seed (train.steps=0)."""
    out = pathlib.Path(args.out) / "sft-longer"
    runs = []
    for seed in seeds:
        over = {**COMMON, "seed": seed, "train.steps": 0, "sft.steps": 2 * warm_steps}
        cfg = repro_lib.config(args.preset, over, name=NAME)
        print(f"== SFT x2 ({2 * warm_steps} steps), seed {seed}", flush=True)
        runs.append(repro_lib.run(cfg, out / f"seed{seed}", progress=not args.no_progress))
    return runs


def summarize(runs, arm_list, longer, warm_records) -> tuple[list[str], dict]:
    start = float(repro_lib.series(warm_records, KEY)[1][0])
    change = {a.name: [repro_lib.last(r, KEY) - start for r in runs[a.name]] for a in arm_list}
    change["sft-longer"] = [repro_lib.last(r, KEY) - start for r in longer]
    end = {a.name: [repro_lib.last(r, KEY) for r in runs[a.name]] for a in arm_list}
    end["sft-longer"] = [repro_lib.last(r, KEY) for r in longer]
    fidelity = {
        a.name: [repro_lib.last(r, "eval/process_fidelity") for r in runs[a.name]] for a in arm_list
    }
    fidelity["sft-longer"] = [repro_lib.last(r, "eval/process_fidelity") for r in longer]
    wrong = {
        a.name: [repro_lib.last(r, "eval/right_answer_wrong_process") for r in runs[a.name]]
        for a in arm_list
    }
    wrong["sft-longer"] = [repro_lib.last(r, "eval/right_answer_wrong_process") for r in longer]
    seconds = {a.name: [_train_seconds(r) for r in runs[a.name]] for a in arm_list}
    maj = repro_lib.last(warm_records, _maj_key(warm_records))
    rows = [["warm start (step 0)", f"{start:.3f}", "0", "", "", ""]]
    rows.append([f"warm start, majority vote ({_maj_key(warm_records)[5:]})", f"{maj:.3f}",
                 f"{maj - start:+.3f}", "", "", ""])  # fmt: skip
    titles = {a.name: a.title for a in arm_list} | {"sft-longer": "SFT x2 steps (fresh runs)"}
    for name in [a.name for a in arm_list] + ["sft-longer"]:
        rows.append([
            titles[name], repro_lib.ci(end[name]), repro_lib.ci(change[name]),
            repro_lib.ci(fidelity[name]), repro_lib.ci(wrong[name]),
            repro_lib.spread(seconds.get(name, []), 0),
        ])  # fmt: skip
    header = ["arm", "pass@1 end", "change from the warm start", "process fidelity",
              "right answer, wrong process", "RL time (s)"]  # fmt: skip
    notes = (
        "Held-out greedy pass@1 on the test split, mean ± the half-width of the 95% Student-t "
        f"interval over {len(longer)} seeds [its ends]; every arm from the same warm start "
        "(its step-0 numbers). RL time: the seconds of the arm's RL steps (evaluations "
        "excluded). The SFT x2 arm is a fresh warm start of twice the steps per seed."
    )
    data = dict(start=start, majority=maj, end=end, change=change, fidelity=fidelity,
                right_answer_wrong_process=wrong, rl_seconds=seconds)  # fmt: skip
    return [repro_lib.markdown_table(header, rows), notes], data


def _train_seconds(records: list[dict]) -> float:
    return sum((r.get("perf/step_s") or 0.0) - (r.get("perf/eval_s") or 0.0) for r in records)


def main(argv=None) -> dict:
    parser = repro_lib.parser(__doc__, out="runs/repro/testbed", seeds="0,1,2")
    parser.set_defaults(preset="default")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated RL-like arms")
    args = parser.parse_args(argv)
    arm_list = repro_lib.select_arms(parser, args.arms, ARMS)
    seeds, out = repro_lib.seeds_of(args), pathlib.Path(args.out)
    warm = pathlib.Path(args.warm_start) if args.warm_start else out / "warm_start"
    runs = repro_lib.run_arms(
        out, args.preset, arm_list, seeds, progress=not args.no_progress, warm=warm, name=NAME,
        common=COMMON,
    )  # fmt: skip
    warm_steps = repro_lib.config(args.preset, name=NAME).sft.steps
    longer = sft_longer(args, seeds, warm_steps)
    warm_records = repro_lib.run(
        repro_lib.config(args.preset, {"seed": seeds[0], "train.steps": 0}, name=NAME),
        warm,
        progress=False,
    )
    sections, data = summarize(runs, arm_list, longer, warm_records)
    curves = repro_lib.curves_of(runs, arm_list)
    files = [
        repro_lib.plot(out / "heldout.png", [(KEY, "greedy pass@1 (test)"),
                                             ("eval/process_fidelity", "process fidelity")],
                       curves, title="From the flawed teacher's warm start"),
    ]  # fmt: skip
    repro_lib.finish(args, argv, script="repro_testbed.py", title="The testbed's controls",
                     sections=sections, files=files, data=data)  # fmt: skip
    return data


if __name__ == "__main__":
    main()
