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
  per seed), at least the rl arm's training time; its change is also paired with each seed's
  own warm start (OUT/warm_start_seed<k>, the first seed's the shared one).
- maj@k: the warm start's majority vote over its k sampled answers (`eval/maj@k`), the baseline
  a reviewer compares RL's greedy pass@1 with; measured on the first eval.sampled_prompts
  prompts only, so it is given with its binomial 95% half-width at that n.
The metric, named before running: the change in held-out greedy pass@1 on the test split
(`eval.split=test`, which depends on `data.seed` only) from the warm start to the end of the
run, mean over seeds with its 95% Student-t interval (over RL seeds from the one shared warm
start). Beside it: the paired differences (RL minus rejection sampling; SFT x2 minus each seed's
own warm start) and the greedy ceiling of a model that has learnt the teacher exactly, counted
on the test prompts themselves (`repro_lib.ceiling_of`). Written to OUT (default
runs/repro/testbed): results.md / results.json and heldout.png; `--results FILE` rebuilds the
tables from a stored results.json without training (`--own-starts`: repro_make_run.py's
results.json, for a results.json from before the own warm starts were recorded).
"""

from __future__ import annotations

import json
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
TITLES = {a.name: a.title for a in ARMS.values()} | {"sft-longer": "SFT x2 steps (fresh runs)"}
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


def summarize(runs, arm_list, longer, warm_records, own_start, reference) -> tuple[list, dict]:
    """(Markdown sections, JSON data) of the runs: per-seed values (`measure`), then `render`."""
    data = measure(runs, arm_list, longer, warm_records, own_start) | reference
    return render(data), data


def measure(runs, arm_list, longer, warm_records, own_start) -> dict:
    """The per-seed values every table row is computed from (results.json). `own_start`: each
    seed's own warm start's pass@1 (SFT x2's paired baseline)."""
    start = float(repro_lib.series(warm_records, KEY)[1][0])
    every = {a.name: runs[a.name] for a in arm_list} | {"sft-longer": longer}
    per = lambda fn: {name: [fn(r) for r in rs] for name, rs in every.items()}
    end = per(lambda r: repro_lib.last(r, KEY))
    maj_key = _maj_key(warm_records)
    return dict(
        start=start,
        majority=repro_lib.last(warm_records, maj_key),
        majority_key=maj_key,
        sampled_prompts=repro_lib.last(warm_records, "eval/num_sampled_prompts"),
        num_prompts=repro_lib.last(warm_records, "eval/num_prompts"),
        end=end,
        change={name: [e - start for e in ends] for name, ends in end.items()},
        own_start=list(own_start),
        fidelity=per(lambda r: repro_lib.last(r, "eval/process_fidelity")),
        right_answer_wrong_process=per(
            lambda r: repro_lib.last(r, "eval/right_answer_wrong_process")
        ),
        rl_seconds={a.name: [_train_seconds(r) for r in runs[a.name]] for a in arm_list},
    )


def reference_points(preset: str) -> dict:
    """The exact teacher's greedy ceiling on the test prompts every run evaluates and on the
    first eval.sampled_prompts of them (where maj@k is measured): generated, not trained."""
    cfg = repro_lib.config(preset, name=NAME)
    examples = repro_lib.eval_examples(cfg)
    ceiling = lambda ex: repro_lib.teacher_ceiling(
        ex, flaw=cfg.data.teacher_flaw, error=cfg.data.teacher_error
    )
    return {"ceiling": ceiling(examples), "ceiling_sampled": ceiling(examples[: _sampled(cfg)])}


def _sampled(cfg) -> int:
    return cfg.eval.sampled_prompts or cfg.eval.num_prompts


def render(data: dict) -> list[str]:
    """The tables and notes of results.md from `measure`'s data (and `reference_points`')."""
    start, maj, ceil = data["start"], data["majority"], data["ceiling"]
    n_maj, n_all = int(data["sampled_prompts"]), int(data["num_prompts"])
    maj_name = data["majority_key"].removeprefix("eval/")
    half = repro_lib.binomial_half_width(maj, n_maj)
    rows = [["warm start (step 0)", f"{start:.3f}", "0", "", "", ""]]
    majority = f"{maj:.3f} ± {half:.3f} (binomial)"
    rows.append([f"warm start, majority vote ({maj_name}, first {n_maj} prompts)", majority,
                 f"{maj - start:+.3f}", "", "", ""])  # fmt: skip
    exact = ceil["ceiling"]
    rows.append(["a model that has learnt the teacher exactly (greedy)", f"{exact:.3f}",
                 f"{exact - start:+.3f}", "", "", ""])  # fmt: skip
    names = [n for n in data["end"] if n != "sft-longer"] + ["sft-longer"]
    for name in names:
        rows.append([
            TITLES.get(name, name), repro_lib.ci(data["end"][name]),
            repro_lib.ci(data["change"][name]), repro_lib.ci(data["fidelity"][name]),
            repro_lib.ci(data["right_answer_wrong_process"][name]),
            repro_lib.spread(data["rl_seconds"].get(name, []), 0),
        ])  # fmt: skip
    header = ["arm", "pass@1 end", "change from the shared warm start",
              "process fidelity (share of all prompts)",
              "right answer, wrong process (share of right answers)", "RL time (s)"]  # fmt: skip
    own, longer = data["own_start"], data["end"]["sft-longer"]
    per_seed = lambda xs, ys: " / ".join(f"{x - y:+.3f}" for x, y in zip(xs, ys, strict=True))
    paired = [["SFT x2 minus each seed's own warm start", per_seed(longer, own),
               repro_lib.paired_difference(longer, own)]]  # fmt: skip
    if "rft" in data["end"] and "rl" in data["end"]:
        rl, rft = data["end"]["rl"], data["end"]["rft"]
        paired.append(["RL minus rejection-sampling FT (the same warm start and seed)",
                       per_seed(rl, rft), repro_lib.paired_difference(rl, rft)])  # fmt: skip
    flat = [ceil["ceiling"]] * len(longer)
    paired.append(["SFT x2 minus the exact teacher's ceiling", per_seed(longer, flat),
                   repro_lib.paired_difference(longer, flat)])  # fmt: skip
    second = repro_lib.markdown_table(
        ["comparison (seed by seed)", "per seed", "mean ± 95% interval (seeds > 0)"], paired
    )
    sampled = data["ceiling_sampled"]
    notes = (
        f"Held-out greedy pass@1 on the {n_all} test prompts, mean ± the half-width of the 95% "
        f"Student-t interval over {len(longer)} seeds [its ends]. The RL-like arms start from "
        f"one shared warm start (the first seed's, pass@1 {start:.3f}): their intervals are over "
        "RL seeds from that one warm start, not over warm starts. SFT x2 is a fresh warm start "
        "of twice the steps per seed: its change in the first table is from the shared warm "
        "start; paired with each seed's own warm start (pass@1 "
        + " / ".join(f"{x:.3f}" for x in own)
        + ") in the second. Process fidelity is a share of all prompts (greedy completions "
        "whose every step is true); right answer, wrong process is a share of the right greedy "
        f"answers (those whose steps are not true). {maj_name} is the warm start's majority "
        f"vote on the first {n_maj} prompts only, ± the binomial 95% half-width at that n; "
        f"per-prompt greedy results are not recorded, so it is compared with pass@1 on all "
        f"{n_all}, a different prompt set. The exact teacher's ceiling: the greedy pass@1 of a "
        "model that drops the sign of every negative answer as the teacher mostly does, "
        f"counted on these prompts ({ceil['negative']} of {ceil['prompts']} answers negative: "
        f"{ceil['ceiling']:.3f}; on the first {sampled['prompts']}, {sampled['negative']} "
        f"negative: {sampled['ceiling']:.3f}); greedy SFT is not an exact copy of the teacher, "
        "so it can end above it. RL time: the seconds of the arm's RL steps (evaluations "
        "excluded)."
    )
    return [repro_lib.markdown_table(header, rows), second, notes]


def _train_seconds(records: list[dict]) -> float:
    return sum((r.get("perf/step_s") or 0.0) - (r.get("perf/eval_s") or 0.0) for r in records)


def own_starts(args, seeds, warm: pathlib.Path) -> list[float]:
    """Each seed's own warm start's held-out pass@1 (the first seed's is the shared one, `warm`):
    the baseline SFT x2 is paired with."""
    out = []
    for seed in seeds:
        where = warm if seed == seeds[0] else pathlib.Path(args.out) / f"warm_start_seed{seed}"
        cfg = repro_lib.config(args.preset, {"seed": seed, "train.steps": 0}, name=NAME)
        out.append(float(repro_lib.series(repro_lib.run(cfg, where, progress=False), KEY)[1][0]))
    return out


def rebuilt(args, parser) -> dict:
    """--results: the data of a stored results.json, what an older one lacks filled in: each
    seed's own warm start from --own-starts (repro_make_run.py's results.json, whose seed k
    is this script's warm start of seed k), the evaluation's sizes from the config."""
    data = json.loads(pathlib.Path(args.results).read_text())
    if "own_start" not in data:
        if not args.own_starts:
            parser.error(f"--results {args.results} has no own_start: give --own-starts")
        made = json.loads(pathlib.Path(args.own_starts).read_text())
        data["own_start"] = made["pass@1 start"][: len(data["end"]["sft-longer"])]
    cfg = repro_lib.config(args.preset, name=NAME)
    data.setdefault("majority_key", f"eval/maj@{cfg.eval.samples}")
    data.setdefault("sampled_prompts", _sampled(cfg))
    data.setdefault("num_prompts", cfg.eval.num_prompts)
    return data


def main(argv=None) -> dict:
    parser = repro_lib.parser(__doc__, out="runs/repro/testbed", seeds="0,1,2")
    parser.set_defaults(preset="default")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated RL-like arms")
    parser.add_argument(
        "--results",
        default=None,
        help="rebuild the tables from this stored results.json (e.g. docs/testbed/results.json) "
        "instead of running",
    )
    parser.add_argument(
        "--own-starts",
        default=None,
        help="with --results: repro_make_run.py's results.json, each seed's own warm start",
    )
    args = parser.parse_args(argv)
    arm_list = repro_lib.select_arms(parser, args.arms, ARMS)
    seeds, out = repro_lib.seeds_of(args), pathlib.Path(args.out)
    reference = reference_points(args.preset)
    if args.results:
        data = rebuilt(args, parser) | reference
        out.mkdir(parents=True, exist_ok=True)
        files = [f for f in [out / "heldout.png"] if f.exists()]
        repro_lib.finish(args, argv, script="repro_testbed.py", title="The testbed's controls",
                         sections=render(data), files=files, data=data)  # fmt: skip
        return data
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
    own = own_starts(args, seeds, warm)
    sections, data = summarize(runs, arm_list, longer, warm_records, own, reference)
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
