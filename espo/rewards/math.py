"""Verifiable math reward: the stated final answer checked against the gold by `math-verify`.

This module owns symbolic answer equivalence. Extraction (last `\\boxed{}`, else a final-answer
line) lives in `espo.rewards.extract`; equivalence (`\\frac{1}{2}` == `0.5`, `\\dfrac{3}{4}` ==
`3/4`, `x = 5` == `5`, sets up to order, ...) is delegated to Hugging Face `math-verify`.

A reward is `fn(prompt, completion, meta) -> float` with the gold answer in `meta["answer"]`.
`math_reward` and `MathReward` instances are picklable (a top-level function, a frozen dataclass)
and hold no state, so they can run in a process pool.

Threads and timeouts: `math-verify` bounds each parse / comparison with `signal.alarm`, which only
works in the main thread of the main interpreter; anywhere else it raises `ValueError`, even with
`raise_on_error=False`. `MathReward` therefore passes its `timeout_seconds` only in the main thread
and disables the library's timeout elsewhere (`parsing_timeout=None`, `timeout_seconds=None`); the
caller then owns the time limit (the reward pool's per-sample timeout). Note that in the main
thread the library's alarm replaces, and on exit cancels, any `SIGALRM` alarm the caller had set:
a caller that times samples out with `signal.alarm` itself should set `timeout_seconds=None`.
"""

from __future__ import annotations

import dataclasses
import math as pymath
import threading
from collections.abc import Mapping
from typing import Any

import math_verify

from espo import errors
from espo.rewards import extract

# Re-exported: the math reward's answer extraction, for callers that only import this module.
extract_answer = extract.extract_answer


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathReward:
    """`correct` if the completion's final answer equals `meta[answer_key]`, else `incorrect`.

    Attributes:
      correct: reward for an answer equivalent to the gold.
      incorrect: reward for a stated answer that is not equivalent.
      unparsable: reward when the completion states no answer (no `\\boxed{}` nor answer line) or
        the answer parses to nothing.
      answer_key: the `meta` key holding the gold answer (str, int or float).
      after_think: extract only from the text after the reasoning block (`</think>`); a thought
        opened (in the completion, or by a prompt ending in "<think>") and never closed then counts
        as no answer.
      timeout_seconds: math-verify's per-parse / per-comparison limit, in whole seconds, when
        called from the main thread; `None` disables it. Ignored (disabled) in other threads.
      float_rounding: decimal places numbers are rounded to before comparing (math-verify).
    """

    correct: float = 1.0
    incorrect: float = 0.0
    unparsable: float = 0.0
    answer_key: str = "answer"
    after_think: bool = True
    timeout_seconds: int | None = 5
    float_rounding: int = 6

    def __post_init__(self) -> None:
        for name in ("correct", "incorrect", "unparsable"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not pymath.isfinite(value):
                raise errors.InvalidValue("MathReward", name, value, "a finite number")
        if self.timeout_seconds is not None and (
            not isinstance(self.timeout_seconds, int) or self.timeout_seconds < 1
        ):
            raise errors.InvalidValue(
                "MathReward", "timeout_seconds", self.timeout_seconds,
                "an int >= 1 (signal.alarm counts whole seconds) or None",
            )  # fmt: skip
        if not isinstance(self.float_rounding, int) or self.float_rounding < 0:
            raise errors.InvalidValue(
                "MathReward", "float_rounding", self.float_rounding, "an int >= 0"
            )
        if not self.answer_key:
            raise errors.InvalidValue("MathReward", "answer_key", self.answer_key, "non-empty")

    def __call__(self, prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
        gold = gold_answer(meta, key=self.answer_key)
        text = completion
        if self.after_think:
            think_open = prompt.rstrip().endswith(extract.THINK_OPEN)
            text = extract.answer_section(completion, think_open=think_open)
        answer = extract.extract_answer(text)
        if answer is None:
            return float(self.unparsable)
        verdict = answers_equivalent(
            gold=gold,
            prediction=answer,
            timeout_seconds=self.timeout_seconds,
            float_rounding=self.float_rounding,
        )
        if verdict is None:
            return float(self.unparsable)
        return float(self.correct if verdict else self.incorrect)


def math_reward(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
    """1.0 if the completion's final answer is equivalent to `meta["answer"]`, else 0.0."""
    return MathReward()(prompt, completion, meta)


def gold_answer(meta: Mapping[str, Any], *, key: str = "answer") -> str:
    """`meta[key]` as a string; raises `KeyError` naming the key and the keys present."""
    if key not in meta:
        raise KeyError(f"reward meta has no gold answer {key!r}; keys present: {sorted(meta)}")
    return str(meta[key])


def answers_equivalent(
    *,
    gold: str,
    prediction: str,
    timeout_seconds: int | None = 5,
    float_rounding: int = 6,
) -> bool | None:
    """Whether `prediction` is mathematically equivalent to `gold` (both bare answer strings,
    e.g. "3/4" and "\\dfrac{3}{4}"), or None when `prediction` parses to nothing.

    Both are parsed as inline LaTeX (`$...$`); math-verify keeps a string fallback next to the
    parsed expression, so answers that are not math ("Yes", "(B)") are compared as strings.
    `timeout_seconds` applies in the main thread only (see the module doc).
    """
    timeout = timeout_seconds if _signals_usable() else None
    gold_parsed = math_verify.parse(_as_latex(gold), parsing_timeout=timeout)
    pred_parsed = math_verify.parse(_as_latex(prediction), parsing_timeout=timeout)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} parses to nothing")
    if not pred_parsed:
        return None
    return bool(
        math_verify.verify(
            gold_parsed, pred_parsed, float_rounding=float_rounding, timeout_seconds=timeout
        )
    )


def _as_latex(answer: str) -> str:
    """`answer` as inline math, the form math-verify's LaTeX extraction anchors on."""
    return f"${extract.clean_answer(answer)}$"


def _signals_usable() -> bool:
    """Whether `signal.alarm` may be used here (main thread of the main interpreter)."""
    return threading.current_thread() is threading.main_thread()
