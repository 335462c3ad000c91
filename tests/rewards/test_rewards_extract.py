"""Answer extraction: boxed (nested, fbox, last wins), final-answer lines, the reasoning block."""

import pytest

from espo.rewards import extract


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        # Nested braces: the naive regex `\boxed{(.*?)}` would stop at `\frac{\sqrt{3`.
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        # Escaped braces are literal, not nesting.
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        # The last box wins, \fbox counts.
        (r"first \boxed{1}, then \fbox{\dfrac{3}{4}}", r"\dfrac{3}{4}"),
        (r"$\boxed{x^{2}}$", "x^{2}"),
        (r"\boxed 7.", "7"),
        # An unclosed (truncated) box is skipped, the earlier one is used.
        (r"\boxed{5} and then \boxed{6", "5"),
        # An empty box states nothing; the earlier one is used.
        (r"\boxed{5} \boxed{ }", "5"),
    ],
)
def test_boxed(completion, expected):
    assert extract.extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("48 + 24 = 72 clips.\n#### 72", "72"),
        ("so\n#### 1,234", "1,234"),
        ("Final Answer: The final answer is $5$. I hope it is correct.", "5"),
        ("The final answer is: 12.", "12"),
        ("**Final Answer:** 3/4", "3/4"),
        ("**Final Answer**\n\n$42$", "42"),
        ("Answer: (B)", "(B)"),
        ("**Answer:** $\\frac{1}{2}$", r"\frac{1}{2}"),
        # The last statement wins.
        ("Answer: 1\nwait, no.\nAnswer: 2", "2"),
        # A boxed answer beats an answer line wherever it is.
        ("\\boxed{9}\nAnswer: 2", "9"),
    ],
)
def test_answer_lines(completion, expected):
    assert extract.extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "I am not sure what the result is.",
        # "final answer" inside a sentence with nothing after it is not a header.
        "Let me check my final answer.\nIt seems fine",
        r"\boxed{",
        "Answer:",
    ],
)
def test_no_answer(completion):
    assert extract.extract_answer(completion) is None


@pytest.mark.parametrize(
    ("completion", "think_open", "expected"),
    [
        ("<think>a</think> b", False, " b"),
        ("<think>a</think> b </think> c", False, " c"),
        ("a</think>b", True, "b"),
        ("<think>never closed \\boxed{1}", False, ""),
        ("never closed \\boxed{1}", True, ""),
        ("no reasoning \\boxed{1}", False, "no reasoning \\boxed{1}"),
    ],
)
def test_answer_section(completion, think_open, expected):
    assert extract.answer_section(completion, think_open=think_open) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  $5$. ", "5"),
        ("**12**", "12"),
        (r"\(x+1\)", "x+1"),
        (r"\[ 3 \]", "3"),
        ("7. I hope it is correct.", "7"),
        ("3.14", "3.14"),
        ("...", "..."),
    ],
)
def test_clean_answer(raw, expected):
    assert extract.clean_answer(raw) == expected


def test_find_boxed_lists_all_in_order():
    assert extract.find_boxed(r"\boxed{1} x \fbox{{2}} \boxed{") == ["1", "{2}"]
