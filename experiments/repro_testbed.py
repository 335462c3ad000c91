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

The offline controls (issue 55, experiment 1), pre-registered here before their first run:

Run:  python experiments/repro_testbed.py --offline [sft-filtered,sft-x4] --seeds 0,1,2
          --baselines docs/testbed/results.json --report docs/testbed/offline [--out DIR]

Both arms are fresh supervised runs of configs/default.py (`train.steps=0`, no RL step, zero
rollouts), one per seed, each seed's run starting from the same random init and reading the same
SFT stream as that seed's own 420-step warm start; nothing else differs from the warm start's
recipe (learning rate 4e-3, 20 warmup steps, cosine, batch 64, packed):
- sft-filtered (offline filtering): the warm start's recipe, its 420 steps (`sft.steps` x 1:
  the same number as SFT x2's extra steps, and the warm start's own, so that the only difference
  from each seed's own warm start is the data), trained only on the teacher's demonstrations
  whose final answer the task's verifier accepts (`sft.verified_only`: `ChainReward`, the reward
  RL scores rollouts with, > advantage.success_threshold, what rejection sampling counts as
  correct); the others are drawn and skipped. About 22% of the demonstrations (the negative
  answers whose sign the teacher dropped) are filtered out; the count is printed with the table.
- sft-x4: the warm start's recipe at 4x its steps (1680), all demonstrations: the plateau,
  measured directly (SFT x2, 840 steps, is stored in the baselines).
The metric (the same as every control's): held-out greedy pass@1 on the 1024 test prompts
(`eval.split=test`, fixed by `data.seed`), mean ± the 95% Student-t interval over seeds 0, 1, 2.
Analysis, fixed before the runs:
- primary: sft-filtered's change paired with each seed's own 420-step warm start (pass@1 of
  sft-filtered seed k minus the warm start of seed k, stored in the baselines' own_start), mean ±
  95% t-interval over the 3 paired differences.
- beside it: that change against RL's and rejection-sampling FT's changes (the baselines: each
  from the one shared warm start, seed 0's), as the difference of the two arms' mean changes with
  a Welch (unpaired) 95% interval, since RL's seeds share one warm start and are not paired with
  the filtered runs; sft-filtered minus SFT x2 paired by seed; sft-filtered minus the exact
  teacher's ceiling (0.672 on these prompts); process fidelity.
- sft-x4: its change paired with each seed's own warm start, sft-x4 minus SFT x2 paired by seed
  (does SFT gain past 840 steps?), and minus the ceiling.
What a result means, fixed before the runs:
- sft-filtered's paired change has an interval above 0, its end an interval above the ceiling,
  and its difference from RL's change an interval that is not entirely below 0: offline
  filtering fixes the flaw as RL does, and the README says so plainly (the verifier's filter is
  what teaches on this task; RL, like rejection-sampling FT, is one way to apply it). With 3
  seeds "as RL does" means no deficit the interval can show; its lower end is the largest
  deficit the runs leave possible, and is printed.
- the change is above 0 but the difference from RL's change is entirely below 0: filtering fixes
  part of the flaw, RL more (RL learns from the policy's own samples, not only the teacher's).
- the change is above 0, its difference from RL's not entirely below 0, but its end's interval
  not above the ceiling: between readings 1 and 2, said so, with both intervals.
- the change's interval includes 0 or lies below it: the filtered demonstrations alone do not
  teach the sign; reward on the policy's own samples does.
- sft-x4 minus SFT x2 with an interval including 0 (or below it): the recipe has plateaued by
  840 steps, so RL's gain is not SFT left unfinished; an interval above 0 says SFT was still
  climbing, and by how much.
The own warm starts are the stored ones (docs/testbed/results.json's own_start: make run's
seeds 0, 1, 2, the SFT x2 arm's baseline too), not retrained; their greedy pass@1 does not
depend on eval.sampled_prompts (64 there, 16 here: the sampled pass only).
Written to REPORT (default OUT/offline): records/<arm>/seed<k>.jsonl.gz after every run (each
run's metrics.jsonl), results.md and results.json; rerunning resumes (finished runs are
skipped; a run cut short in its SFT starts again, SFT keeps no checkpoint), and `--records
REPORT/records` rebuilds the tables without training. Without --baselines (e.g. `--quick`),
each seed's own warm start is trained (OUT/warm_start, OUT/warm_start_seed<k>) and the RL rows
are left out.
"""

from __future__ import annotations

import argparse
import json
import math
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
    paired = [repro_lib.paired_row("SFT x2 minus each seed's own warm start", longer, own)]
    if "rft" in data["end"] and "rl" in data["end"]:
        rl, rft = data["end"]["rl"], data["end"]["rft"]
        paired.append(repro_lib.paired_row(
            "RL minus rejection-sampling FT (the same warm start and seed)", rl, rft
        ))  # fmt: skip
    flat = [ceil["ceiling"]] * len(longer)
    paired.append(repro_lib.paired_row("SFT x2 minus the exact teacher's ceiling", longer, flat))
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


# ---- the offline controls (issue 55): the pre-registration is in the module docstring --------
OFFLINE_TITLES = {
    "sft-filtered": "filtered SFT (verified demonstrations only)",
    "sft-x4": "SFT x4 steps (fresh runs)",
}


def offline_arms(preset: str) -> dict[str, repro_lib.Arm]:
    """The offline arms at `preset`: their sft.steps are the warm start's x 1 and x 4."""
    steps = repro_lib.config(preset, name=NAME).sft.steps
    return {
        "sft-filtered": repro_lib.Arm(
            "sft-filtered", {"sft.verified_only": True, "sft.steps": steps},
            OFFLINE_TITLES["sft-filtered"],
        ),
        "sft-x4": repro_lib.Arm("sft-x4", {"sft.steps": 4 * steps}, OFFLINE_TITLES["sft-x4"]),
    }  # fmt: skip


def run_offline(args, arms, seeds, report: pathlib.Path) -> dict[str, list[list[dict]]]:
    """Every arm x seed as a fresh supervised run (train.steps=0), every seed of the first arm
    before the second's; each run's records are written to REPORT/records as it finishes."""
    out, runs = pathlib.Path(args.out), {}
    for arm in arms:
        runs[arm.name] = []
        for seed in seeds:
            over = {**COMMON, **dict(arm.overrides), "seed": seed, "train.steps": 0}
            cfg = repro_lib.config(args.preset, over, name=NAME)
            print(f"== {arm.title} ({cfg.sft.steps} SFT steps), seed {seed}", flush=True)
            records = repro_lib.run(
                cfg, out / arm.name / f"seed{seed}", progress=not args.no_progress
            )
            runs[arm.name].append(records)
            repro_lib.write_records(report / "records", out, [arm], [seed])
    return runs


def offline_baselines(args, parser, seeds) -> dict:
    """What the offline arms are compared with: each seed's own warm start's pass@1 and, with
    --baselines (the testbed's results.json, seeds 0..n-1), RL's, rejection sampling's and SFT
    x2's per-seed values; without it the own warm starts are trained here (`own_starts`)."""
    if not args.baselines:
        warm = (
            pathlib.Path(args.warm_start)
            if args.warm_start
            else pathlib.Path(args.out) / "warm_start"
        )
        return {"own_start": own_starts(args, seeds, warm), "baselines": None}
    stored = json.loads(pathlib.Path(args.baselines).read_text())
    have = len(stored["own_start"])
    if max(seeds) >= have:
        parser.error(f"--baselines {args.baselines} holds seeds 0..{have - 1}, not {seeds}")
    pick = lambda xs: [xs[s] for s in seeds]
    chosen = {
        "file": args.baselines,
        "shared_start": stored["start"],
        "change": {a: pick(stored["change"][a]) for a in ("rl", "rft") if a in stored["change"]},
        "end": {
            a: pick(stored["end"][a]) for a in ("rl", "rft", "sft-longer") if a in stored["end"]
        },
    }
    return {"own_start": pick(stored["own_start"]), "baselines": chosen}


def demonstrations_kept(preset: str) -> dict:
    """How many of the training pool's demonstrations the verifier accepts (`sft.verified_only`'s
    filter), and how many of those have a negative answer: counted, not trained."""
    from espo import config as config_lib
    from espo import trainer
    from espo.data import sources

    cfg = repro_lib.config(preset, {"sft.verified_only": True}, name=NAME)
    s = config_lib.Settings.from_config(cfg)
    accept = trainer.verified(s, trainer.reward_fn_of(s))
    train, _ = sources.make_sources(s.data)
    pool = [train[i] for i in range(len(train))]
    kept = [e for e in pool if accept(e)]
    negative = lambda es: sum(int(e.answer) < 0 for e in es)
    return {"pool": len(pool), "kept": len(kept), "pool_negative": negative(pool),
            "kept_negative": negative(kept)}  # fmt: skip


def offline_measure(runs, seeds, base: dict, ceiling: dict, kept: dict) -> dict:
    """The per-seed values the offline tables are computed from (REPORT/results.json)."""
    per = lambda fn: {name: [fn(r) for r in rs] for name, rs in runs.items()}
    return dict(
        seeds=list(seeds),
        end=per(lambda r: repro_lib.last(r, KEY)),
        fidelity=per(lambda r: repro_lib.last(r, "eval/process_fidelity")),
        right_answer_wrong_process=per(
            lambda r: repro_lib.last(r, "eval/right_answer_wrong_process")
        ),
        own_start=list(base["own_start"]),
        baselines=base["baselines"],
        ceiling=ceiling,
        kept=kept,
    )


def offline_verdict(data: dict) -> list[str]:
    """The pre-registered readings (module docstring) applied to the numbers."""
    out, own, ceil = [], data["own_start"], data["ceiling"]["ceiling"]
    base = data["baselines"]
    if "sft-filtered" in data["end"]:
        filt = data["end"]["sft-filtered"]
        change = [f - o for f, o in zip(filt, own, strict=True)]
        m, h = repro_lib.interval(change)
        cm, chh = repro_lib.interval([f - ceil for f in filt])
        above = math.isfinite(h) and m - h > 0 and math.isfinite(chh) and cm - chh > 0
        rl = (base or {}).get("change", {}).get("rl")
        if not (math.isfinite(h) and m - h > 0):
            out.append(
                "Filtered SFT: the change's interval is not above 0: the filtered "
                "demonstrations alone do not teach the sign (pre-registered reading 3)."
            )
        elif rl is None:
            out.append("Filtered SFT: the change's interval is above 0 (no RL baseline given).")
        else:
            d, dh = repro_lib.welch_interval(change, rl)
            if above and (not math.isfinite(dh) or d + dh >= 0):
                out.append(
                    "Filtered SFT fixes the flaw as RL does (reading 1): its change is above 0, "
                    f"its end above the exact teacher's ceiling, and its change minus RL's is "
                    f"{d:+.3f} ± {dh:.3f} (the largest deficit the runs leave possible: "
                    f"{d - dh:+.3f}). The verifier's filter is what teaches on this task; RL, "
                    "like rejection-sampling FT, is one way to apply it."
                )
            elif d + dh < 0:
                out.append(
                    "Filtered SFT fixes part of the flaw, RL more (reading 2): its change minus "
                    f"RL's is {d:+.3f} ± {dh:.3f}, entirely below 0."
                )
            else:
                out.append(
                    "Filtered SFT: its change is above 0 but its end is not above the exact "
                    f"teacher's ceiling by its interval ({cm:+.3f} ± {chh:.3f}); its change "
                    f"minus RL's is {d:+.3f} ± {dh:.3f}: between readings 1 and 2."
                )
    if "sft-x4" in data["end"] and base and "sft-longer" in base["end"]:
        x4, x2 = data["end"]["sft-x4"], base["end"]["sft-longer"]
        m, h = repro_lib.interval([a - b for a, b in zip(x4, x2, strict=True)])
        if math.isfinite(h) and m - h > 0:
            out.append(
                f"SFT x4 minus SFT x2: {m:+.3f} ± {h:.3f}, above 0: SFT was still "
                "climbing at 840 steps."
            )
        elif math.isfinite(h):
            out.append(
                f"SFT x4 minus SFT x2: {m:+.3f} ± {h:.3f}, an interval including 0 (or "
                "below): the recipe has plateaued by 840 steps."
            )
    return out


def offline_render(data: dict) -> list[str]:
    """The offline controls' tables, comparisons and readings from `offline_measure`'s data."""
    own, ceil, base = data["own_start"], data["ceiling"], data["baselines"]
    exact = ceil["ceiling"]
    seeds = ", ".join(str(s) for s in data["seeds"])
    per_seed = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
    rows = [["each seed's own warm start (420 SFT steps)", per_seed(own), repro_lib.ci(own),
             "0", "", ""]]  # fmt: skip
    ends = dict(data["end"])
    if base and "sft-longer" in base["end"]:
        ends = {"sft-longer": base["end"]["sft-longer"], **ends}
    for name, xs in ends.items():
        stored = name not in data["end"]
        title = "SFT x2 steps (fresh runs; stored)" if stored else OFFLINE_TITLES.get(name, name)
        fid = "" if stored else repro_lib.ci(data["fidelity"][name])
        rawp = "" if stored else repro_lib.ci(data["right_answer_wrong_process"][name])
        rows.append([title, per_seed(xs), repro_lib.ci(xs),
                     repro_lib.paired_difference(xs, own), fid, rawp])  # fmt: skip
    if base:
        for name, title in (("rl", "RL (stored)"), ("rft", "rejection-sampling FT (stored)")):
            if name in base["end"]:
                rows.append([f"{title}, from the one shared warm start "
                             f"({base['shared_start']:.3f})", per_seed(base["end"][name]),
                             repro_lib.ci(base["end"][name]),
                             repro_lib.ci(base["change"][name]) + " (from the shared start)",
                             "", ""])  # fmt: skip
    header = ["arm", f"pass@1 (seeds {seeds})", "mean ± 95% interval",
              "change, paired with each seed's own warm start",
              "process fidelity (share of all prompts)",
              "right answer, wrong process (share of right answers)"]  # fmt: skip
    comp = []
    x2 = base["end"].get("sft-longer") if base else None
    for name, xs in data["end"].items():
        t = OFFLINE_TITLES.get(name, name)
        comp.append(repro_lib.paired_row(f"{t} minus each seed's own warm start", xs, own))
        if base:
            change = [x - o for x, o in zip(xs, own, strict=True)]
            for other in ("rl", "rft"):
                if other in base["change"]:
                    welch = repro_lib.welch_difference(change, base["change"][other])
                    comp.append([f"{t}'s change minus {other.upper()}'s (unpaired)", "", welch])
        if x2 is not None:
            comp.append(repro_lib.paired_row(f"{t} minus SFT x2 (the same seed)", xs, x2))
        flat = [exact] * len(xs)
        comp.append(repro_lib.paired_row(f"{t} minus the exact teacher's ceiling", xs, flat))
    second = repro_lib.markdown_table(
        ["comparison", "per seed", "mean ± 95% interval (seeds > 0)"], comp
    )
    k = data["kept"]
    notes = (
        f"Held-out greedy pass@1 on the {ceil['prompts']} test prompts, mean ± the half-width of "
        f"the 95% Student-t interval over seeds {seeds} [its ends]; no arm here samples a "
        "rollout. Each arm's seed k is a fresh supervised run from seed k's init and SFT stream, "
        "paired with seed k's own 420-step warm start (the baselines' own_start). The filter "
        f"keeps {k['kept']} of the {k['pool']} training demonstrations "
        f"({100 * k['kept'] / k['pool']:.1f}%): {k['kept_negative']} of the "
        f"{k['pool_negative']} with a negative answer (those whose sign the teacher kept). "
        "RL's and rejection sampling's changes are from their one shared warm start (seed 0's), "
        "so they are compared with the offline arms' changes unpaired (Welch). The exact "
        f"teacher's ceiling on these prompts: {exact:.3f} ({ceil['negative']} of "
        f"{ceil['prompts']} answers negative)."
        + (f" Baselines: {base['file']}." if base else " No baselines given: RL rows left out.")
    )
    verdict = offline_verdict(data)
    return [repro_lib.markdown_table(header, rows), second, notes, *verdict]


def offline(args, parser, argv) -> dict:
    """--offline: the offline arms (run, or read from --records), their tables in REPORT."""
    known = offline_arms(args.preset)
    arms = repro_lib.select_arms(parser, args.offline, known)
    seeds = repro_lib.seeds_of(args)
    report = pathlib.Path(args.report) if args.report else pathlib.Path(args.out) / "offline"
    report.mkdir(parents=True, exist_ok=True)
    if args.records:
        runs = repro_lib.read_records(pathlib.Path(args.records), arms, seeds)
    else:
        runs = run_offline(args, arms, seeds, report)
    base = offline_baselines(args, parser, seeds)
    ceiling = reference_points(args.preset)["ceiling"]
    data = offline_measure(runs, seeds, base, ceiling, demonstrations_kept(args.preset))
    out_args = argparse.Namespace(**{**vars(args), "out": str(report)})
    repro_lib.finish(out_args, argv, script="repro_testbed.py",
                     title="The testbed's offline controls: filtered SFT and SFT x4",
                     sections=offline_render(data), files=[], data=data)  # fmt: skip
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
    parser.add_argument(
        "--offline",
        nargs="?",
        const="sft-filtered,sft-x4",
        default=None,
        help="run only the offline controls (comma-separated: sft-filtered,sft-x4); see the "
        "module docstring's pre-registration",
    )
    parser.add_argument(
        "--baselines",
        default=None,
        help="with --offline: the testbed's results.json (each seed's own warm start, RL, "
        "rejection sampling, SFT x2), e.g. docs/testbed/results.json",
    )
    parser.add_argument(
        "--report",
        default=None,
        help="with --offline: where results.md / results.json / records/ go (default OUT/offline)",
    )
    args = parser.parse_args(argv)
    if args.offline:
        return offline(args, parser, argv)
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
