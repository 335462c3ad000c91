"""The chains task: generator, flawed teacher, verifier and process check by hand, the teacher's
error rate over many draws, and a held-out set that does not move with the run's seed."""

from __future__ import annotations

import collections
import math
import pathlib
import random

import pytest

from espo import config as config_lib
from espo import testing
from espo.data import chains, examples, sources, worked
from espo.rewards import model_rewards
from espo.testing import raises_invalid

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHAIN = chains.Chain((7, 3, 6, 1), ("-", "-", "+"))  # 7 - 3 = 4, 4 - 6 = -2, -2 + 1 = -1


def test_chain_prompt_values_and_worked_solution_by_hand():
    assert CHAIN.prompt == "Calculate 7 - 3 - 6 + 1."
    assert CHAIN.values() == [4, -2, -1] and CHAIN.answer == -1
    assert chains.solution(CHAIN) == "7-3=4\n4-6=-2\n-2+1=-1\n-1"
    two = chains.Chain((5, 9), ("-",))
    assert two.prompt == "Calculate 5 - 9." and chains.solution(two) == "5-9=-4\n-4"
    # The earlier default's worked solutions are the same text (espo.data.worked).
    assert worked.arithmetic_solution("7 - 3 - 6 + 1") == chains.solution(CHAIN)


@pytest.mark.parametrize(
    "flaw, expected",
    [
        ("none", "7-3=4\n4-6=-2\n-2+1=-1\n-1"),
        ("final_sign", "7-3=4\n4-6=-2\n-2+1=-1\n1"),  # only the answer line loses its sign
        ("sign", "7-3=4\n4-6=2\n2+1=3\n3"),  # -2 written as 2, and the teacher carries on
    ],
)
def test_teacher_flaws_by_hand(flaw, expected):
    got = chains.teacher_solution(CHAIN, flaw=flaw, error=1.0, rng=random.Random(0))
    assert got == expected
    # At error 0 every flaw is the perfect teacher.
    perfect = chains.teacher_solution(CHAIN, flaw=flaw, error=0.0, rng=random.Random(0))
    assert perfect == chains.solution(CHAIN)


def test_teacher_never_touches_non_negative_values():
    chain = chains.Chain((2, 3, 4), ("+", "-"))  # 5, 1
    for flaw in chains.FLAWS:
        got = chains.teacher_values(chain, flaw=flaw, error=1.0, rng=random.Random(1))
        assert got == ([5, 1], 1)


@pytest.mark.parametrize("flaw", ["final_sign", "sign"])
@pytest.mark.parametrize("error", [0.3, 0.7])
def test_teacher_error_rate_over_many_draws(flaw, error):
    """Over 4000 chains, the share of places the flaw can occur (a negative answer for
    final_sign; any negative step value for sign, followed from what the teacher wrote) where it
    occurs is `error` within 4 binomial standard errors; final_sign never touches a step."""
    places = flawed = 0
    for i in range(4000):
        chain = chains.draw(3, i, min_terms=3, max_terms=6, decay=0.8)
        written, answer = chains.teacher_values(chain, flaw=flaw, error=error, rng=random.Random(i))
        if flaw == "final_sign":
            assert written == chain.values()
            places += chain.answer < 0
            flawed += answer == -chain.answer != 0
            continue
        assert answer == written[-1]
        value = chain.terms[0]
        for k, (op, t) in enumerate(zip(chain.ops, chain.terms[1:], strict=True)):
            value = value + t if op == "+" else value - t
            if value < 0:
                places += 1
                flawed += written[k] == -value
            value = written[k]  # the teacher carries on from what it wrote
    assert places > 1000
    assert abs(flawed / places - error) < 4 * math.sqrt(error * (1 - error) / places)


def test_draw_lengths_follow_the_decay_and_terms_are_digits():
    counts = collections.Counter(
        len(chains.draw(0, i, min_terms=3, max_terms=6, decay=0.5).terms) for i in range(8000)
    )
    weights = chains.length_weights(3, 6, 0.5)
    assert weights == pytest.approx([8 / 15, 4 / 15, 2 / 15, 1 / 15])
    for n, w in zip(range(3, 7), weights, strict=True):
        assert abs(counts[n] / 8000 - w) < 4 * math.sqrt(w * (1 - w) / 8000)
    chain = chains.draw(0, 1, min_terms=3, max_terms=6, decay=0.5)
    assert all(0 <= t <= 9 for t in chain.terms) and set(chain.ops) <= {"+", "-"}
    assert chains.draw(0, 1, min_terms=3, max_terms=6, decay=0.5) == chain  # a pure function
    assert chains.draw(1, 1, min_terms=3, max_terms=6, decay=0.5) != chain


@pytest.mark.parametrize(
    "completion, faithful, correct",
    [
        ("7-3=4\n4-6=-2\n-2+1=-1\n-1", True, True),
        ("7-3=4\n4-6=-2\n-2+1=-1\n-1\n", True, True),  # a trailing newline is not a line
        ("7-3=4\n4-6=-2\n-2+1=-1\n1", False, False),  # the teacher's final_sign slip
        ("7-3=4\n4-6=2\n2+1=3\n3", False, False),  # the teacher's sign slip, carried on
        ("7-3=4\n4-6+1=-1\n-1\n-1", False, True),  # right answer, two steps in one line
        ("7-3=5\n5-6=-2\n-2+1=-1\n-1", False, True),  # two wrong steps that cancel
        ("7-3=4\n4-6=-2\n-2+2=-1\n-1", False, True),  # a term misread
        ("7-3=4\n4+6=-2\n-2+1=-1\n-1", False, True),  # an operator misread
        ("7-3=4\n3-6=-2\n-2+1=-1\n-1", False, True),  # a step not from the value above
        ("7-3=4\n4-6=-2\n-2+1=-1\n-1\n-1", False, True),  # an extra line
        ("7-3=4\n4-6=-2\n-2+1=-1\n-2\n-1", False, True),  # a wrong line before the answer
        ("-1", False, True),  # the bare answer
        ("7-3=4\n4 - 6=-2\n-2+1=-1\n-1", False, True),  # not the step format
        ("", False, False),
    ],
)
def test_process_check_by_hand(completion, faithful, correct):
    got = chains.check_process(CHAIN, completion)
    assert (got.faithful, got.correct) == (faithful, correct)
    meta = {"answer": "-1", "terms": [7, 3, 6, 1], "ops": ["-", "-", "+"], "task": "chains"}
    assert chains.ChainReward()(CHAIN.prompt, completion, meta) == float(correct)
    assert chains.process_faithful(CHAIN.prompt, completion, meta) is faithful


def test_reward_reads_the_last_line_exactly():
    reward, meta = chains.ChainReward(), {"answer": "-12", "task": "chains"}
    assert reward("", "a\n -12 \n", meta) == 1.0
    assert reward("", "-12\n3", meta) == 0.0
    assert reward("", "-12.0", meta) == 0.0 and reward("", "12", meta) == 0.0
    with pytest.raises(KeyError, match="answer"):
        reward("", "1", {"task": "chains"})
    with pytest.raises(KeyError, match="terms"):
        chains.process_faithful("", "1", {"answer": "1", "task": "chains"})


def test_executed_reward_equals_the_verifier():
    """The program-executing reward gives ChainReward's value on the teacher's demonstrations
    (some with its sign slip) and on the true solutions of long chains."""
    data = _data(min_terms=8, max_terms=16, teacher_flaw="sign", teacher_error=0.5)
    train = sources.make_sources(data)[0]
    exs = [train[i] for i in range(6)]
    values = []
    for e in exs:
        for completion in (e.demonstration, chains.solution(chains.chain_of(e.meta))):
            want = chains.ChainReward()(e.prompt, completion, e.meta)
            assert chains.executed_reward(e.prompt, completion, e.meta) == want, completion
            values.append(want)
    assert 0.0 in values and 1.0 in values


def _data(**kw) -> examples.DataConfig:
    base = dict(source="chains", size=400, min_terms=3, max_terms=6, eval_fraction=0.25)
    return examples.DataConfig(**(base | kw))


def test_source_examples_carry_the_teacher_and_the_truth():
    train, held_out = sources.make_sources(_data(teacher_flaw="final_sign", teacher_error=1.0))
    assert len(train) + len(held_out) == 400 and len(held_out) > 50
    for e in (train[i] for i in range(len(train))):
        chain = chains.chain_of(e.meta)
        assert e.prompt == chain.prompt and e.answer == str(chain.answer) == e.meta["answer"]
        assert e.id.startswith(f"chains:{len(chain.terms)}-terms:")
        assert e.difficulty == (len(chain.terms) - 3) / 3
        flipped = chains.solution(chain, answer=abs(chain.answer))
        assert e.demonstration == flipped  # error 1: every negative answer loses its sign


def test_test_set_depends_on_data_seed_not_on_the_run_seed():
    cfg = testing.load_script(ROOT / "configs" / "default.py").get_config("tiny")

    def held_out(seed, data_seed):
        cfg.seed, cfg.data.seed = seed, data_seed
        s = config_lib.Settings.from_config(cfg)
        _, ev = sources.make_sources(s.data)
        return [ev[i].prompt for i in range(len(ev))]

    assert held_out(0, 0) == held_out(7, 0)
    assert held_out(0, 0) != held_out(0, 1)


def test_dev_and_test_halves_split_the_held_out_set():
    _, held_out = sources.make_sources(_data(size=4000))
    splits = collections.Counter(
        sources.eval_split_of(held_out[i].prompt) for i in range(len(held_out))
    )
    assert set(splits) == {"dev", "test"} and abs(splits["dev"] - splits["test"]) < 0.2 * sum(
        splits.values()
    )
    assert sources.eval_split_of("Calculate 1 + 2.") == sources.eval_split_of("Calculate 1 + 2.")


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_terms", 1),
        ("max_terms", 2),  # below min_terms=3
        ("terms_decay", 0.0),
        ("terms_decay", math.inf),
        ("teacher_error", 1.5),
        ("teacher_error", True),
        ("teacher_flaw", "carry"),
        ("eval_path", "x.jsonl"),
    ],
)
def test_bad_chains_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"DataConfig\.{field}="):
        _data(**{field: value})


@pytest.mark.parametrize(
    "section, field, value",
    [("data", "teacher_error", 2.0), ("data", "teacher_flaw", "carry"), ("eval", "split", "train"),
     ("advantage", "estimator", "sft")],
)  # fmt: skip
def test_config_errors_name_the_key(section, field, value):
    cfg = testing.load_script(ROOT / "configs" / "default.py").get_config("tiny")
    cfg[section][field] = value
    with pytest.raises(config_lib.ConfigError, match=rf"--config\.{section}\.{field}="):
        config_lib.Settings.from_config(cfg)


def test_reward_shuffle_must_be_a_bool():
    with raises_invalid("shuffle", where="RewardConfig"):
        model_rewards.RewardConfig(shuffle=1)


def test_dev_split_needs_a_held_out_set_cut_from_the_data():
    cfg = testing.load_script(ROOT / "configs" / "default.py").get_config("tiny")
    cfg.data.update(source="jsonl", path="train.jsonl", eval_path="test.jsonl")
    cfg.eval.split = "dev"
    with pytest.raises(config_lib.ConfigError, match=r"--config\.eval\.split='dev'"):
        config_lib.Settings.from_config(cfg)
    cfg.eval.split = "test"
    assert config_lib.Settings.from_config(cfg).eval.split == "test"
