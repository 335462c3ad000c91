"""A generative pairwise judge backed by an espo model (the GenRM of docs/formulas.md §1.5).

This module owns the prompt a judge model sees, the parsing of its completion into a verdict, and
text generation through `espo.sampler`:
  * `ModelCompleter`: prompts (text) -> completions (text) with any `espo.sampler.SamplingModel`
    (or a `ModelConfig`) and a tokenizer-like `encode` / `decode` pair, batched through
    `sampler.sample` in fixed-size chunks (one compile per prompt bucket);
  * `parse_verdict`: completion -> "better" / "worse" / "tie" for response A, or
    `judge.UNPARSEABLE`;
  * `GenerativeJudge`: a `judge.PairJudgeFn` that renders the pairwise `template` (question,
    response A, response B) for each pair, completes all of a group's pairs in one call and
    parses them. It plugs into `judge.judge_group` / `judge.judge_groups` like `FakeJudge`.

Verdict parsing (robust to malformed output): a label is "A" or "B" (upper case, so the article
"a" is not one) or "tie" (any case), standing alone, i.e. not inside a longer word ("Bob",
"ABBA", "tied", "A-grade" are not labels). If the completion names labels after "verdict:" or
"answer:" (e.g. "A looks longer. Verdict: B") and they agree, that label wins; otherwise the
completion must hold exactly one distinct label. Anything else (empty, garbage, both "A" and "B") is
UNPARSEABLE: `judge_group` scores it as a tie and counts it (`judge/unparseable`), so a judge
that cannot answer adds no signal instead of a random one.

Position bias: a judge model may prefer whichever response it sees first. Use
`judge.judge_group(..., both_orders=True)`, which asks for (A, B) = (o_i, o_j) and (o_j, o_i) and
averages the two scores, (s(o_i, o_j) - s(o_j, o_i)) / 2: a judge that always answers "A" then
gives every pair 0 (a zero-variance, non-verifiable group), and a consistent judge is unchanged.
Both orders of every pair go to the model in one `judge_pairs` call.
"""

from __future__ import annotations

import dataclasses
import re
import string
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from espo import errors, sampler, scheduling
from espo.rewards import judge

DEFAULT_TEMPLATE = (
    "Compare two responses to the question.\n"
    "Question: {question}\n"
    "Response A: {a}\n"
    "Response B: {b}\n"
    "Which response is better? Answer A, B or Tie.\n"
    "Verdict:"
)
_FIELDS = {"question", "a", "b"}

_EDGE = r"[\w-]"  # characters that make a label part of a longer word
_LABEL = rf"(?<!{_EDGE})(A|B|[Tt][Ii][Ee])(?!{_EDGE})"
_LABEL_RE = re.compile(_LABEL)
_EXPLICIT_RE = re.compile(rf"(?i:verdict|answer)\s*[:=]\W{{0,3}}{_LABEL}")
_VERDICT = {"A": "better", "B": "worse", "TIE": "tie"}  # from response A's side


def parse_verdict(completion: str) -> str:
    """ "better" (A wins) / "worse" (B wins) / "tie", or judge.UNPARSEABLE (module docstring).

    Examples: " A" -> better; "Tie." -> tie; "**B**" -> worse; "A is better. Verdict: A" ->
    better; "A or B" -> unparseable; "Bob" -> unparseable; "" -> unparseable.
    """
    for pattern in (_EXPLICIT_RE, _LABEL_RE):
        labels = {m.upper() for m in pattern.findall(completion)}
        if len(labels) == 1:
            return _VERDICT[labels.pop()]
        if labels:  # conflicting labels: no verdict
            return judge.UNPARSEABLE
    return judge.UNPARSEABLE


def _check_int(owner: str, name: str, value: Any, low: int) -> None:
    if not errors.is_int(value) or value < low:
        raise errors.InvalidValue(owner, name, value, f"an int >= {low}")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ModelCompleter:
    """Text completion with an espo model: `completer(prompts) -> completions` (lists of str).

    Each prompt is encoded, sampled once with `espo.sampler.sample` (at most max_new_tokens,
    stopping at eos_id) and the completion, EOS excluded, decoded. Prompts go in chunks of
    batch_size rows (the last one padded with copies of its first prompt), so a run compiles
    once per prompt bucket. Greedy by default (temperature 0): a judge's verdict should be a
    function of its prompt. With temperature > 0, each chunk's key is `key` folded with a
    CRC32 of its prompts, so the same comparison always gets the same randomness.
    """

    model: sampler.SamplingModel | Any  # a SamplingModel or an espo ModelConfig
    params: Any
    encode: Callable[[str], Sequence[int]]  # text -> token ids (< the model's vocabulary)
    decode: Callable[[Sequence[int]], str]  # token ids -> text
    eos_id: int
    pad_id: int
    max_new_tokens: int = 8  # a verdict is a word or two
    temperature: float = 0.0
    key: jax.Array | None = None  # needed when temperature > 0
    batch_size: int = 8  # rows per sampler call
    buckets: scheduling.LengthBuckets = sampler.DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        for name in ("encode", "decode"):
            if not callable(getattr(self, name)):
                raise errors.InvalidValue("ModelCompleter", name, getattr(self, name), "callable")
        _check_int("ModelCompleter", "batch_size", self.batch_size, 1)
        _check_int("ModelCompleter", "max_new_tokens", self.max_new_tokens, 1)
        _check_int("ModelCompleter", "eos_id", self.eos_id, 0)
        _check_int("ModelCompleter", "pad_id", self.pad_id, 0)
        if self.temperature > 0 and self.key is None:
            raise errors.InvalidValue(
                "ModelCompleter", "key", None,
                f"a PRNG key with temperature={self.temperature!r} (or temperature=0, greedy)",
            )  # fmt: skip
        sampler.SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            stop_ids=(self.eos_id,), pad_id=self.pad_id,
        )  # fmt: skip

    def __call__(self, prompts: Sequence[str]) -> list[str]:
        out: list[str] = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._complete_chunk(list(prompts[start : start + self.batch_size]))
        return out

    def _complete_chunk(self, prompts: list[str]) -> list[str]:
        ids = [list(self.encode(p)) for p in prompts]
        for p, row in zip(prompts, ids, strict=True):
            if not row:
                raise ValueError(f"ModelCompleter.encode({p!r}) returned no tokens")
        n = len(ids)
        ids += [ids[0]] * (self.batch_size - n)  # a fixed batch: one compile per bucket
        if self.temperature > 0:
            digest = zlib.crc32("\x00".join(prompts).encode()) & 0x7FFFFFFF
            key = jax.random.fold_in(self.key, digest)
        else:
            key = jax.random.key(0)  # unused by greedy decoding
        result = sampler.sample(
            self.model, self.params, ids, np.array([len(r) for r in ids]), key=key,
            num_samples=1, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            stop_ids=(self.eos_id,), pad_id=self.pad_id, buckets=self.buckets,
        )  # fmt: skip
        tokens = np.asarray(result.tokens)  # [batch_size, Tg]
        lengths = np.asarray(result.lengths)  # [batch_size], EOS included when finished
        finished = np.asarray(result.finished)  # [batch_size]
        return [self.decode(tokens[i, : lengths[i] - int(finished[i])].tolist()) for i in range(n)]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GenerativeJudge:
    """A pairwise judge that asks a model: `judge(a, b)` / `judge.judge_pairs(pairs)`.

    `complete` maps prompts to completions (a `ModelCompleter`, or any scripted stand-in);
    `render` turns a response into the text placed in the template. The question is part of
    the judge: use `for_question(q)` per group, e.g.
    `judge.judge_group(responses, gen.for_question(q), both_orders=True)`.
    """

    complete: Callable[[Sequence[str]], Sequence[str]]
    question: str = ""
    template: str = DEFAULT_TEMPLATE  # with the fields {question}, {a}, {b}
    render: Callable[[Any], str] = str

    def __post_init__(self) -> None:
        if not callable(self.complete):
            raise errors.InvalidValue("GenerativeJudge", "complete", self.complete, "callable")
        if not callable(self.render):
            raise errors.InvalidValue("GenerativeJudge", "render", self.render, "callable")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        except ValueError as e:
            raise errors.InvalidValue("GenerativeJudge", "template", self.template, f"{e}") from e
        if fields != _FIELDS:
            raise ValueError(
                f"GenerativeJudge.template={self.template!r} has fields {sorted(fields)}; it "
                f"must use exactly {sorted(_FIELDS)}"
            )

    def for_question(self, question: str) -> GenerativeJudge:
        """The same judge for another question."""
        return dataclasses.replace(self, question=question)

    def prompt(self, a: Any, b: Any) -> str:
        """The judge's prompt with a as response A and b as response B."""
        return self.template.format(question=self.question, a=self.render(a), b=self.render(b))

    def judge_pairs(self, pairs: Sequence[tuple[Any, Any]]) -> list[str]:
        """Verdicts (from each pair's first response's side) of all `pairs`, in one call."""
        completions = list(self.complete([self.prompt(a, b) for a, b in pairs]))
        if len(completions) != len(pairs):
            raise ValueError(
                f"GenerativeJudge.complete returned {len(completions)} completions for "
                f"{len(pairs)} prompts"
            )
        return [parse_verdict(c) for c in completions]

    def __call__(self, a: Any, b: Any, /) -> str:
        return self.judge_pairs([(a, b)])[0]
