"""The generative judge end to end with a tiny real espo model and a char-level tokenizer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import model, scheduling
from espo.rewards import generative_judge as gj
from espo.rewards import judge
from espo.testing import raises_invalid

EOS, PAD = 1, 0
CFG = model.ModelConfig.tiny(num_layers=1)  # vocab 256: every ASCII character is a token
BUCKETS = scheduling.LengthBuckets(prompt_buckets=(128, 256), generation_buckets=(4,))
QUESTION = "What is 2 + 2?"
RESPONSES = ["4", "5", "four"]


def encode(text: str) -> list[int]:
    """A trivial char-level tokenizer: a character's code point is its id (ASCII only)."""
    ids = [ord(c) for c in text]
    assert all(2 <= i < CFG.vocab_size for i in ids), text
    return ids


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def params():
    # An "rbg" key: compiling `model.init` takes about half as long as with threefry.
    return model.init(CFG, jax.random.key(0, impl="rbg"))


def _completer(model_, params, **kw):
    return gj.ModelCompleter(
        model=model_, params=params, encode=encode, decode=decode, eos_id=EOS, pad_id=PAD,
        max_new_tokens=4, batch_size=8, buckets=BUCKETS, **kw,
    )  # fmt: skip


@pytest.mark.slow
def test_tiny_model_judges_a_group_end_to_end(params):
    completer = _completer(CFG, params)
    gen = gj.GenerativeJudge(complete=completer).for_question(QUESTION)
    scores = judge.judge_group(RESPONSES, gen, both_orders=True)
    assert scores.rewards.shape == (3,) and np.isfinite(scores.rewards).all()
    np.testing.assert_allclose(scores.rewards.sum(), 0.0, atol=1e-6)
    assert not scores.verifiable and scores.metrics["judge/comparisons"] == 6.0
    pairs = [(a, b) for a in RESPONSES for b in RESPONSES if a != b]
    prompts = [gen.prompt(a, b) for a, b in pairs]
    completions = completer(prompts)  # greedy: the judge saw exactly these
    assert len(completions) == 6 and all(isinstance(c, str) for c in completions)
    assert all(len(c) <= 4 for c in completions)  # max_new_tokens, EOS stripped
    verdicts = gen.judge_pairs(pairs)
    assert verdicts == [gj.parse_verdict(c) for c in completions]
    assert set(verdicts) <= {*judge.VERDICTS, judge.UNPARSEABLE}
    assert scores.metrics["judge/unparseable"] == verdicts.count(judge.UNPARSEABLE)
    # A prompt's completion does not depend on the rows padding its chunk.
    assert completer(prompts[:1]) == completions[:1]


@dataclasses.dataclass(frozen=True)
class FirstLabelModel:
    """The tiny espo model with +100 on the logit of "A": a judge with total position bias."""

    inner: model.Model

    @property
    def num_layers(self):
        return self.inner.num_layers

    @property
    def top_k(self):
        return self.inner.top_k

    def init_cache(self, *, batch, max_length):
        return self.inner.init_cache(batch=batch, max_length=max_length)

    def forward(self, params, tokens, *, attention_mask, cache):
        out = self.inner.forward(params, tokens, attention_mask=attention_mask, cache=cache)
        bias = 100.0 * jax.nn.one_hot(ord("A"), CFG.vocab_size)  # [V]
        return out.replace(logits=out.logits + bias)  # [B, T, V]


@pytest.mark.slow
def test_position_biased_model_is_cancelled_by_both_orders(params):
    biased = FirstLabelModel(model.Model(CFG))
    completer = dataclasses.replace(_completer(biased, params), max_new_tokens=1)
    gen = gj.GenerativeJudge(complete=completer).for_question(QUESTION)
    assert completer([gen.prompt("4", "5")]) == ["A"]
    one_order = judge.judge_group(RESPONSES, gen)  # "A" always: the first response wins
    np.testing.assert_allclose(one_order.rewards, [1.0, 0.0, -1.0])
    both = judge.judge_group(RESPONSES, gen, both_orders=True)
    np.testing.assert_array_equal(both.rewards, 0.0)  # a zero-variance, non-verifiable group
    assert bool(both.zero_variance_mask) and not bool(both.verifiable)
    assert both.metrics["judge/unparseable"] == 0.0


def test_model_completer_validation(params):
    with raises_invalid("key", where="ModelCompleter"):
        _completer(CFG, params, temperature=1.0)
    with pytest.raises(ValueError, match=r"ModelCompleter\.batch_size=0"):
        dataclasses.replace(_completer(CFG, params), batch_size=0)
    with raises_invalid("encode", where="ModelCompleter"):
        dataclasses.replace(_completer(CFG, params), encode=3)
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p|temperature"):
        _completer(CFG, params, temperature=-1.0, key=jax.random.key(0))
    empty = dataclasses.replace(_completer(CFG, params), encode=lambda text: [])
    with pytest.raises(ValueError, match=r"encode\(''\) returned no tokens"):
        empty([""])
    assert _completer(CFG, params, temperature=0.7, key=jnp.zeros((2,), jnp.uint32))
