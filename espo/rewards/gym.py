"""The reasoning_gym verifier as an espo reward.

`ReasoningGymReward()(prompt, completion, meta) -> float in [0, 1]` scores the stripped
completion text with reasoning_gym's own scorer for `meta["task"]`
(`reasoning_gym.get_score_answer_fn(task)(answer, entry)`), where `meta["entry"]` is the
generator's entry (question, answer, metadata) as `espo.data.sources` stores it. It holds no
state and pickles, so it runs in the reward pool's workers; each worker builds a task's scorer
once and keeps it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any


@functools.cache
def _scorer(task: str) -> Callable[[str, dict], float]:
    import reasoning_gym  # heavy; imported in the worker that scores

    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError as e:
        raise ValueError(f"ReasoningGymReward: meta['task']={task!r}: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymReward:
    """reasoning_gym's scorer for meta["task"] on the stripped completion; see the module doc.

    Attributes:
      last_line: score only the completion's last non-empty line (worked solutions,
        `espo.data.worked`: the steps come first, the answer alone last).
    """

    last_line: bool = False

    def __call__(self, prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
        del prompt  # the entry in meta carries what the scorer needs
        for key in ("task", "entry"):
            if key not in meta:
                raise KeyError(
                    f"ReasoningGymReward: meta has no {key!r} (it has {sorted(meta)}); "
                    "reasoning_gym examples from espo.data.sources carry 'task' and 'entry'"
                )
        task, entry = meta["task"], meta["entry"]
        if not isinstance(entry, Mapping) or "answer" not in entry:
            raise KeyError(
                f"ReasoningGymReward: meta['entry'] for task {task!r} must be the generator's "
                f"entry with an 'answer'; got {type(entry).__name__}"
            )
        answer = completion.strip()
        if self.last_line:
            answer = answer.rsplit("\n", 1)[-1].strip()
        score = float(_scorer(task)(answer, dict(entry)))
        if not (math.isfinite(score) and 0.0 <= score <= 1.0):
            raise ValueError(
                f"ReasoningGymReward: the {task!r} scorer returned {score!r}; valid: [0, 1]"
            )
        return score
