"""Zero-variance elimination in training, with the real trainer: where the rollouts go.

Run:  python experiments/repro_zve_training.py [--preset quick|cpu|large] [--seeds 0]
                                               [--arms plain,resample,rl_zvp,full] [--out DIR]

"Each Prompt Matters" spends no rollout on prompts whose group rewards are all equal. Four arms
train GRPO on the embedded default (`configs/default.py`) from one shared warm start, adding the
stages cumulatively (experiments/repro_zve.py measures the same stages on a simulated policy):
- plain:    GRPO as it is: zero-variance groups reach the optimiser with advantage 0
            (zve.mode=rl_zvp with advantage.rl_zvp_alpha=0), no pre-filter, fixed G;
- resample: DAPO-style refill (zve.mode=resample): ZVP groups are dropped and more prompts drawn;
- rl_zvp:   ZVP groups kept with RL-ZVP's entropy-shaped advantages (alpha 0.1);
- full:     rl_zvp + the online pass-rate pre-filter (zve.prefilter=drop) + adaptive G (up to
            zve.max_group_size=16): the default pipeline.
Written to OUT (default runs/repro/zve_training): results.md / results.json (per arm: rollouts
generated in total, rollouts per informative group, the share of the optimiser's rollouts with
zero advantage and of loss tokens with a gradient, the ZVP rate of the rollouts, held-out
pass@1 at the end) and heldout.png
(held-out accuracy against rollouts spent: the x axis is compute, not steps) and zve.png.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

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
ROLLOUTS = "train/rollouts"  # rollouts generated in a step (refills included)


def total(records: list[dict], key: str) -> float:
    return float(sum(r.get(key) or 0.0 for r in records))


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    cols = {
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
    notes = (
        "Totals over the run (rollouts, informative groups: groups whose verifier rewards "
        "differ) and means over the RL steps: the share of the optimiser's rollouts in ZVP "
        "groups (verifier advantage 0), the share of loss tokens with a nonzero gradient "
        "(`loss/grad_token_frac`: RL-ZVP gives ZVP groups one), the ZVP rate of the generated "
        "groups; ± is the std over seeds. Every arm optimises train.prompts_per_step groups a "
        "step, so arms that refill spend more rollouts a step."
    )
    return [table, notes], data


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
    args, arm_list = repro_lib.parse_arms(__doc__, argv, out="runs/repro/zve_training", arms=ARMS)
    return repro_lib.experiment(
        args,
        argv,
        arm_list,
        script="repro_zve_training.py",
        title="Zero-variance elimination in training",
        summarize=summarize,
        plots=plots,
    )


if __name__ == "__main__":
    main()
