"""Pairwise generative-judge rewards: round-robin Better / Tie / Worse within a group.

This module owns the map from a judge's three-way verdicts to rewards, the [INFERRED] reading of
docs/formulas.md §1.5 (the paper's exact formula is unknown): within a group of G responses every
unordered pair {i, j} is judged once, judge(o_i, o_j) in {"better", "tie", "worse"} scores
+1 / 0 / -1 for i and the opposite for j, and r_i is the mean of i's G - 1 scores, in [-1, 1].
A judge may also answer UNPARSEABLE (a generative judge whose completion held no verdict): it
scores as a tie and is counted in the metrics (`judge/unparseable`).

Invariants: responses the judge calls ties get no reward difference from their comparison, and a
group the judge calls all ties gets r = 0 for every response. Rewards sum to 0 over a group.
`both_orders=True` judges each pair in both orders and averages, (s(o_i, o_j) - s(o_j, o_i)) / 2,
cancelling a judge's position bias at twice the calls: recommended for generative judges.

Judge rewards are relative, never absolute correctness: r = 0 means "as good as the rest of the
group", not "wrong". `judge_group` / `judge_groups` therefore return `JudgeScores` whose
`verifiable` flag is False for every group. Judge-only groups with no spread are left to
zero-variance elimination, never RL-ZVP: pass `verifiable` to the advantages (RL-ZVP applies only
where verifiable is True), so an all-tie group is dropped or gets zero advantage instead of being
pushed down as "all wrong". `zero_variance_mask` marks those groups (spread <= 1e-6, the
tolerance of `espo.advantages.zero_variance_mask`).

The judge is any `JudgeFn` (`espo.rewards.generative_judge.GenerativeJudge` for a real model);
a judge with a `judge_pairs(pairs)` method (a `PairJudgeFn`) gets all of a group's comparisons in
one call, so a model judge can batch them. `FakeJudge` is a deterministic stand-in for tests and
experiments.
"""

from __future__ import annotations

import dataclasses
import math as pymath
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from jaxtyping import Bool, Float

from espo import errors

VERDICTS = ("better", "tie", "worse")
UNPARSEABLE = "unparseable"  # a verdict the judge could not read: scored as a tie, counted
_SCORE = {"better": 1.0, "tie": 0.0, "worse": -1.0, UNPARSEABLE: 0.0}
ZERO_VARIANCE_ATOL = 1e-6  # as espo.advantages.zero_variance_mask


class JudgeFn(Protocol):
    """judge(a, b): is response `a` "better" than, a "tie" with, or "worse" than `b`?"""

    def __call__(self, a: Any, b: Any, /) -> str: ...


class PairJudgeFn(JudgeFn, Protocol):
    """A judge that can take many comparisons at once: verdicts[k] = judge(*pairs[k])."""

    def judge_pairs(self, pairs: Sequence[tuple[Any, Any]], /) -> Sequence[str]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeScores:
    """Round-robin judge rewards and what the advantages must know about them.

    Shapes: [G] and [] from `judge_group`, [P, G] and [P] from `judge_groups`.
    """

    rewards: Float[np.ndarray, "*P G"]  # float32 in [-1, 1], summing to 0 over each group
    verifiable: Bool[np.ndarray, "*P"]  # always False: no absolute correctness, never RL-ZVP
    zero_variance_mask: Bool[np.ndarray, "*P"]  # no spread: left to zero-variance elimination
    # float32 [*P, G, G]: score of i against j (+1 better ... -1 worse; both orders averaged),
    # antisymmetric, 0 on the diagonal; r = its row sums / (G - 1).
    pair_scores: Float[np.ndarray, "*P G G"]
    # judge/comparisons (judge calls), judge/unparseable, judge/ties (parsed ties only),
    # judge/zero_variance_groups: counts over the groups judged.
    metrics: Mapping[str, float]


def _verdict_score(verdict: str, *, a_index: int, b_index: int) -> float:
    if verdict not in _SCORE:
        raise ValueError(
            f"judge_fn(responses[{a_index}], responses[{b_index}]) returned {verdict!r}; "
            f"valid verdicts are {VERDICTS} or {UNPARSEABLE!r}"
        )
    return _SCORE[verdict]


def _judge_all(judge_fn: JudgeFn, pairs: list[tuple[Any, Any]]) -> list[str]:
    """Verdicts of `pairs`, in one `judge_pairs` call when the judge has one."""
    if not pairs:
        return []
    judge_pairs = getattr(judge_fn, "judge_pairs", None)
    if judge_pairs is None:
        return [judge_fn(a, b) for a, b in pairs]
    verdicts = list(judge_pairs(pairs))
    if len(verdicts) != len(pairs):
        raise ValueError(
            f"judge_fn.judge_pairs returned {len(verdicts)} verdicts for {len(pairs)} pairs"
        )
    return verdicts


def _round_robin(
    responses: Sequence[Any], judge_fn: JudgeFn, *, both_orders: bool
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Rewards [G], pair scores [G, G] (float32) and counts of one group."""
    G = len(responses)
    index = [(i, j) for i in range(G) for j in range(i + 1, G)]
    if both_orders:
        index += [(j, i) for i, j in index]
    verdicts = _judge_all(judge_fn, [(responses[a], responses[b]) for a, b in index])
    score = {
        (a, b): _verdict_score(v, a_index=a, b_index=b)
        for (a, b), v in zip(index, verdicts, strict=True)
    }
    scores = np.zeros((G, G), np.float64)  # scores[i, j]: i's result against j
    for i, j in index[: G * (G - 1) // 2]:
        s = (score[i, j] - score[j, i]) / 2 if both_orders else score[i, j]
        scores[i, j], scores[j, i] = s, -s
    rewards = scores.sum(1) / max(G - 1, 1)  # G == 1: r = 0, nothing to compare with
    counts = {
        "judge/comparisons": float(len(verdicts)),
        "judge/unparseable": float(sum(v == UNPARSEABLE for v in verdicts)),
        "judge/ties": float(sum(v == "tie" for v in verdicts)),
    }
    return rewards.astype(np.float32), scores.astype(np.float32), counts


def judge_group(
    responses: Sequence[Any], judge_fn: JudgeFn, *, both_orders: bool = False
) -> JudgeScores:
    """Round-robin rewards of one group: r_i = mean_{j != i} score(i vs j), float32 [G].

    score(i vs j) is +1 / 0 / -1 for "better" / "tie" (or UNPARSEABLE) / "worse" from
    judge_fn(o_i, o_j) for i < j (and its negation for j); with both_orders it is
    (s(o_i, o_j) - s(o_j, o_i)) / 2. A group of one response gets r = 0 (nothing to compare
    with). E.g. qualities [3, 1, 2] with an exact judge: s01 = +1, s02 = +1, s12 = -1, so
    r = [(1 + 1) / 2, (-1 - 1) / 2, (-1 + 1) / 2] = [1, -1, 0].
    """
    rewards, pair_scores, counts = _round_robin(responses, judge_fn, both_orders=both_orders)
    zero_var = np.bool_(np.ptp(rewards) <= ZERO_VARIANCE_ATOL)
    return JudgeScores(
        rewards=rewards,
        verifiable=np.bool_(False),
        zero_variance_mask=zero_var,
        pair_scores=pair_scores,
        metrics={**counts, "judge/zero_variance_groups": float(zero_var)},
    )


def judge_groups(
    groups: Sequence[Sequence[Any]], judge_fn: JudgeFn, *, both_orders: bool = False
) -> JudgeScores:
    """`judge_group` over P groups of equal size G: rewards [P, G], flags [P], summed counts."""
    sizes = {len(g) for g in groups}
    if len(sizes) > 1:
        raise ValueError(f"groups must all have the same size G, got sizes {sorted(sizes)}")
    if not sizes:
        raise ValueError("groups is empty: judge_groups needs at least one group")
    one = [judge_group(g, judge_fn, both_orders=both_orders) for g in groups]
    return JudgeScores(
        rewards=np.stack([s.rewards for s in one]),  # [P, G]
        verifiable=np.zeros((len(one),), bool),  # [P]
        zero_variance_mask=np.array([bool(s.zero_variance_mask) for s in one]),  # [P]
        pair_scores=np.stack([s.pair_scores for s in one]),  # [P, G, G]
        metrics={k: float(sum(s.metrics[k] for s in one)) for k in one[0].metrics},
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeJudge:
    """A deterministic judge: compares key(a) with key(b) (numbers), a tie within tie_tol.

    key defaults to `float`, so responses may simply be their (known) qualities.
    """

    tie_tol: float = 0.0  # |key(a) - key(b)| <= tie_tol is a tie
    key: Callable[[Any], float] = float  # the response's quality

    def __post_init__(self) -> None:
        t = self.tie_tol
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < pymath.inf:
            raise errors.InvalidValue("FakeJudge", "tie_tol", t, "in [0, inf)")
        if not callable(self.key):
            raise errors.InvalidValue("FakeJudge", "key", self.key, "callable")

    def __call__(self, a: Any, b: Any, /) -> str:
        diff = self.key(a) - self.key(b)
        if diff > self.tie_tol:
            return "better"
        if diff < -self.tie_tol:
            return "worse"
        return "tie"
