"""Rewards from a learned reward model in training: save / load a Bradley–Terry RM, score every
rollout with it, and turn a group's scores into rewards (`reward.model_path`, `reward.model_mode`).

This module owns the trainer's reward-model path (docs/formulas.md §1.5). Modes:
  * "naive":    r = the RM score. GRPO's group normalisation blows the RM's noise up to
                unit-size advantages of random sign wherever rollouts are equally good.
  * "adjusted": r = `reward_model.adjust_rewards(scores, correct=verifier)`: correctness tiers
                from the verifier, RM gaps below `dead_zone` are ties, ranks inside a tier.
  * "judge":    the round-robin Better / Tie / Worse rewards (`judge.judge_groups`) of a
                pairwise judge that prefers the higher RM score and calls gaps <= `dead_zone`
                ties (the paper's judge with an explicit Tie class, backed by the RM).
The verifier's rewards still measure the run (train/accuracy, evals, the curriculum) and define
the true quality the inversion metrics compare with: `rm/inversion_rate` (share of rollouts whose
group-normalised reward has the wrong sign against correctness, a rollout of a group whose
rollouts are all equally correct counting when its advantage is nonzero,
`reward_model.inversion_rate`), `rm/inversion_rate_mixed` (the same over groups that mix correct
and wrong rollouts), `rm/sign_agreement` and `rm/pair_accuracy` (the share of (correct, wrong)
pairs of a group that the raw RM score orders right: the RM's own noise).

An RM directory holds `reward_model.json` (format, the backbone's ModelConfig) and `params/`
(orbax). `save` refuses to overwrite one; `load` names the file and key of what is wrong.
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
from espo.rewards import judge
from espo.rewards import reward_model as rm

FORMAT = "espo.reward_model.v1"
MODES = ("naive", "adjusted", "judge")  # how scores become rewards (RewardConfig.model_mode)
MANIFEST = "reward_model.json"


def save(directory: str | pathlib.Path, cfg: model.ModelConfig, params: dict) -> pathlib.Path:
    """Writes an RM (`reward_model.init_reward_model`'s tree) to a new directory."""
    directory = pathlib.Path(directory).absolute()
    if (directory / MANIFEST).exists():
        raise FileExistsError(
            f"{directory} already holds a reward model; delete it or pick another"
        )
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", jax.device_get(params))
    manifest = {"format": FORMAT, "model_config": dataclasses.asdict(cfg)}
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
    model_mode: str = "adjusted"  # how its scores become rewards: naive | adjusted | judge
    # RM score gaps below it are ties (adjusted, judge)
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
    """(backbone ModelConfig, params) of an RM written by `save`."""
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
    abstract = jax.eval_shape(lambda: rm.init_reward_model(cfg, jax.random.key(0)))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(directory / "params", abstract)
    return cfg, params


def make_scorer(cfg: model.ModelConfig, *, chunk: int = 256):
    """`score(params, tokens [N, T], mask [N, T]) -> np.ndarray [N]` for any N, in chunks of
    `chunk` rows (the last one padded with copies of row 0), so every call shares one compile."""
    fn = jax.jit(lambda p, t, m: rm.reward_scores(cfg, p, t, attention_mask=m)[0])

    def score(params, tokens, mask):
        n = len(tokens)
        fill = lambda x: np.concatenate([x, np.repeat(x[:1], -n % chunk, axis=0)])
        tokens, mask = fill(np.asarray(tokens)), fill(np.asarray(mask, bool))
        out = [fn(params, tokens[i : i + chunk], mask[i : i + chunk]) for i in range(0, n, chunk)]
        return np.concatenate([np.asarray(o) for o in out])[:n].astype(np.float32)

    return score


def group_rewards(
    scores: np.ndarray, correct: np.ndarray, *, mode: str, dead_zone: float
) -> np.ndarray:
    """Rewards [P, G] of RM scores [P, G] (float32) and verifier correctness [P, G] in `mode`."""
    scores = np.asarray(scores, np.float32)
    if mode == "naive":
        return scores
    if mode == "adjusted":
        cfg = rm.RmAdjustConfig(dead_zone=dead_zone)
        return np.asarray(_adjust(jnp.asarray(scores), correct=jnp.asarray(correct, bool), cfg=cfg))
    if mode == "judge":
        return judge.judge_groups(list(scores), judge.FakeJudge(tie_tol=dead_zone)).rewards
    raise errors.InvalidValue("reward model", "mode", mode, f"one of {MODES}")


_adjust = jax.jit(rm.adjust_rewards, static_argnames="cfg")


def inversion_metrics(
    rewards: np.ndarray, scores: np.ndarray, correct: np.ndarray
) -> dict[str, float]:
    """rm/* of groups [P, G] (see the module docstring); sums, so callers can pool sizes."""
    q = np.asarray(correct, np.float32)  # [P, G] true quality
    adv = np.asarray(advantages.group_normalized(rewards))  # [P, G]
    mixed = q.max(-1) > q.min(-1)  # [P]
    inv = lambda a, t: float(rm.inversion_rate(a, true_quality=t)) * a.size if a.size else 0.0
    ordered = q[:, :, None] > q[:, None, :]  # [P, G, G] i correct, j wrong
    decided = np.abs(q - q.mean(-1, keepdims=True)) > 1e-6  # [P, G] not of mean quality
    return {
        "rollouts": float(q.size),
        "inverted": inv(adv, q),
        "mixed_rollouts": float(q[mixed].size),
        "mixed_inverted": inv(adv[mixed], q[mixed]),
        "decided": float(decided.sum()),
        "agreeing": float(rm.sign_agreement_rate(adv, true_quality=q)) * float(decided.sum()),
        "pairs": float(ordered.sum()),
        "pairs_right": float((ordered & (scores[:, :, None] > scores[:, None, :])).sum()),
    }


@dataclasses.dataclass
class RewardModelRewards:
    """The trainer's RM stage: rollout rows -> rewards [N], verifiable flags [P], rm/* metrics."""

    cfg: model.ModelConfig
    params: dict
    mode: str
    dead_zone: float

    def __post_init__(self):
        self.score = make_scorer(self.cfg)

    @classmethod
    def load(cls, directory: str, *, mode: str, dead_zone: float) -> RewardModelRewards:
        cfg, params = load(directory)
        return cls(cfg=cfg, params=params, mode=mode, dead_zone=dead_zone)

    def __call__(
        self, tokens: np.ndarray, mask: np.ndarray, group_ids: np.ndarray, correct: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """Rows [N, T] (prompt and completion), group ids [N] (group-major), correctness [N].

        Groups of one size go through `group_rewards` together (adaptive G gives several).
        "adjusted" rewards keep absolute correctness (their groups stay verifiable, RL-ZVP may
        apply); naive scores and judge rewards are relative (never verifiable).
        """
        scores = self.score(self.params, tokens, mask)  # [N]
        group_ids = np.asarray(group_ids)
        num_groups = int(group_ids.max()) + 1
        sizes = np.bincount(group_ids, minlength=num_groups)  # [P]
        starts = np.cumsum(sizes) - sizes  # [P]
        rewards = np.zeros_like(scores)  # [N]
        totals: dict[str, float] = {}
        for g in np.unique(sizes):
            rows = (starts[sizes == g][:, None] + np.arange(g)).ravel()  # [P_g * g]
            s, c = scores[rows].reshape(-1, g), np.asarray(correct)[rows].reshape(-1, g)
            r = group_rewards(s, c, mode=self.mode, dead_zone=self.dead_zone)  # [P_g, g]
            rewards[rows] = r.ravel()
            for k, v in inversion_metrics(r, s, c).items():
                totals[k] = totals.get(k, 0.0) + v
        ratio = lambda a, b: totals[a] / totals[b] if totals[b] else 0.0
        metrics = {
            "rm/score_mean": float(scores.mean()),
            "rm/inversion_rate": ratio("inverted", "rollouts"),
            "rm/inversion_rate_mixed": ratio("mixed_inverted", "mixed_rollouts"),
            "rm/sign_agreement": ratio("agreeing", "decided"),
            "rm/pair_accuracy": ratio("pairs_right", "pairs"),
        }
        verifiable = np.full(num_groups, self.mode == "adjusted")  # [P]
        return rewards, verifiable, metrics
