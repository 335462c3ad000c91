"""Router replay with the real trainer: train-inference mismatch with and without replay, for f32,
bf16 and FP8 rollouts, and with truncated importance sampling (TIS) on top.

Run:  python experiments/repro_replay.py [--preset quick|cpu|large] [--seeds 0]
                                         [--arms f32,f32-free,...] [--out DIR]

"Each Prompt Matters" replays the experts the rollout engine chose in the training forward and
reports roughly an order of magnitude lower train-inference mismatch with it. Each arm trains
the embedded default (`configs/default.py`, ESPO) from one shared warm start; the rollout engine
samples in float32, bfloat16 activations (`rollout.dtype`) or FP8 weights (`rollout.fp8`), and
pi_old is recomputed by the trainer (float32) with the rollout's experts replayed
(`train.router_replay=True`) or routed freely. `prepare` measures on every step's loss tokens:
k3 KL(sampler || trainer), the extreme-token fraction (|dlogp| > ln 2), and the agreement of a
free-routing trainer forward with the rollout's experts. The TIS arms add
`loss.rollout_is=token` (verl's truncated IS, cap 2) to correct what mismatch remains.
Written to OUT (default runs/repro/replay): results.md / results.json (per arm: mean mismatch
over the RL steps, its ratio to the replayed arm of the same precision, router agreement,
held-out pass@1, the largest gradient norm and the clip fraction as stability signals) and
mismatch.png / heldout.png / stability.png (mean over seeds, min-max band).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

PRECISION = {
    "f32": {"rollout.fp8": False, "rollout.dtype": "float32"},
    "bf16": {"rollout.fp8": False, "rollout.dtype": "bfloat16"},
    "fp8": {"rollout.fp8": True, "rollout.dtype": ""},
}
TIS = {"loss.rollout_is": "token"}


def all_arms() -> dict[str, repro_lib.Arm]:
    arms = {}
    for p, over in PRECISION.items():
        arms[p] = repro_lib.Arm(p, {**over, "train.router_replay": True}, f"{p} replay")
        arms[f"{p}-free"] = repro_lib.Arm(
            f"{p}-free", {**over, "train.router_replay": False}, f"{p} no replay"
        )
    arms["fp8-tis"] = repro_lib.Arm(
        "fp8-tis", {**PRECISION["fp8"], **TIS, "train.router_replay": True}, "fp8 replay + TIS"
    )
    arms["fp8-free-tis"] = repro_lib.Arm(
        "fp8-free-tis", {**PRECISION["fp8"], **TIS, "train.router_replay": False}, "fp8 TIS alone"
    )
    return arms


def _replayed(name: str) -> str:
    """The replayed arm of the same precision (the ratio's denominator)."""
    return name.split("-")[0]


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    cols = {
        "k3 KL": lambda r: repro_lib.mean_over(r, "mismatch/k3_kl"),
        "extreme frac": lambda r: repro_lib.mean_over(r, "mismatch/extreme_token_frac"),
        "mean abs dlogp": lambda r: repro_lib.mean_over(r, "mismatch/abs_dlogp_mean"),
        "router agreement": lambda r: repro_lib.mean_over(r, "mismatch/router_agreement"),
        "pass@1 start": lambda r: repro_lib.series(r, "eval/pass@1")[1][0],
        "pass@1 end": lambda r: repro_lib.last(r, "eval/pass@1"),
        "pass@1 change": lambda r: repro_lib.change(r, "eval/pass@1"),
        "max grad norm": lambda r: max(repro_lib.series(r, "optim/grad_norm")[1], default=0.0),
        "clip frac": lambda r: repro_lib.mean_over(r, "loss/clip_frac"),
    }
    data, rows = {}, []
    for arm in arm_list:
        data[arm.name] = {c: repro_lib.per_seed(runs[arm.name], fn) for c, fn in cols.items()}
    for arm in arm_list:
        values = data[arm.name]
        base = data.get(_replayed(arm.name))
        ratio = "n/a"
        if base is not None:
            num, den = sum(values["k3 KL"]), sum(base["k3 KL"])
            ratio = f"{num / den:.2f}" if den > 0 else "n/a"
        values_str = [repro_lib.spread(v) for v in values.values()]
        rows.append([arm.title, *values_str[:1], ratio, *values_str[1:]])
    header = ["arm", "k3 KL", "k3 / replayed", *list(cols)[1:]]
    notes = (
        "Mismatch metrics: mean over the RL steps of the loss tokens' k3 KL(sampler || trainer "
        "pi_old), the share with |logp_trainer - logp_sampler| > ln 2 and the mean |dlogp|; "
        "'k3 / replayed' divides an arm's k3 by the replayed arm's of the same rollout "
        "precision (same seeds). Router agreement: share of (token, expert) choices a "
        "free-routing trainer forward shares with the rollout. ± is the std over seeds."
    )
    return [repro_lib.markdown_table(header, rows), notes], data


MISMATCH = [
    ("mismatch/k3_kl", "k3 KL(sampler || trainer)", "log"),
    ("mismatch/extreme_token_frac", "|dlogp| > ln 2"),
    ("mismatch/router_agreement", "expert agreement"),
]
STABILITY = [("optim/grad_norm", "gradient norm"), ("loss/clip_frac", "clip fraction")]


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = repro_lib.curves_of(runs, arm_list)
    return [
        repro_lib.plot(out / "mismatch.png", MISMATCH, curves, title="Train-inference mismatch"),
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1")], curves),
        repro_lib.plot(out / "stability.png", STABILITY, curves, title="Stability"),
    ]


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(__doc__, argv, out="runs/repro/replay", arms=all_arms())
    return repro_lib.experiment(
        args,
        argv,
        arm_list,
        script="repro_replay.py",
        title="Router replay and train-inference mismatch",
        summarize=summarize,
        plots=plots,
    )


if __name__ == "__main__":
    main()
