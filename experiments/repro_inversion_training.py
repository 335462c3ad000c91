"""Advantage inversion in training: a noisy learned reward model, naive vs adjusted vs a pairwise
judge, with the real trainer.

Run:  python experiments/repro_inversion_training.py [--preset quick|cpu|large] [--seeds 0]
                                                     [--arms verifier,naive,adjusted,judge]

"Each Prompt Matters" adjusts its reward model because GRPO's group normalisation turns RM
noise into unit-size advantages of random sign among equally good rollouts ("advantage
inversion"); experiments/repro_inversion.py measures that on a synthetic task with a simulated
policy. Here the policy is the embedded default (`configs/default.py`) trained from the shared
warm start, and its rewards come from a learned Bradley–Terry RM (`reward.model_path`):
1. The RM: the warm start's backbone plus a scalar head (`espo.rewards.reward_model`), trained
   on (correct, wrong) pairs of the warm-start policy's own samples (G = 8 per prompt at
   temperature 1, one pair per group that mixes both, labelled by the verifier), LABEL_NOISE
   of the labels flipped: an RM that learns correctness from outcomes, noisily. Its held-out
   pair accuracy (clean labels, other prompts) is reported; `rm/pair_accuracy` measures it on
   the training run's rollouts, whose policy drifts from the one it was trained on.
2. Arms (plain GRPO, same seeds and budget): "verifier" (the reference: verifier rewards, no
   RM), "naive" (r = RM score), "adjusted" (`reward_model.adjust_rewards`: verifier tiers, RM
   gaps < 0.75 tie, ranks), "judge" (round-robin Better / Tie / Worse of a judge that prefers
   the higher RM score, ties within 0.75).
Inversion is measured against the verifier on every step's rollouts (`rm/inversion_rate`: the
share of rollouts whose group-normalised reward has the wrong sign, a rollout of a group whose
rollouts are all equally correct counting when its advantage is nonzero; `rm/
inversion_rate_mixed`: over groups that mix correct and wrong rollouts only), next to held-out
greedy pass@1 (the verifier). Written to OUT (default runs/repro/inversion_training):
results.md / results.json and inversion.png / heldout.png.
"""

from __future__ import annotations

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
from espo.rewards import model_rewards  # noqa: E402
from espo.rewards import reward_model as rm  # noqa: E402

LABEL_NOISE = 0.2  # share of the RM's training labels flipped
RM_STEPS = {"quick": 2, "cpu": 400, "large": 1000}
RM_PROMPTS = {"quick": (32, 32), "cpu": (4096, 512), "large": (16384, 1024)}  # train, held out
RM_LR = 3e-4
EVAL_EVERY = 50
RM_BATCH = 32
_PLAIN = {
    "loss.name": "grpo",
    "zve.mode": "rl_zvp",
    "advantage.rl_zvp_alpha": 0.0,
    "zve.prefilter": "off",
}
ARMS = {
    "verifier": repro_lib.Arm("verifier", {**_PLAIN, "reward.model_path": ""}, "verifier (no RM)"),
    "naive": repro_lib.Arm("naive", {**_PLAIN, "reward.model_mode": "naive"}, "naive RM"),
    "adjusted": repro_lib.Arm(
        "adjusted", {**_PLAIN, "reward.model_mode": "adjusted"}, "adjusted RM"
    ),
    "judge": repro_lib.Arm("judge", {**_PLAIN, "reward.model_mode": "judge"}, "RM judge"),
}
RM_KEYS = ("rm/inversion_rate", "rm/inversion_rate_mixed", "rm/sign_agreement", "rm/pair_accuracy")


class PairMaker:
    """(prompt + correct rollout, prompt + wrong rollout) pairs of the warm-start policy's own
    samples (temperature 1, G per prompt, scored by the verifier): the pairs an RM for this
    policy would be trained on, so what it learns transfers to the rollouts it will score."""

    def __init__(self, preset: str, params, *, seed: int, group_size: int = 8):
        s = config_lib.Settings.from_config(repro_lib.config(preset))
        self.s, self.params, self.G = s, params, group_size
        self.tok = tokenizer.load_tokenizer(s.hf_path)
        self.reward_fn = trainer.reward_fn_of(s)
        self.stream = stream.PromptStream(sources.make_sources(s.data)[0], seed=seed + 7)
        self.key = jax.random.key(seed + 7)
        self.T = s.max_prompt_length + s.curriculum.max_new_tokens
        self.rng = np.random.default_rng(seed)

    def pairs(self, num_prompts: int, *, chunk: int = 32) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [N, 2, T] and masks [N, 2, T] of (correct, wrong) pairs, one per group with a
        wrong sample (its correct side a correct sample, else the prompt's demonstration)."""
        s, tok, thr = self.s, self.tok, self.s.advantage.success_threshold
        tokens, masks = [], []
        for _ in range(0, num_prompts, chunk):
            exs = self.stream.take(
                chunk, accept=lambda e: len(tok.encode_prompt(e.prompt)) <= s.max_prompt_length
            )
            prompts = [tok.encode_prompt(e.prompt) for e in exs]
            self.key, key = jax.random.split(self.key)
            out = sampler.sample(
                model.Model(s.model), self.params, prompts, [len(p) for p in prompts], key=key,
                num_samples=self.G, max_new_tokens=s.curriculum.max_new_tokens,
                stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id,
            )  # fmt: skip
            completions, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            for i, e in enumerate(exs):
                rows = range(i * self.G, (i + 1) * self.G)
                samples = [completions[r, : lengths[r]] for r in rows]
                good, bad = [], []
                for c in samples:
                    ok = self.reward_fn(e.prompt, tok.decode(c), e.meta) > thr
                    (good if ok else bad).append(c)
                # No correct sample (a weak policy): the prompt's demonstration is the good one.
                good = good or [np.asarray(tok.encode_completion(e.demonstration or e.answer))]
                if bad:
                    pair = [self._row(prompts[i], c)
                            for c in (good[self.rng.integers(len(good))],
                                      bad[self.rng.integers(len(bad))])]  # fmt: skip
                    tokens.append(np.stack([t for t, _ in pair]))
                    masks.append(np.stack([m for _, m in pair]))
        return np.stack(tokens), np.stack(masks)

    def _row(self, prompt_ids, completion_ids):
        ids = np.concatenate([prompt_ids, completion_ids])[: self.T]
        row = np.full(self.T, self.tok.pad_id, np.int32)
        row[: len(ids)] = ids
        return row, np.arange(self.T) < len(ids)


def preference_batch(tokens, masks, rows, flip) -> rm.PreferenceBatch:
    """Pairs `rows` of `PairMaker.pairs`, the label of those with `flip` swapped."""
    first = np.where(flip, 1, 0)
    pick = lambda a, side: a[rows, side]
    return rm.PreferenceBatch(
        pick(tokens, first), pick(tokens, 1 - first), pick(masks, first), pick(masks, 1 - first)
    )


def train_reward_model(out: pathlib.Path, warm: pathlib.Path, preset: str, *, seed: int) -> dict:
    """Trains and saves the RM in OUT/reward_model once; its held-out clean pair accuracy.

    Held-out pairs (other prompts, clean labels) are split in two: the validation half picks
    the checkpoint (every EVAL_EVERY steps: BT on noisy pairs overfits them), the test half is
    the accuracy reported."""
    path, s = out / "reward_model", config_lib.Settings.from_config(repro_lib.config(preset))
    policy = trainer.params_of_run(str(warm), s.model)
    maker = PairMaker(preset, policy, seed=seed)
    n_train, n_held = RM_PROMPTS[preset]
    held_tokens, held_masks = maker.pairs(n_held)
    half = len(held_tokens) // 2
    cfg = s.model
    score = model_rewards.make_scorer(cfg)
    accuracy = lambda p, sl: float(
        np.mean(score(p, held_tokens[sl, 0], held_masks[sl, 0])
                > score(p, held_tokens[sl, 1], held_masks[sl, 1]))
    )  # fmt: skip
    info = {"held_out_pairs": len(held_tokens) - half}
    if not (path / model_rewards.MANIFEST).exists():
        tokens, masks = maker.pairs(n_train)
        noisy = maker.rng.random(len(tokens)) < LABEL_NOISE  # fixed per pair: noisy labels
        params = rm.init_reward_model(cfg, jax.random.key(seed))
        params["backbone"] = policy
        optimizer = optax.adam(RM_LR)
        step, opt_state = rm.make_train_step(cfg, optimizer), optimizer.init(params)
        best = (-1.0, 0, params)
        for i in range(1, RM_STEPS[preset] + 1):
            rows = maker.rng.integers(len(tokens), size=RM_BATCH)
            batch = preference_batch(tokens, masks, rows, noisy[rows])
            params, opt_state, m = step(params, opt_state, batch)
            if i % EVAL_EVERY == 0 or i == RM_STEPS[preset]:
                val = accuracy(params, slice(0, half))
                print(
                    f"RM step {i}: BT loss {float(m['bt_loss']):.3f}, validation {val:.3f}",
                    flush=True,
                )
                best = max(best, (val, i, params), key=lambda b: b[:2])
        model_rewards.save(path, cfg, best[2])
        info |= {"train_pairs": len(tokens), "chosen_step": best[1], "validation": best[0]}
    _, params = model_rewards.load(path)
    return {"path": str(path), "held_out_pair_accuracy": accuracy(params, slice(half, None)),
            **info}  # fmt: skip


def summarize(rm_info):
    def _summarize(runs, arm_list) -> tuple[list[str], dict]:
        cols = {k.split("/")[1]: (lambda r, k=k: repro_lib.mean_over(r, k)) for k in RM_KEYS}
        cols |= {
            "train accuracy": lambda r: repro_lib.mean_over(r, "train/accuracy"),
            **repro_lib.heldout_columns(),
        }
        table, data = repro_lib.arm_table(runs, arm_list, cols)
        notes = (
            f"The RM: the warm start's backbone + a scalar head, {rm_info['steps']} Bradley–Terry "
            f"steps of {RM_BATCH} pairs drawn from {rm_info.get('train_pairs', '?')} (correct, "
            f"wrong) pairs of the warm-start policy's samples, {LABEL_NOISE:.0%} of the labels "
            f"flipped, lr {RM_LR}, the step of best validation accuracy kept (step "
            f"{rm_info.get('chosen_step', '?')}); test pair accuracy (clean labels, "
            f"{rm_info['held_out_pairs']} pairs of other prompts) "
            f"{rm_info['held_out_pair_accuracy']:.3f}. Columns: "
            "means over the RL steps (rm/* measured against the verifier on every step's "
            "rollouts; the verifier arm has no RM: n/a); ± is the std over seeds."
        )
        return [table, notes], {"rm": rm_info, **data}

    return _summarize


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = repro_lib.curves_of(runs, arm_list)
    return [
        repro_lib.plot(out / "inversion.png", [("rm/inversion_rate", "inversion rate"),
                                               ("rm/inversion_rate_mixed", "inversion (mixed)"),
                                               ("rm/pair_accuracy", "RM pair accuracy")], curves),
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1"),
                                             ("train/accuracy", "train accuracy")], curves),
    ]  # fmt: skip


def main(argv=None) -> dict:
    args, arm_list = repro_lib.parse_arms(
        __doc__, argv, out="runs/repro/inversion_training", arms=ARMS
    )
    out, seeds = pathlib.Path(args.out), repro_lib.seeds_of(args)
    warm = repro_lib.warm_start(
        repro_lib.warm_dir(args), args.preset, seed=seeds[0], progress=not args.no_progress
    )
    rm_info = train_reward_model(out, warm, args.preset, seed=seeds[0])
    rm_info["steps"] = RM_STEPS[args.preset]
    print(f"reward model: {rm_info}", flush=True)
    return repro_lib.experiment(
        args,
        argv,
        arm_list,
        script="repro_inversion_training.py",
        title="Advantage inversion in training",
        summarize=summarize(rm_info),
        plots=plots,
        common={"reward.model_path": rm_info["path"]},
    )


if __name__ == "__main__":
    main()
