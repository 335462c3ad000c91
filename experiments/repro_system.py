"""The system table (the analogue of "Each Prompt Matters" Table 1) with the real trainer.

Run:  python experiments/repro_system.py [--preset quick|cpu|large] [--seeds 0] [--out DIR]

End-to-end RL step time of the embedded default (`configs/default.py`, from the shared warm
start) as the rollout system's parts are switched on cumulatively:
  baseline        FIFO scheduling, serial detokenisation on the host, rewards scored after the
                  whole rollout decoded, no FP8 (rollout.schedule=fifo, rollout.detokenize=host,
                  rollout.overlap_rewards=False, rollout.fp8=False);
  + parallel detokenisation   the reward pool's workers detokenize (rollout.detokenize=workers);
  + reward overlap            samples are scored while later chunks decode;
  + FP8 rollout               e4m3 weights in the sampler (rollout.fp8=True);
  + length-aware scheduling   chunks by predicted length (rollout.schedule=length_aware).
Per arm, the median over the steps after the first two (compilation) of: the step time without
eval and checkpoint, the rollout phase and inside it decoding (generate), the host's hand-off
work and the wait for rewards after decoding, old log-probs and the update; and generated
tokens per second of rollout. Written to OUT (default runs/repro/system): results.md /
results.json and steps.png (the time per phase of each arm).

On a CPU the FP8 arm is expected to be SLOWER: XLA:CPU has no e4m3 matmul, so the sampler
dequantizes every weight to the activation dtype each step (more work, not less); the saving is
memory bandwidth on a Hopper GPU. The arithmetic verifier of the default task is cheap, so
overlapping rewards saves little here; the paper's math verifiers are not.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

_BASE = {
    "rollout.schedule": "fifo",
    "rollout.detokenize": "host",
    "rollout.overlap_rewards": False,
    "rollout.fp8": False,
}
_STEPS = (
    ("baseline", "baseline", {}),
    ("detok", "+ parallel detokenisation", {"rollout.detokenize": "workers"}),
    ("overlap", "+ reward overlap", {"rollout.overlap_rewards": True}),
    ("fp8", "+ FP8 rollout", {"rollout.fp8": True}),
    ("length_aware", "+ length-aware scheduling", {"rollout.schedule": "length_aware"}),
)
COMMON = {  # a short run: timings, no evaluation in between, no checkpoint in between
    "quick": {"train.steps": 3, "eval.every_steps": 0},
    "cpu": {"train.steps": 10, "eval.every_steps": 0, "checkpoint.every_steps": 1000},
    "large": {"train.steps": 20, "eval.every_steps": 0, "checkpoint.every_steps": 1000},
}
WARMUP_STEPS = 2  # left out of the medians: compilation


def arms() -> dict[str, repro_lib.Arm]:
    out, overrides = {}, dict(_BASE)
    for name, label, change in _STEPS:
        overrides = {**overrides, **change}  # cumulative
        out[name] = repro_lib.Arm(name, dict(overrides), label)
    return out


def _median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records[1 + WARMUP_STEPS :] if r.get(key) is not None]
    values = values[:-1] if len(values) > 1 else values  # the last step also evaluates
    return float(np.median(values)) if values else float("nan")


def _step_s(records: list[dict]) -> list[dict]:
    """Each step's time without its eval and checkpoint phases, as `perf/train_step_s`."""
    out = []
    for r in records:
        r = dict(r)
        if r.get("perf/step_s") is not None:
            extra = (r.get("perf/eval_s") or 0.0) + (r.get("perf/checkpoint_s") or 0.0)
            r["perf/train_step_s"] = r["perf/step_s"] - extra
        out.append(r)
    return out


COLUMNS = {
    "step s": "perf/train_step_s",
    "rollout s": "perf/rollout_s",
    "decode s": "rollout/generate_s",
    "host hand-off s": "rollout/host_handoff_s",
    "reward wait s": "rollout/reward_wait_s",
    "old log-probs s": "perf/old_logps_s",
    "update s": "perf/update_s",
    "rollout tokens/s": "rollout/tokens_per_s",
}


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    data, rows = {}, []
    base = None
    for arm in arm_list:
        per_seed = [_step_s(r) for r in runs[arm.name]]
        data[arm.name] = {c: [_median(r, k) for r in per_seed] for c, k in COLUMNS.items()}
        step = float(np.mean(data[arm.name]["step s"]))
        base = step if base is None else base
        rows.append([arm.title, f"{base / step:.2f}x",
                     *(repro_lib.spread(v) for v in data[arm.name].values())])  # fmt: skip
    notes = (
        f"Medians over steps {WARMUP_STEPS + 1} to the last but one (the first steps compile, "
        "the last one evaluates); 'step s' leaves out eval and checkpoint time; 'speed-up' is "
        "the baseline's step time over the arm's. rollout/generate_s is the decode loop with "
        "the hand-offs inside it; reward wait is the time spent waiting for rewards after the "
        "last chunk decoded."
    )
    return [repro_lib.markdown_table(["arm", "speed-up", *COLUMNS], rows), notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = lambda key: {
        a.title: [repro_lib.series(_step_s(r), key) for r in runs[a.name]] for a in arm_list
    }
    panels = [("perf/train_step_s", "s"), ("perf/rollout_s", "s"), ("perf/update_s", "s")]
    return [repro_lib.plot(out / "steps.png", panels, curves, title="Time per RL step")]


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(__doc__, argv, out="runs/repro/system", arms=arms())
    return repro_lib.experiment(
        args,
        argv,
        arm_list,
        script="repro_system.py",
        title="The rollout system, part by part (Table 1 analogue)",
        summarize=summarize,
        plots=plots,
        common=COMMON[args.preset],
    )


if __name__ == "__main__":
    main()
