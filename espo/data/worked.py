"""Worked solutions: step-by-step demonstrations of chained + / - arithmetic.

With `data.worked_solutions=True` the supervised warm start shows its work, one binary step a
line, left to right, and the answer alone on the last line:

    "7 - 3 - 6 - 10"  ->  "7-3=4\\n4-6=-2\\n-2-10=-12\\n-12"

Why: answered in one step, each expression is a fact of its own, which a small policy memorises
(the default's held-out two-term prompts are facts it never saw: greedy pass@1 0.04 against 0.90
on training prompts). Worked step by step, every held-out expression is made of steps that
training prompts also take, so what RL sharpens on training prompts transfers to held-out ones.
The reward then reads the completion's last line (`espo.rewards.gym.ReasoningGymReward`
`last_line=True`).
"""

from __future__ import annotations

from espo.data import chains

OPERATORS = ("+", "-")


def arithmetic_solution(expression: str) -> str:
    """The worked solution of `expression`: "a op b" integer terms separated by spaces.

    Evaluated left to right (what + and - without parentheses mean); one line "x<op>y=z" per
    operator, then the result. A single term is its own answer.

    Raises:
      ValueError: naming the expression, when a term is not an integer or an operator is not
        one of OPERATORS (multiplication, division and parentheses have no worked form here).
    """
    tokens = expression.split()
    terms, ops = tokens[::2], tokens[1::2]
    bad_term = next((t for t in terms if not _is_int_literal(t)), None)
    bad_op = next((o for o in ops if o not in OPERATORS), None)
    if bad_term is not None:
        what = f"term {bad_term!r}"
    elif bad_op is not None:
        what = f"operator {bad_op!r}"
    elif not tokens or len(tokens) % 2 == 0:
        what = "its shape"
    else:
        what = ""
    if what:
        raise ValueError(
            f"worked solution of {expression!r}: {what} is not supported; valid: integer terms "
            f"joined by {' or '.join(OPERATORS)} with spaces (no parentheses, * or /)"
        )
    if len(terms) == 1:
        return str(int(terms[0]))
    return chains.solution(chains.Chain(tuple(int(t) for t in terms), tuple(ops)))


def _is_int_literal(text: str) -> bool:
    digits = text[1:] if text[:1] in "+-" else text
    return digits.isdigit()
