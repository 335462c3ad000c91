"""Multi-stage zero-variance elimination (ZVE): the host-side stages, measurable and switchable.

A prompt whose G rollouts all get the same reward is a zero-variance prompt (ZVP): GRPO gives it
zero advantage, so its rollouts are wasted (docs/formulas.md §1.1). Owned here, stage by stage:
  1. Offline: `estimate_pass_rates` (N samples per prompt via `sample_fn`), `PassRateTable` (saved
     at `table_path(dataset)`, keyed by `prompt_id`, tagged with the policy, written atomically,
     never silently replacing another policy's table), `prefilter`, `difficulty`.
  2. Rollout: `zvp_probability` p^G + (1-p)^G, `adaptive_group_sizes` (smallest allowed G with
     ZVP probability <= target, capped, optional budget), `zvp_rate_by_group_size` (the paper's
     Fig. 3 curve), `PassRateHistory` (online per-prompt Beta counts with decay).
  3. Reward: shaping lives in `espo.rewards.shaping`; here it is only measured, by comparing
     `Groups.raw_rewards` (before shaping) with `Groups.rewards`.
  4. Optimisation: `ZveConfig`, `fill_batch`: "resample" refills the batch DAPO-style
     (docs/formulas.md §5) with informative groups, leftovers kept in a buffer; "rl_zvp" keeps
     ZVP groups for `espo.advantages.rl_zvp`; "drop" discards them.

Data: `Groups`, a table of row-aligned host arrays with `group_ids` (the convention of
`espo.types.Rollout` and `espo.batching.TrainBatch`): per-row rewards, validity and any named
payload (tokens, masks, sampler log-probs, router trace...), per-group prompt ids, ages and
verifiability. `generate` returns one table per call, `fill_batch` returns the batch and the
resample buffer as tables, and the buffer checkpoints through `Groups.state_dict()`.

The rules (shared with `espo.advantages.compute`, issue 7):
  * Validity: a sample whose reward call failed (`Groups.valid` False, from Rollout.reward_ok)
    contributes nothing: it is left out of zero-variance detection and of `PassRateHistory`,
    and is counted ("zve/invalid_samples"). A group with fewer than 2 valid samples has no
    signal: it is never informative ("zve/no_signal_groups").
  * Zero-variance is judged on the VERIFIER rewards (`Groups.verifier_rewards`: `raw_rewards`
    before shaping when given, else `rewards`) of the valid samples: max - min <= atol, the test
    of `espo.advantages.compute`, evaluated per group in numpy (`zero_variance_groups`, the one
    implementation; `is_zero_variance` and `is_informative` call it). Shaping breaks ties only
    in the final reward, which the advantage adds centred and unscaled, so a group tied on the
    verifier stays zero-variance for the optimiser: "resample" and "drop" never keep it, and
    "rl_zvp" gives it RL-ZVP (if verifiable). `zve/post_shaping_zvp_rate` still measures the
    ties left in the shaped rewards.
  * A sample "passes" when its verifier reward is > `success_threshold` (default 0, RL-ZVP's
    "correct"). Unverifiable groups (`Groups.verifiable` False, e.g. a judge's rewards, which
    are relative) have no pass rate and do not update `PassRateHistory`.
  * Resample carry-over is off by default (`max_carry_over_steps=0`, as in DAPO). When on, an
    informative group generated beyond a full batch waits in the buffer for at most
    `max_carry_over_steps` later batches. `Groups.ages` counts the optimiser steps between its
    sampling and the batch that uses it (0: sampled for this batch; in the buffer: the age it
    will have in the next batch). Its payload rows are the ones the sampler produced, so a
    carried group is an OFF-POLICY sample, `age` updates old: its tokens, sampler log-probs and
    router trace are those of the policy `age` steps back. What the trainer does with that
    (`espo.train_step.prepare`): with `train.old_logps="recompute"` (default) pi_old is
    recomputed with the CURRENT parameters (replaying the old router trace), so the importance
    ratio and its clip are against the current policy and the `age`-step drift between the
    behaviour policy and pi_old is not corrected; with `train.old_logps="sampler"` pi_old is
    the stored sampler log-probs, i.e. the behaviour policy itself, so the ratio corrects (and
    the clip bounds) that drift. Either way the `mismatch/*` metrics of a carried row include
    `age` steps of policy change, not only the sampler/trainer numerics.
Metric keys start with "zve/"; a ratio is omitted when its denominator is 0 (counts never are).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from espo import errors

Prompt = Any  # a prompt record: text, or a JSON-like mapping from a dataset row
FORMAT = "espo.pass_rates.v1"


@dataclasses.dataclass(frozen=True)
class ZveMode:
    """What the optimiser stage (`fill_batch`) and the advantage do with zero-variance groups."""

    resamples: bool = False  # draw more prompts for the groups it discards (DAPO), in rounds
    keeps_zero_variance: bool = False  # they stay in the batch (else they are discarded)
    rl_zvp: bool = False  # and the advantage gives the verifiable ones RL-ZVP token advantages


ZVE_MODES: dict[str, ZveMode] = {
    "resample": ZveMode(resamples=True),
    "rl_zvp": ZveMode(keeps_zero_variance=True, rl_zvp=True),
    "drop": ZveMode(),
}
PREFILTER_MODES = ("off", "drop", "downweight")


def prompt_id(prompt: Prompt) -> str:
    """A stable id: the first 16 hex digits of the sha256 of the text (or canonical JSON)."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def zero_variance_groups(
    rewards: np.ndarray,
    *,
    group_ids: np.ndarray,
    num_groups: int,
    valid: np.ndarray | None = None,
    atol: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray]:
    """(zero_variance bool [P], num_valid int64 [P]) of ragged groups given as flat rows [N].

    A group is zero-variance when its valid rewards all lie within `atol` of each other
    (max - min, in float32 as `espo.advantages.compute`), or when it has fewer than 2 valid
    rewards (no spread at all; `num_valid` tells the two apart). Invalid entries may hold
    anything (NaN): they are never read. A NaN among the valid rewards is a spread (not zero).
    """
    rewards = np.asarray(rewards, np.float32)  # [N]
    ids = np.asarray(group_ids, np.int64)  # [N]
    ok = np.ones(rewards.shape, bool) if valid is None else np.asarray(valid, bool)  # [N]
    num_valid = np.bincount(ids[ok], minlength=num_groups)  # [P]
    hi = np.full(num_groups, -np.inf, np.float32)  # [P]
    lo = np.full(num_groups, np.inf, np.float32)  # [P]
    np.maximum.at(hi, ids[ok], rewards[ok])  # np.maximum propagates NaN, as np.ptp does
    np.minimum.at(lo, ids[ok], rewards[ok])
    with np.errstate(invalid="ignore"):  # inf - inf: valid rewards all +inf (or all -inf)
        spread = hi - lo  # [P]
    return (num_valid < 2) | (spread <= atol), num_valid


def is_zero_variance(
    rewards: np.ndarray, *, atol: float = 1e-6, valid: np.ndarray | None = None
) -> bool:
    """`zero_variance_groups` of one group's rewards [G]: True also for < 2 valid samples."""
    ids = np.zeros(np.shape(rewards), np.int64)  # [G] one group
    return bool(
        zero_variance_groups(rewards, group_ids=ids, num_groups=1, valid=valid, atol=atol)[0][0]
    )


def is_informative(groups: Groups, *, atol: float = 1e-6) -> np.ndarray:
    """bool [P]: >= 2 valid samples whose verifier rewards differ by more than atol (signal)."""
    zero, _ = zero_variance_groups(
        groups.verifier_rewards, group_ids=groups.group_ids, num_groups=groups.num_groups,
        valid=groups.valid, atol=atol,
    )  # fmt: skip
    return ~zero


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
        bad = {k: v for k, v in self.pass_rates.items() if not 0.0 <= v <= 1.0}
        errors.check(
            self,
            {
                "policy_tag": (
                    isinstance(self.policy_tag, str) and self.policy_tag,
                    "a non-empty str",
                ),
                "num_samples": (
                    errors.is_int(self.num_samples) and self.num_samples >= 1,
                    "an int >= 1",
                ),
                "pass_rates": (not bad, f"rates in [0, 1]; not {bad}"),
            },
        )

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
        # vars, not dataclasses.asdict: asdict deep-copies pass_rates, which fails on a read-only
        # Mapping (a MappingProxyType cannot be pickled); dict() makes any Mapping JSON-able.
        state = dict(vars(self), format=FORMAT, pass_rates=dict(self.pass_rates))
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


def predicted_zero_variance(rates: np.ndarray | float, *, low: float, high: float) -> np.ndarray:
    """The pre-filter's rule, for `prefilter` and the trainer's prompt stream alike: a prompt whose
    known pass rate is <= low or >= high is predicted to give a zero-variance group; an unknown
    rate (NaN) never is."""
    rates = np.asarray(rates, np.float64)
    return ~np.isnan(rates) & ((rates <= low) | (rates >= high))


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
        raise errors.InvalidValue("prefilter", "mode", mode, f"one of {PREFILTER_MODES}")
    rates = np.array([table.pass_rates.get(id_fn(p), np.nan) for p in prompts], np.float64)
    known = ~np.isnan(rates)
    flagged = predicted_zero_variance(rates, low=low, high=high)  # [P]
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
        errors.check(
            self,
            {
                "decay": (lambda: 0.0 < self.decay <= 1.0, "(0, 1]"),
                "prior": (lambda: len(self.prior) == 2 and min(self.prior) > 0, "two counts > 0"),
            },
        )

    @classmethod
    def from_table(cls, table: PassRateTable, **kwargs: Any) -> PassRateHistory:
        """Seeded with the offline estimate: rate * N passes, (1 - rate) * N failures."""
        n = table.num_samples
        counts = {k: [r * n, (1.0 - r) * n] for k, r in table.pass_rates.items()}
        return cls(success_threshold=table.success_threshold, counts=counts, **kwargs)

    def update(self, groups: Groups) -> None:
        """Adds each group's passes and failures: verifier rewards of its valid samples only.

        Groups are visited in order (a prompt twice in `groups` decays twice). Unverifiable
        groups (a judge's relative rewards) and groups with no valid sample are skipped: they
        say nothing about the prompt's pass rate.
        """
        P, ids, valid = groups.num_groups, groups.group_ids, groups.valid
        passed = (groups.verifier_rewards > self.success_threshold) & valid  # [N]
        passes = np.bincount(ids, weights=passed, minlength=P)  # [P]
        num_valid = np.bincount(ids, weights=valid, minlength=P)  # [P]
        for pid, verifiable, p, n in zip(
            groups.prompt_ids, groups.verifiable, passes, num_valid, strict=True
        ):
            if not verifiable or n == 0:
                continue
            c = self.counts.setdefault(pid, [0.0, 0.0])
            c[0] = self.decay * c[0] + float(p)
            c[1] = self.decay * c[1] + float(n - p)

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


def _zve_rules(c: ZveConfig) -> dict[str, tuple]:
    """field -> (is it valid, what is valid) of `c` for `errors.check`; lambdas are evaluated in
    order, so a rule may read a field checked before it (a str where a number belongs: a
    TypeError, invalid)."""
    is_int = errors.is_int
    return {
        "mode": (lambda: c.mode in ZVE_MODES, f"one of {tuple(ZVE_MODES)}"),
        "max_resample_rounds": (is_int(c.max_resample_rounds) and c.max_resample_rounds >= 0,
                                "an int >= 0"),
        "oversample": (lambda: c.oversample >= 1.0, "a float >= 1"),
        "max_oversample": (lambda: c.max_oversample >= c.oversample, "a float >= oversample"),
        "max_carry_over_steps": (is_int(c.max_carry_over_steps) and c.max_carry_over_steps >= 0,
                                 "an int >= 0"),
        "atol": (lambda: c.atol >= 0, "a float >= 0"),
        "prefilter": (lambda: c.prefilter in PREFILTER_MODES, f"one of {PREFILTER_MODES}"),
        "prefilter_low": (lambda: 0 <= c.prefilter_low < 1, "[0, 1)"),
        "prefilter_high": (lambda: c.prefilter_low < c.prefilter_high <= 1, "(prefilter_low, 1]"),
        "prefilter_downweight": (lambda: 0 <= c.prefilter_downweight <= 1, "[0, 1]"),
        "pass_rate_table": (isinstance(c.pass_rate_table, str), "a path, or '' (none)"),
        "group_size": (is_int(c.group_size) and c.group_size >= 1, "an int >= 1"),
        "max_group_size": (lambda: is_int(c.max_group_size) and c.max_group_size >= c.group_size,
                           "an int >= group_size"),
        "zvp_target": (lambda: 0 < c.zvp_target < 1, "(0, 1)"),
        "rollout_budget": (c.rollout_budget is None
                           or (is_int(c.rollout_budget) and c.rollout_budget >= 1),
                           "None or an int >= 1"),
    }  # fmt: skip


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
    # A PassRateTable file (`espo.pass_rates`) that seeds a fresh run's pass-rate history, so
    # the pre-filter and adaptive G act from the first step; "": the online history alone.
    pass_rate_table: str = ""
    group_size: int = 8  # rollout stage: G of well-mixed and unknown prompts (g_min)
    max_group_size: int = 8  # rollout stage: adaptive G cap (g_max); == group_size: fixed G
    zvp_target: float = 0.5  # rollout stage: largest acceptable p^G + (1-p)^G
    rollout_budget: int | None = None  # rollout stage: cap on sum(G) per batch; None: no cap

    def __post_init__(self) -> None:
        errors.check(self, _zve_rules(self))

    def group_sizes(self, pass_rates: Sequence[float | None] | np.ndarray) -> np.ndarray:
        """The rollout-stage G of each prompt (NaN / None: unknown prompt, gets group_size)."""
        g = dict(g_min=self.group_size, g_max=self.max_group_size, budget=self.rollout_budget)
        return adaptive_group_sizes(pass_rates, zvp_target=self.zvp_target, **g)


def _row_major(x: np.ndarray | None, n: int, dtype, name: str) -> np.ndarray | None:
    if x is None:
        return None
    x = np.asarray(x, dtype)
    if x.shape != (n,):
        raise ValueError(f"Groups.{name} has shape {x.shape}; need ({n},), one per row")
    return x


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Groups:
    """Groups of rollouts as row-aligned host arrays: what the ZVE stages and the trainer share.

    The convention of `espo.types.Rollout` / `espo.batching.TrainBatch`: row r belongs to group
    `group_ids[r]` in 0..P-1; here rows are also group-major (the rows of a group adjacent, the
    groups in id order, every group non-empty), as a Rollout's are. Per-group fields are indexed
    by group id. `rows` holds any named per-row payload [N, ...] (tokens, masks, sampler
    log-probs, router trace...); every selection (`take`, `concat`) moves it with its rows, so a
    group never loses the arrays of the policy that sampled it. Host numpy only, never jitted.
    """

    prompt_ids: tuple[str, ...]  # [P] the prompt of each group
    group_ids: np.ndarray  # int32 [N] 0..P-1, non-decreasing
    rewards: np.ndarray  # float32 [N] final rewards (after shaping)
    raw_rewards: np.ndarray | None = None  # float32 [N] verifier, before shaping; None: rewards
    valid: np.ndarray | None = None  # bool [N] reward call succeeded (reward_ok); None: all
    verifiable: np.ndarray | None = None  # bool [P] False: relative rewards (a judge); None: all
    ages: np.ndarray | None = None  # int64 [P] optimiser steps since sampling; None: all 0
    # float32 [N] the verifier's own rewards when raw_rewards are not (a reward model's scores,
    # the shuffled-reward control): what train/accuracy measures; None: raw_rewards are.
    true_rewards: np.ndarray | None = None
    rows: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)  # [N, ...] payload

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)  # normalise the frozen fields
        set_("prompt_ids", tuple(str(p) for p in self.prompt_ids))
        P, ids = len(self.prompt_ids), np.asarray(self.group_ids, np.int32)  # [N]
        n = ids.shape[0] if ids.ndim == 1 else -1
        in_range = n > 0 and ids.min() >= 0 and ids.max() < P
        sizes = np.bincount(ids, minlength=P) if in_range else np.zeros(P, np.int64)  # [P]
        if not (n == P == 0 or (in_range and (sizes >= 1).all() and (np.diff(ids) >= 0).all())):
            raise ValueError(
                f"Groups.group_ids={ids!r:.120} invalid: need [N] ids 0..{P - 1} (P = "
                f"len(prompt_ids)), non-decreasing, every group with >= 1 row"
            )
        set_("group_ids", ids)
        set_("rewards", _row_major(self.rewards, n, np.float32, "rewards"))
        set_("raw_rewards", _row_major(self.raw_rewards, n, np.float32, "raw_rewards"))
        set_("true_rewards", _row_major(self.true_rewards, n, np.float32, "true_rewards"))
        valid = np.ones(n, bool) if self.valid is None else self.valid
        set_("valid", _row_major(valid, n, bool, "valid"))
        for name, dtype, default in (("verifiable", bool, True), ("ages", np.int64, 0)):
            value = (
                np.full(P, default, dtype) if getattr(self, name) is None else getattr(self, name)
            )
            value = np.asarray(value, dtype)
            if value.shape != (P,):
                raise ValueError(
                    f"Groups.{name} has shape {value.shape}; need ({P},), one per group"
                )
            set_(name, value)
        if (self.ages < 0).any():
            raise errors.InvalidValue("Groups", "ages", self.ages, "ints >= 0")
        rows = {k: np.asarray(v) for k, v in self.rows.items()}
        bad = {k: v.shape for k, v in rows.items() if v.ndim == 0 or v.shape[0] != n}
        if bad:
            raise ValueError(f"Groups.rows {bad} are not row-aligned: need [N={n}, ...] arrays")
        set_("rows", rows)

    @classmethod
    def of(
        cls,
        *,
        prompt_ids: Sequence[str],
        rewards: Sequence[np.ndarray],
        raw_rewards: Sequence[np.ndarray] | None = None,
        valid: Sequence[np.ndarray] | None = None,
        true_rewards: Sequence[np.ndarray] | None = None,
        rows: Mapping[str, Sequence[np.ndarray]] | None = None,
        **per_group: Any,
    ) -> Groups:
        """The table of ragged groups given one array per group (`rewards[p]` [G_p] ...);
        `per_group` are the per-group fields (verifiable, ages)."""
        sizes = [np.size(r) for r in rewards]
        cat = lambda xs: None if xs is None else np.concatenate([np.ravel(x) for x in xs])
        empty = np.zeros(0, np.float32)
        return cls(
            prompt_ids=tuple(prompt_ids),
            group_ids=np.repeat(np.arange(len(sizes)), sizes),
            rewards=cat(rewards) if sizes else empty,
            raw_rewards=cat(raw_rewards) if sizes else None,
            valid=cat(valid) if sizes else None,
            true_rewards=cat(true_rewards) if sizes else None,
            rows={k: np.concatenate(v) for k, v in (rows or {}).items()},
            **per_group,
        )

    @classmethod
    def empty(cls) -> Groups:
        return cls(prompt_ids=(), group_ids=np.zeros(0, np.int32), rewards=np.zeros(0))

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_rows(self) -> int:
        return self.group_ids.shape[0]

    @property
    def group_sizes(self) -> np.ndarray:
        """int64 [P] rows of each group (its G)."""
        return np.bincount(self.group_ids, minlength=self.num_groups)

    @property
    def verifier_rewards(self) -> np.ndarray:
        """float32 [N]: the rewards before shaping (`raw_rewards`, else `rewards`)."""
        return self.rewards if self.raw_rewards is None else self.raw_rewards

    @property
    def measured_rewards(self) -> np.ndarray:
        """float32 [N]: the verifier's own rewards (`true_rewards`, else `verifier_rewards`)."""
        return self.verifier_rewards if self.true_rewards is None else self.true_rewards

    def take(self, groups: Sequence[int] | np.ndarray) -> Groups:
        """The groups `groups` (ids, in that order) with their rows, renumbered 0..len-1."""
        index = np.asarray(groups, np.int64).reshape(-1)  # [P']
        sizes = self.group_sizes
        starts = np.cumsum(sizes) - sizes  # [P] first row of each group
        rows = np.concatenate([np.arange(starts[g], starts[g] + sizes[g]) for g in index] or
                              [np.zeros(0, np.int64)])  # fmt: skip
        pick = lambda x: None if x is None else x[rows]
        return Groups(
            prompt_ids=tuple(self.prompt_ids[g] for g in index),
            group_ids=np.repeat(np.arange(index.size), sizes[index]),
            rewards=self.rewards[rows],
            raw_rewards=pick(self.raw_rewards),
            true_rewards=pick(self.true_rewards),
            valid=self.valid[rows],
            verifiable=self.verifiable[index],
            ages=self.ages[index],
            rows={k: v[rows] for k, v in self.rows.items()},
        )

    @staticmethod
    def concat(tables: Sequence[Groups]) -> Groups:
        """The groups of every table in order, renumbered; tables without groups are skipped
        (an empty buffer has no payload names). The others must share their `rows` names."""
        tables = [t for t in tables if t.num_groups]
        if not tables:
            return Groups.empty()
        if len(tables) == 1:
            return tables[0]
        names = {tuple(sorted(t.rows)) for t in tables}
        if len(names) > 1:
            raise ValueError(f"Groups.concat: tables with different payload rows {sorted(names)}")
        offsets = np.cumsum([0] + [t.num_groups for t in tables[:-1]])
        cat = lambda f: np.concatenate([f(t) for t in tables])
        raw = any(t.raw_rewards is not None for t in tables)
        true = any(t.true_rewards is not None for t in tables)
        return Groups(
            prompt_ids=sum((t.prompt_ids for t in tables), ()),
            group_ids=np.concatenate(
                [t.group_ids + o for t, o in zip(tables, offsets, strict=True)]
            ),
            rewards=cat(lambda t: t.rewards),
            raw_rewards=cat(lambda t: t.verifier_rewards) if raw else None,
            true_rewards=cat(lambda t: t.measured_rewards) if true else None,
            valid=cat(lambda t: t.valid),
            verifiable=cat(lambda t: t.verifiable),
            ages=cat(lambda t: t.ages),
            rows={k: cat(lambda t, k=k: t.rows[k]) for k in tables[0].rows},
        )

    def state_dict(self) -> dict[str, Any]:
        """Numpy arrays and plain python (`espo.checkpoint.arrays_to_json` makes it JSON)."""
        names = ("group_ids", "rewards", "raw_rewards", "true_rewards", "valid", "verifiable")
        names += ("ages",)
        return dict(
            prompt_ids=list(self.prompt_ids),
            **{k: getattr(self, k) for k in names},
            rows=dict(self.rows),
        )

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Groups:
        return cls(**dict(state, prompt_ids=tuple(state["prompt_ids"]), rows=dict(state["rows"])))


class _CallStats(NamedTuple):
    """What the metrics need of one generate call (its payload is not kept for them)."""

    num_groups: int
    num_rows: int
    informative: np.ndarray  # bool [P]
    num_valid: np.ndarray  # int64 [P]
    shaped_zero: np.ndarray | None  # bool [P] ties in the shaped rewards; None: no raw rewards


@dataclasses.dataclass(frozen=True, kw_only=True)
class FillResult:
    batch: Groups  # the optimiser's batch, at most batch_size groups, ids 0..P-1
    buffer: Groups  # leftovers for the next call, ages = their age in the next batch
    metrics: dict[str, float]


def fill_batch(
    *,
    prompts: Iterator[Prompt],
    generate: Callable[[list[Prompt], np.ndarray], Groups],
    batch_size: int,
    group_size: int | Callable[[list[Prompt]], Sequence[int]],
    config: ZveConfig,
    buffer: Groups | None = None,
    history: PassRateHistory | None = None,
) -> FillResult:
    """One optimiser batch of `batch_size` groups under `config.mode`.

    `generate(prompts, group_sizes)` returns one `Groups` table with group p = prompts[p] of
    group_sizes[p] rows (its ages are ignored: new groups have age 0); `group_size` is a fixed G
    or a callback prompts -> [G] (e.g. `config.group_sizes` of the history's pass rates).
    Buffered leftovers fill the batch first. "resample" then draws
    missing * clip(1 / informative rate so far, oversample, max_oversample) prompts per round for
    at most 1 + max_resample_rounds calls, keeps informative groups only, and buffers the extra;
    a batch still short is returned short (never padded with ZVP groups) and reported. "rl_zvp"
    and "drop" make one call for the missing prompts; "drop" discards groups that are not
    informative, "rl_zvp" keeps them (the advantage gives them RL-ZVP, or 0 without signal).
    "Informative" is `is_informative`: judged on verifier rewards of valid samples (see the
    module docstring). The batch is one table (buffered groups first, then the new ones in
    generation order, ids renumbered), each group's `ages` the steps since it was sampled.
    `history` is updated in place with every newly generated group, ZVP groups included,
    buffered ones not again.
    """
    if not errors.is_int(batch_size) or batch_size < 1:
        raise errors.InvalidValue("", "batch_size", batch_size, "an int >= 1")
    buffer = Groups.empty() if buffer is None else buffer
    limit = config.max_carry_over_steps
    fresh = np.flatnonzero(buffer.ages <= limit)  # a buffered group's age is its age now
    older = lambda t: dataclasses.replace(t, ages=t.ages + 1)
    parts = [buffer.take(fresh[:batch_size])]  # the batch, in order
    waiting = older(buffer.take(fresh[batch_size:]))
    leftovers, made = [], []  # informative groups generated beyond the batch; every new table
    stats: list[_CallStats] = []
    num_batch = parts[0].num_groups
    mode = ZVE_MODES[config.mode]
    resample = mode.resamples
    calls, drawn_total, exhausted = 0, 0, False
    max_calls = 1 + config.max_resample_rounds if resample else 1
    while num_batch < batch_size and calls < max_calls and not exhausted:
        generated = sum(c.num_groups for c in stats)
        rate = sum(c.informative.sum() for c in stats) / generated if generated else 1.0
        factor = min(config.max_oversample, max(config.oversample, 1 / max(rate, 1e-9)))
        n = math.ceil((batch_size - num_batch) * (factor if resample else 1.0))
        drawn = list(itertools.islice(prompts, n))
        exhausted = len(drawn) < n
        if not drawn:
            break
        drawn_total += len(drawn)
        sizes = np.asarray(group_size(drawn) if callable(group_size) else [group_size] * len(drawn))
        out = generate(drawn, sizes)
        calls += 1
        if out.num_groups != len(drawn):
            raise ValueError(f"generate returned {out.num_groups} groups for {len(drawn)} prompts")
        if not np.array_equal(out.group_sizes, sizes):
            raise ValueError(f"generate returned group sizes {out.group_sizes} for G={sizes}")
        out = dataclasses.replace(out, ages=np.zeros(out.num_groups, np.int64))
        made.append(out)
        zero, num_valid = zero_variance_groups(
            out.verifier_rewards, group_ids=out.group_ids, num_groups=out.num_groups,
            valid=out.valid, atol=config.atol,
        )  # fmt: skip
        shaped = None
        if out.raw_rewards is not None:  # a measurement of the reward stage only
            shaped = zero_variance_groups(
                out.rewards, group_ids=out.group_ids, num_groups=out.num_groups,
                valid=out.valid, atol=config.atol,
            )[0]  # fmt: skip
        stats.append(_CallStats(out.num_groups, out.num_rows, ~zero, num_valid, shaped))
        kept = np.flatnonzero(np.ones_like(zero) if mode.keeps_zero_variance else ~zero)
        room = batch_size - num_batch
        parts.append(out.take(kept[:room]))
        leftovers.append(out.take(kept[room:]))
        num_batch += min(room, kept.size)
    if history is not None:  # after the loop: adaptive G and the prompts see the old history
        for out in made:
            history.update(out)
    batch = Groups.concat(parts)
    aged = Groups.concat([waiting, *(older(t) for t in leftovers)])  # ages in the next batch
    carried = aged.take(np.flatnonzero(aged.ages <= limit))  # the rest is too old (or limit 0)
    num_generated = sum(c.num_groups for c in stats)
    num_informative = int(sum(c.informative.sum() for c in stats))
    rollouts = sum(c.num_rows for c in stats)
    metrics = {
        "zve/generate_calls": float(calls),
        "zve/prompts_drawn": float(drawn_total),
        "zve/prompts_exhausted": float(exhausted),
        "zve/carried_in": float(parts[0].num_groups),
        "zve/carried_out": float(carried.num_groups),
        "zve/buffer_dropped": float(
            buffer.num_groups - fresh.size + aged.num_groups - carried.num_groups
        ),
        "zve/batch_groups": float(batch.num_groups),
        "zve/batch_fill_fraction": batch.num_groups / batch_size,
        "zve/groups_generated": float(num_generated),
        "zve/rollouts_generated": float(rollouts),
        "zve/informative_groups_generated": float(num_informative),
        "zve/invalid_samples": float(rollouts - sum(c.num_valid.sum() for c in stats)),
        "zve/no_signal_groups": float(sum((c.num_valid < 2).sum() for c in stats)),
    }
    if num_generated:
        metrics["zve/rollout_zvp_rate"] = 1.0 - num_informative / num_generated  # verifier
        shaped = [c.shaped_zero for c in stats if c.shaped_zero is not None]
        if shaped:  # ties left in the shaped rewards, over the calls that gave raw rewards
            metrics["zve/post_shaping_zvp_rate"] = float(np.concatenate(shaped).mean())
    if num_informative:
        metrics["zve/rollouts_per_informative_group"] = rollouts / num_informative
    if batch.num_groups:
        # The verifier part of the advantage is 0 on these; rl_zvp gives verifiable ones RL-ZVP.
        batch_zvp = ~is_informative(batch, atol=config.atol)  # [P]
        metrics["zve/optimizer_zvp_rate"] = float(batch_zvp.mean())
        zero_rows = batch.group_sizes[batch_zvp].sum()
        metrics["zve/zero_advantage_rollout_fraction"] = float(zero_rows / batch.num_rows)
    return FillResult(batch=batch, buffer=carried, metrics=metrics)
