"""Verifiable math reward: math-verify equivalences, extraction, threads, configuration."""

import pickle
import threading
from concurrent import futures

import math_verify
import pytest

from espo.rewards import math as math_rewards
from espo.testing import raises_invalid


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{\dfrac{3}{4}}", "3/4"),
        (r"\boxed{\frac34}", "0.75"),
        # Nested braces inside the box.
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
        (r"\boxed{1000}", "1,000"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{\{2, 1\}}", r"\{1,2\}"),
        (r"\boxed{1 + 2x}", "2x+1"),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("The final answer is $\\frac{2}{3}$. I hope it is correct.", "2/3"),
        # An integer gold from the data loader, not a string.
        (r"\boxed{42}", 42),
    ],
)
def test_equivalent_answers_get_one(completion, gold):
    assert math_rewards.math_reward("", completion, {"answer": gold}) == 1.0


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"\boxed{0.6}", r"\frac{1}{2}"),
        (r"\boxed{\frac{4}{3}}", "3/4"),
        (r"\boxed{43}", "42"),
        (r"\boxed{x = 6}", "5"),
        ("#### 71", "72"),
        # Only the last box counts, and it is wrong.
        (r"\boxed{42} no wait \boxed{41}", "42"),
    ],
)
def test_wrong_answers_get_zero(completion, gold):
    assert math_rewards.math_reward("", completion, {"answer": gold}) == 0.0


def test_configured_values():
    reward = math_rewards.MathReward(correct=2.0, incorrect=-1.0, unparsable=-0.5)
    assert reward("", r"\boxed{3}", {"answer": "3"}) == 2.0
    assert reward("", r"\boxed{4}", {"answer": "3"}) == -1.0
    assert reward("", "I have no idea.", {"answer": "3"}) == -0.5
    assert reward("", "", {"answer": "3"}) == -0.5


def test_float_rounding_reaches_math_verify():
    """Numbers agree to float_rounding decimal places: 3.14 is pi's 3.14159 at 2, not at 6."""
    completion, meta = r"\boxed{3.14}", {"answer": "3.14159"}
    assert math_rewards.MathReward(float_rounding=2)("", completion, meta) == 1.0
    assert math_rewards.MathReward(float_rounding=6)("", completion, meta) == 0.0


def test_answer_key():
    reward = math_rewards.MathReward(answer_key="solution")
    assert reward("", r"\boxed{3}", {"solution": "3"}) == 1.0
    with pytest.raises(KeyError, match="'answer'.*'solution'"):
        math_rewards.math_reward("", r"\boxed{3}", {"solution": "3"})


def test_only_the_answer_after_the_reasoning_counts():
    reward = math_rewards.MathReward(unparsable=-1.0)
    # The boxed 3 inside the thought is a draft; the answer after it is wrong.
    assert reward("", r"<think>\boxed{3}</think> so \boxed{4}", {"answer": "3"}) == 0.0
    assert reward("", r"<think>\boxed{4}</think> so \boxed{3}", {"answer": "3"}) == 1.0
    # A thought that never closes (truncated) states no answer, also when the prompt opened it.
    assert reward("", r"<think>maybe \boxed{3}", {"answer": "3"}) == -1.0
    assert reward("Solve.<think>\n", r"maybe \boxed{3}", {"answer": "3"}) == -1.0
    assert reward("Solve.<think>\n", r"hm</think>\boxed{3}", {"answer": "3"}) == 1.0
    # With after_think=False the whole completion is searched.
    whole = math_rewards.MathReward(after_think=False)
    assert whole("", r"<think>maybe \boxed{3}", {"answer": "3"}) == 1.0


def test_extract_answer_is_reexported():
    assert math_rewards.extract_answer(r"x \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert math_rewards.extract_answer("no answer") is None


def test_unparsable_gold_raises():
    with pytest.raises(ValueError, match="gold answer ''"):
        math_rewards.answers_equivalent(gold="", prediction="3")


def test_runs_in_a_thread():
    # math-verify's default signal.alarm timeout raises ValueError outside the main thread.
    results, errors = [], []

    def target():
        try:
            results.append(math_rewards.math_reward("", r"\boxed{0.5}", {"answer": "1/2"}))
        except Exception as error:  # noqa: BLE001 - surfaced by the assert below.
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)
    assert not errors, errors
    assert results == [1.0]


def test_runs_in_a_thread_pool():
    golds = ["1/2", "3", "0.25", "7"]
    completions = [r"\boxed{0.5}", r"\boxed{4}", r"\boxed{\frac14}", "#### 7"]
    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        rewards = list(
            pool.map(
                lambda c, g: math_rewards.math_reward("", c, {"answer": g}), completions, golds
            )
        )
    assert rewards == [1.0, 0.0, 1.0, 1.0]


def test_timeout_used_in_main_thread_and_disabled_elsewhere(monkeypatch):
    calls = []
    real_parse, real_verify = math_verify.parse, math_verify.verify

    def parse(text, **kwargs):
        calls.append(("parse", kwargs["parsing_timeout"]))
        return real_parse(text, **kwargs)

    def verify(gold, target, **kwargs):
        calls.append(("verify", kwargs["timeout_seconds"]))
        return real_verify(gold, target, **kwargs)

    monkeypatch.setattr(math_verify, "parse", parse)
    monkeypatch.setattr(math_verify, "verify", verify)
    reward = math_rewards.MathReward(timeout_seconds=3)
    assert reward("", r"\boxed{2}", {"answer": "2"}) == 1.0
    assert calls == [("parse", 3), ("parse", 3), ("verify", 3)]

    calls.clear()
    thread = threading.Thread(target=reward, args=("", r"\boxed{2}", {"answer": "2"}))
    thread.start()
    thread.join(timeout=30)
    assert calls == [("parse", None), ("parse", None), ("verify", None)]


def test_picklable():
    reward = math_rewards.MathReward(correct=2.0, timeout_seconds=None)
    assert pickle.loads(pickle.dumps(reward)) == reward
    assert pickle.loads(pickle.dumps(math_rewards.math_reward)) is math_rewards.math_reward


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"correct": float("nan")}, "correct"),
        ({"unparsable": "0"}, "unparsable"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": 0.5}, "timeout_seconds"),
        ({"float_rounding": -1}, "float_rounding"),
        ({"answer_key": ""}, "answer_key"),
    ],
)
def test_config_errors_name_field_value_and_range(kwargs, message):
    with raises_invalid(message, where="MathReward"):
        math_rewards.MathReward(**kwargs)
