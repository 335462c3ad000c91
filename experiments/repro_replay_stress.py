"""Router replay under off-policy stress (issue 33's protocol 2 for replay), with the real trainer.

Run:  python experiments/repro_replay_stress.py [--preset default|quick] [--seeds 0,1,2,3,4]
                                                [--arms replay,free] [--out DIR]

"Each Prompt Matters" replays the rollout's experts in training because experts that flip
between the rollout engine and the trainer make the training data off-policy, and that
instability grows with the number of experts and the length of the run. The paired
counterfactual (`repro_replay_paired.py`) measures the mismatch on the same batches; this
script measures what it does to training, in the regime it exists for: make run's task
(`configs/default.py`) with a finer MoE (SHARED: 64 experts, top-8, width 64, warm start
included), bfloat16 rollouts (no FP8), 4 optimiser updates per rollout batch, no importance
correction (`loss.rollout_is=none`), 150 RL steps (STRESS). Arms: `replay` (the rollout's
experts in the old-log-prob and update forwards, `train.router_replay=True`) and `free`
(the trainer routes by itself); same warm start, seeds and batches.

Metrics, named before the runs: the extreme-token fraction (|logp_trainer - logp_sampler| >
ln 2, `mismatch/extreme_token_frac`) over the run and over its last STEPS_LATE steps, the
clip fraction, collapses (`repro_lib.collapsed`: held-out pass@1 more than 10 points below the
start, or entropy collapse) and the area under the held-out curve, its difference replay minus
free paired by seed (95% t-interval). Written to OUT (default runs/repro/replay_stress):
results.md / results.json, mismatch.png, stability.png, heldout.png.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

NAME = "default"  # configs/default.py, make run's task
# The model of the warm start and of every arm: 64 experts of width 64, top-8 (twice the
# default's expert parameters, the same active width 8 x 64 = 4 x 128).
SHARED = {
    "default": {"model.num_experts": 64, "model.top_k": 8, "model.moe_ffn_dim": 64},
    "quick": {"model.num_experts": 8, "model.top_k": 2},
}
_OFF_POLICY = {"rollout.fp8": False, "rollout.dtype": "bfloat16", "loss.rollout_is": "none"}
STRESS = {
    "default": {
        **_OFF_POLICY,
        "train.steps": 150,
        "train.prompts_per_step": 8,  # 64 rows a step
        "train.mini_batch_size": 16,  # 4 optimiser updates per rollout batch
        "eval.every_steps": 25,
        "eval.num_prompts": 512,
        "checkpoint.every_steps": 25,
    },
    "quick": {**_OFF_POLICY, "train.mini_batch_size": 4},
}
STEPS_LATE = 50  # "late in the run": the last 50 steps
ARMS = {
    "replay": repro_lib.Arm("replay", {"train.router_replay": True}, "router replay"),
    "free": repro_lib.Arm("free", {"train.router_replay": False}, "free routing"),
}


def _late(records: list[dict], key: str) -> float:
    last = max((r["step"] for r in records), default=0)
    return repro_lib.mean_over(records, key, first_step=max(1, last - STEPS_LATE + 1))


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    cols = {
        **repro_lib.stability_columns(),
        **repro_lib.heldout_columns(),
        "extreme frac": lambda r: repro_lib.mean_over(r, "mismatch/extreme_token_frac"),
        "extreme frac late": lambda r: _late(r, "mismatch/extreme_token_frac"),
        "k3 KL": lambda r: repro_lib.mean_over(r, "mismatch/k3_kl"),
        "router agreement": lambda r: repro_lib.mean_over(r, "mismatch/router_agreement"),
        "clip frac": lambda r: repro_lib.mean_over(r, "loss/clip_frac"),
    }
    table, data = repro_lib.arm_table(runs, arm_list, cols)
    head = repro_lib.markdown_table(
        ["routing", *repro_lib.stability_header("replay"),
         "extreme-token fraction, all / last steps", "clip fraction"],
        [[a.title, *repro_lib.stability_cells(data, a.name, "replay"),
          f"{repro_lib.spread(data[a.name]['extreme frac'], 4)} / "
          f"{repro_lib.spread(data[a.name]['extreme frac late'], 4)}",
          repro_lib.spread(data[a.name]["clip frac"], 4)] for a in arm_list],
    )  # fmt: skip
    notes = (
        f"Collapse: held-out greedy pass@1 more than {repro_lib.COLLAPSE_DROP:.2f} below the start "
        f"at some eval, or a step's token entropy below {repro_lib.ENTROPY_FLOOR} x the first "
        "step's. Held-out area: the mean of the held-out curve over the run. Extreme tokens: "
        "loss tokens with |logp_trainer - logp_sampler| > ln 2 (pi_old against the bf16 "
        f"sampler), mean over the RL steps and over the last {STEPS_LATE}. ± in the second table "
        "is the std over seeds."
    )
    return [head, table, notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = repro_lib.curves_of(runs, arm_list)
    return [
        repro_lib.plot(out / "mismatch.png", [("mismatch/extreme_token_frac", "|dlogp| > ln 2"),
                                              ("mismatch/k3_kl", "k3 KL", "log"),
                                              ("mismatch/router_agreement", "expert agreement")],
                       curves, title="Train-inference mismatch over the run"),
        repro_lib.plot(out / "stability.png", [("loss/clip_frac", "clip fraction"),
                                               ("optim/grad_norm", "gradient norm"),
                                               ("loss/entropy", "token entropy", "log")],
                       curves, title="Stability"),
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1")], curves),
    ]  # fmt: skip


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/replay_stress", arms=ARMS, preset="default",
        seeds="0,1,2,3,4",
    )  # fmt: skip
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_replay_stress.py",
        title="Router replay under off-policy stress", summarize=summarize, plots=plots,
        common=STRESS[args.preset], shared=SHARED[args.preset], name=NAME,
    )  # fmt: skip


if __name__ == "__main__":
    main()
