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
   on (prompt, correct demonstration) vs (prompt, another prompt's demonstration that the
   verifier scores wrong) pairs of the training prompts, LABEL_NOISE of the labels flipped:
   an RM that mostly knows correctness, noisily. Its held-out pair accuracy (clean labels) is
   reported; `rm/pair_accuracy` measures it on the policy's own rollouts during training.
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
from espo import trainer  # noqa: E402
from espo.data import sources, stream, tokenizer  # noqa: E402
from espo.rewards import model_rewards  # noqa: E402
from espo.rewards import reward_model as rm  # noqa: E402

LABEL_NOISE = 0.2  # share of the RM's training labels flipped
RM_STEPS = {"quick": 2, "cpu": 150, "large": 400}
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
    """(prompt + correct demonstration, prompt + a wrong one) rows of the run's training prompts."""

    def __init__(self, preset: str, *, seed: int):
        s = config_lib.Settings.from_config(repro_lib.config(preset))
        self.s, self.tok = s, tokenizer.load_tokenizer(s.hf_path)
        self.reward_fn = trainer.reward_fn_of(s)
        self.stream = stream.PromptStream(sources.make_sources(s.data)[0], seed=seed + 7)
        self.T = s.max_prompt_length + s.curriculum.max_new_tokens
        self.rng = np.random.default_rng(seed)

    def _row(self, prompt_ids, text):
        ids = (prompt_ids + self.tok.encode_completion(text))[: self.T]
        row = np.full(self.T, self.tok.pad_id, np.int32)
        row[: len(ids)] = ids
        return row, np.arange(self.T) < len(ids)

    def batch(self, n: int, *, noise: float) -> rm.PreferenceBatch:
        chosen, rejected = [], []
        thr = self.s.advantage.success_threshold
        while len(chosen) < n:
            a, *others = self.stream.take(8)
            text = lambda e: e.demonstration or e.answer
            wrong = [text(b) for b in others if self.reward_fn(a.prompt, text(b), a.meta) <= thr]
            if wrong:  # another prompt's demonstration that the verifier scores wrong
                p = self.tok.encode_prompt(a.prompt)
                chosen.append(self._row(p, text(a)))
                rejected.append(self._row(p, wrong[self.rng.integers(len(wrong))]))
        flip = self.rng.random(n) < noise
        pick = lambda x, y, i: np.stack([(y if f else x)[k][i] for k, f in enumerate(flip)])
        return rm.PreferenceBatch(
            pick(chosen, rejected, 0), pick(rejected, chosen, 0),
            pick(chosen, rejected, 1), pick(rejected, chosen, 1),
        )  # fmt: skip


def train_reward_model(out: pathlib.Path, warm: pathlib.Path, preset: str, *, seed: int) -> dict:
    """Trains and saves the RM in OUT/reward_model once; its held-out clean pair accuracy."""
    path, s = out / "reward_model", config_lib.Settings.from_config(repro_lib.config(preset))
    pairs = PairMaker(preset, seed=seed)
    held_out = pairs.batch(256, noise=0.0)
    if not (path / model_rewards.MANIFEST).exists():
        params = rm.init_reward_model(s.model, jax.random.key(seed))
        params["backbone"] = trainer.params_of_run(str(warm), s.model)
        optimizer = optax.adam(1e-3)
        step, opt_state = rm.make_train_step(s.model, optimizer), optimizer.init(params)
        for i in range(RM_STEPS[preset]):
            params, opt_state, m = step(params, opt_state, pairs.batch(RM_BATCH, noise=LABEL_NOISE))
            if i % 25 == 0:
                print(f"RM step {i}: BT loss {float(m['bt_loss']):.3f}", flush=True)
        model_rewards.save(path, s.model, params)
    cfg, params = model_rewards.load(path)
    score = model_rewards.make_scorer(cfg)
    good = score(params, held_out.chosen, held_out.chosen_mask)
    bad = score(params, held_out.rejected, held_out.rejected_mask)
    return {"path": str(path), "held_out_pair_accuracy": float(np.mean(good > bad))}


def summarize(rm_info):
    def _summarize(runs, arm_list) -> tuple[list[str], dict]:
        cols = {k.split("/")[1]: (lambda r, k=k: repro_lib.mean_over(r, k)) for k in RM_KEYS}
        cols |= {
            "train accuracy": lambda r: repro_lib.mean_over(r, "train/accuracy"),
            "pass@1 start": lambda r: repro_lib.series(r, "eval/pass@1")[1][0],
            "pass@1 end": lambda r: repro_lib.last(r, "eval/pass@1"),
            "pass@1 change": lambda r: repro_lib.change(r, "eval/pass@1"),
        }
        data = {a.name: {c: repro_lib.per_seed(runs[a.name], f) for c, f in cols.items()}
                for a in arm_list}  # fmt: skip
        rows = [[a.title, *(repro_lib.spread(v) for v in data[a.name].values())] for a in arm_list]
        notes = (
            f"The RM: the warm start's backbone + a scalar head, {rm_info['steps']} Bradley–Terry "
            f"steps of {RM_BATCH} pairs with {LABEL_NOISE:.0%} of the labels flipped; held-out "
            f"pair accuracy (clean labels) {rm_info['held_out_pair_accuracy']:.3f}. Columns: "
            "means over the RL steps (rm/* measured against the verifier on every step's "
            "rollouts; the verifier arm has no RM: n/a); ± is the std over seeds."
        )
        return [repro_lib.markdown_table(["arm", *cols], rows), notes], {"rm": rm_info, **data}

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
    parser = repro_lib.parser(__doc__, out="runs/repro/inversion_training", seeds="0")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args(argv)
    arm_list = repro_lib.select_arms(parser, args.arms, ARMS)
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
