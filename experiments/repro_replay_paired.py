"""Router replay on paired batches: the trainer's mismatch with the rollout with and without
replay, measured on the same rollouts (issue 33's protocol 1 for router replay).

Run:  python experiments/repro_replay_paired.py [--preset default|quick] [--seeds 0,1,2]
                                                [--arms bf16,fp8,f32] [--out DIR]

"Each Prompt Matters" replays the experts the rollout engine chose in the training forward and
reports roughly an order of magnitude lower train-inference mismatch with it. Comparing a run
with replay against another run without it (`repro_replay.py`) compares different batches; here
every RL step of one run measures both on its own batch: the run replays
(`train.router_replay=True`) and `train.replay_counterfactual=True` recomputes pi_old once more
with free routing on the same rows (`mismatch/counterfactual/*`), and the free forward's expert
agreement with the rollout per MoE layer (`mismatch/free_agreement/layer_<l>`).

Each arm runs `configs/default.py` (make run's settings) from one shared warm start with the
rollout engine in bfloat16 activations (`rollout.dtype`), FP8 weights (`rollout.fp8`, the
default's) or float32 (the control: the sampler routes as the trainer, so both ratios are 1).
The metric, named before the runs: per seed, k3 KL(sampler || trainer pi_old) averaged over the
RL steps without replay divided by the same with replay, then the mean and 95% t-interval of
that ratio over seeds; the same for the share of extreme tokens (|dlogp| > ln 2). Written to OUT
(default runs/repro/replay_paired): results.md / results.json and paired.png.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

NAME = "default"  # configs/default.py, make run's task
COMMON = {
    "train.router_replay": True,
    "train.replay_counterfactual": True,
    "eval.every_steps": 0,  # held-out accuracy is not this protocol's metric: start and end only
    "eval.num_prompts": 128,
}
ARMS = {
    "bf16": repro_lib.Arm("bf16", {"rollout.fp8": False, "rollout.dtype": "bfloat16"}, "bf16"),
    "fp8": repro_lib.Arm("fp8", {"rollout.fp8": True, "rollout.dtype": ""}, "FP8 weights"),
    "f32": repro_lib.Arm("f32", {"rollout.fp8": False, "rollout.dtype": "float32"}, "float32"),
}
PAIRS = (("k3", "k3_kl"), ("extreme", "extreme_token_frac"), ("|dlogp|", "abs_dlogp_mean"))


def _ratio(records, metric: str) -> float:
    """Free routing's mismatch over replay's, each averaged over the run's steps (nan if 0)."""
    free = repro_lib.mean_over(records, f"mismatch/counterfactual/{metric}")
    replay = repro_lib.mean_over(records, f"mismatch/{metric}")
    return free / replay if replay > 0 else float("nan")


def _share_higher(records) -> float:
    """The share of steps whose batch has a higher k3 under free routing than under replay."""
    _, free = repro_lib.series(records, "mismatch/counterfactual/k3_kl")
    _, replay = repro_lib.series(records, "mismatch/k3_kl")
    return float((free > replay).mean()) if len(free) == len(replay) > 0 else float("nan")


def _layers(records) -> list[str]:
    return sorted(
        {k for r in records for k in r if k.startswith("mismatch/free_agreement/")},
        key=lambda k: int(k.rsplit("_", 1)[1]),
    )


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    data, rows = {}, []
    for arm in arm_list:
        recs = runs[arm.name]
        d = {}
        for short, metric in PAIRS:
            d[f"{short} replay"] = repro_lib.per_seed(
                recs, lambda r, m=metric: repro_lib.mean_over(r, f"mismatch/{m}")
            )
            d[f"{short} free"] = repro_lib.per_seed(
                recs, lambda r, m=metric: repro_lib.mean_over(r, f"mismatch/counterfactual/{m}")
            )
            d[f"{short} free / replay"] = repro_lib.per_seed(recs, lambda r, m=metric: _ratio(r, m))
        for key in _layers(recs[0]):
            d[f"agreement layer {key.rsplit('_', 1)[1]}"] = repro_lib.per_seed(
                recs, lambda r, k=key: repro_lib.mean_over(r, k)
            )
        d["steps"] = [len(repro_lib.series(r, "mismatch/k3_kl")[0]) for r in recs]
        d["k3 free > replay, share of steps"] = repro_lib.per_seed(recs, _share_higher)
        data[arm.name] = d
        sci = lambda v: repro_lib.spread(v) if len(v) == 1 else f"{np.mean(v):.2e}"
        rows.append([
            arm.title, sci(d["k3 replay"]), sci(d["k3 free"]),
            repro_lib.ci(d["k3 free / replay"], 2),
            " / ".join(f"{v:.2f}" for v in d["k3 free / replay"]),
            f"{np.mean(d['k3 free > replay, share of steps']):.2f}",
            sci(d["extreme replay"]), sci(d["extreme free"]),
            repro_lib.ci(d["extreme free / replay"], 2),
            " / ".join(f"{np.mean(v):.3f}" for k, v in d.items() if k.startswith("agreement")),
        ])  # fmt: skip
    header = [
        "rollout", "k3 replay", "k3 free", "k3 free / replay", "per seed", "steps free > replay",
        "extreme replay", "extreme free",
        "extreme free / replay", "free expert agreement per layer",
    ]  # fmt: skip
    notes = (
        "Every value is measured on the same batches: each RL step's loss tokens, pi_old "
        "recomputed by the float32 trainer with the rollout's experts replayed (the run's own "
        "forward) and with free routing (the counterfactual), against the rollout's log-probs. "
        "k3 = KL(sampler || trainer), extreme = share with |dlogp| > ln 2, each the mean over "
        "the RL steps of a run, then over seeds; the ratios are per seed, shown as mean ± the 95% "
        "t-interval over seeds [its ends], and each seed's; 'steps free > replay': the share "
        "of steps (batches) where free routing's k3 is the higher, over every seed's steps. "
        "Free expert agreement: the share of the rollout's "
        "(token, expert) choices a free-routing trainer forward makes too, per MoE layer."
    )
    return [repro_lib.markdown_table(header, rows), notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = repro_lib.curves_of(runs, arm_list)
    panels = [
        ("mismatch/k3_kl", "k3, replay", "log"),
        ("mismatch/counterfactual/k3_kl", "k3, free routing (same batches)", "log"),
        ("mismatch/extreme_token_frac", "|dlogp| > ln 2, replay"),
        ("mismatch/counterfactual/extreme_token_frac", "|dlogp| > ln 2, free routing"),
    ]
    return [repro_lib.plot(out / "paired.png", panels, curves, title="Paired mismatch")]


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__,
        argv,
        out="runs/repro/replay_paired",
        arms=ARMS,
        preset="default",
        seeds="0,1,2",
    )
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_replay_paired.py",
        title="Router replay on paired batches", summarize=summarize, plots=plots,
        common=COMMON, name=NAME,
    )  # fmt: skip


if __name__ == "__main__":
    main()
