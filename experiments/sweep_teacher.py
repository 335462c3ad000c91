"""The flawed teacher swept: how the teacher's flaw and its rate set the warm start and RL's gain.

Run:  python experiments/sweep_teacher.py [--points final_sign:0.5,final_sign:0.7,...]
                                           [--seeds 0] [--out DIR] [--preset default|quick]

Each point (`data.teacher_flaw`:`data.teacher_error`) is the whole of `make run` with that
teacher: its own warm start on the teacher's demonstrations, then RL with the verifier's reward.
This is a tuning sweep, so it evaluates on the dev split (`eval.split=dev`); the test split is
kept for the reported runs (repro_make_run.py, repro_testbed.py). Per point: the teacher's own
accuracy (the share of its demonstrations whose last line is the true answer, over the first
draws of data.seed), the warm start's greedy pass@1 and pass@k, greedy pass@1 after RL, the
change, process fidelity and the right answers reached by a wrong process at the end. Written to OUT
(default runs/repro/sweep_teacher): results.md / results.json and heldout.png.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

from espo.data import chains  # noqa: E402

NAME = "default"  # configs/default.py
KEY = "eval/pass@1"
POINTS = "final_sign:0.3,final_sign:0.5,final_sign:0.7,final_sign:0.9,sign:0.7"


def parse_points(parser, text: str) -> list[tuple[str, float]]:
    """ "flaw:error,..." -> [(flaw, error)]; a bad point is a usage error naming it."""
    points = []
    for item in text.split(","):
        flaw, _, error = item.partition(":")
        try:
            rate = float(error)
        except ValueError:
            rate = -1.0
        if flaw not in chains.FLAWS or not 0.0 <= rate <= 1.0:
            parser.error(
                f"--points: {item!r} is invalid; valid: FLAW:ERROR with FLAW one of "
                f"{', '.join(chains.FLAWS)} and ERROR in [0, 1]"
            )
        points.append((flaw, rate))
    return points


def teacher_accuracy(cfg, draws: int) -> float:
    """The share of the teacher's demonstrations (examples 0..draws-1 of cfg.data) whose last
    line is the chain's true answer."""
    d = cfg.data
    right = 0
    for i in range(draws):
        chain = chains.draw(
            d.seed, i, min_terms=d.min_terms, max_terms=d.max_terms, decay=d.terms_decay
        )
        demo = chains.demonstration(d.seed, i, chain, flaw=d.teacher_flaw, error=d.teacher_error)
        right += chains.final_answer(demo) == str(chain.answer)
    return right / draws


def main(argv=None) -> dict:
    parser = repro_lib.parser(__doc__, out="runs/repro/sweep_teacher", seeds="0")
    parser.set_defaults(preset="default")
    parser.add_argument("--points", default=POINTS, help="comma-separated FLAW:ERROR points")
    args = parser.parse_args(argv)
    points, seeds = parse_points(parser, args.points), repro_lib.seeds_of(args)
    out = pathlib.Path(args.out)
    runs, arms, accuracy = {}, [], {}
    for flaw, error in points:
        arm = repro_lib.Arm(f"{flaw}-{error:g}", {}, f"{flaw}, p={error:g}")
        overrides = {"data.teacher_flaw": flaw, "data.teacher_error": error, "eval.split": "dev"}
        runs[arm.name] = []
        for seed in seeds:
            cfg = repro_lib.config(args.preset, {**overrides, "seed": seed}, name=NAME)
            print(f"== {arm.title}, seed {seed}", flush=True)
            runs[arm.name].append(
                repro_lib.run(cfg, out / arm.name / f"seed{seed}", progress=not args.no_progress)
            )
        accuracy[arm.name] = teacher_accuracy(cfg, min(cfg.data.size, 20000))
        arms.append(arm)
    k = repro_lib.config(args.preset, name=NAME).eval.samples
    every = repro_lib.testbed_columns(k, KEY)
    cols = {
        c: every[c]
        for c in (
            "pass@1 start",
            "pass@1 end",
            "change",
            f"pass@{k} start",
            "process fidelity end",
            "right answer, wrong process end",
        )
    }
    data = {a.name: {c: repro_lib.per_seed(runs[a.name], fn) for c, fn in cols.items()}
            for a in arms}  # fmt: skip
    for a in arms:
        data[a.name]["teacher accuracy"] = accuracy[a.name]
    rows = [[a.title, f"{accuracy[a.name]:.3f}", *(repro_lib.spread(data[a.name][c]) for c in cols)]
            for a in arms]  # fmt: skip
    table = repro_lib.markdown_table(["teacher", "teacher accuracy", *cols], rows)
    notes = (
        "Dev split (eval.split=dev, data.seed=0): greedy pass@1 on eval.num_prompts prompts, "
        f"pass@{k} on the first eval.sampled_prompts. Teacher accuracy: the share of the "
        "teacher's demonstrations (the first 20,000 draws of data.seed, held-out ones included) "
        "whose last line is the true "
        f"answer. Seeds {seeds}: one value, or the mean ± the std over seeds."
    )
    files = [
        repro_lib.plot(out / "heldout.png", [(KEY, "greedy pass@1 (dev)"),
                                             ("eval/process_fidelity", "process fidelity")],
                       repro_lib.curves_of(runs, arms), title="The teacher's flaw swept")
    ]  # fmt: skip
    repro_lib.finish(args, argv, script="sweep_teacher.py", title="The flawed teacher swept",
                     sections=[table, notes], files=files, data=data)  # fmt: skip
    return data


if __name__ == "__main__":
    main()
