"""Pairwise generative-judge rewards: round-robin Better / Tie / Worse within a group (§1.5).

This module owns the map from a judge's three-way verdicts to rewards, the [INFERRED] reading of
papers.md §1.5 (the paper's exact formula is unknown): within a group of G responses every
unordered pair {i, j} is judged once, judge(o_i, o_j) in {"better", "tie", "worse"} scores
+1 / 0 / -1 for i and the opposite for j, and r_i is the mean of i's G - 1 scores, in [-1, 1].

Invariants: responses the judge calls ties get no reward difference from their comparison, and a
group the judge calls all ties gets r = 0 for every response: a zero-variance group (left to
ZVE, `espo.advantages.zero_variance_mask`), never spurious +/- advantages. Rewards sum to 0 over
a group. `both_orders=True` judges each pair in both orders and averages, cancelling a judge's
position bias at twice the calls.

The judge is any `JudgeFn` (the GenRM in production, a process pool's business); `FakeJudge` is
a deterministic stand-in for tests and experiments.
"""

from __future__ import annotations

import dataclasses
import math as pymath
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from jaxtyping import Float

VERDICTS = ("better", "tie", "worse")
_SCORE = {"better": 1.0, "tie": 0.0, "worse": -1.0}


class JudgeFn(Protocol):
    """judge(a, b): is response `a` "better" than, a "tie" with, or "worse" than `b`?"""

    def __call__(self, a: Any, b: Any, /) -> str: ...


def _verdict_score(verdict: str, *, a_index: int, b_index: int) -> float:
    if verdict not in _SCORE:
        raise ValueError(
            f"judge_fn(responses[{a_index}], responses[{b_index}]) returned {verdict!r}; "
            f"valid verdicts are {VERDICTS}"
        )
    return _SCORE[verdict]


def judge_group(
    responses: Sequence[Any], judge_fn: JudgeFn, *, both_orders: bool = False
) -> Float[np.ndarray, " G"]:
    """Round-robin rewards of one group: r_i = mean_{j != i} score(i vs j), float32 [G].

    score(i vs j) is +1 / 0 / -1 for "better" / "tie" / "worse" from judge_fn(o_i, o_j) for
    i < j (and its negation for j); with both_orders it is (s(o_i, o_j) - s(o_j, o_i)) / 2.
    A group of one response gets r = 0 (nothing to compare with).
    """
    G = len(responses)
    scores = np.zeros((G, G), np.float64)  # scores[i, j]: i's result against j
    for i in range(G):
        for j in range(i + 1, G):
            s = _verdict_score(judge_fn(responses[i], responses[j]), a_index=i, b_index=j)
            if both_orders:
                back = _verdict_score(judge_fn(responses[j], responses[i]), a_index=j, b_index=i)
                s = (s - back) / 2
            scores[i, j], scores[j, i] = s, -s
    if G == 1:
        return np.zeros((1,), np.float32)
    return (scores.sum(1) / (G - 1)).astype(np.float32)


def judge_groups(
    groups: Sequence[Sequence[Any]], judge_fn: JudgeFn, *, both_orders: bool = False
) -> Float[np.ndarray, "P G"]:
    """`judge_group` over P groups of equal size G, stacked to [P, G]."""
    sizes = {len(g) for g in groups}
    if len(sizes) > 1:
        raise ValueError(f"groups must all have the same size G, got sizes {sorted(sizes)}")
    return np.stack([judge_group(g, judge_fn, both_orders=both_orders) for g in groups])


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
            raise ValueError(f"FakeJudge.tie_tol={t!r} must be in [0, inf)")
        if not callable(self.key):
            raise ValueError(f"FakeJudge.key={self.key!r} must be callable")

    def __call__(self, a: Any, b: Any, /) -> str:
        diff = self.key(a) - self.key(b)
        if diff > self.tie_tol:
            return "better"
        if diff < -self.tie_tol:
            return "worse"
        return "tie"
