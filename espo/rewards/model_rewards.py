"""Rewards from a learned reward model in training: save / load a Bradley–Terry RM, score every
rollout with it, and turn a group's scores into rewards (`reward.model_path`, `reward.model_mode`).

This module owns the trainer's reward-model path (docs/formulas.md §1.5). Modes:
  * "naive":    r = the RM score. GRPO's group normalisation blows the RM's noise up to
                unit-size advantages of random sign wherever rollouts are equally good.
  * "dead_zone": r = `reward_model.adjust_rewards(scores, correct=None, tiered=False)`: RM
                gaps below `dead_zone` are ties, ranks in the group; the verifier is not read.
  * "adjusted": r = `reward_model.adjust_rewards(scores, correct=verifier)`: correctness tiers
                from the verifier, RM gaps below `dead_zone` are ties, ranks inside a tier.
  * "judge":    the round-robin Better / Tie / Worse rewards (`judge.judge_groups`) of a
                pairwise judge: a trained one (`pair_judge`, a saved model of kind
                "pairwise", both orders of every pair), or, for a scalar RM, one that prefers
                the higher RM score and calls gaps <= `dead_zone` ties.
The verifier's rewards still measure the run (train/accuracy, evals, the curriculum) and define
the true quality the inversion metrics compare with: `rm/inversion_rate` (share of rollouts whose
group-normalised reward has the wrong sign against correctness, a rollout of a group whose
rollouts are all equally correct counting when its advantage is nonzero,
`reward_model.inversion_rate`), `rm/inversion_rate_mixed` (the same over groups that mix correct
and wrong rollouts), `rm/pair_inversion_tied` / `rm/pair_inversion_diff` (over a group's pairs
of equal / different correctness: advantages of opposite signs / the wrong rollout's above the
right one's), `rm/sign_agreement` and `rm/pair_accuracy` (the share of (correct, wrong) pairs of
a group that the raw RM score, or a trained judge's round-robin score, orders right: the
model's own noise).

A model directory holds `reward_model.json` (format, kind "scalar" or "pairwise", the backbone's
ModelConfig) and `params/` (orbax). `save` refuses to overwrite one; `load` names the file and
key of what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from espo import advantages, errors, model
from espo.rewards import judge, pair_judge
from espo.rewards import reward_model as rm

FORMAT = "espo.reward_model.v1"
# How scores become rewards (RewardConfig.model_mode).
MODES = ("naive", "dead_zone", "adjusted", "judge")
MANIFEST = "reward_model.json"
# What a saved model is: a scalar BT RM, or a pairwise Better / Tie / Worse judge.
KINDS = {"scalar": rm.init_reward_model, "pairwise": pair_judge.init_pair_judge}


def save(
    directory: str | pathlib.Path, cfg: model.ModelConfig, params: dict, *, kind: str = "scalar"
) -> pathlib.Path:
    """Writes an RM (`reward_model.init_reward_model`'s tree, kind "scalar") or a pair judge
    (`pair_judge.init_pair_judge`'s, kind "pairwise") to a new directory."""
    if kind not in KINDS:
        raise errors.InvalidValue("model_rewards.save", "kind", kind, " | ".join(KINDS))
    directory = pathlib.Path(directory).absolute()
    if (directory / MANIFEST).exists():
        raise FileExistsError(
            f"{directory} already holds a reward model; delete it or pick another"
        )
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", jax.device_get(params))
    manifest = {"format": FORMAT, "kind": kind, "model_config": dataclasses.asdict(cfg)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    return directory


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Reward shaping weights (L_max of the overlong penalty is the stage's max_new_tokens)."""

    overlong_weight: float = 1.0
    overlong_cache_fraction: float = 0.5
    repetition_weight: float = 0.0
    ngram_size: int = 4
    repetition_threshold: float = 0.0
    function: str = ""  # "module:name" of a reward fn(prompt, completion, meta) -> float
    model_path: str = ""  # a saved reward model (espo.rewards.model_rewards) scoring rollouts
    # how its scores become rewards: naive | dead_zone | adjusted | judge (a pairwise judge:
    # judge only)
    model_mode: str = "adjusted"
    # RM score gaps below it are ties (dead_zone, adjusted, judge with a scalar RM)
    model_dead_zone: float = rm.DEFAULT_DEAD_ZONE
    # A control: the rewards of each rollout call permuted over its rows (a policy that learns
    # from them learns from something other than the reward); metrics keep the true rewards.
    shuffle: bool = False

    def __post_init__(self):
        frac = self.overlong_cache_fraction
        dz = self.model_dead_zone
        spec = re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.function or "x:y")
        errors.check(
            self,
            {
                "overlong_cache_fraction": (errors.is_real(frac) and 0 < frac <= 1, "in (0, 1]"),
                "function": (
                    isinstance(self.function, str) and spec is not None,
                    "'' (the data source's verifier) or 'module:name'",
                ),
                "model_path": (isinstance(self.model_path, str), "a directory or ''"),
                "model_mode": (
                    self.model_mode in MODES,
                    " | ".join(MODES),
                ),
                "model_dead_zone": (errors.is_real(dz) and dz >= 0, ">= 0"),
                "shuffle": (isinstance(self.shuffle, bool), "True or False"),
            },
        )


def load(directory: str | pathlib.Path) -> tuple[model.ModelConfig, dict]:
    """(backbone ModelConfig, params) of a model written by `save` (`kind` tells which)."""
    cfg, what = _manifest(directory)
    return cfg, _restore(directory, cfg, what)


def _restore(directory: str | pathlib.Path, cfg: model.ModelConfig, what: str) -> dict:
    abstract = jax.eval_shape(lambda: KINDS[what](cfg, jax.random.key(0)))
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(pathlib.Path(directory).absolute() / "params", abstract)


def kind(directory: str | pathlib.Path) -> str:
    """ "scalar" (a BT reward model) or "pairwise" (a pair judge) of a model written by `save`."""
    return _manifest(directory)[1]


def _manifest(directory: str | pathlib.Path) -> tuple[model.ModelConfig, str]:
    directory = pathlib.Path(directory).absolute()
    path = directory / MANIFEST
    if not path.is_file():
        valid = "a reward model directory (write one with model_rewards.save)"
        raise errors.CheckpointError(str(directory), MANIFEST, valid=valid)
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise errors.CheckpointError(str(path), "format", manifest.get("format"), repr(FORMAT))
    fields = dict(manifest["model_config"])
    fields["dense_layers"] = tuple(fields.get("dense_layers", ()))
    try:
        cfg = model.ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: key model_config: {e}") from None
    what = manifest.get("kind", "scalar")  # written before pair judges: a scalar RM
    if what not in KINDS:
        raise errors.CheckpointError(str(path), "kind", what, " | ".join(KINDS))
    return cfg, what


def make_scorer(cfg: model.ModelConfig, *, chunk: int = 256):
    """`score(params, tokens [N, T], mask [N, T]) -> np.ndarray [N]` for any N, in chunks of
    `chunk` rows (the last one padded with copies of row 0), so every call shares one compile."""
    fn = jax.jit(lambda p, t, m: rm.reward_scores(cfg, p, t, attention_mask=m)[0])
    apply = rm.chunked(fn, chunk=chunk)
    return lambda params, tokens, mask: apply(params, tokens, mask).astype(np.float32)


def group_rewards(
    scores: np.ndarray, correct: np.ndarray, *, mode: str, dead_zone: float
) -> np.ndarray:
    """Rewards [P, G] of RM scores [P, G] (float32) and verifier correctness [P, G] in `mode`."""
    scores = np.asarray(scores, np.float32)
    if mode == "naive":
        return scores
    if mode == "dead_zone":
        cfg = rm.RmAdjustConfig(tiered=False, dead_zone=dead_zone)
        return np.asarray(_adjust(jnp.asarray(scores), correct=None, cfg=cfg))
    if mode == "adjusted":
        cfg = rm.RmAdjustConfig(dead_zone=dead_zone)
        return np.asarray(_adjust(jnp.asarray(scores), correct=jnp.asarray(correct, bool), cfg=cfg))
    if mode == "judge":
        return judge.judge_groups(list(scores), judge.FakeJudge(tie_tol=dead_zone)).rewards
    raise errors.InvalidValue("reward model", "mode", mode, f"one of {MODES}")


_adjust = jax.jit(rm.adjust_rewards, static_argnames="cfg")


def inversion_metrics(
    rewards: np.ndarray, preference: np.ndarray, correct: np.ndarray
) -> dict[str, float]:
    """rm/* of groups [P, G] (see the module docstring); sums, so callers can pool sizes.

    preference [P, G, G]: > 0 where the model prefers rollout i to rollout j (a scalar RM:
    s_i - s_j; a judge: its round-robin score of i against j)."""
    q = np.asarray(correct, np.float32)  # [P, G] true quality
    adv = np.asarray(advantages.group_normalized(rewards))  # [P, G]
    mixed = q.max(-1) > q.min(-1)  # [P]
    inv = lambda a, t: float(rm.inversion_rate(a, true_quality=t)) * a.size if a.size else 0.0
    ordered = q[:, :, None] > q[:, None, :]  # [P, G, G] i correct, j wrong
    G = q.shape[-1]
    tied = np.triu(np.ones((G, G), bool), k=1) & (q[:, :, None] == q[:, None, :])  # [P, G, G]
    decided = np.abs(q - q.mean(-1, keepdims=True)) > 1e-6  # [P, G] not of mean quality
    per_pair = lambda f, n: float(f(adv, true_quality=q)) * float(n)
    return {
        "rollouts": float(q.size),
        "inverted": inv(adv, q),
        "mixed_rollouts": float(q[mixed].size),
        "mixed_inverted": inv(adv[mixed], q[mixed]),
        "decided": float(decided.sum()),
        "agreeing": float(rm.sign_agreement_rate(adv, true_quality=q)) * float(decided.sum()),
        "pairs": float(ordered.sum()),
        "pairs_right": float((ordered & (np.asarray(preference) > 0)).sum()),
        "pairs_inverted": per_pair(rm.pairwise_inversion_rate, ordered.sum()),
        "tied_pairs": float(tied.sum()),
        "tied_split": per_pair(rm.tied_pair_split_rate, tied.sum()),
    }


@dataclasses.dataclass
class RewardModelRewards:
    """The trainer's RM stage: rollout rows -> rewards [N], verifiable flags [P], rm/* metrics."""

    cfg: model.ModelConfig
    params: dict
    mode: str
    dead_zone: float
    kind: str = "scalar"  # "pairwise": a trained pair judge (mode "judge" only)

    def __post_init__(self):
        if self.kind == "pairwise" and self.mode != "judge":
            raise errors.InvalidValue(
                "reward", "model_mode", self.mode, "judge (the model is a pairwise judge)"
            )
        if self.kind == "pairwise":
            self.judge = pair_judge.ModelJudge(self.cfg, self.params)
        else:
            self.score = make_scorer(self.cfg)

    @classmethod
    def load(cls, directory: str, *, mode: str, dead_zone: float) -> RewardModelRewards:
        cfg, what = _manifest(directory)  # read once: the config and the kind
        params = _restore(directory, cfg, what)
        return cls(cfg=cfg, params=params, mode=mode, dead_zone=dead_zone, kind=what)

    def __call__(
        self, tokens: np.ndarray, mask: np.ndarray, group_ids: np.ndarray, correct: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """Rows [N, T] (prompt and completion), group ids [N] (group-major), correctness [N].

        Groups of one size go through `group_rewards` (or the judge) together (adaptive G gives
        several). "adjusted" rewards keep absolute correctness (their groups stay verifiable,
        RL-ZVP may apply); the other modes' rewards are relative (never verifiable).
        """
        tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
        scores = None if self.kind == "pairwise" else self.score(self.params, tokens, mask)
        group_ids = np.asarray(group_ids)
        num_groups = int(group_ids.max()) + 1
        sizes = np.bincount(group_ids, minlength=num_groups)  # [P]
        starts = np.cumsum(sizes) - sizes  # [P]
        rewards = np.zeros(len(group_ids), np.float32)  # [N]
        totals: dict[str, float] = {}
        for g in np.unique(sizes):
            rows = (starts[sizes == g][:, None] + np.arange(g)).reshape(-1, g)  # [P_g, g]
            c = np.asarray(correct)[rows]  # [P_g, g]
            if scores is None:  # a trained judge: both orders of every pair
                groups = [[(tokens[i], mask[i]) for i in group] for group in rows]
                judged = judge.judge_groups(groups, self.judge, both_orders=True)
                r, preference = judged.rewards, judged.pair_scores
                for k in ("judge/comparisons", "judge/ties"):
                    totals[k] = totals.get(k, 0.0) + judged.metrics[k]
            else:
                s = scores[rows]  # [P_g, g]
                r = group_rewards(s, c, mode=self.mode, dead_zone=self.dead_zone)
                preference = s[:, :, None] - s[:, None, :]  # [P_g, g, g]
            rewards[rows.ravel()] = np.asarray(r).ravel()
            for k, v in inversion_metrics(r, preference, c).items():
                totals[k] = totals.get(k, 0.0) + v
        ratio = lambda a, b: totals[a] / totals[b] if totals[b] else 0.0
        metrics = {
            "rm/inversion_rate": ratio("inverted", "rollouts"),
            "rm/inversion_rate_mixed": ratio("mixed_inverted", "mixed_rollouts"),
            "rm/pair_inversion_tied": ratio("tied_split", "tied_pairs"),
            "rm/pair_inversion_diff": ratio("pairs_inverted", "pairs"),
            "rm/sign_agreement": ratio("agreeing", "decided"),
            "rm/pair_accuracy": ratio("pairs_right", "pairs"),
        }
        if scores is None:
            metrics["rm/judge_tie_rate"] = ratio("judge/ties", "judge/comparisons")
        else:
            metrics["rm/score_mean"] = float(scores.mean())
        verifiable = np.full(num_groups, self.mode == "adjusted")  # [P]
        return rewards, verifiable, metrics
