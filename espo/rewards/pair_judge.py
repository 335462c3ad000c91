"""A trained pairwise judge: is response A better than, tied with or worse than B?

The paper's GenRM (docs/formulas.md §1.5) is a language model that reads two responses and
answers Better / Tie / Worse; its point is the explicit Tie class, which keeps equally good
responses from being pushed apart. This module is that judge as a classifier on the espo
backbone, trained on labelled pairs instead of generating its verdict as text (the generative
form is `espo.rewards.generative_judge`):
  * input (`pair_rows`): row A's real tokens (prompt + response), a separator (`sep_id`, the
    vocabulary's last id, unused by the character tokenizer), row B's real tokens, padded right;
  * logits (`judge_logits`): the final-norm hidden state at the last real token times a [D, 3]
    head, classes in `judge.VERDICTS` order (A better, tie, A worse), float32;
  * loss (`judge_loss`): cross entropy against the labels + the backbone's router aux loss;
    train with `reward_model.make_train_step(cfg, optimizer, loss=judge_loss)`;
  * `ModelJudge`: a `judge.PairJudgeFn` over (tokens, mask) rows, its verdict the argmax class,
    for `judge.judge_groups` (use both_orders=True: the classifier may favour a position).
Save and load it with `espo.rewards.model_rewards` (kind "pairwise").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from espo import model
from espo.rewards import judge
from espo.rewards import reward_model as rm

NUM_CLASSES = len(judge.VERDICTS)  # (better, tie, worse) for response A


class JudgeBatch(NamedTuple):
    tokens: Int[Array, "B S"]  # `pair_rows` of each pair
    mask: Bool[Array, "B S"]
    labels: Int[Array, " B"]  # index into judge.VERDICTS: 0 A better, 1 tie, 2 A worse


def sep_id(cfg: model.ModelConfig) -> int:
    """The separator between the two responses: the vocabulary's last id."""
    return cfg.vocab_size - 1


def init_pair_judge(cfg: model.ModelConfig, key: jax.Array) -> dict:
    """Backbone params from `model.init` and a zero [D, 3] head (every class equally likely)."""
    return {
        "backbone": model.init(cfg, key),
        "head": {
            "w": jnp.zeros((cfg.d_model, NUM_CLASSES), jnp.float32),
            "b": jnp.zeros((NUM_CLASSES,), jnp.float32),
        },
    }


def pair_rows(
    a_tokens: Int[np.ndarray, "B Ta"],
    a_mask: Bool[np.ndarray, "B Ta"],
    b_tokens: Int[np.ndarray, "B Tb"],
    b_mask: Bool[np.ndarray, "B Tb"],
    *,
    sep: int,
    pad_id: int = 0,
) -> tuple[Int[np.ndarray, "B S"], Bool[np.ndarray, "B S"]]:
    """Judge inputs [B, Ta + 1 + Tb]: A's real tokens, `sep`, B's real tokens, then padding
    (`pad_id`, masked out). The rows may be padded anywhere (left, right, both)."""
    a_tokens, b_tokens = np.asarray(a_tokens), np.asarray(b_tokens)
    a_mask, b_mask = np.asarray(a_mask, bool), np.asarray(b_mask, bool)
    B, Ta = a_tokens.shape
    Tb = b_tokens.shape[1]
    S = Ta + 1 + Tb
    # Real tokens first, in order: a stable sort of "is padding".
    a = np.take_along_axis(a_tokens, np.argsort(~a_mask, axis=1, kind="stable"), axis=1)
    b = np.take_along_axis(b_tokens, np.argsort(~b_mask, axis=1, kind="stable"), axis=1)
    na, nb = a_mask.sum(1), b_mask.sum(1)  # [B]
    cols = np.arange(S)[None]  # [1, S]
    tokens = np.full((B, S), pad_id, a_tokens.dtype)
    tokens[:, :Ta] = np.where(cols[:, :Ta] < na[:, None], a, pad_id)
    tokens[np.arange(B), na] = sep
    in_b = (cols > na[:, None]) & (cols <= (na + nb)[:, None])  # [B, S]
    b_at = np.clip(cols - na[:, None] - 1, 0, Tb - 1)  # [B, S] B's index at each position
    tokens = np.where(in_b, np.take_along_axis(b, b_at, axis=1), tokens)
    return tokens, cols <= (na + nb)[:, None]


def judge_logits(
    cfg: model.ModelConfig,
    params: dict,
    tokens: Int[Array, "B S"],
    *,
    attention_mask: Bool[Array, "B S"],
) -> tuple[Float[Array, "B 3"], model.ModelAux]:
    """Class logits (judge.VERDICTS order) of `pair_rows` inputs and the router stats."""
    final, aux = rm.last_hidden(cfg, params["backbone"], tokens, attention_mask=attention_mask)
    head = params["head"]
    # Multiply-and-sum, not a matmul: a default-precision dot may run in bf16 (TPU) / tf32 (GPU).
    return (final[:, :, None] * head["w"][None]).sum(1) + head["b"], aux  # [B, 3]


def judge_loss(
    cfg: model.ModelConfig, params: dict, batch: JudgeBatch
) -> tuple[Float[Array, " "], dict]:
    """mean_b -log softmax(logits_b)[label_b] + the backbone's router aux loss."""
    logits, aux = judge_logits(cfg, params, batch.tokens, attention_mask=batch.mask)
    logp = jax.nn.log_softmax(logits, axis=-1)  # [B, 3]
    ce = -jnp.take_along_axis(logp, batch.labels[:, None], axis=1).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == batch.labels)
    return ce + aux.total, {"ce_loss": ce, "accuracy": accuracy, "aux_loss": aux.total}


@dataclasses.dataclass
class ModelJudge:
    """judge(a, b) with a trained pair judge; a and b are (tokens [T], mask [T]) rows.

    `judge_pairs` classifies all of its pairs in chunks of `chunk` (one compile)."""

    cfg: model.ModelConfig
    params: dict
    chunk: int = 64

    def __post_init__(self):
        fn = jax.jit(lambda p, t, m: judge_logits(self.cfg, p, t, attention_mask=m)[0])
        self._logits = rm.chunked(fn, chunk=self.chunk)

    def logits(self, a_tokens, a_mask, b_tokens, b_mask) -> np.ndarray:
        """float32 [B, 3] of the pairs (A, B) row by row."""
        tokens, mask = pair_rows(a_tokens, a_mask, b_tokens, b_mask, sep=sep_id(self.cfg))
        return self._logits(self.params, tokens, mask).astype(np.float32)

    def judge_pairs(self, pairs: Sequence[tuple[tuple, tuple]]) -> list[str]:
        sides = zip(*pairs, strict=True)  # the A responses, the B responses
        (at, am), (bt, bm) = [[np.stack(x) for x in zip(*side, strict=True)] for side in sides]
        return [judge.VERDICTS[k] for k in np.argmax(self.logits(at, am, bt, bm), axis=-1)]

    def __call__(self, a, b) -> str:
        return self.judge_pairs([(a, b)])[0]
