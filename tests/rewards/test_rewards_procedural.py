"""Procedural rewards: normalised exact match, numeric match with tolerance, the format reward."""

import fractions
import pickle

import pytest

from espo.rewards import procedural
from espo.testing import raises_invalid

F = fractions.Fraction


def test_normalize_text():
    assert procedural.normalize_text("  Hello \n\t World  ") == "Hello World"
    assert procedural.normalize_text(" Hello  World ", case_fold=True) == "hello world"
    assert procedural.normalize_text("a  b", collapse_whitespace=False) == "a  b"
    assert procedural.normalize_text("STRASSE", case_fold=True) == "strasse"
    assert procedural.normalize_text("Straße", case_fold=True) == "strasse"  # casefold, not lower


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", F(42)),
        ("-3", F(-3)),
        ("+2.50", F(5, 2)),
        ("1e-3", F(1, 1000)),
        ("3/4", F(3, 4)),
        ("-3/4", F(-3, 4)),
        ("1,234", F(1234)),
        ("1,234,567.5", F(2469135, 2)),
        ("-1,234", F(-1234)),  # a sign before thousands groups
        ("+12,000.5", F(24001, 2)),
        (r"\frac{3}{4}", F(3, 4)),
        (r"-\dfrac{1}{8}", F(-1, 8)),
        (r"\frac12", F(1, 2)),
        ("$12$.", F(12)),
        ("\u22125", F(-5)),  # Unicode minus sign.
    ],
)
def test_parse_number(text, expected):
    assert procedural.parse_number(text) == expected


@pytest.mark.parametrize(
    "text", ["", "abc", "1,2", "12,34", "3 4", "inf", "nan", "1/0", r"\frac{1}{0}", "50%"]
)
def test_parse_number_rejects(text):
    # "1,2" and "12,34" are not thousands groups (a tuple, a decimal comma): not numbers.
    assert procedural.parse_number(text) is None


def test_numbers_close():
    # Bound = max(rel_tol * |gold|, abs_tol) = max(0.01 * 100, 0) = 1.
    assert procedural.numbers_close(gold=F(100), prediction=F(101), rel_tol=0.01, abs_tol=0)
    assert procedural.numbers_close(gold=F(100), prediction=F(99), rel_tol=0.01, abs_tol=0)
    assert not procedural.numbers_close(
        gold=F(100), prediction=F(10115, 100), rel_tol=0.01, abs_tol=0
    )
    # Relative to gold only: |0 - 1e-10| <= abs_tol 1e-9 although rel_tol * |gold| = 0.
    assert procedural.numbers_close(gold=F(0), prediction=F(1, 10**10), rel_tol=0.5, abs_tol=1e-9)
    # Zero tolerances: exact comparison of the exact values.
    assert procedural.numbers_close(gold=F(3, 4), prediction=F(75, 100), rel_tol=0, abs_tol=0)
    assert not procedural.numbers_close(
        gold=F(1, 3), prediction=F(333333, 10**6), rel_tol=0, abs_tol=0
    )


def test_exact_match():
    reward = procedural.ExactMatchReward()
    meta = {"answer": "Blue Whale"}
    assert reward("", r"\boxed{Blue   Whale}", meta) == 1.0
    assert reward("", "Answer: Blue Whale.", meta) == 1.0
    assert reward("", r"\boxed{blue whale}", meta) == 0.0  # Case matters by default.
    assert procedural.ExactMatchReward(case_fold=True)("", r"\boxed{blue whale}", meta) == 1.0
    assert reward("", "Blue Whale", meta) == 0.0  # No stated answer: unparsable.


def test_exact_match_fallback_and_values():
    reward = procedural.ExactMatchReward(
        fallback_to_text=True, correct=2.0, incorrect=-1.0, unparsable=-2.0
    )
    assert reward("", "<think>sorting...</think>\n 1 2 3 \n", {"answer": "1 2 3"}) == 2.0
    assert reward("", "<think>sorting...</think>3 2 1", {"answer": "1 2 3"}) == -1.0
    assert reward("", "<think>truncated", {"answer": "1 2 3"}) == -2.0


def test_numeric_match():
    reward = procedural.NumericMatchReward(rel_tol=0, abs_tol=0)
    assert reward("", r"\boxed{0.75}", {"answer": "3/4"}) == 1.0
    assert reward("", "#### 1,234", {"answer": 1234}) == 1.0
    assert reward("", r"\boxed{\frac{3}{4}}", {"answer": "0.75"}) == 1.0
    assert reward("", r"\boxed{0.7500001}", {"answer": "3/4"}) == 0.0
    assert reward("", r"\boxed{three}", {"answer": "3"}) == 0.0  # Not a number: unparsable.
    loose = procedural.NumericMatchReward(rel_tol=1e-3, abs_tol=0, unparsable=-1.0)
    assert loose("", r"\boxed{1000.9}", {"answer": "1000"}) == 1.0
    assert loose("", r"\boxed{1001.1}", {"answer": "1000"}) == 0.0
    assert loose("", "no answer", {"answer": "1000"}) == -1.0


def test_numeric_match_fallback_to_text():
    """fallback_to_text: a bare number after the reasoning block is the answer; without it, it
    is no stated answer."""
    completion, meta = "<think>3 * 4</think>\n 12 \n", {"answer": "12"}
    assert procedural.NumericMatchReward(fallback_to_text=True)("", completion, meta) == 1.0
    assert procedural.NumericMatchReward(unparsable=-1.0)("", completion, meta) == -1.0


def test_numeric_gold_must_be_a_number():
    with pytest.raises(ValueError, match="gold answer 'three'"):
        procedural.NumericMatchReward()("", r"\boxed{3}", {"answer": "three"})


@pytest.mark.parametrize(
    ("prompt", "completion", "expected"),
    [
        ("", "<think>work</think> so \\boxed{3}", 1.0),
        ("", "  <think>\nwork\n</think>\n\\boxed{3}", 1.0),
        ("Q<think>\n", "work</think>\\boxed{3}", 1.0),  # The prompt opened the block.
        ("Q<think>\n", "<think>work</think>\\boxed{3}", 0.0),  # Opened twice.
        ("", "\\boxed{3}", 0.0),  # No reasoning block.
        ("", "<think>work \\boxed{3}", 0.0),  # Never closed.
        ("", "<think>a</think><think>b</think>\\boxed{3}", 0.0),  # Two blocks.
        ("", "intro <think>work</think>\\boxed{3}", 0.0),  # Text before the block.
        ("", "<think>work</think>   ", 0.0),  # Nothing after the block.
        ("", "<think>work</think> no box", 0.0),
        ("", "<think>work</think> \\boxed{3} or \\boxed{4}", 0.0),  # Two boxes.
        ("", "<think>draft \\boxed{2}</think> \\boxed{3}", 1.0),  # Boxes in the thought: fine.
    ],
)
def test_format_reward(prompt, completion, expected):
    assert procedural.FormatReward()(prompt, completion, {}) == expected


def test_format_reward_options():
    think_only = procedural.FormatReward(require_single_boxed=False, weight=0.5)
    assert think_only("", "<think>a</think> 3", {}) == 0.5
    assert think_only("", "3", {}) == 0.0
    boxed_only = procedural.FormatReward(require_think=False)
    assert boxed_only("", "so \\boxed{3}", {}) == 1.0
    assert boxed_only("", "so \\boxed{3} \\fbox{4}", {}) == 0.0


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (procedural.ExactMatchReward, {"correct": float("inf")}, "correct"),
        (
            procedural.NumericMatchReward,
            {"rel_tol": -1e-3},
            "rel_tol",
        ),
        (procedural.NumericMatchReward, {"abs_tol": float("inf")}, "abs_tol"),
        (procedural.FormatReward, {"weight": float("nan")}, "weight"),
        (
            procedural.FormatReward,
            {"require_think": False, "require_single_boxed": False},
            "requires nothing",
        ),
    ],
)
def test_config_errors(cls, kwargs, message):
    if message == "requires nothing":
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)
        return
    with raises_invalid(message, where=cls.__name__):
        cls(**kwargs)


def test_picklable():
    for reward in (
        procedural.ExactMatchReward(case_fold=True),
        procedural.NumericMatchReward(rel_tol=0.1),
        procedural.FormatReward(weight=0.2),
    ):
        assert pickle.loads(pickle.dumps(reward)) == reward
