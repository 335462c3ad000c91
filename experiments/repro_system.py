"""The system table (the analogue of "Each Prompt Matters" Table 1) with the real trainer.

Run:  python experiments/repro_system.py [--preset default|quick] [--seeds 0,1,2] [--out DIR]

End-to-end RL step time of make run's task (`configs/default.py`) in the regime the rollout
system exists for (issue 33's protocol, `long_completions`): long, heavy-tailed completions
(chains of 14 to 32 terms, P(n) ~ 0.9^n: the teacher's solutions have a median of 142 tokens,
p90 216, p99 270, max 306, in a 384-token budget)
and a reward with the latency of executing code (`espo.data.chains.executed_reward`: the
verifier's value, the answer computed by a fresh Python interpreter per sample, tens of ms).
The warm start learns the long chains (its own, in OUT/warm_start). A step's 128 rows decode in
chunks of 32 (an engine's batch slots), so scheduling and reward overlap have chunks to act
on. The parts are switched on cumulatively:
  baseline        FIFO scheduling, serial detokenisation on the host, rewards scored after the
                  whole rollout decoded, no FP8 (rollout.schedule=fifo, rollout.detokenize=host,
                  rollout.overlap_rewards=False, rollout.fp8=False);
  + parallel detokenisation   the reward pool's workers detokenize (rollout.detokenize=workers);
  + reward overlap            samples are scored while later chunks decode;
  + FP8 rollout               e4m3 weights in the sampler (rollout.fp8=True);
  + length-aware scheduling   chunks by predicted length (rollout.schedule=length_aware).
Per arm and seed, the median over the steps after the first two and before the last, leaving out
any that compiled (a new length bucket's shapes), of: the step time without eval and
checkpoint, the rollout phase and inside it decoding (generate), the host's
hand-off work and the wait for rewards after decoding, old log-probs and the update; generated
tokens per second of rollout, the padded decode slots (`rollout/padding_waste`) and the
rollout's idle fraction (the share of the rollout phase spent on hand-offs and waiting for
rewards, not decoding). Metrics named before the runs: step time and the idle fraction, each
arm's speed-up over the baseline paired by seed, with 95% t-intervals over seeds. Written to
OUT (default runs/repro/system): results.md / results.json and steps.png (the time per phase
of each arm).

On a CPU the FP8 arm is expected to be SLOWER: XLA:CPU has no e4m3 matmul, so the sampler
dequantizes every weight to the activation dtype each step (more work, not less); the saving is
memory bandwidth on a Hopper GPU. The earlier protocol (short completions, a cheap verifier;
docs/repro/README.md) left the rollout at 9% of a step, with nothing for the parts to act on.
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
NAME = "default"  # configs/default.py, make run's task
EXECUTED = {"reward.function": "espo.data.chains:executed_reward"}
COMMON = {  # a short run: timings, no evaluation in between, no checkpoint in between
    "quick": {**EXECUTED, "train.steps": 3, "eval.every_steps": 0},
    "default": {**EXECUTED, "train.steps": 12, "eval.every_steps": 0,
                "checkpoint.every_steps": 1000,
                # an engine's batch slots: a step's 128 rows in 4 chunks, so that scheduling
                # has chunks to form and rewards have later chunks to overlap (one chunk of
                # 128, the default, leaves both nothing to act on)
                "rollout.max_chunk_size": 32,
                # the start's and the end's evaluation say the run is sane; the table times
                # the steps between them (1024 long greedy completions cost ~3 min here)
                "eval.num_prompts": 128, "eval.sampled_prompts": 16},
}  # fmt: skip


def long_completions(preset: str) -> dict:
    """The warm start's and every arm's data and budget: long, heavy-tailed chains."""
    if preset == "quick":
        return {"data.max_terms": 6, "data.max_prompt_length": 40}
    stage = repro_lib.config_module(NAME).stage
    return {
        "data.min_terms": 14,
        "data.max_terms": 32,
        "data.terms_decay": 0.9,
        "data.max_prompt_length": 144,  # the longest prompt: 136 characters
        "curriculum.stages": (stage("all", max_difficulty=1.0, steps=10**9, max_new_tokens=384),),
    }


WARMUP_STEPS = 2  # left out of the medians: compilation


def _timed(records: list[dict]) -> list[dict]:
    """The steps a median is taken over: after the first WARMUP_STEPS, not the last (it also
    evaluates), and none that compiled (`perf/compiles` > 0: a new length bucket's shapes);
    all but the last after the warm-up when every step compiled."""
    steps = [r for r in records if r.get("step", 0) > WARMUP_STEPS]
    steps = steps[:-1] if len(steps) > 1 else steps
    clean = [r for r in steps if not r.get("perf/compiles")]
    return clean or steps


def arms() -> dict[str, repro_lib.Arm]:
    out, overrides = {}, dict(_BASE)
    for name, label, change in _STEPS:
        overrides = {**overrides, **change}  # cumulative
        out[name] = repro_lib.Arm(name, dict(overrides), label)
    return out


def _median(records: list[dict], key: str) -> float:
    values = [r[key] for r in _timed(records) if r.get(key) is not None]
    return float(np.median(values)) if values else float("nan")


def _step_s(records: list[dict]) -> list[dict]:
    """Each step's time without its eval and checkpoint phases, as `perf/train_step_s`, and the
    rollout's idle fraction (hand-offs + reward wait over the rollout), `rollout/idle_frac`."""
    out = []
    for r in records:
        r = dict(r)
        if r.get("perf/step_s") is not None:
            extra = (r.get("perf/eval_s") or 0.0) + (r.get("perf/checkpoint_s") or 0.0)
            r["perf/train_step_s"] = r["perf/step_s"] - extra
        if r.get("rollout/total_s"):
            idle = (r.get("rollout/host_handoff_s") or 0.0) + (
                r.get("rollout/reward_wait_s") or 0.0
            )
            r["rollout/idle_frac"] = idle / r["rollout/total_s"]
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
    "padded slots": "rollout/padding_waste",
    "mean length": "rollout/mean_length",
    "idle fraction": "rollout/idle_frac",
}


def summarize(runs, arm_list) -> tuple[list[str], dict]:
    steps = {a.name: [_step_s(r) for r in runs[a.name]] for a in arm_list}
    medians = {c: (lambda r, k=k: _median(r, k)) for c, k in COLUMNS.items()}
    table, data = repro_lib.arm_table(steps, arm_list, medians)  # per seed
    base = data[arm_list[0].name]["step s"]  # the first arm's (the baseline's), seed by seed
    for arm in arm_list:
        own = data[arm.name]["step s"]
        data[arm.name]["speed-up"] = [b / a for b, a in zip(base, own, strict=True)]
    head = repro_lib.markdown_table(
        ["arm (cumulative)", "step s (95% CI)", "speed-up over the baseline, paired (95% CI)",
         "rollout idle fraction (95% CI)", "rollout s", "reward wait s", "padded slots"],
        [[a.title, *(repro_lib.ci(data[a.name][c]) for c in ("step s", "speed-up",
                                                               "idle fraction")),
          *(repro_lib.spread(data[a.name][c]) for c in ("rollout s", "reward wait s",
                                                         "padded slots"))]
         for a in arm_list],
    )  # fmt: skip
    notes = (
        f"Per seed, medians over steps {WARMUP_STEPS + 1} to the last but one (the first steps "
        "compile, the last one evaluates), leaving out any step that compiled (a new length "
        "bucket); 'step s' leaves out eval and checkpoint time; the "
        "speed-up is the baseline's step time over the arm's on the same seed. "
        "rollout/generate_s is the decode loop with the hand-offs inside it; reward wait is "
        "the time spent waiting for rewards after the last chunk decoded; the idle fraction is "
        "hand-offs + reward wait over the rollout; padded slots: the share of decode "
        "slot-steps spent on finished or padding rows. ± in the second table is the std over "
        "seeds."
    )
    return [head, table, notes], data


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = lambda key: {
        a.title: [repro_lib.series(_step_s(r), key) for r in runs[a.name]] for a in arm_list
    }
    panels = [("perf/train_step_s", "s"), ("perf/rollout_s", "s"), ("perf/update_s", "s")]
    return [repro_lib.plot(out / "steps.png", panels, curves, title="Time per RL step")]


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/system", arms=arms(), preset="default", seeds="0,1,2"
    )
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_system.py",
        title="The rollout system, part by part (Table 1 analogue)", summarize=summarize,
        plots=plots, common=COMMON[args.preset], shared=long_completions(args.preset), name=NAME,
    )  # fmt: skip


if __name__ == "__main__":
    main()
