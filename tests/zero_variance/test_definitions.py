"""What every ZVE stage of espo.zero_variance shares: prompt ids and the zero-variance rule.

`prompt_id` is stable, independent of key order, hashes text as is and anything else as
canonical JSON. A group is zero-variance when max - min <= atol over its valid verifier rewards
(float32 spread, inputs of any dtype), and informative only with >= 2 valid samples; the host
rule (`is_zero_variance`, `zero_variance_groups`, `is_informative`) agrees with the device rule
of espo.advantages.
"""

import hashlib
import warnings

import jax
import numpy as np
import pytest

from espo import advantages
from espo import zero_variance as zv


def test_prompt_id_is_stable_and_order_free():
    a = zv.prompt_id({"question": "1+1?", "answer": "2"})
    assert a == zv.prompt_id({"answer": "2", "question": "1+1?"})  # key order is irrelevant
    assert a != zv.prompt_id({"question": "1+2?", "answer": "3"})
    assert len(a) == 16 and int(a, 16) >= 0
    assert zv.prompt_id("text") == zv.prompt_id("text") != zv.prompt_id("text ")


def test_prompt_id_hashes_text_itself_and_json_of_anything_else():
    # sha256("abc") = ba7816bf8f01cfea 414140de... (FIPS 180-2 test vector): text is hashed as
    # is, not as its JSON string '"abc"' (which would hash to something else).
    assert zv.prompt_id("abc") == "ba7816bf8f01cfea"
    # A mapping is hashed as canonical JSON (sorted keys, json's default separators).
    want = hashlib.sha256(b'{"a": 2, "b": 1}').hexdigest()[:16]
    assert zv.prompt_id({"b": 1, "a": 2}) == want
    # Values json cannot encode (numpy scalars from a dataset loader) are encoded by str().
    assert zv.prompt_id({"p": np.float32(1.5)}) == zv.prompt_id({"p": "1.5"})


@pytest.mark.slow
def test_zero_variance_agrees_with_advantages_compute():
    # The host rule (is_informative) and the device rule (advantages.compute) are one rule:
    # verifier rewards of valid samples, max - min <= atol, >= 2 valid for any signal.
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, size=(64, 4)).astype(np.float32)  # [P, G], many ties
    rewards[:8] += rng.normal(0, 1e-7, size=(8, 4))  # near-ties, below atol
    rewards[8:16, 0] += 1e-3  # above atol
    valid = rng.random((64, 4)) > 0.25
    rewards[~valid] = np.nan  # what a failed sample holds must not matter
    groups = zv.Groups.of(prompt_ids=[str(i) for i in range(64)], rewards=rewards, valid=valid)
    ours = zv.is_informative(groups)
    one_by_one = [not zv.is_zero_variance(r, valid=v) for r, v in zip(rewards, valid, strict=True)]
    np.testing.assert_array_equal(ours, one_by_one)
    dense = jax.jit(advantages.compute_dense, static_argnames="cfg")  # op by op: ~50 compiles
    out = dense(rewards, cfg=advantages.AdvantageConfig(), valid=valid)
    theirs = ~np.asarray(out.zero_variance_groups) & ~np.asarray(out.no_signal_groups)
    np.testing.assert_array_equal(ours, theirs)
    assert 0 < sum(ours) < 64
    dense = [zv.is_zero_variance(r) for r in np.nan_to_num(rewards)]
    np.testing.assert_array_equal(dense, advantages.zero_variance_mask(np.nan_to_num(rewards)))


def test_zero_variance_boundaries_by_hand():
    # max - min <= atol: all equal, all correct, all wrong -> True; one sample (no spread) ->
    # True but not informative; at the tolerance (spread 0.25 == atol) -> True (the "<" bug:
    # False); above (0.375) -> False. Invalid entries (NaN here) are never read.
    check = lambda r, **kw: zv.is_zero_variance(np.array(r, np.float32), atol=0.25, **kw)
    assert check([0.5, 0.5, 0.5]) and check([1, 1, 1]) and check([0, 0, 0]) and check([1])
    assert check([0.5, 0.75]) and not check([0.5, 0.875])
    assert check([1.0, np.nan, 1.0], valid=[True, False, True])
    assert not check([1.0, 0.0, np.nan], valid=[True, True, False])
    table = zv.Groups.of(prompt_ids=["a", "b", "c"], rewards=[[1.0], [1.0, 0.0], [1.0, 0.0]],
                         valid=[[True], [True, False], [True, True]])  # fmt: skip
    # one sample: no signal; one valid sample: no signal; two different: informative.
    np.testing.assert_array_equal(zv.is_informative(table), [False, False, True])
    zero, num_valid = zv.zero_variance_groups(
        table.rewards, group_ids=table.group_ids, num_groups=3, valid=table.valid
    )
    np.testing.assert_array_equal(zero, [True, True, False])
    np.testing.assert_array_equal(num_valid, [1, 1, 2])


def test_zero_variance_groups_spread_is_float32_and_inputs_are_normalised():
    # float32 spread: 1e8 lies in [2^26, 2^27), where float32 steps by 2^(26-23) = 8, so
    # 1e8 - (-1) = 100000001 rounds to 1e8 == atol -> zero-variance. In float64 the spread
    # would be 100000001 > atol (the wrong answer: informative).
    zero, _ = zv.zero_variance_groups(
        np.array([1e8, -1.0], np.float32), group_ids=np.zeros(2, np.int64), num_groups=1,
        atol=1e8,
    )  # fmt: skip
    np.testing.assert_array_equal(zero, [True])
    # Group ids of any numeric dtype and a validity mask given as 0/1 ints (not bool: as
    # integer indices they would pick rows 0 and 1) mean the same as int64 ids and bools.
    # Groups: 0 = [1, 0*, 1] (zero-variance on its 2 valid rows), 1 = [5*, 5*] (no valid
    # row), 2 = [2, 3] (spread 1).
    rewards = np.array([1.0, 0.0, 1.0, 5.0, 5.0, 2.0, 3.0])
    ids = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0])  # float ids
    valid = np.array([1, 0, 1, 0, 0, 1, 1])
    zero, num_valid = zv.zero_variance_groups(rewards, group_ids=ids, num_groups=3, valid=valid)
    np.testing.assert_array_equal(zero, [True, True, False])
    np.testing.assert_array_equal(num_valid, [2, 0, 2])
    # Rewards all +inf (or all -inf): max - min = inf - inf = NaN, a spread (not zero-variance),
    # as `advantages.zero_variance_mask` says; computed silently, without a RuntimeWarning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero, _ = zv.zero_variance_groups(
            np.array([np.inf, np.inf, -np.inf, -np.inf]), group_ids=np.array([0, 0, 1, 1]),
            num_groups=2,
        )  # fmt: skip
    np.testing.assert_array_equal(zero, [False, False])
    # A trailing group without a valid row: bincount alone would give num_valid [2] (length 1).
    zero, num_valid = zv.zero_variance_groups(
        np.array([1.0, 0.0, 1.0, 0.0]), group_ids=np.array([0, 0, 1, 1]), num_groups=2,
        valid=np.array([True, True, False, False]),
    )  # fmt: skip
    np.testing.assert_array_equal(zero, [False, True])
    np.testing.assert_array_equal(num_valid, [2, 0])


def test_is_informative_and_zvp_rate_use_the_given_atol():
    # Spreads 0.25 and 1: with atol 0.5 only the second is a signal (the default 1e-6 would
    # call both informative).
    groups = zv.Groups.of(prompt_ids=["a", "b"], rewards=[[0.0, 0.25], [0.0, 1.0]])
    np.testing.assert_array_equal(zv.is_informative(groups, atol=0.5), [False, True])
    assert zv.zvp_rate_by_group_size([[0.0, 0.25], [0.0, 1.0]], atol=0.5) == {2: 0.5}
    assert zv.zvp_rate_by_group_size([]) == {}  # no prompts: no group size to report
