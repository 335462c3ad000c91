"""espo.data.worked: worked solutions of + / - chains, in sources, the reward and the warm start."""

import re

import hypothesis
import pytest
from hypothesis import strategies as st

from espo.data import examples, sources, worked
from espo.rewards import gym
from espo.testing import raises_invalid


def test_hand_example():
    # Left to right: 7 - 3 = 4, 4 - 6 = -2, -2 - 10 = -12 (not 7 - (3 - 6) ...).
    assert worked.arithmetic_solution("7 - 3 - 6 - 10") == "7-3=4\n4-6=-2\n-2-10=-12\n-12"
    assert worked.arithmetic_solution("5 + -3") == "5+-3=2\n2"  # a negated term
    assert worked.arithmetic_solution("4") == "4"


@hypothesis.given(
    st.lists(st.integers(-99, 99), min_size=1, max_size=6),
    st.lists(st.sampled_from(["+", "-"]), min_size=5, max_size=5),
)
def test_every_line_is_a_true_step_and_the_last_is_the_value(terms, ops):
    expression = " ".join(
        [str(terms[0])] + [f"{op} {t}" for op, t in zip(ops, terms[1:], strict=False)]
    )
    lines = worked.arithmetic_solution(expression).split("\n")
    assert len(lines) == len(terms)  # one step per operator, then the answer
    value = terms[0]
    for line, op, term in zip(lines, ops, terms[1:], strict=False):
        new = value + term if op == "+" else value - term
        assert line == f"{value}{op}{term}={new}"
        value = new
    assert lines[-1] == str(value) == str(eval(expression))  # noqa: S307 (test oracle)


@pytest.mark.parametrize(
    "expression, named",
    [("2 * 3", "operator '*'"), ("(1 + 2)", "term '(1'"), ("1 +", "shape"), ("", "shape")],
)
def test_unsupported_expressions_are_named(expression, named):
    with pytest.raises(ValueError, match=re.escape(repr(expression)) + ".*" + re.escape(named)):
        worked.arithmetic_solution(expression)


def _config(tasks, **kw):
    return examples.DataConfig(tasks=tasks, size=30, eval_fraction=0.2, **kw)


def test_sources_carry_the_demonstration_and_the_reward_reads_its_last_line():
    tasks = (
        "basic_arithmetic:min_terms=3:max_terms=3:min_digits=1:max_digits=1:operators=+-:"
        "allow_parentheses=false:allow_negation=false;chain_sum:min_terms=4:max_terms=4"
    )
    train, held_out = sources.make_sources(_config(tasks, worked_solutions=True))
    exs = list(train) + list(held_out)
    assert {sources.group_of(e).rsplit("-", 1)[-1] for e in exs} == {
        "basic_arithmetic",
        "chain_sum",
    }
    reward, plain = gym.ReasoningGymReward(last_line=True), gym.ReasoningGymReward()
    for e in exs:
        expression = e.meta["entry"]["metadata"]["expression"]
        assert e.demonstration == worked.arithmetic_solution(expression)
        assert e.demonstration.count("\n") == len(expression.split()) // 2
        assert reward(e.prompt, e.demonstration + "\n", e.meta) == 1.0
        wrong = e.demonstration.rsplit("\n", 1)[0] + f"\n{int(e.answer) + 1}"
        assert reward(e.prompt, wrong, e.meta) == 0.0  # the last line decides, not the steps
        assert plain(e.prompt, e.demonstration, e.meta) < 1.0  # the whole text is no answer
    off, _ = sources.make_sources(_config(tasks))
    assert all(e.demonstration == "" for e in off)


def test_tasks_without_a_worked_form_are_errors_naming_the_spec():
    with raises_invalid("name", where="DataConfig.tasks[0]") as info:
        sources.make_sources(_config("gcd", worked_solutions=True))
    mul = "basic_arithmetic:min_terms=2:max_terms=2:operators=*:allow_parentheses=false"
    with raises_invalid("expression", where="DataConfig.tasks[0]") as info:
        sources.make_sources(_config(mul, worked_solutions=True))
    assert "operator '*'" in info.value.valid


def test_worked_solutions_only_for_reasoning_gym():
    with pytest.raises(ValueError, match='worked_solutions.*source="reasoning_gym"'):
        examples.DataConfig(source="jsonl", path="x.jsonl", worked_solutions=True)
    with raises_invalid("worked_solutions"):
        examples.DataConfig(worked_solutions=1)
