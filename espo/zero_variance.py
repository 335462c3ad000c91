"""Multi-stage zero-variance elimination (ZVE): the host-side stages, measurable and switchable.

A prompt whose G rollouts all get the same reward is a zero-variance prompt (ZVP): GRPO gives it
zero advantage, so its rollouts are wasted (papers.md §1.1). Owned here, stage by stage:
  1. Offline: `estimate_pass_rates` (N samples per prompt via `sample_fn`), `PassRateTable` (saved
     at `table_path(dataset)`, keyed by `prompt_id`, tagged with the policy, written atomically,
     never silently replacing another policy's table), `prefilter`, `difficulty`.
  2. Rollout: `zvp_probability` p^G + (1-p)^G, `adaptive_group_sizes` (smallest allowed G with
     ZVP probability <= target, capped, optional budget), `zvp_rate_by_group_size` (the paper's
     Fig. 3 curve), `PassRateHistory` (online per-prompt Beta counts with decay).
  3. Reward: shaping lives in `espo.rewards.shaping`; here it is only measured, by comparing
     `Group.raw_rewards` (before shaping) with `Group.rewards`.
  4. Optimisation: `ZveConfig`, `fill_batch`: "resample" refills the batch DAPO-style (§5) with
     informative groups, leftovers kept in a `ResampleBuffer`; "rl_zvp" keeps ZVP groups for
     `espo.advantages.rl_zvp`; "drop" discards them.

The rules (shared with `espo.advantages.compute`, issue 7):
  * Validity: a sample whose reward call failed (`Group.valid` False, from Rollout.reward_ok)
    contributes nothing: it is left out of zero-variance detection and of `PassRateHistory`,
    and is counted ("zve/invalid_samples"). A group with fewer than 2 valid samples has no
    signal: it is never informative ("zve/no_signal_groups").
  * Zero-variance is judged on the VERIFIER rewards (`Group.verifier_rewards`: `raw_rewards`
    before shaping when given, else `rewards`) of the valid samples: max - min <= atol, the test
    of `espo.advantages.compute`, evaluated in numpy since groups live on the host with ragged
    G. Shaping breaks ties only in the final reward, which the advantage adds centred and
    unscaled, so a group tied on the verifier stays zero-variance for the optimiser: "resample"
    and "drop" never keep it, and "rl_zvp" gives it RL-ZVP (if verifiable).
    `zve/post_shaping_zvp_rate` still measures the ties left in the shaped rewards.
  * A sample "passes" when its verifier reward is > `success_threshold` (default 0, RL-ZVP's
    "correct"). Unverifiable groups (`Group.verifiable` False, e.g. a judge's rewards, which
    are relative) have no pass rate and do not update `PassRateHistory`.
  * Resample carry-over is off by default (`max_carry_over_steps=0`, as in DAPO). When on, a
    group carried into a later batch has `Group.age` = the optimiser steps since it was sampled
    (0: sampled for this batch); its payload keeps the old log-probs and router trace of the
    policy that sampled it, so the trainer's importance ratios are against that behaviour
    policy (an off-policy sample by `age` steps), not the current pi_old.
Metric keys start with "zve/"; a ratio is omitted when its denominator is 0 (counts never are).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

Prompt = Any  # a prompt record: text, or a JSON-like mapping from a dataset row
FORMAT = "espo.pass_rates.v1"
ZVE_MODES = ("resample", "rl_zvp", "drop")
PREFILTER_MODES = ("off", "drop", "downweight")


def prompt_id(prompt: Prompt) -> str:
    """A stable id: the first 16 hex digits of the sha256 of the text (or canonical JSON)."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def is_zero_variance(
    rewards: np.ndarray, *, atol: float = 1e-6, valid: np.ndarray | None = None
) -> bool:
    """True when the valid rewards all lie within `atol` of each other (max - min).

    No spread at all (fewer than 2 valid samples) also counts as True here; `is_informative`
    tells the two apart. Invalid entries may hold anything (NaN): they are never read.
    """
    rewards = np.asarray(rewards, np.float32)  # [G]
    if valid is not None:
        rewards = rewards[np.asarray(valid, bool)]  # host numpy: ragged is fine
    return bool(rewards.size < 2 or np.ptp(rewards) <= atol)


def is_informative(group: Group, *, atol: float = 1e-6) -> bool:
    """>= 2 valid samples whose verifier rewards differ by more than atol (GRPO has signal)."""
    return not is_zero_variance(group.verifier_rewards, atol=atol, valid=group.valid_mask)


# ---------------------------------------------------------------- stage 1: offline pre-filter


def table_path(dataset_path: str | os.PathLike) -> pathlib.Path:
    """Where the pass-rate table of a dataset file lives: `<dataset>.pass_rates.json`."""
    return pathlib.Path(f"{os.fspath(dataset_path)}.pass_rates.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassRateTable:
    """Per-prompt pass rates estimated with `num_samples` samples of the policy `policy_tag`."""

    policy_tag: str  # the checkpoint / policy that produced the samples
    num_samples: int  # N samples per prompt
    pass_rates: Mapping[str, float]  # prompt_id -> fraction of the N samples that passed
    success_threshold: float = 0.0  # a sample passed when its reward is > this

    def __post_init__(self) -> None:
        if not isinstance(self.policy_tag, str) or not self.policy_tag:
            raise ValueError(f"PassRateTable.policy_tag={self.policy_tag!r}; need a non-empty str")
        if not _is_int(self.num_samples) or self.num_samples < 1:
            raise ValueError(f"PassRateTable.num_samples={self.num_samples!r}; need an int >= 1")
        bad = {k: v for k, v in self.pass_rates.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"PassRateTable.pass_rates must lie in [0, 1]; got {bad}")

    def save(self, path: str | os.PathLike, *, overwrite_other_tag: bool = False) -> None:
        """Writes atomically (temp file + os.replace); refuses to replace another policy's table."""
        path = pathlib.Path(path)
        if path.exists() and not overwrite_other_tag:
            old = PassRateTable.load(path)
            if old.policy_tag != self.policy_tag:
                raise FileExistsError(
                    f"{path} holds pass rates of policy_tag={old.policy_tag!r}, not "
                    f"{self.policy_tag!r}; delete it or pass overwrite_other_tag=True"
                )
        state = dict(dataclasses.asdict(self), format=FORMAT, pass_rates=dict(self.pass_rates))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> PassRateTable:
        state = json.loads(pathlib.Path(path).read_text())
        if not isinstance(state, dict) or state.pop("format", None) != FORMAT:
            raise ValueError(f"{path} is not a pass-rate table (expected format {FORMAT!r})")
        return cls(**state)


def estimate_pass_rates(
    prompts: Sequence[Prompt],
    *,
    sample_fn: Callable[[list[Prompt], int], np.ndarray],
    num_samples: int,
    policy_tag: str,
    batch_size: int = 64,
    success_threshold: float = 0.0,
    existing: PassRateTable | None = None,
    id_fn: Callable[[Prompt], str] = prompt_id,
) -> PassRateTable:
    """Pass rate of each distinct prompt from `sample_fn(prompt_batch, N) -> rewards [P, N]`;
    prompts already in `existing` (same tag and N) are skipped, so an estimate can resume."""
    rates, key = dict(existing.pass_rates) if existing else {}, (policy_tag, num_samples)
    if existing and (existing.policy_tag, existing.num_samples) != key:
        raise ValueError(f"existing table is {existing.policy_tag!r}, N={existing.num_samples}")
    unique = {id_fn(p): p for p in prompts}
    todo = [(pid, p) for pid, p in unique.items() if pid not in rates]
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        rewards = np.asarray(sample_fn([p for _, p in chunk], num_samples), np.float32)  # [P, N]
        if rewards.shape != (len(chunk), num_samples):
            raise ValueError(f"sample_fn gave {rewards.shape}; need {(len(chunk), num_samples)}")
        passed = (rewards > success_threshold).mean(axis=1)  # [P]
        rates.update((pid, float(r)) for (pid, _), r in zip(chunk, passed, strict=True))
    kwargs = dict(policy_tag=policy_tag, num_samples=num_samples, pass_rates=rates)
    return PassRateTable(success_threshold=success_threshold, **kwargs)


def difficulty(pass_rate: float | np.ndarray) -> float | np.ndarray:
    """1 - pass_rate: 0 for prompts the policy always solves, 1 for never (the curriculum key)."""
    return 1.0 - pass_rate


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefilterResult:
    prompts: list[Prompt]  # the kept prompts, in input order
    weights: np.ndarray  # float64 [P'] unnormalised sampling weights (1 or `downweight`)
    metrics: dict[str, float]


def prefilter(
    prompts: Sequence[Prompt],
    table: PassRateTable,
    *,
    mode: str = "drop",
    low: float = 0.0,
    high: float = 1.0,
    downweight: float = 0.1,
    id_fn: Callable[[Prompt], str] = prompt_id,
) -> PrefilterResult:
    """Drops (or gives weight `downweight`) prompts whose pass rate is <= low or >= high.

    Prompts missing from the table are kept with weight 1 and counted as unknown. mode="off"
    keeps everything at weight 1 and only measures.
    """
    if mode not in PREFILTER_MODES:
        raise ValueError(f"prefilter mode={mode!r}; valid: {PREFILTER_MODES}")
    rates = np.array([table.pass_rates.get(id_fn(p), np.nan) for p in prompts], np.float64)
    known = ~np.isnan(rates)
    flagged = known & ((rates <= low) | (rates >= high))  # [P] predicted zero-variance
    keep = ~flagged if mode == "drop" else np.ones_like(flagged)
    weights = np.where(flagged & (mode == "downweight"), downweight, 1.0)[keep]
    n = max(len(prompts), 1)
    metrics = {
        "zve/prefilter_flagged_fraction": float(flagged.sum() / n),
        "zve/prefilter_removed_fraction": float((~keep).sum() / n),
        "zve/prefilter_unknown_fraction": float((~known).sum() / n),
    }
    kept = [p for p, k in zip(prompts, keep, strict=True) if k]
    return PrefilterResult(prompts=kept, weights=weights, metrics=metrics)


# ---------------------------------------------------------------- stage 2: rollout


def zvp_probability(pass_rate: float | np.ndarray, group_size: int | np.ndarray) -> np.ndarray:
    """p^G + (1-p)^G: the chance that G independent samples all pass or all fail."""
    p = np.asarray(pass_rate, np.float64)
    return p**group_size + (1.0 - p) ** group_size


def adaptive_group_sizes(
    pass_rates: Sequence[float | None] | np.ndarray,
    *,
    g_min: int,
    g_max: int,
    zvp_target: float = 0.5,
    allowed: Sequence[int] | None = None,
    default: int | None = None,
    budget: int | None = None,
) -> np.ndarray:
    """int64 [P]: per prompt, the smallest allowed G with p^G + (1-p)^G <= zvp_target.

    Allowed sizes default to the multiples of g_min up to g_max (plus g_max); prompts none of
    them satisfies (p near 0 or 1) get the largest. Unknown prompts (None / NaN) get `default`
    (g_min). With `budget`, while sum(G) > budget the largest G (first one on ties) steps down
    to the next smaller allowed size; a budget below P * min(allowed) is a ValueError.
    """
    if not 1 <= g_min <= g_max:
        raise ValueError(f"need 1 <= g_min <= g_max; got g_min={g_min}, g_max={g_max}")
    if allowed is None:
        allowed = [*range(g_min, g_max + 1, g_min), g_max]
    sizes = np.array(sorted({int(g) for g in allowed if g_min <= g <= g_max}), np.int64)  # [S]
    if sizes.size == 0:
        raise ValueError(f"allowed={allowed} has no size in [g_min={g_min}, g_max={g_max}]")
    default = g_min if default is None else default  # not validated: any G the caller wants
    p = np.array([np.nan if r is None else r for r in pass_rates], np.float64)  # [P]
    ok = zvp_probability(p[:, None], sizes[None, :]) <= zvp_target  # [P, S]
    first = np.where(ok.any(axis=1), ok.argmax(axis=1), sizes.size - 1)  # [P]
    out = np.where(np.isnan(p), default, sizes[first])  # [P]
    if budget is not None:
        if budget < out.size * sizes[0]:
            raise ValueError(f"budget={budget} < P * min size = {out.size} * {sizes[0]}")
        while out.sum() > budget:
            i = int(out.argmax())
            out[i] = sizes[sizes < out[i]].max()
    return out


def zvp_rate_by_group_size(
    rewards_by_prompt: Sequence[np.ndarray] | np.ndarray,
    *,
    group_sizes: Sequence[int] | None = None,
    atol: float = 1e-6,
) -> dict[int, float]:
    """{g: fraction of prompts whose first g rewards are zero-variance}, over prompts with >= g.

    Samples are i.i.d., so the first g of a group are a fair size-g group. Prefix rates never
    increase with g (a prefix with two distinct rewards stays so). Default g: 2..max G.
    """
    groups = [np.asarray(r, np.float32) for r in rewards_by_prompt]
    if group_sizes is None:
        group_sizes = range(2, max((r.size for r in groups), default=1) + 1)
    zero = {
        g: [is_zero_variance(r[:g], atol=atol) for r in groups if r.size >= g] for g in group_sizes
    }
    return {int(g): float(np.mean(z)) for g, z in zero.items() if z}


@dataclasses.dataclass(kw_only=True)
class PassRateHistory:
    """Online per-prompt pass rate: Beta(prior + decayed pass / fail counts), mutable host state.

    Each `update` of a prompt first multiplies its counts by `decay` (1: plain counts; < 1: an
    EMA over that prompt's visits), then adds its passes and failures. `pass_rates` gives the
    posterior means. Checkpoint it with `state_dict()` / `from_state_dict()` (plain JSON).
    """

    decay: float = 1.0  # per-visit forgetting factor in (0, 1]
    prior: tuple[float, float] = (0.5, 0.5)  # Beta prior pseudo-counts (passes, failures)
    success_threshold: float = 0.0  # a sample passed when its reward is > this
    counts: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # id -> [pass, fail]

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"PassRateHistory.decay={self.decay!r}; valid: (0, 1]")
        if len(self.prior) != 2 or min(self.prior) <= 0:
            raise ValueError(f"PassRateHistory.prior={self.prior!r}; valid: two counts > 0")

    @classmethod
    def from_table(cls, table: PassRateTable, **kwargs: Any) -> PassRateHistory:
        """Seeded with the offline estimate: rate * N passes, (1 - rate) * N failures."""
        n = table.num_samples
        counts = {k: [r * n, (1.0 - r) * n] for k, r in table.pass_rates.items()}
        return cls(success_threshold=table.success_threshold, counts=counts, **kwargs)

    def update(self, groups: Sequence[Group]) -> None:
        """Adds each group's passes and failures: verifier rewards of its valid samples only.

        Unverifiable groups (a judge's relative rewards) and groups with no valid sample are
        skipped: they say nothing about the prompt's pass rate.
        """
        for group in groups:
            valid = group.valid_mask
            if not group.verifiable or not valid.any():
                continue
            passed = np.asarray(group.verifier_rewards) > self.success_threshold  # [G]
            passes = float((passed & valid).sum())
            c = self.counts.setdefault(group.prompt_id, [0.0, 0.0])
            c[0] = self.decay * c[0] + passes
            c[1] = self.decay * c[1] + (float(valid.sum()) - passes)

    def pass_rates(self, prompt_ids: Sequence[str]) -> np.ndarray:
        """float64 [P] posterior means; NaN for prompts never seen."""
        a, b = self.prior
        out = [self.counts.get(k) for k in prompt_ids]
        return np.array([np.nan if c is None else (c[0] + a) / (sum(c) + a + b) for c in out])

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PassRateHistory:
        counts = {k: [float(x) for x in v] for k, v in state["counts"].items()}
        return cls(**dict(state, prior=tuple(state["prior"]), counts=counts))


# ---------------------------------------------------------------- stage 4: optimisation


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# field -> (is valid given (config, value), what is valid); checked in ZveConfig.__post_init__.
_ZVE_RULES: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "mode": (lambda c, v: v in ZVE_MODES, f"one of {ZVE_MODES}"),
    "max_resample_rounds": (lambda c, v: _is_int(v) and v >= 0, "an int >= 0"),
    "oversample": (lambda c, v: v >= 1.0, "a float >= 1"),
    "max_oversample": (lambda c, v: v >= c.oversample, "a float >= oversample"),
    "max_carry_over_steps": (lambda c, v: _is_int(v) and v >= 0, "an int >= 0"),
    "atol": (lambda c, v: v >= 0, "a float >= 0"),
    "prefilter": (lambda c, v: v in PREFILTER_MODES, f"one of {PREFILTER_MODES}"),
    "prefilter_low": (lambda c, v: 0 <= v < 1, "[0, 1)"),
    "prefilter_high": (lambda c, v: c.prefilter_low < v <= 1, "(prefilter_low, 1]"),
    "prefilter_downweight": (lambda c, v: 0 <= v <= 1, "[0, 1]"),
    "group_size": (lambda c, v: _is_int(v) and v >= 1, "an int >= 1"),
    "max_group_size": (lambda c, v: _is_int(v) and v >= c.group_size, "an int >= group_size"),
    "zvp_target": (lambda c, v: 0 < v < 1, "(0, 1)"),
    "rollout_budget": (lambda c, v: v is None or (_is_int(v) and v >= 1), "None or an int >= 1"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZveConfig:
    """The `zve` config section: one switch per stage (the reward stage is ShapingConfig)."""

    mode: str = "rl_zvp"  # optimiser stage: "resample" (DAPO refill), "rl_zvp" or "drop"
    max_resample_rounds: int = 4  # resample: generate calls allowed after the first, per batch
    oversample: float = 1.0  # resample: prompts drawn per round >= missing groups * this
    max_oversample: float = 4.0  # resample: cap of the adaptive factor 1 / informative rate
    max_carry_over_steps: int = 0  # resample: later steps a leftover may fill; 0 (DAPO): none
    atol: float = 1e-6  # rewards within atol (max - min) make a zero-variance group
    prefilter: str = "drop"  # offline stage: "off", "drop" or "downweight"
    prefilter_low: float = 0.0  # pass rates <= this are flagged (never solved)
    prefilter_high: float = 1.0  # pass rates >= this are flagged (always solved)
    prefilter_downweight: float = 0.1  # sampling weight of flagged prompts in "downweight"
    group_size: int = 8  # rollout stage: G of well-mixed and unknown prompts (g_min)
    max_group_size: int = 8  # rollout stage: adaptive G cap (g_max); == group_size: fixed G
    zvp_target: float = 0.5  # rollout stage: largest acceptable p^G + (1-p)^G
    rollout_budget: int | None = None  # rollout stage: cap on sum(G) per batch; None: no cap

    def __post_init__(self) -> None:
        for name, (is_valid, valid) in _ZVE_RULES.items():
            value = getattr(self, name)
            try:
                ok = is_valid(self, value)
            except TypeError:  # e.g. a str where a number belongs
                ok = False
            if not ok:
                raise ValueError(f"ZveConfig.{name}={value!r}; valid: {valid}")

    def group_sizes(self, pass_rates: Sequence[float | None] | np.ndarray) -> np.ndarray:
        """The rollout-stage G of each prompt (NaN / None: unknown prompt, gets group_size)."""
        g = dict(g_min=self.group_size, g_max=self.max_group_size, budget=self.rollout_budget)
        return adaptive_group_sizes(pass_rates, zvp_target=self.zvp_target, **g)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Group:
    """The G rollouts of one prompt, as the ZVE stages see them."""

    prompt_id: str
    rewards: np.ndarray  # float32 [G] final rewards (after shaping)
    raw_rewards: np.ndarray | None = None  # float32 [G] verifier rewards, before shaping
    valid: np.ndarray | None = None  # bool [G] reward call succeeded (reward_ok); None: all
    verifiable: bool = True  # False: rewards without absolute correctness (a judge)
    age: int = 0  # optimiser steps since sampling; > 0 only for carried-over resample groups
    payload: Any = None  # opaque: tokens, old log-probs, entropies, router trace (of its policy)

    def __post_init__(self) -> None:
        shape = np.shape(self.rewards)
        for name in ("raw_rewards", "valid"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != shape:
                raise ValueError(f"Group.{name} has shape {np.shape(value)}; need {shape}")
        if not _is_int(self.age) or self.age < 0:
            raise ValueError(f"Group.age={self.age!r}; valid: an int >= 0")

    @property
    def group_size(self) -> int:
        return int(np.size(self.rewards))

    @property
    def verifier_rewards(self) -> np.ndarray:
        """float32 [G]: the rewards before shaping (`raw_rewards`, else `rewards`)."""
        return self.rewards if self.raw_rewards is None else self.raw_rewards

    @property
    def valid_mask(self) -> np.ndarray:
        """bool [G]: `valid`, or all True."""
        if self.valid is None:
            return np.ones(self.group_size, bool)
        return np.asarray(self.valid, bool)

    @property
    def shaping(self) -> np.ndarray:
        """float32 [G]: rewards - verifier rewards (what `espo.advantages.compute` centres)."""
        return np.asarray(self.rewards, np.float32) - np.asarray(self.verifier_rewards, np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResampleBuffer:
    """Informative groups generated beyond a batch, with their ages in steps (explicit state)."""

    groups: tuple[Group, ...] = ()
    ages: tuple[int, ...] = ()  # steps each group has waited

    def state_dict(self) -> dict[str, Any]:
        return dict(groups=[dict(vars(g)) for g in self.groups], ages=list(self.ages))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ResampleBuffer:
        groups = tuple(_group(**g) for g in state["groups"])
        return cls(groups=groups, ages=tuple(int(a) for a in state["ages"]))


def _group(*, prompt_id, rewards, raw_rewards=None, valid=None, **kwargs) -> Group:
    raw = None if raw_rewards is None else np.asarray(raw_rewards, np.float32)
    valid = None if valid is None else np.asarray(valid, bool)
    rewards = np.asarray(rewards, np.float32)
    return Group(prompt_id=prompt_id, rewards=rewards, raw_rewards=raw, valid=valid, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FillResult:
    groups: list[Group]  # the optimiser's batch, at most batch_size groups
    buffer: ResampleBuffer  # leftovers for the next call
    metrics: dict[str, float]


def fill_batch(
    *,
    prompts: Iterator[Prompt],
    generate: Callable[[list[Prompt], np.ndarray], Sequence[Group | np.ndarray]],
    batch_size: int,
    group_size: int | Callable[[list[Prompt]], Sequence[int]],
    config: ZveConfig,
    buffer: ResampleBuffer | None = None,
    history: PassRateHistory | None = None,
    id_fn: Callable[[Prompt], str] = prompt_id,
) -> FillResult:
    """One optimiser batch of `batch_size` groups under `config.mode`.

    `generate(prompts, group_sizes)` returns one Group (or rewards array [G]) per prompt;
    `group_size` is a fixed G or a callback prompts -> [G] (e.g. `config.group_sizes` of the
    history's pass rates). Buffered leftovers fill the batch first. "resample" then draws
    missing * clip(1 / informative rate so far, oversample, max_oversample) prompts per round for
    at most 1 + max_resample_rounds calls, keeps informative groups only, and buffers the extra;
    a batch still short is returned short (never padded with ZVP groups) and reported. "rl_zvp"
    and "drop" make one call for the missing prompts; "drop" discards groups that are not
    informative, "rl_zvp" keeps them (the advantage gives them RL-ZVP, or 0 without signal).
    "Informative" is `is_informative`: judged on verifier rewards of valid samples (see the
    module docstring). Groups served from the buffer come back with `age` set to the steps since
    they were sampled. `history` is updated in place with every newly generated group, ZVP
    groups included, buffered ones not again.
    """
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; valid: an int >= 1")
    buffer = buffer or ResampleBuffer()
    limit = config.max_carry_over_steps
    fresh = [(g, a) for g, a in zip(buffer.groups, buffer.ages, strict=True) if a < limit]
    # A leftover buffered at age 0 was sampled one optimiser step before this batch.
    batch = [dataclasses.replace(g, age=a + 1) for g, a in fresh[:batch_size]]
    waiting = fresh[batch_size:]
    leftovers, generated = [], []  # informative groups beyond the batch; every new group
    informative_of: dict[int, bool] = {}  # id(group) -> is_informative, computed once
    informative = lambda g: informative_of.setdefault(id(g), is_informative(g, atol=config.atol))
    resample = config.mode == "resample"
    calls, drawn_total, exhausted = 0, 0, False
    max_calls = 1 + config.max_resample_rounds if resample else 1
    while len(batch) < batch_size and calls < max_calls and not exhausted:
        num_informative = sum(informative(g) for g in generated)
        rate = num_informative / len(generated) if generated else 1.0  # informative rate so far
        factor = min(config.max_oversample, max(config.oversample, 1 / max(rate, 1e-9)))
        n = math.ceil((batch_size - len(batch)) * (factor if resample else 1.0))
        drawn = list(itertools.islice(prompts, n))
        exhausted = len(drawn) < n
        if not drawn:
            break
        drawn_total += len(drawn)
        sizes = np.asarray(group_size(drawn) if callable(group_size) else [group_size] * len(drawn))
        out = list(generate(drawn, sizes))
        calls += 1
        if len(out) != len(drawn):
            raise ValueError(f"generate returned {len(out)} groups for {len(drawn)} prompts")
        for item, prompt, g in zip(out, drawn, sizes, strict=True):
            if not isinstance(item, Group):
                item = _group(prompt_id=id_fn(prompt), rewards=item)
            if item.group_size != g:
                raise ValueError(f"generate returned {item.group_size} rewards for G={g}")
            generated.append(item)
            if config.mode == "rl_zvp" or informative(item):
                (batch if len(batch) < batch_size else leftovers).append(item)
    if history is not None:
        history.update(generated)
    num_informative = sum(informative(g) for g in generated)
    rollouts = sum(g.group_size for g in generated)
    aged = [(g, a + 1) for g, a in waiting] + [(g, 0) for g in leftovers]
    carried = [(g, a) for g, a in aged if a < limit]  # the rest is too old (or carry-over is off)
    groups, ages = zip(*carried, strict=True) if carried else ((), ())
    num_valid = lambda g: int(g.valid_mask.sum())
    metrics = {
        "zve/generate_calls": float(calls),
        "zve/prompts_drawn": float(drawn_total),
        "zve/prompts_exhausted": float(exhausted),
        "zve/carried_in": float(len(fresh[:batch_size])),
        "zve/carried_out": float(len(carried)),
        "zve/buffer_dropped": float(len(buffer.groups) - len(fresh) + len(aged) - len(carried)),
        "zve/batch_groups": float(len(batch)),
        "zve/batch_fill_fraction": len(batch) / batch_size,
        "zve/groups_generated": float(len(generated)),
        "zve/rollouts_generated": float(rollouts),
        "zve/informative_groups_generated": float(num_informative),
        "zve/invalid_samples": float(sum(g.group_size - num_valid(g) for g in generated)),
        "zve/no_signal_groups": float(sum(num_valid(g) < 2 for g in generated)),
    }
    if generated:
        metrics["zve/rollout_zvp_rate"] = 1.0 - num_informative / len(generated)  # verifier
        if any(g.raw_rewards is not None for g in generated):
            # A measurement of the reward stage only: ties left in the shaped rewards.
            shaped = [is_zero_variance(g.rewards, atol=config.atol, valid=g.valid_mask)
                      for g in generated]  # fmt: skip
            metrics["zve/post_shaping_zvp_rate"] = float(np.mean(shaped))
    if num_informative:
        metrics["zve/rollouts_per_informative_group"] = rollouts / num_informative
    if batch:
        # The verifier part of the advantage is 0 on these; rl_zvp gives verifiable ones RL-ZVP.
        batch_zvp = [not informative(g) for g in batch]
        metrics["zve/optimizer_zvp_rate"] = float(np.mean(batch_zvp))
        zero = sum(g.group_size for g, z in zip(batch, batch_zvp, strict=True) if z)
        metrics["zve/zero_advantage_rollout_fraction"] = zero / sum(g.group_size for g in batch)
    buffer_out = ResampleBuffer(groups=tuple(groups), ages=tuple(ages))
    return FillResult(groups=batch, buffer=buffer_out, metrics=metrics)
