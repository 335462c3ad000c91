"""Reward shaping: penalties added to the verifiable reward (ZVE's reward stage).

This module owns the auxiliary penalties of docs/formulas.md §1.7 (ZVE's reward stage is §1.1)
and their combination:
  * DAPO soft overlong punishment (DAPO Eq. 13, [VERIFIED] there; CompassMax's own length penalty
    is [UNKNOWN], this is the stand-in):
        R_len(L) = 0                          if L <= L_max - L_cache
                 = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                 = -1                         if L > L_max
    equivalently clip(((L_max - L_cache) - L) / L_cache, -1, 0). With L_cache = 0 it is a hard
    cut: 0 up to L_max, -1 beyond.
  * A repetition penalty (formula [INFERRED]; the paper mentions none): -weight * r where r is the
    repeated n-gram ratio, the fraction of a sequence's n-grams that repeat an earlier n-gram,
    applied only when r > threshold.

Invariant: `shape_rewards` returns `shaped == base + sum(components.values())` exactly, each
component already weighted, so the logged components explain the shaped reward. Penalties are
never positive. No state: every function is pure and the config is a frozen dataclass.
"""

from __future__ import annotations

import dataclasses
import math as pymath
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from espo import errors

TokensOrText = str | Sequence[int] | np.ndarray


def _check_lengths(*, max_length: int, cache_length: int) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise errors.InvalidValue("", "max_length", max_length, "an int >= 1")
    if (
        isinstance(cache_length, bool)
        or not isinstance(cache_length, int)
        or not 0 <= cache_length <= max_length
    ):
        valid = f"an int in [0, max_length={max_length}]"
        raise errors.InvalidValue("", "cache_length", cache_length, valid)


def overlong_penalty(length: int, *, max_length: int, cache_length: int) -> float:
    """DAPO soft overlong punishment of one response of `length` tokens (in [-1, 0])."""
    _check_lengths(max_length=max_length, cache_length=cache_length)
    if length < 0:
        raise errors.InvalidValue("", "length", length, ">= 0")
    soft_start = max_length - cache_length
    if length <= soft_start:
        return 0.0
    if length > max_length:
        return -1.0
    return (soft_start - length) / cache_length


def overlong_penalties(
    lengths: Int[Array, " B"] | Int[np.ndarray, " B"],
    *,
    max_length: int,
    cache_length: int,
) -> Float[Array, " B"] | Float[np.ndarray, " B"]:
    """`overlong_penalty` of every length, float32, as a jax array for jax input (jit-safe; the
    limits are static) and a numpy array otherwise."""
    _check_lengths(max_length=max_length, cache_length=cache_length)
    xp = jnp if isinstance(lengths, jax.Array) else np
    lengths = xp.asarray(lengths)
    if cache_length == 0:  # Hard cut; the soft formula would divide by zero.
        return xp.where(lengths > max_length, -1.0, 0.0).astype(xp.float32)
    # Integer difference first: exact for any length, one rounding in the division.
    soft = ((max_length - cache_length) - lengths).astype(xp.float32) / cache_length  # [B]
    return xp.clip(soft, -1.0, 0.0).astype(xp.float32)  # [B]


def _as_tokens(tokens_or_text: TokensOrText) -> np.ndarray:
    """int64 [T] ids; text is split on whitespace and each distinct word given an id."""
    if isinstance(tokens_or_text, str):
        vocab: dict[str, int] = {}
        ids = [vocab.setdefault(word, len(vocab)) for word in tokens_or_text.split()]
        return np.asarray(ids, dtype=np.int64)
    tokens = np.asarray(tokens_or_text)
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    return tokens.astype(np.int64)


def repeated_ngram_ratio(tokens_or_text: TokensOrText, *, n: int = 4) -> float:
    """The fraction of the n-grams of a sequence that repeat an earlier n-gram.

    (number of n-grams - number of distinct n-grams) / number of n-grams, in [0, 1); 0 when the
    sequence is shorter than `n`. A string is split on whitespace (n-grams of words); anything
    else is a 1-D sequence of token ids. E.g. "a b a b a b", n=2: bigrams ab ba ab ba ab, three
    repeat an earlier one -> 3/5.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise errors.InvalidValue("", "n", n, "an int >= 1")
    tokens = _as_tokens(tokens_or_text)  # [T]
    num_ngrams = tokens.shape[0] - n + 1
    if num_ngrams <= 0:
        return 0.0
    windows = np.lib.stride_tricks.sliding_window_view(tokens, n)  # [T - n + 1, n]
    num_distinct = np.unique(windows, axis=0).shape[0]
    return (num_ngrams - num_distinct) / num_ngrams


def repetition_penalty(
    tokens_or_text: TokensOrText, *, n: int = 4, weight: float = 1.0, threshold: float = 0.0
) -> float:
    """-weight * repeated_ngram_ratio if that ratio exceeds `threshold`, else 0."""
    ratio = repeated_ngram_ratio(tokens_or_text, n=n)
    return -weight * ratio if ratio > threshold else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapingConfig:
    """Weights and limits of the reward penalties.

    Attributes:
      overlong_weight: multiplies the overlong penalty (in [-1, 0]); DAPO uses 1; 0 disables it.
      max_length: L_max, responses longer than this get the full -1 (DAPO: 20480).
      cache_length: L_cache, the soft-penalty band (L_max - L_cache, L_max] (DAPO: 4096).
      repetition_weight: multiplies the repeated n-gram ratio; 0 (the default) disables it.
      ngram_size: n of the repeated n-gram ratio.
      repetition_threshold: ratios at or below this are not penalised.
    """

    overlong_weight: float = 1.0
    max_length: int = 20480
    cache_length: int = 4096
    repetition_weight: float = 0.0
    ngram_size: int = 4
    repetition_threshold: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overlong_weight", "repetition_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < pymath.inf:
                raise errors.InvalidValue("ShapingConfig", name, value, "in [0, inf)")
        for name, low in (("max_length", 1), ("ngram_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise errors.InvalidValue("ShapingConfig", name, value, f"an int >= {low}")
        cache = self.cache_length
        if (
            isinstance(cache, bool)
            or not isinstance(cache, int)
            or not 0 <= cache <= self.max_length
        ):
            valid = f"an int in [0, max_length={self.max_length}]"
            raise errors.InvalidValue("ShapingConfig", "cache_length", cache, valid)
        threshold = self.repetition_threshold
        if not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise errors.InvalidValue(
                "ShapingConfig", "repetition_threshold", threshold, "in [0, 1]"
            )


def shape_rewards(
    base_rewards: Float[np.ndarray, " B"],
    *,
    lengths: Int[np.ndarray, " B"],
    token_ids_or_texts: Sequence[TokensOrText] | np.ndarray | None,
    cfg: ShapingConfig,
) -> tuple[Float[np.ndarray, " B"], Mapping[str, Float[np.ndarray, " B"]]]:
    """The base rewards plus the weighted penalties, on the host (numpy, float32).

    Args:
      base_rewards: [B] verifiable rewards.
      lengths: [B] response lengths in tokens (for the overlong penalty, and to cut padding).
      token_ids_or_texts: B responses for the repetition penalty: texts, token-id sequences, or
        a padded [B, T] id array whose row i is cut to `lengths[i]` (token sequences are cut the
        same way; texts are used whole). May be None when `cfg.repetition_weight == 0`.
      cfg: the penalty weights and limits.

    Returns:
      (shaped [B], components) with components {"overlong": [B], "repetition": [B]}, each the
      weighted penalty actually added, so shaped == base + sum(components.values()).
    """
    base = np.asarray(base_rewards, dtype=np.float32)  # [B]
    lengths = np.asarray(lengths)  # [B]
    if base.ndim != 1 or lengths.shape != base.shape:
        raise ValueError(
            f"base_rewards and lengths must both be [B]; got {base.shape} and {lengths.shape}"
        )
    overlong = cfg.overlong_weight * overlong_penalties(
        lengths, max_length=cfg.max_length, cache_length=cfg.cache_length
    )  # [B]
    repetition = np.zeros_like(base)  # [B]
    if cfg.repetition_weight > 0:
        if token_ids_or_texts is None or len(token_ids_or_texts) != base.shape[0]:
            got = None if token_ids_or_texts is None else len(token_ids_or_texts)
            raise ValueError(
                f"token_ids_or_texts must hold B={base.shape[0]} responses when "
                f"repetition_weight={cfg.repetition_weight} > 0; got {got}"
            )
        for i, response in enumerate(token_ids_or_texts):
            if not isinstance(response, str):
                response = response[: int(lengths[i])]
            repetition[i] = repetition_penalty(
                response,
                n=cfg.ngram_size,
                weight=cfg.repetition_weight,
                threshold=cfg.repetition_threshold,
            )
    components = {"overlong": overlong.astype(np.float32), "repetition": repetition}
    shaped = base + sum(components.values())  # [B]
    return shaped, components
