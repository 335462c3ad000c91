"""Rewards for procedural tasks (exact / numeric answers) and for the response format.

This module owns the non-symbolic checks:
  * `ExactMatchReward`: the extracted answer equals the gold after normalisation (strip,
    whitespace collapse, optional case-fold).
  * `NumericMatchReward`: both parse to numbers (ints, decimals, scientific, "1,234" thousands,
    "3/4" and `\\frac{3}{4}` fractions) that agree within a tolerance.
  * `FormatReward`: the completion has the expected shape (a closed `<think>` block followed by an
    answer; exactly one `\\boxed{}` in the answer).

Every reward is a frozen dataclass called as `reward(prompt, completion, meta) -> float`, holds no
state and pickles, so it can run in a process pool. Answer extraction is
`espo.rewards.extract.extract_answer` applied to the text after the reasoning block.
"""

from __future__ import annotations

import dataclasses
import fractions
import math as pymath
import re
from collections.abc import Mapping
from typing import Any

from espo import errors
from espo.rewards import extract

_WHITESPACE_RE = re.compile(r"\s+")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LATEX_FRAC_RE = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_LATEX_FRAC_SHORT_RE = re.compile(r"([+-]?)\\[dt]?frac(\d)(\d)")  # `\frac12`


def normalize_text(text: str, *, case_fold: bool = False, collapse_whitespace: bool = True) -> str:
    """`text` stripped, with whitespace runs made one space and optionally case-folded."""
    text = text.strip()
    if collapse_whitespace:
        text = _WHITESPACE_RE.sub(" ", text)
    if case_fold:
        text = text.casefold()
    return text


def parse_number(text: str) -> fractions.Fraction | None:
    """`text` as an exact number, or None when it is not one.

    Accepts ints and decimals with an optional sign ("-3", "+2.50"), scientific notation ("1e-3"),
    thousands separators in groups of three ("1,234,567.5"; "1,2" is not a number), fractions
    "3/4" and `\\frac{3}{4}` / `\\dfrac{3}{4}` / `\\frac34` with numeric parts, surrounding `$`
    and a trailing period, and the Unicode minus sign. Not accepted: units, percent signs,
    "inf" and "nan".
    """
    text = extract.clean_answer(text).replace("\u2212", "-")
    if not text:
        return None
    for pattern in (_LATEX_FRAC_RE, _LATEX_FRAC_SHORT_RE):
        match = pattern.fullmatch(text)
        if match:
            sign, numerator, denominator = match.groups()
            num, den = parse_number(numerator), parse_number(denominator)
            if num is None or den is None or den == 0:
                return None
            return -num / den if sign == "-" else num / den
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    try:
        # Fraction parses "3/4", "-2.5", "1e-3" exactly and rejects "inf", "nan" and "1,2".
        return fractions.Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_close(
    *,
    gold: fractions.Fraction,
    prediction: fractions.Fraction,
    rel_tol: float,
    abs_tol: float,
) -> bool:
    """|prediction - gold| <= max(rel_tol * |gold|, abs_tol), exact when both tolerances are 0.

    Relative to the gold only (not symmetric like `math.isclose`), so the tolerance does not grow
    with a wildly wrong prediction.
    """
    error = abs(prediction - gold)
    bound = max(fractions.Fraction(rel_tol) * abs(gold), fractions.Fraction(abs_tol))
    return error <= bound


def _answer_text(prompt: str, completion: str, *, fallback_to_text: bool) -> str | None:
    """The stated answer after the reasoning block; the whole answer section when allowed."""
    think_open = prompt.rstrip().endswith(extract.THINK_OPEN)
    section = extract.answer_section(completion, think_open=think_open)
    answer = extract.extract_answer(section)
    if answer is None and fallback_to_text:
        answer = extract.clean_answer(section) or None
    return answer


def _gold(meta: Mapping[str, Any], key: str) -> str:
    if key not in meta:
        raise KeyError(f"reward meta has no gold answer {key!r}; keys present: {sorted(meta)}")
    return str(meta[key])


def _check_scores(owner: str, **scores: float) -> None:
    for name, value in scores.items():
        if not isinstance(value, (int, float)) or not pymath.isfinite(value):
            raise errors.InvalidValue(owner, name, value, "a finite number")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactMatchReward:
    """`correct` if the normalised answer equals the normalised `meta[answer_key]`.

    Attributes:
      case_fold: compare case-insensitively.
      collapse_whitespace: treat any whitespace run as one space.
      fallback_to_text: without a `\\boxed{}` or answer line, use the whole answer section (for
        tasks whose prompt asks for the bare answer).
      answer_key: the `meta` key holding the gold answer.
      correct, incorrect, unparsable: rewards for a match, a mismatch and no stated answer.
    """

    case_fold: bool = False
    collapse_whitespace: bool = True
    fallback_to_text: bool = False
    answer_key: str = "answer"
    correct: float = 1.0
    incorrect: float = 0.0
    unparsable: float = 0.0

    def __post_init__(self) -> None:
        _check_scores(
            "ExactMatchReward",
            correct=self.correct,
            incorrect=self.incorrect,
            unparsable=self.unparsable,
        )

    def __call__(self, prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
        gold = _gold(meta, self.answer_key)
        answer = _answer_text(prompt, completion, fallback_to_text=self.fallback_to_text)
        if answer is None:
            return float(self.unparsable)
        options = dict(case_fold=self.case_fold, collapse_whitespace=self.collapse_whitespace)
        gold = normalize_text(extract.clean_answer(gold), **options)
        matched = normalize_text(answer, **options) == gold
        return float(self.correct if matched else self.incorrect)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NumericMatchReward:
    """`correct` if the answer is a number within tolerance of `meta[answer_key]`.

    Attributes:
      rel_tol: allowed error relative to |gold| (>= 0).
      abs_tol: allowed absolute error (>= 0); the bound is max(rel_tol * |gold|, abs_tol).
      fallback_to_text, answer_key: as in `ExactMatchReward`.
      correct, incorrect: rewards for a number within / outside the tolerance.
      unparsable: reward when no answer is stated or it is not a number.

    A gold answer that is not a number raises `ValueError`: it is a data error, not a sample's.
    """

    rel_tol: float = 1e-6
    abs_tol: float = 1e-9
    fallback_to_text: bool = False
    answer_key: str = "answer"
    correct: float = 1.0
    incorrect: float = 0.0
    unparsable: float = 0.0

    def __post_init__(self) -> None:
        _check_scores(
            "NumericMatchReward",
            correct=self.correct,
            incorrect=self.incorrect,
            unparsable=self.unparsable,
        )
        for name in ("rel_tol", "abs_tol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < pymath.inf:
                raise errors.InvalidValue("NumericMatchReward", name, value, "in [0, inf)")

    def __call__(self, prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
        gold_text = _gold(meta, self.answer_key)
        gold = parse_number(gold_text)
        if gold is None:
            raise ValueError(f"gold answer {gold_text!r} ({self.answer_key!r}) is not a number")
        answer = _answer_text(prompt, completion, fallback_to_text=self.fallback_to_text)
        prediction = None if answer is None else parse_number(answer)
        if prediction is None:
            return float(self.unparsable)
        close = numbers_close(
            gold=gold, prediction=prediction, rel_tol=self.rel_tol, abs_tol=self.abs_tol
        )
        return float(self.correct if close else self.incorrect)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatReward:
    """`weight` if the completion is well formed, else 0.

    Attributes:
      require_think: the completion holds exactly one reasoning block, closed, followed by a
        non-empty answer. The block opens with `<think>` at the start of the completion, or in
        the prompt when the prompt ends with "<think>" (then the completion has no `<think>`).
      require_single_boxed: the answer (after the reasoning block, if any) holds exactly one
        `\\boxed{...}` / `\\fbox{...}`.
      weight: the reward for a well-formed completion (the reward for a malformed one is 0).
    """

    require_think: bool = True
    require_single_boxed: bool = True
    weight: float = 1.0

    def __post_init__(self) -> None:
        _check_scores("FormatReward", weight=self.weight)
        if not (self.require_think or self.require_single_boxed):
            raise ValueError(
                "FormatReward requires nothing: set require_think=True or "
                "require_single_boxed=True (got both False)"
            )

    def __call__(self, prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
        del meta  # The format does not depend on the gold.
        think_open = prompt.rstrip().endswith(extract.THINK_OPEN)
        if self.require_think and not has_think_block(completion, think_open=think_open):
            return 0.0
        section = extract.answer_section(completion, think_open=think_open)
        if self.require_single_boxed and len(extract.find_boxed(section)) != 1:
            return 0.0
        return float(self.weight)


def has_think_block(completion: str, *, think_open: bool = False) -> bool:
    """Whether `completion` is one closed reasoning block followed by a non-empty answer.

    With `think_open` (the prompt ended with "<think>") the completion must not open another one.
    """
    num_open = completion.count(extract.THINK_OPEN)
    if completion.count(extract.THINK_CLOSE) != 1:
        return False
    if think_open:
        if num_open != 0:
            return False
    elif num_open != 1 or not completion.lstrip().startswith(extract.THINK_OPEN):
        return False
    answer = completion.split(extract.THINK_CLOSE, 1)[1]
    return bool(answer.strip())
