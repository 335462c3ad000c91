"""`make run` over seeds: held-out greedy pass@1 from the warm start to the end of RL, mean ± 95%.

Run:  python experiments/repro_make_run.py [--seeds 0,1,2] [--out DIR] [--preset default|quick]

Each seed is the whole of `make run` (`python experiments/run.py --config configs/default.py
--config.seed=K`): its own init, warm start, data order and RL; `data.seed` stays 0, so every seed
is evaluated on the same test split. A seed whose workdir already holds a finished run of the same
config is read, not retrained. Written to OUT (default runs/repro/make_run): results.md /
results.json (per seed: start, end, change, pass@8, maj@8 of the warm start, process fidelity,
right answers with a wrong process, wall time; mean ± the 95% Student-t interval; the greedy
ceiling of a model that has learnt the teacher exactly, on the same test prompts) and
heldout.png (the held-out curves of every seed). `--results FILE` rebuilds the table from a
stored results.json without training.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

KEY = "eval/pass@1"


# The table's header of a column whose name does not say its denominator.
HEADERS = {
    "process fidelity end": "process fidelity end (share of all prompts)",
    "right answer, wrong process end": "right answer, wrong process end (share of right answers)",
}


def render(data: dict, seeds, preset: str) -> list[str]:
    """The table and notes of results.md from the per-seed `data` (results.json)."""
    cfg = repro_lib.config(preset, name="default")
    k, walls = cfg.eval.samples, data["wall_s"]
    cols = [c for c in data if c != "wall_s"]
    rows = [[f"seed {s}", *(f"{data[c][i]:.3f}" for c in cols), f"{walls[i]:.0f}"]
            for i, s in enumerate(seeds)]  # fmt: skip
    rows.append(["mean ± 95% interval", *(repro_lib.ci(data[c]) for c in cols),
                 repro_lib.ci(walls, 0)])  # fmt: skip
    table = repro_lib.markdown_table(["run", *(HEADERS.get(c, c) for c in cols), "wall (s)"], rows)
    ceiling = repro_lib.ceiling_of(cfg)
    sampled = cfg.eval.sampled_prompts or cfg.eval.num_prompts
    majority = data.get(f"maj@{k} start", [])
    width = repro_lib.binomial_half_width(float(np.mean(majority)), sampled) if majority else 0.0
    notes = (
        "Held-out test split (eval.split=test, data.seed=0: the same prompts for every seed): "
        f"greedy pass@1 on eval.num_prompts ({cfg.eval.num_prompts}) prompts; pass@{k} and "
        f"maj@{k} on the first eval.sampled_prompts ({sampled}) of them only, so maj@{k} and "
        f"pass@1 are measured on different prompt sets (maj@{k}'s binomial 95% half-width at "
        f"that n: ±{width:.2f}). Process fidelity is "
        "a share of all prompts; right answer, wrong process a share of the right greedy "
        "answers. A model that has learnt the teacher exactly (it drops the sign of every "
        f"negative answer) scores {ceiling['ceiling']:.3f} greedy on these prompts "
        f"({ceiling['negative']} of {ceiling['prompts']} answers negative). The interval is "
        "the two-sided 95% Student-t interval of the mean over seeds [its ends]. Wall: "
        "summary.json's wall_s, from the start of `trainer.train` to the summary (the process "
        "adds ~13 s of Python and JAX imports)."
    )
    return [table, notes]


def main(argv=None) -> dict:
    parser = repro_lib.parser(__doc__, out="runs/repro/make_run", seeds="0,1,2")
    parser.set_defaults(preset="default")
    parser.add_argument(
        "--results",
        default=None,
        help="rebuild the table from this stored results.json (e.g. docs/make_run/results.json) "
        "instead of running",
    )
    args = parser.parse_args(argv)
    out, seeds = pathlib.Path(args.out), repro_lib.seeds_of(args)
    if args.results:
        data = json.loads(pathlib.Path(args.results).read_text())
        out.mkdir(parents=True, exist_ok=True)
        files = [f for f in [out / "heldout.png"] if f.exists()]
        return _finish(args, argv, data, files)
    runs, walls = [], []
    for seed in seeds:
        cfg = repro_lib.config(args.preset, {"seed": seed}, name="default")
        print(f"== make run, seed {seed}", flush=True)
        workdir = out / f"seed{seed}"
        runs.append(repro_lib.run(cfg, workdir, progress=not args.no_progress))
        walls.append(json.loads((workdir / "summary.json").read_text())["wall_s"])
    k = repro_lib.config(args.preset, name="default").eval.samples
    cols = repro_lib.testbed_columns(k, KEY)
    data = {name: [fn(r) for r in runs] for name, fn in cols.items()}
    data["wall_s"] = walls
    arm = repro_lib.Arm("make_run", {}, "make run")
    files = [
        repro_lib.plot(
            out / "heldout.png",
            [(KEY, "greedy pass@1 (test)"), ("eval/process_fidelity", "process fidelity")],
            repro_lib.curves_of({"make_run": runs}, [arm]),
            title=f"make run, {len(seeds)} seeds (mean, min-max band)",
        )
    ]
    return _finish(args, argv, data, files)


def _finish(args, argv, data: dict, files) -> dict:
    sections = render(data, repro_lib.seeds_of(args), args.preset)
    repro_lib.finish(args, argv, script="repro_make_run.py", title="make run over seeds",
                     sections=sections, files=files, data=data)  # fmt: skip
    return data


if __name__ == "__main__":
    main()
