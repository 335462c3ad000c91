"""Advantage inversion in training with the verifier hidden (issue 33's protocol), real trainer.

Run:  python experiments/repro_inversion_training.py [--preset default|quick] [--seeds 0,1,2]
                                                     [--arms verifier,naive,dead_zone,judge]

"Each Prompt Matters" replaces its Bradley–Terry reward model with a judge that answers Better /
Tie / Worse, because GRPO's group normalisation turns a scalar RM's noise into unit-size
advantages of random sign among equally good rollouts ("advantage inversion"). Here the policy
is make run's (`configs/default.py`, from the shared warm start) and, in every arm but the
ceiling, training never reads the verifier: its rewards come from a learned model, and the
stages that read pass rates (the pre-filter, adaptive G) are off in every arm (HIDDEN).
1. Pairs: the warm-start policy's own samples (G = 8 per prompt at the rollout temperature),
   labelled by the verifier as a rater would (correct beats wrong; two correct or two wrong
   tie), LABEL_NOISE of the labels corrupted (a BT pair flipped; a judge label replaced by
   another class at random). Held-out pairs of other prompts (clean labels) are split in two:
   validation (picks the checkpoint, every EVAL_EVERY steps, and the dead zone) and test.
2. The models, both the warm start's backbone plus a head: a scalar BT RM
   (`espo.rewards.reward_model`) on the (correct, wrong) pairs, and a Better / Tie / Worse pair
   judge (`espo.rewards.pair_judge`) on (correct, wrong) pairs in both orders and tied pairs.
   Reported: test pair accuracy (a (correct, wrong) pair ordered right; for the judge, its
   score averaged over both orders), tie accuracy of the judge and of the dead zone.
3. Arms (same warm start, seeds and budget; make run's loss and schedule): "verifier" (the
   ceiling: verifier rewards), "naive" (r = RM score), "dead_zone" (the RM with ties below the
   dead zone calibrated on the validation pairs, ranks; `reward.model_mode=dead_zone`),
   "judge" (the trained judge round-robin, both orders). "adjusted" (the RM inside the
   verifier's correctness tiers) reads the verifier: on demand only.
Metrics, named before the runs: inversion against the verifier on every step's rollouts, split
into tied pairs (`rm/pair_inversion_tied`: equally correct rollouts given advantages of opposite
signs) and different-quality pairs (`rm/pair_inversion_diff`: the wrong rollout's advantage
above the correct one's), and the true held-out greedy pass@1 after the run (the verifier).
Written to OUT (default runs/repro/inversion_training): results.md / results.json,
inversion.png, heldout.png, models.json (the RM and judge accuracies).
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

from espo import config as config_lib  # noqa: E402
from espo import model, sampler, trainer  # noqa: E402
from espo.data import sources, stream, tokenizer  # noqa: E402
from espo.rewards import model_rewards, pair_judge  # noqa: E402
from espo.rewards import reward_model as rm  # noqa: E402

NAME = "default"  # configs/default.py, make run's task
LABEL_NOISE = 0.2  # share of the models' training labels corrupted
# Pair prompts: train, held out. Pilot (1024 / 512 prompts, 410 (correct, wrong) and 1024 tied
# training pairs, 600 steps each): BT RM test pair accuracy 0.864 (best validation at step
# 100), dead zone 0.089 with tie accuracy 0.973; judge pair accuracy 0.748, tie accuracy 0.984.
PROMPTS = {"quick": (32, 32), "default": (3072, 768)}
# Optimiser steps at most of the RM and of the judge (a judge step: ~3 s on 2 cores). --quick: one;
# a second compiles the update again (the new head and the optimiser state are committed to the
# device by the first), and one step already runs a fit and its validation end to end.
STEPS = {"quick": 1, "default": 1500}
JUDGE_STEPS = {"quick": 1, "default": 600}
EVAL_EVERY = 50  # the BT RM overfits its noisy labels fast (pilot: best at step 100)
PATIENCE = 300  # steps without a better validation score that stop a fit
LR, BATCH = 1e-4, 32
# Nothing in training reads the verifier: the pass-rate pre-filter and adaptive G are off.
HIDDEN = {
    "default": {"zve.prefilter": "off", "zve.max_group_size": 8},
    "quick": {"zve.prefilter": "off", "zve.max_group_size": 4},
}
ARMS = {
    "verifier": repro_lib.Arm("verifier", {"reward.model_path": ""}, "verifier (ceiling)"),
    "naive": repro_lib.Arm("naive", {"reward.model_mode": "naive"}, "BT RM score"),
    "dead_zone": repro_lib.Arm(
        "dead_zone", {"reward.model_mode": "dead_zone"}, "BT RM + dead zone"
    ),
    "judge": repro_lib.Arm("judge", {"reward.model_mode": "judge"}, "B/T/W judge"),
    "adjusted": repro_lib.Arm(
        "adjusted", {"reward.model_mode": "adjusted"}, "BT RM in verifier tiers"
    ),
}
DEFAULT_ARMS = "verifier,naive,dead_zone,judge"
RM_KEYS = (
    "rm/pair_inversion_tied",
    "rm/pair_inversion_diff",
    "rm/inversion_rate",
    "rm/sign_agreement",
    "rm/pair_accuracy",
)


class Groups:
    """The warm-start policy's samples of `num_prompts` prompts, G each, scored by the verifier:
    rows [P, G, T] (prompt + completion, padded right), masks [P, G, T], correct [P, G]."""

    @classmethod
    def cached(cls, path: pathlib.Path, preset: str, params, **kw) -> Groups:
        """The groups saved in `path` (.npz), else sampled and saved there."""
        if path.exists():
            self = cls.__new__(cls)
            with np.load(path) as f:
                self.rows, self.masks, self.correct = f["rows"], f["masks"], f["correct"]
                self.demonstrations = int(f["demonstrations"])
            return self
        self = cls(preset, params, **kw)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, rows=self.rows, masks=self.masks, correct=self.correct,
                            demonstrations=self.demonstrations)  # fmt: skip
        return self

    def __init__(self, preset: str, params, *, seed: int, num_prompts: int, G: int = 8):
        s = config_lib.Settings.from_config(repro_lib.config(preset, name=NAME))
        tok = tokenizer.load_tokenizer(s.hf_path)
        reward_fn, thr = trainer.reward_fn_of(s), s.advantage.success_threshold
        prompts_stream = stream.PromptStream(sources.make_sources(s.data)[0], seed=seed + 7)
        key, T = jax.random.key(seed + 7), s.max_prompt_length + s.curriculum.max_new_tokens
        rows, lengths, correct, self.demonstrations = [], [], [], 0
        for _ in range(0, num_prompts, 32):
            exs = prompts_stream.take(
                32, accept=lambda e: len(tok.encode_prompt(e.prompt)) <= s.max_prompt_length
            )
            prompts = [tok.encode_prompt(e.prompt) for e in exs]
            key, k = jax.random.split(key)
            out = sampler.sample(
                model.Model(s.model), params, prompts, [len(p) for p in prompts], key=k,
                num_samples=G, max_new_tokens=s.curriculum.max_new_tokens,
                temperature=s.rollout.temperature, stop_ids=tuple(tok.stop_ids),
                pad_id=tok.pad_id,
            )  # fmt: skip
            tokens, ends = np.asarray(out.tokens), np.asarray(out.lengths)
            for i, e in enumerate(exs):
                group = [tokens[r, : ends[r]] for r in range(i * G, (i + 1) * G)]
                right = [reward_fn(e.prompt, tok.decode(c), e.meta) > thr for c in group]
                demo = tok.encode_completion(e.demonstration or "")
                if not any(right) and reward_fn(e.prompt, e.demonstration or "", e.meta) > thr:
                    # No correct sample: the (correct) demonstration stands in for the last one,
                    # as a rater's reference answer would (counted: `demonstrations`).
                    group[-1], right[-1] = np.asarray(demo), True
                    self.demonstrations += 1
                for c, ok in zip(group, right, strict=True):
                    ids = np.concatenate([prompts[i], c])[:T]
                    rows.append(np.pad(ids, (0, T - len(ids)), constant_values=tok.pad_id))
                    lengths.append(len(ids))
                    correct.append(ok)
        self.rows = np.stack(rows).reshape(-1, G, T)[:num_prompts]  # [P, G, T]
        self.masks = np.arange(T) < np.reshape(lengths, (-1, G, 1))[:num_prompts]  # [P, G, T]
        self.correct = np.array(correct).reshape(-1, G)[:num_prompts]  # [P, G]

    def pairs(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [N, 2, T], masks [N, 2, T] and labels [N] (0: the first is better, 1: tie) of
        one (correct, wrong) pair of each group that has both, then one tied pair (two correct
        or two wrong, whichever the group has two of, at random) of each group that has one,
        as many as there are (correct, wrong) pairs at most (a random subset)."""
        decided, tied = [], []  # (group, first, second)
        for g, c in enumerate(self.correct):
            right, wrong = np.flatnonzero(c), np.flatnonzero(~c)
            if len(right) and len(wrong):
                decided.append((g, rng.choice(right), rng.choice(wrong)))
            pools = [p for p in (right, wrong) if len(p) > 1]
            if pools:
                tied.append((g, *rng.choice(pools[rng.integers(len(pools))], 2, replace=False)))
        if len(tied) > len(decided):  # balanced classes: most groups of a good policy are tied
            tied = [tied[k] for k in sorted(rng.choice(len(tied), len(decided), replace=False))]
        index = np.array(decided + tied, int).reshape(-1, 3)  # [N, 3]
        labels = np.repeat([0, 1], [len(decided), len(tied)])
        pick = (index[:, :1], index[:, 1:])  # [N, 1] groups, [N, 2] rollouts
        return self.rows[pick], self.masks[pick], labels


def _noisy_labels(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Judge labels (0 better, 1 tie, 2 worse) with LABEL_NOISE of them replaced by one of the
    other two classes at random."""
    noisy = rng.random(len(labels)) < LABEL_NOISE
    return np.where(noisy, (labels + rng.integers(1, 3, len(labels))) % 3, labels)


def _both_orders(rows, masks, labels):
    """Each pair in both orders: (A, B) with its label, then (B, A) with better <-> worse."""
    swap = lambda a: a[:, ::-1]
    return (np.concatenate([rows, swap(rows)]), np.concatenate([masks, swap(masks)]),
            np.concatenate([labels, 2 - labels]))  # fmt: skip


def train_models(out: pathlib.Path, warm: pathlib.Path, preset: str, *, seed: int) -> dict:
    """Trains and saves the BT RM (OUT/models/reward_model) and the pair judge (OUT/models/judge)
    once; their accuracies on the test pairs and the calibrated dead zone (OUT/models.json)."""
    done = out / "models.json"
    if done.exists():
        return json.loads(done.read_text())
    s = config_lib.Settings.from_config(repro_lib.config(preset, name=NAME))
    cfg, policy = s.model, trainer.params_of_run(str(warm), s.model)
    rng = np.random.default_rng(seed)
    n_train, n_held = PROMPTS[preset]
    models = out / "models"  # every part is saved as it is done: a rerun resumes
    train = Groups.cached(
        models / "groups_train.npz", preset, policy, seed=seed, num_prompts=n_train
    )
    held = Groups.cached(models / "groups_held.npz", preset, policy, seed=seed + 1000,
                         num_prompts=n_held)  # fmt: skip
    rows, masks, labels = train.pairs(rng)
    h_rows, h_masks, h_labels = held.pairs(rng)
    val = np.arange(len(h_labels)) % 2 == 0  # validation / test halves of the held-out pairs
    score = model_rewards.make_scorer(cfg)
    judge = pair_judge.ModelJudge(cfg, {})

    def rm_gaps(params, pick):
        a = score(params, h_rows[pick, 0], h_masks[pick, 0])
        return a - score(params, h_rows[pick, 1], h_masks[pick, 1])  # [n] first minus second

    def judge_scores(params, pick):
        judge.params = params
        at, am, bt, bm = h_rows[pick, 0], h_masks[pick, 0], h_rows[pick, 1], h_masks[pick, 1]
        first = np.argmax(judge.logits(at, am, bt, bm), -1)  # 0 better, 1 tie, 2 worse
        second = np.argmax(judge.logits(bt, bm, at, am), -1)
        return ((1 - first) - (1 - second)) / 2  # [n] in [-1, 1], > 0: the first is better

    def accuracies(pref, pick, *, tie_band):
        d, t = h_labels[pick] == 0, h_labels[pick] == 1
        return {"pair_accuracy": float(np.mean(pref[d] > tie_band)),
                "tie_accuracy": float(np.mean(np.abs(pref[t]) <= tie_band))}  # fmt: skip

    info = {"train_pairs": int((labels == 0).sum()), "train_tied_pairs": int((labels == 1).sum()),
            "test_pairs": int((h_labels[~val] == 0).sum()),
            "test_tied_pairs": int((h_labels[~val] == 1).sum()),
            "policy_accuracy": float(train.correct.mean()),
            "demonstrations": train.demonstrations + held.demonstrations}  # fmt: skip
    # The BT RM: (correct, wrong) pairs, LABEL_NOISE of them flipped.
    d_rows, d_masks = rows[labels == 0], masks[labels == 0]
    flip = rng.random(len(d_rows)) < LABEL_NOISE
    d_rows = np.where(flip[:, None, None], d_rows[:, ::-1], d_rows)
    d_masks = np.where(flip[:, None, None], d_masks[:, ::-1], d_masks)

    def rm_batch(pick):
        b = (d_rows[pick, 0], d_rows[pick, 1], d_masks[pick, 0], d_masks[pick, 1])
        return rm.PreferenceBatch(*b)

    rm_dir, rm_fit = models / "reward_model", models / "reward_model_fit.json"
    if rm_fit.exists():  # saved with the record of its fit
        params, info["rm"] = model_rewards.load(rm_dir)[1], json.loads(rm_fit.read_text())
    else:
        params = {**rm.init_reward_model(cfg, jax.random.key(seed)), "backbone": policy}
        rm_val = lambda p: accuracies(rm_gaps(p, val), val, tie_band=0.0)["pair_accuracy"]
        params, info["rm"] = _fit(
            cfg, params, rm.bradley_terry_loss, rm_batch, len(d_rows), rm_val, STEPS[preset],
            rng,
        )  # fmt: skip
        model_rewards.save(rm_dir, cfg, params)
        rm_fit.write_text(json.dumps(info["rm"]) + "\n")
    gaps_val = rm_gaps(params, val)
    info["dead_zone"] = _calibrate(np.abs(gaps_val), h_labels[val] == 1, gaps_val > 0)
    gaps = rm_gaps(params, ~val)
    zoned = accuracies(gaps, ~val, tie_band=info["dead_zone"])
    info["rm"] |= accuracies(gaps, ~val, tie_band=0.0)
    info["rm"] |= {"tie_accuracy": zoned["tie_accuracy"],
                   "pair_accuracy_dead_zone": zoned["pair_accuracy"]}  # fmt: skip
    # The judge: every pair in both orders, LABEL_NOISE of the labels replaced (its own
    # generator: the same labels and batches whether the RM was fitted in this run or loaded).
    rng = np.random.default_rng([seed, 1])
    j_rows, j_masks, j_labels = _both_orders(rows, masks, _noisy_labels(labels, rng))

    def judge_batch(pick):
        t, m = pair_judge.pair_rows(j_rows[pick, 0], j_masks[pick, 0], j_rows[pick, 1],
                                    j_masks[pick, 1], sep=pair_judge.sep_id(cfg))  # fmt: skip
        return pair_judge.JudgeBatch(t, m, j_labels[pick])

    params = {**pair_judge.init_pair_judge(cfg, jax.random.key(seed)), "backbone": policy}
    three_way = lambda p: _three_way(judge_scores(p, val), h_labels[val])
    params, info["judge"] = _fit(
        cfg, params, pair_judge.judge_loss, judge_batch, len(j_labels), three_way,
        JUDGE_STEPS[preset], rng,
    )  # fmt: skip
    info["judge"] |= accuracies(judge_scores(params, ~val), ~val, tie_band=0.0)
    model_rewards.save(out / "models" / "judge", cfg, params, kind="pairwise")
    done.write_text(json.dumps(info, indent=2) + "\n")
    return info


def _fit(cfg, params, loss, batch_of, n, validate, steps, rng) -> tuple[dict, dict]:
    """Up to `steps` Adam steps on random batches of the n examples, stopped once validation
    (checked every EVAL_EVERY steps and at the end) has not improved for PATIENCE steps; the
    params of the best validation score and what was chosen."""
    optimizer = optax.adam(LR)
    step, opt_state = rm.make_train_step(cfg, optimizer, loss), optimizer.init(params)
    best = (-1.0, 0, params)
    for i in range(1, steps + 1):
        params, opt_state, m = step(params, opt_state, batch_of(rng.integers(n, size=BATCH)))
        if i % EVAL_EVERY == 0 or i == steps:
            v = validate(params)
            print(f"step {i}: loss {float(m['loss']):.3f}, validation {v:.3f}", flush=True)
            best = max(best, (v, i, params), key=lambda b: b[:2])
            if i - best[1] >= PATIENCE:
                break
    return best[2], {"chosen_step": best[1], "validation": best[0], "steps": i}


def _three_way(pref: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy of preferences in [-1, 1] (first vs second) as better / tie against labels
    0 (the first is better) / 1 (tie)."""
    return float(np.mean(np.where(labels == 0, pref > 0, pref == 0)))


def _calibrate(gap: np.ndarray, tie: np.ndarray, right: np.ndarray) -> float:
    """The dead zone that classifies the validation pairs best as tie (|gap| below it) or
    decided in the right order: one of the observed |gaps| (0 when no zone beats none)."""
    zones = np.concatenate([[0.0], np.sort(gap)])
    acc = [np.mean(np.where(tie, gap < z, (gap >= z) & right)) for z in zones]
    return float(zones[int(np.argmax(acc))])


def summarize(info):
    def _summarize(runs, arm_list) -> tuple[list[str], dict]:
        cols = {k.split("/")[1]: (lambda r, k=k: repro_lib.mean_over(r, k)) for k in RM_KEYS}
        cols |= {"train accuracy": lambda r: repro_lib.mean_over(r, "train/accuracy"),
                 **repro_lib.heldout_columns()}  # fmt: skip
        table, data = repro_lib.arm_table(runs, arm_list, cols)
        head = repro_lib.markdown_table(
            ["rewards", "tied pairs split (95% CI)", "different-quality pairs inverted (95% CI)",
             "final held-out pass@1 (95% CI)", "pass@1 change (95% CI)"],
            [[a.title, *(repro_lib.ci(data[a.name][c]) for c in
                         ("pair_inversion_tied", "pair_inversion_diff", "pass@1 end",
                          "pass@1 change"))] for a in arm_list],
        )  # fmt: skip
        r, j = info["rm"], info["judge"]
        notes = (
            f"The models: the warm start's backbone + a head, the step of best validation kept; "
            f"{info['train_pairs']} (correct, wrong) and {info['train_tied_pairs']} tied training "
            f"pairs of the warm-start policy's samples (its accuracy {info['policy_accuracy']:.3f}"
            f"), {LABEL_NOISE:.0%} of the labels corrupted. Test pairs (clean labels, other "
            f"prompts): {info['test_pairs']} (correct, wrong), {info['test_tied_pairs']} tied. "
            f"BT RM: pair accuracy {r['pair_accuracy']:.3f}; dead zone {info['dead_zone']:.3f} "
            f"(calibrated on the validation pairs): tie accuracy {r['tie_accuracy']:.3f}, pair "
            f"accuracy outside it {r['pair_accuracy_dead_zone']:.3f}. Judge: pair accuracy "
            f"{j['pair_accuracy']:.3f}, tie accuracy {j['tie_accuracy']:.3f} (both orders "
            "averaged). Columns of the second table: means over the RL steps (rm/* against the "
            "verifier on every step's rollouts; the verifier arm has no model: n/a); ± is the "
            "std over seeds."
        )
        return [head, table, notes], {"models": info, **data}

    return _summarize


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = repro_lib.curves_of(runs, arm_list)
    return [
        repro_lib.plot(out / "inversion.png", [("rm/pair_inversion_tied", "tied pairs split"),
                                               ("rm/pair_inversion_diff", "pairs inverted"),
                                               ("rm/pair_accuracy", "pair accuracy")], curves),
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1 (verifier)"),
                                             ("train/accuracy", "train accuracy")], curves),
    ]  # fmt: skip


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/inversion_training", arms=ARMS, preset="default",
        seeds="0,1,2", default=DEFAULT_ARMS,
    )  # fmt: skip
    out, seeds = pathlib.Path(args.out), repro_lib.seeds_of(args)
    out.mkdir(parents=True, exist_ok=True)
    if args.records:  # a table from kept curves: the models' record lies beside them
        info = json.loads((pathlib.Path(args.records).parent / "models.json").read_text())
    else:
        warm = repro_lib.warm_start(
            repro_lib.warm_dir(args), args.preset, seed=seeds[0],
            progress=not args.no_progress, name=NAME,
        )  # fmt: skip
        info = train_models(out, warm, args.preset, seed=seeds[0])
    print(f"models: {json.dumps(info)}", flush=True)
    judge = {"reward.model_path": str(out / "models" / "judge")}
    arm_list = [
        repro_lib.Arm(a.name, {**a.overrides, **judge}, a.label) if a.name == "judge" else a
        for a in arm_list
    ]
    return repro_lib.experiment(
        args, argv, arm_list, script="repro_inversion_training.py",
        title="Advantage inversion in training, the verifier hidden", summarize=summarize(info),
        plots=plots, name=NAME,
        common={**HIDDEN[args.preset], "reward.model_path": str(out / "models" / "reward_model"),
                "reward.model_dead_zone": info["dead_zone"]},
    )  # fmt: skip


if __name__ == "__main__":
    main()
