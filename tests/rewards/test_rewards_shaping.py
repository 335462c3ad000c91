"""Reward shaping: DAPO overlong penalty at its boundaries, repeated n-grams, the combination."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo.rewards import shaping
from espo.testing import raises_invalid

# DAPO's values: the soft band is (16384, 20480].
L_MAX, L_CACHE = 20480, 4096


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (16384, 0.0),  # L = L_max - L_cache: last length without penalty.
        (16385, -1 / 4096),  # First penalised length: (16384 - 16385) / 4096.
        (18432, -0.5),  # Middle of the band.
        (20479, -4095 / 4096),
        (20480, -1.0),  # L = L_max: the soft formula reaches -1 exactly.
        (20481, -1.0),  # Beyond L_max: -1, not the formula's -4097/4096.
        (10**6, -1.0),
    ],
)
def test_overlong_penalty_boundaries(length, expected):
    assert shaping.overlong_penalty(length, max_length=L_MAX, cache_length=L_CACHE) == expected


def test_overlong_penalty_small():
    # L_max = 10, L_cache = 4: band (6, 10], steps of 1/4.
    got = [shaping.overlong_penalty(n, max_length=10, cache_length=4) for n in range(5, 13)]
    assert got == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]


def test_overlong_penalty_without_cache_is_a_hard_cut():
    got = [shaping.overlong_penalty(n, max_length=10, cache_length=0) for n in (9, 10, 11)]
    assert got == [0.0, 0.0, -1.0]
    np.testing.assert_array_equal(
        shaping.overlong_penalties(np.array([9, 10, 11]), max_length=10, cache_length=0),
        [0.0, 0.0, -1.0],
    )


def test_overlong_penalties_vectorised_match_scalar():
    lengths = np.array([0, 16384, 16385, 18432, 20479, 20480, 20481, 10**6])
    expected = np.array(
        [shaping.overlong_penalty(int(n), max_length=L_MAX, cache_length=L_CACHE) for n in lengths],
        np.float32,
    )
    got_np = shaping.overlong_penalties(lengths, max_length=L_MAX, cache_length=L_CACHE)
    assert isinstance(got_np, np.ndarray) and got_np.dtype == np.float32
    np.testing.assert_array_equal(got_np, expected)

    jitted = jax.jit(
        lambda x: shaping.overlong_penalties(x, max_length=L_MAX, cache_length=L_CACHE)
    )
    got_jnp = jitted(jnp.asarray(lengths, jnp.int32))
    assert isinstance(got_jnp, jax.Array) and got_jnp.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got_jnp), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0, "cache_length": 0}, "max_length"),
        ({"max_length": 10, "cache_length": 11}, "cache_length"),
        ({"max_length": 10, "cache_length": -1}, "cache_length"),
        ({"max_length": 10.0, "cache_length": 2}, "max_length"),
    ],
)
def test_overlong_penalty_argument_errors(kwargs, message):
    with raises_invalid(message):
        shaping.overlong_penalty(5, **kwargs)
    with raises_invalid(message):
        shaping.overlong_penalties(np.array([5]), **kwargs)


@pytest.mark.parametrize(
    ("sequence", "n", "expected"),
    [
        # Bigrams ab ba ab ba ab: the last three repeat an earlier one.
        ("a b a b a b", 2, 3 / 5),
        # Unigrams a b a b a b: 6, 2 distinct.
        ("a b a b a b", 1, 4 / 6),
        ("a b c d e", 2, 0.0),
        ("the cat the cat the dog", 2, 2 / 5),  # the-cat, cat-the repeat once each.
        ([7, 7, 7, 7, 7], 2, 3 / 4),
        (np.array([1, 2, 3, 1, 2, 3, 1]), 3, 2 / 5),  # 123 231 312 123 231.
        ([1, 2, 3], 4, 0.0),  # Shorter than n: no n-grams.
        ("", 4, 0.0),
        # Same words, different whitespace: the text is split on whitespace.
        ("a\nb  a\tb", 2, 1 / 3),
    ],
)
def test_repeated_ngram_ratio(sequence, n, expected):
    assert shaping.repeated_ngram_ratio(sequence, n=n) == pytest.approx(expected, abs=1e-12)


def test_repeated_ngram_ratio_errors():
    with raises_invalid("n"):
        shaping.repeated_ngram_ratio("a b", n=0)
    with pytest.raises(ValueError, match="1-D"):
        shaping.repeated_ngram_ratio(np.zeros((2, 2), np.int32), n=1)
    with pytest.raises(ValueError, match="integers"):
        shaping.repeated_ngram_ratio(np.array([0.5, 1.5]), n=1)


def test_repetition_penalty_threshold():
    text = "a b a b a b"  # ratio 0.6 at n = 2.
    assert shaping.repetition_penalty(text, n=2, weight=0.5) == pytest.approx(-0.3)
    assert shaping.repetition_penalty(text, n=2, weight=0.5, threshold=0.5) == pytest.approx(-0.3)
    assert shaping.repetition_penalty(text, n=2, weight=0.5, threshold=0.6) == 0.0  # Not above.
    assert shaping.repetition_penalty("a b c", n=2, weight=1.0) == 0.0


def test_shape_rewards_hand_derived():
    cfg = shaping.ShapingConfig(
        overlong_weight=0.5, max_length=10, cache_length=4, repetition_weight=0.2, ngram_size=2
    )
    # Rows padded with 0 to T = 12; padding must be cut to `lengths` (uncut, row 1 would repeat
    # the bigram (0, 0)).
    tokens = np.zeros((3, 12), np.int32)
    tokens[0, :5] = [1, 2, 1, 2, 1]  # bigrams 12 21 12 21: ratio 2/4.
    tokens[1, :8] = np.arange(1, 9)  # all distinct: ratio 0.
    tokens[2, :11] = 7  # 10 bigrams, 1 distinct: ratio 9/10.
    shaped, components = shaping.shape_rewards(
        np.array([1.0, 0.0, 1.0]),
        lengths=np.array([5, 8, 11]),
        token_ids_or_texts=tokens,
        cfg=cfg,
    )
    # Overlong: lengths 5, 8, 11 -> 0, -0.5, -1, times 0.5. Repetition: -0.2 * ratio.
    np.testing.assert_allclose(components["overlong"], [0.0, -0.25, -0.5], atol=1e-7)
    np.testing.assert_allclose(components["repetition"], [-0.1, 0.0, -0.18], atol=1e-7)
    np.testing.assert_allclose(shaped, [0.9, -0.25, 0.32], atol=1e-6)
    assert shaped.dtype == np.float32
    # The logged components explain the shaped reward exactly.
    np.testing.assert_array_equal(shaped, np.float32([1, 0, 1]) + sum(components.values()))


def test_shape_rewards_texts_and_lists():
    cfg = shaping.ShapingConfig(
        max_length=100, cache_length=10, repetition_weight=1.0, ngram_size=2
    )
    shaped, components = shaping.shape_rewards(
        [1.0, 1.0],
        lengths=[95, 3],
        token_ids_or_texts=["a b a b a b", [5, 5, 5, 9]],  # Texts are used whole.
        cfg=cfg,
    )
    np.testing.assert_allclose(components["overlong"], [-0.5, 0.0])
    # Row 1 cut to 3 tokens: bigrams 55 55 -> 1/2.
    np.testing.assert_allclose(components["repetition"], [-0.6, -0.5], rtol=1e-6)
    np.testing.assert_allclose(shaped, [-0.1, 0.5], rtol=1e-5)


def test_shape_rewards_without_repetition_needs_no_tokens():
    shaped, components = shaping.shape_rewards(
        np.array([1.0, 1.0]),
        lengths=np.array([1, 20481]),
        token_ids_or_texts=None,
        cfg=shaping.ShapingConfig(),
    )
    np.testing.assert_array_equal(shaped, [1.0, 0.0])
    np.testing.assert_array_equal(components["repetition"], [0.0, 0.0])


def test_shape_rewards_shape_errors():
    cfg = shaping.ShapingConfig(repetition_weight=0.1)
    with pytest.raises(ValueError, match=r"must both be \[B\]"):
        shaping.shape_rewards(np.ones(2), lengths=np.ones(3, int), token_ids_or_texts=None, cfg=cfg)
    with pytest.raises(ValueError, match="must hold B=2 responses .* got 1"):
        shaping.shape_rewards(
            np.ones(2), lengths=np.ones(2, int), token_ids_or_texts=["a"], cfg=cfg
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overlong_weight": -1.0}, "overlong_weight"),
        ({"repetition_weight": float("nan")}, "repetition_weight"),
        ({"max_length": 0}, "max_length"),
        ({"ngram_size": 0}, "ngram_size"),
        ({"ngram_size": True}, "ngram_size"),
        (
            {"max_length": 100, "cache_length": 101},
            "cache_length",
        ),
        (
            {"repetition_threshold": 1.5},
            "repetition_threshold",
        ),
    ],
)
def test_config_errors_name_field_value_and_range(kwargs, message):
    with raises_invalid(message, where="ShapingConfig"):
        shaping.ShapingConfig(**kwargs)


# ---------------------------------------------------------------- mutation audit (issue 13)
# Each test below kills mutants that survived `mutmut` on espo/rewards/shaping.py (see
# notes/mutmut.md): boundaries of every validity check, defaults, dtypes, full messages.


def test_smallest_valid_limits():
    # max_length = 1 is valid (">= 1"); cache_length may equal max_length (band (0, L_max]) or
    # be 0 (hard cut).
    assert [shaping.overlong_penalty(n, max_length=1, cache_length=0) for n in (0, 1, 2)] == [
        0.0,
        0.0,
        -1.0,
    ]
    # L_max = L_cache = 4: band (0, 4], steps of 1/4.
    got = [shaping.overlong_penalty(n, max_length=4, cache_length=4) for n in range(6)]
    assert got == [0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    np.testing.assert_array_equal(
        shaping.overlong_penalties(np.arange(6), max_length=4, cache_length=4), got
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"max_length": 10, "cache_length": 2.0},
            "cache_length",
        ),
        (
            {"max_length": 10, "cache_length": True},
            "cache_length",
        ),
        ({"max_length": True, "cache_length": 0}, "max_length"),
    ],
)
def test_length_limits_must_be_ints(kwargs, message):
    with raises_invalid(message):
        shaping.overlong_penalty(5, **kwargs)


def test_negative_length_message():
    with raises_invalid("length"):
        shaping.overlong_penalty(-1, max_length=10, cache_length=2)


def test_hard_cut_is_float32_for_numpy_input():
    got = shaping.overlong_penalties(np.array([10, 11]), max_length=10, cache_length=0)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, [0.0, -1.0])


def test_ngram_defaults_and_argument_types():
    # Default n = 4: "a b c d a b c d a" has 4-grams abcd bcda cdab dabc abcd bcda: 2 of 6 repeat
    # (n = 5 would give 1 of 5).
    text = "a b c d a b c d a"
    assert shaping.repeated_ngram_ratio(text) == pytest.approx(2 / 6)
    # repetition_penalty defaults: n = 4, weight 1, threshold 0.
    assert shaping.repetition_penalty(text) == pytest.approx(-2 / 6)
    for n in (2.0, True):
        with raises_invalid("n"):
            shaping.repeated_ngram_ratio(text, n=n)
    # Token ids are compared as integers: 2^53 and 2^53 + 1 are distinct (as float64 they tie).
    big = np.array([2**53, 2**53 + 1], np.int64)
    assert shaping.repeated_ngram_ratio(big, n=1) == 0.0


def test_config_boundaries_accepted_and_rejected():
    # Accepted: the smallest ints, cache 0 and cache == max_length, threshold 1.
    shaping.ShapingConfig(max_length=1, cache_length=1, ngram_size=1, repetition_threshold=1.0)
    shaping.ShapingConfig(max_length=5, cache_length=0)
    for kwargs, message in [
        (
            {"overlong_weight": float("inf")},
            "overlong_weight",
        ),
        (
            {"cache_length": 2.0},
            "cache_length",
        ),
        (
            {"cache_length": True},
            "cache_length",
        ),
    ]:
        with raises_invalid(message, where="ShapingConfig"):
            shaping.ShapingConfig(**kwargs)


def test_shape_rewards_passes_the_threshold_and_says_what_is_missing():
    # threshold 0.5: "a b a b a b" (ratio 0.6 at n = 2) is penalised, "a b c a b" (bigrams ab bc
    # ca ab: ratio 1/4) is not.
    cfg = shaping.ShapingConfig(repetition_weight=1.0, ngram_size=2, repetition_threshold=0.5)
    _, components = shaping.shape_rewards(
        np.zeros(2), lengths=np.array([6, 5]), token_ids_or_texts=["a b a b a b", "a b c a b"],
        cfg=cfg,
    )  # fmt: skip
    np.testing.assert_allclose(components["repetition"], [-0.6, 0.0], rtol=1e-6)
    message = "token_ids_or_texts must hold B=2 responses when repetition_weight=1.0 > 0; got None"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        shaping.shape_rewards(
            np.zeros(2), lengths=np.ones(2, int), token_ids_or_texts=None, cfg=cfg
        )
