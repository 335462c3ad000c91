"""`make run` over seeds: held-out greedy pass@1 from the warm start to the end of RL, mean ± 95%.

Run:  python experiments/repro_make_run.py [--seeds 0,1,2] [--out DIR] [--preset default|quick]

Each seed is the whole of `make run` (`python experiments/run.py --config configs/default.py
--config.seed=K`): its own init, warm start, data order and RL; `data.seed` stays 0, so every seed
is evaluated on the same test split. A seed whose workdir already holds a finished run of the same
config is read, not retrained. Written to OUT (default runs/repro/make_run): results.md /
results.json (per seed: start, end, change, pass@8, maj@8 of the warm start, process fidelity,
right answers with a wrong process, wall time; mean ± the 95% Student-t interval) and
heldout.png (the held-out curves of every seed).
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

KEY = "eval/pass@1"


def main(argv=None) -> dict:
    parser = repro_lib.parser(__doc__, out="runs/repro/make_run", seeds="0,1,2")
    parser.set_defaults(preset="default")
    args = parser.parse_args(argv)
    out, seeds = pathlib.Path(args.out), repro_lib.seeds_of(args)
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
    rows = [[f"seed {s}", *(f"{data[c][i]:.3f}" for c in cols), f"{walls[i]:.0f}"]
            for i, s in enumerate(seeds)]  # fmt: skip
    rows.append(["mean ± 95% interval", *(repro_lib.ci(data[c]) for c in cols),
                 repro_lib.ci(walls, 0)])  # fmt: skip
    table = repro_lib.markdown_table(["run", *cols, "wall (s)"], rows)
    notes = (
        "Held-out test split (eval.split=test, data.seed=0: the same prompts for every seed): "
        f"greedy pass@1 on eval.num_prompts prompts; pass@{k} and maj@{k} on the first "
        "eval.sampled_prompts of them. The interval is the two-sided 95% Student-t interval "
        "of the mean over seeds [its ends]. Wall: summary.json's wall_s, from the start of "
        "`trainer.train` to the summary (the process adds ~13 s of Python and JAX imports)."
    )
    arm = repro_lib.Arm("make_run", {}, "make run")
    files = [
        repro_lib.plot(
            out / "heldout.png",
            [(KEY, "greedy pass@1 (test)"), ("eval/process_fidelity", "process fidelity")],
            repro_lib.curves_of({"make_run": runs}, [arm]),
            title=f"make run, {len(seeds)} seeds (mean, min-max band)",
        )
    ]
    repro_lib.finish(args, argv, script="repro_make_run.py", title="make run over seeds",
                     sections=[table, notes], files=files, data=data)  # fmt: skip
    return data


if __name__ == "__main__":
    main()
