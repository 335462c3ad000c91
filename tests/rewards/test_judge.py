"""The round-robin judge (`espo.rewards.judge`) and the generative judge's parsing and plumbing
(`espo.rewards.generative_judge`) with scripted completions; the real-model runs are in
test_judge_model.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from espo import advantages
from espo.rewards import generative_judge as gj
from espo.rewards import judge
from espo.testing import raises_invalid


def _close(got, want, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), rtol=0, atol=atol)


# ---- round robin -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qualities", "tie_tol", "want"),
    [
        ([3.0, 1.0, 2.0], 0.0, [1.0, -1.0, 0.0]),  # s01 = +1, s02 = +1, s12 = -1
        ([1.0, 1.0, 0.0], 0.0, [0.5, 0.5, -1.0]),  # a tie: equal rewards
        ([1.0, 1.05, 2.0], 0.1, [-0.5, -0.5, 1.0]),  # a tie within tie_tol
        ([5.0, 5.0, 5.0], 0.0, [0.0, 0.0, 0.0]),  # all ties: zero variance
        ([4.0], 0.0, [0.0]),  # nothing to compare with
    ],
)
def test_judge_group_round_robin(qualities, tie_tol, want):
    got = judge.judge_group(qualities, judge.FakeJudge(tie_tol=tie_tol))
    assert got.rewards.dtype == np.float32 and got.rewards.shape == (len(qualities),)
    _close(got.rewards, want)
    _close(got.rewards.sum(), 0.0)
    assert not got.verifiable


def test_pair_scores_by_hand():
    """Qualities [3, 1, 2]: i against j is +1 where i is better; rewards are the row sums / 2.
    Over groups the matrices stack."""
    got = judge.judge_group([3.0, 1.0, 2.0], judge.FakeJudge())
    want = [[0, 1, 1], [-1, 0, -1], [-1, 1, 0]]
    _close(got.pair_scores, want)
    _close(got.rewards, np.asarray(want, np.float32).sum(1) / 2)
    both = judge.judge_groups([[3.0, 1.0, 2.0], [1.0, 1.0, 0.0]], judge.FakeJudge())
    _close(both.pair_scores[0], want)
    _close(both.pair_scores[1], [[0, 0, 1], [0, 0, 1], [-1, -1, 0]])


def test_all_tie_group_is_zero_variance_and_not_verifiable():
    """Catches issue 7 defect 5: an all-tie judge group has r = 0 for every member, which RL-ZVP
    would read as "all wrong"; the scores must say it has no spread and is not verifiable, so
    it is left to zero-variance elimination."""
    scores = judge.judge_groups(
        [[2.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]], judge.FakeJudge()
    )
    assert scores.rewards.shape == (3, 4)
    np.testing.assert_array_equal(scores.rewards[[0, 2]], 0.0)
    np.testing.assert_array_equal(scores.zero_variance_mask, [True, False, True])
    np.testing.assert_array_equal(scores.verifiable, [False, False, False])
    assert scores.verifiable.dtype == np.bool_ and scores.verifiable.shape == (3,)
    # The same groups advantages' zero-variance test finds.
    np.testing.assert_array_equal(
        advantages.zero_variance_mask(jnp.asarray(scores.rewards)), scores.zero_variance_mask
    )
    np.testing.assert_array_equal(advantages.group_normalized(jnp.asarray(scores.rewards))[0], 0.0)
    assert scores.metrics == {
        "judge/comparisons": 18.0,  # 3 groups x 6 pairs
        "judge/unparseable": 0.0,
        "judge/ties": 12.0,
        "judge/zero_variance_groups": 2.0,
    }
    one = judge.judge_group([1.0, 1.0], judge.FakeJudge())
    assert bool(one.zero_variance_mask) and not bool(one.verifiable)


def test_both_orders_cancels_position_bias():
    first_wins = lambda a, b: "better"
    _close(judge.judge_group(["x", "y", "z"], first_wins).rewards, [1.0, 0.0, -1.0])
    both = judge.judge_group(["x", "y", "z"], first_wins, both_orders=True)
    _close(both.rewards, [0.0, 0.0, 0.0])
    assert both.metrics["judge/comparisons"] == 6.0  # every pair in both orders


def test_both_orders_averages_half_credit():
    """o_0 vs o_1: "better" as A, "tie" as B -> (1 - 0) / 2 = 1/2; r = [1/2, -1/2] (G - 1 = 1)."""
    verdicts = {("p", "q"): "better", ("q", "p"): "tie"}
    got = judge.judge_group(["p", "q"], lambda a, b: verdicts[a, b], both_orders=True)
    _close(got.rewards, [0.5, -0.5])


class _BatchedJudge:
    """A `PairJudgeFn` that records its calls: one `judge_pairs` call per group."""

    def __init__(self):
        self.calls = []

    def judge_pairs(self, pairs):
        self.calls.append(list(pairs))
        return [judge.FakeJudge()(a, b) for a, b in pairs]

    def __call__(self, a, b):
        raise AssertionError("a batched judge must get judge_pairs calls only")


def test_batched_judge_gets_each_group_in_one_call():
    j = _BatchedJudge()
    got = judge.judge_group([3.0, 1.0, 2.0], j, both_orders=True)
    _close(got.rewards, [1.0, -1.0, 0.0])
    assert len(j.calls) == 1
    assert sorted(j.calls[0]) == sorted(
        [(a, b) for a in (3.0, 1.0, 2.0) for b in (3.0, 1.0, 2.0) if a != b]
    )


def test_unparseable_scores_as_a_tie_and_is_counted():
    verdicts = {(0, 1): judge.UNPARSEABLE, (0, 2): "better", (1, 2): "tie"}
    got = judge.judge_group([0, 1, 2], lambda a, b: verdicts[a, b])
    # s01 = 0 (unparseable), s02 = +1, s12 = 0: r = [1/2, 0, -1/2]
    _close(got.rewards, [0.5, 0.0, -0.5])
    assert got.metrics["judge/unparseable"] == 1.0 and got.metrics["judge/ties"] == 1.0


def test_judge_errors():
    with pytest.raises(ValueError, match=r"returned 'A'; valid verdicts"):
        judge.judge_group([1, 2], lambda a, b: "A")
    with pytest.raises(ValueError, match="same size G"):
        judge.judge_groups([[1, 2], [1]], judge.FakeJudge())
    with pytest.raises(ValueError, match="groups is empty"):
        judge.judge_groups([], judge.FakeJudge())
    with pytest.raises(ValueError, match=r"FakeJudge\.tie_tol=-1"):
        judge.FakeJudge(tie_tol=-1)

    class Short(_BatchedJudge):
        def judge_pairs(self, pairs):
            return ["tie"]

    with pytest.raises(ValueError, match="returned 1 verdicts for 3 pairs"):
        judge.judge_group([1, 2, 3], Short())


# ---- parsing a generative judge's completion -------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "want"),
    [
        (" A", "better"),
        ("B", "worse"),
        ("Tie", "tie"),
        (" tie.", "tie"),
        ("TIE", "tie"),
        ("**B**", "worse"),
        ("(A)\n", "better"),
        ("\n\nB\n", "worse"),
        ("Response A's answer is right", "better"),  # one label, with a possessive
        ("a tie", "tie"),  # the article "a" is not label A
        ("A is longer. Verdict: B", "worse"),  # an explicit verdict wins
        ("Answer: Tie", "tie"),
        ("Verdict: A. Verdict: B", judge.UNPARSEABLE),  # explicit verdicts disagree
        ("", judge.UNPARSEABLE),  # empty
        ("   \n", judge.UNPARSEABLE),
        ("A or B", judge.UNPARSEABLE),  # both labels
        ("A B Tie", judge.UNPARSEABLE),
        ("xq#7~!", judge.UNPARSEABLE),  # garbage
        ("Bob", judge.UNPARSEABLE),  # labels inside other words
        ("ABBA", judge.UNPARSEABLE),
        ("tied", judge.UNPARSEABLE),
        ("Attie", judge.UNPARSEABLE),
        ("A-grade", judge.UNPARSEABLE),
        ("B2", judge.UNPARSEABLE),
        ("verdict: b", judge.UNPARSEABLE),  # lower-case b is not a label
    ],
)
def test_parse_verdict(completion, want):
    assert gj.parse_verdict(completion) == want


# ---- the generative judge with scripted completions ------------------------------------------


class ScriptedCompleter:
    """A stand-in for a model: maps each prompt's (A, B) responses to a scripted completion."""

    def __init__(self, script):
        self.script = script  # {(a, b): completion}
        self.calls = []

    def __call__(self, prompts):
        self.calls.append(list(prompts))
        out = []
        for p in prompts:
            a = p.split("Response A: ")[1].split("\n")[0]
            b = p.split("Response B: ")[1].split("\n")[0]
            out.append(self.script[a, b])
        return out


def test_generative_judge_with_malformed_outputs():
    """Three responses x, y, z, both orders (6 prompts): two answers are malformed."""
    script = {
        ("x", "y"): " A",  # x > y
        ("y", "x"): " B",  # x > y again
        ("x", "z"): "",  # empty: unparseable
        ("z", "x"): " A and B",  # both labels: unparseable
        ("y", "z"): "Tie",
        ("z", "y"): " Bob",  # label inside a word: unparseable
    }
    completer = ScriptedCompleter(script)
    gen = gj.GenerativeJudge(complete=completer).for_question("2 + 2?")
    got = judge.judge_group(["x", "y", "z"], gen, both_orders=True)
    # s(x, y) = (1 - (-1)) / 2 = 1, s(x, z) = 0, s(y, z) = (0 - 0) / 2 = 0: r = [1/2, -1/2, 0]
    _close(got.rewards, [0.5, -0.5, 0.0])
    assert got.metrics["judge/unparseable"] == 3.0
    assert got.metrics["judge/ties"] == 1.0 and got.metrics["judge/comparisons"] == 6.0
    assert len(completer.calls) == 1 and len(completer.calls[0]) == 6  # one batched call
    assert all("Question: 2 + 2?" in p for p in completer.calls[0])
    assert gen("x", "y") == "better" and gen("x", "z") == judge.UNPARSEABLE


def test_generative_judge_all_unparseable_is_a_non_verifiable_zero_variance_group():
    gen = gj.GenerativeJudge(complete=lambda prompts: ["???"] * len(prompts))
    got = judge.judge_groups([["a", "b", "c"], ["d", "e", "f"]], gen, both_orders=True)
    np.testing.assert_array_equal(got.rewards, 0.0)
    np.testing.assert_array_equal(got.zero_variance_mask, [True, True])
    np.testing.assert_array_equal(got.verifiable, [False, False])
    assert got.metrics["judge/unparseable"] == 12.0


def test_generative_judge_validation():
    with pytest.raises(ValueError, match=r"GenerativeJudge\.template=.*must use exactly"):
        gj.GenerativeJudge(complete=list, template="{question} {a}")
    with raises_invalid("template", where="GenerativeJudge"):
        gj.GenerativeJudge(complete=list, template="{question} {a} {b")
    with raises_invalid("complete", where="GenerativeJudge"):
        gj.GenerativeJudge(complete=3)
    gen = gj.GenerativeJudge(complete=lambda prompts: [])
    with pytest.raises(ValueError, match="returned 0 completions for 1 prompts"):
        gen("a", "b")
    # Braces inside a response are text, not template fields.
    assert "Response A: {x}" in gj.GenerativeJudge(complete=list).prompt("{x}", "y")
