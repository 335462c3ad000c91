"""The default task: + / - chains worked a step a line, demonstrated by a flawed teacher.

This module owns the `data.source="chains"` task end to end (pure Python, no JAX, so reward
workers import it fast): the generator, the teacher that writes the warm start's demonstrations,
the verifier (the reward) and the process check.

A prompt is a chain of one-digit terms joined by + and -, evaluated left to right:

    "Calculate 7 - 3 - 6 + 1."

A worked solution takes one binary step a line, left to right, and ends with the answer alone
(the format of `espo.data.worked`, which the earlier default used):

    "7-3=4\n4-6=-2\n-2+1=-1\n-1"

A chain of n terms takes n lines and about 10 n characters. Chain lengths are heavy-tailed:
P(n) proportional to `terms_decay ** (n - min_terms)`. (A pilot of a "rewrite" format, the
chain rewritten with its first two terms reduced on each line, reached greedy pass@1 0.15 after
300 warm-start steps on 3-6 terms, against 0.63 for this one: docs/testbed/README.md, "How the
default was chosen".)

The teacher (`teacher_solution`) has one systematic, realistic flaw (`data.teacher_flaw`), made
with probability `data.teacher_error` at each place it can occur:
  * "final_sign": it drops the minus sign of a negative answer on the last line (a copying slip
    at the end: every step above it is right);
  * "sign": it drops the minus sign of any negative value it writes, and carries on from the
    wrong value (the steps after it are right for what is written, so the chain ends wrong);
  * "none": a perfect teacher.
The verifier (`ChainReward`) checks the true answer, so supervised learning on the teacher
converges to the teacher's bug while reward can remove it: a controlled model of a cold start on
distilled traces followed by RL with verifiable rewards.

Process fidelity (`check_process`): a completion is faithful when every step is a true step
that starts from the value of the step above (the first term for the first step) and takes the
chain's next operator and term, so the steps consume the terms in order, and the last line is
the last step's value. A right answer reached any other way is counted (`eval/right_answer_wrong_
process`), so a gain that does not come from doing the task shows.

Examples get ids "chains:<n>-terms:<index>" (so evaluation reports pass@1 per length) and
difficulty (n - min_terms) / (max_terms - min_terms); meta holds "task", "answer", "terms" and
"ops". Every draw is a pure function of (seed, index): the same `data.seed` gives the same
examples and demonstrations in every run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from espo import errors

TASK = "chains"
FLAWS = ("none", "final_sign", "sign")
OPERATORS = ("+", "-")
EXEC_TIMEOUT_S = 10.0  # executed_reward: a program that runs longer is an error
_STEP = re.compile(r"(-?\d+)([+-])(\d+)=(-?\d+)")


@dataclasses.dataclass(frozen=True)
class Chain:
    """terms[0] ops[0] terms[1] ... evaluated left to right; len(ops) == len(terms) - 1."""

    terms: tuple[int, ...]
    ops: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.terms) < 2 or len(self.ops) != len(self.terms) - 1:
            raise ValueError(
                f"Chain: {len(self.terms)} terms and {len(self.ops)} operators; valid: >= 2 terms "
                "and one operator fewer"
            )
        if any(op not in OPERATORS for op in self.ops):
            raise errors.InvalidValue("Chain", "ops", self.ops, f"{OPERATORS}")

    @property
    def prompt(self) -> str:
        return f"Calculate {render(self)}."

    def values(self) -> list[int]:
        """The value after each step: values()[-1] is the answer."""
        out, v = [], self.terms[0]
        for op, t in zip(self.ops, self.terms[1:], strict=True):
            v = apply(v, op, t)
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]


def apply(a: int, op: str, b: int) -> int:
    """a + b or a - b."""
    return a + b if op == "+" else a - b


def render(chain: Chain) -> str:
    """The expression: "7 - 3 - 6 + 1"."""
    ops_terms = (f"{op} {t}" for op, t in zip(chain.ops, chain.terms[1:], strict=True))
    return " ".join([str(chain.terms[0]), *ops_terms])


def solution(chain: Chain, written: Sequence[int] | None = None, answer: int | None = None) -> str:
    """The worked solution, one binary step a line ("4-6=-2"), then the answer alone: step k
    writes `written[k]` as its value (default: the true values) and starts from the value
    written above it; the last line is `answer` (default: the last value written)."""
    written = chain.values() if written is None else list(written)
    answer = written[-1] if answer is None else answer
    before = [chain.terms[0], *written[:-1]]
    steps = zip(before, chain.ops, chain.terms[1:], written, strict=True)
    return "\n".join([*(f"{a}{op}{t}={v}" for a, op, t, v in steps), str(answer)])


def teacher_values(
    chain: Chain, *, flaw: str, error: float, rng: random.Random
) -> tuple[list[int], int]:
    """(the step values, the answer) the flawed teacher writes (see the module docstring); one
    `rng` draw per place the flaw can occur (a negative value), so its rate is `error` there."""
    if flaw not in FLAWS:
        raise ValueError(f"teacher flaw {flaw!r} is invalid; valid: {', '.join(FLAWS)}")
    values, v = [], chain.terms[0]
    for op, t in zip(chain.ops, chain.terms[1:], strict=True):
        v = apply(v, op, t)
        if flaw == "sign" and v < 0 and rng.random() < error:
            v = -v  # the minus sign dropped; the teacher carries on from what it wrote
        values.append(v)
    answer = values[-1]
    if flaw == "final_sign" and answer < 0 and rng.random() < error:
        answer = -answer  # dropped on the answer line only; the steps above are right
    return values, answer


def teacher_solution(chain: Chain, *, flaw: str, error: float, rng: random.Random) -> str:
    """The flawed teacher's demonstration of `chain`."""
    return solution(chain, *teacher_values(chain, flaw=flaw, error=error, rng=rng))


@dataclasses.dataclass(frozen=True)
class ProcessCheck:
    faithful: bool  # every step true, from the value above, taking the terms in order
    correct: bool  # the last line is the true answer (what the reward checks)


def parse_step(line: str) -> tuple[int, str, int, int] | None:
    """(a, op, b, c) of a step line "a<op>b=c" (a and c may be negative), or None."""
    match = _STEP.fullmatch(line.strip())
    if not match:
        return None
    a, op, b, c = match.groups()
    return int(a), op, int(b), int(c)


def final_answer(completion: str) -> str:
    """The completion's last non-empty line, stripped (what the reward compares)."""
    lines = [line.strip() for line in completion.strip().split("\n") if line.strip()]
    return lines[-1] if lines else ""


def check_process(chain: Chain, completion: str) -> ProcessCheck:
    """Is every step of `completion` a true step, taking the chain's terms in order, and is the
    last line the value of the last step? (see the module doc)"""
    correct = final_answer(completion) == str(chain.answer)
    lines = [line for line in completion.strip().split("\n") if line.strip()]
    if len(lines) != len(chain.terms):  # n - 1 steps and the answer
        return ProcessCheck(faithful=False, correct=correct)
    value = chain.terms[0]
    for line, op, term in zip(lines, chain.ops, chain.terms[1:], strict=False):
        true = apply(value, op, term)
        if parse_step(line) != (value, op, term, true):
            return ProcessCheck(faithful=False, correct=correct)
        value = true
    return ProcessCheck(faithful=lines[-1].strip() == str(value), correct=correct)


def chain_of(meta: Mapping[str, Any]) -> Chain:
    """The Chain an example's meta describes (meta["terms"], meta["ops"])."""
    try:
        return Chain(tuple(int(t) for t in meta["terms"]), tuple(meta["ops"]))
    except (KeyError, TypeError) as e:
        raise KeyError(
            f"chains: meta needs 'terms' and 'ops' (it has {sorted(meta)}); examples of "
            "data.source='chains' carry them"
        ) from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainReward:
    """1.0 when the completion's last line is the true answer (an integer, exactly), else 0.0."""

    def __call__(self, prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
        del prompt
        if "answer" not in meta:
            raise KeyError(f"ChainReward: meta has no 'answer' (it has {sorted(meta)})")
        return float(final_answer(completion) == str(meta["answer"]))


def executed_reward(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
    """`ChainReward`'s value with the true answer computed by executing the chain as a program in
    a fresh, isolated Python interpreter (`python -I -c "print(7 - 3 - 6 + 1)"`), as a
    code-execution verifier runs each sample's program: the same reward at the cost of a process
    start (about 20-30 ms a sample on 2 cores; `reward.function=espo.data.chains:executed_reward`,
    the realistic reward latency of experiments/repro_system.py). A failed or overlong run
    raises (the reward pool marks the sample `reward_ok=False`)."""
    del prompt
    program = f"print({render(chain_of(meta))})"
    out = subprocess.run(
        [sys.executable, "-I", "-c", program],
        capture_output=True, text=True, timeout=EXEC_TIMEOUT_S, check=True,
    )  # fmt: skip
    return float(final_answer(completion) == out.stdout.strip())


def process_faithful(prompt: str, completion: str, meta: Mapping[str, Any]) -> bool:
    """`check_process(...).faithful` of an example's completion (the evaluator's hook)."""
    del prompt
    return check_process(chain_of(meta), completion).faithful


def length_weights(min_terms: int, max_terms: int, decay: float) -> list[float]:
    """P(n) for n = min_terms..max_terms, proportional to decay ** (n - min_terms)."""
    w = [decay ** (n - min_terms) for n in range(min_terms, max_terms + 1)]
    return [x / sum(w) for x in w]


def _rng(seed: int, what: str, index: int) -> random.Random:
    digest = hashlib.blake2b(f"espo:chains:{seed}:{what}:{index}".encode(), digest_size=8)
    return random.Random(int.from_bytes(digest.digest(), "big"))


def draw(seed: int, index: int, *, min_terms: int, max_terms: int, decay: float) -> Chain:
    """Chain `index` of `seed`: its length from `length_weights`, terms uniform in 0..9, each
    operator + or - with probability 1/2."""
    rng = _rng(seed, "chain", index)
    lengths = range(min_terms, max_terms + 1)
    n = rng.choices(lengths, weights=length_weights(min_terms, max_terms, decay))[0]
    terms = tuple(rng.randrange(10) for _ in range(n))
    ops = tuple(rng.choice(OPERATORS) for _ in range(n - 1))
    return Chain(terms, ops)


def demonstration(seed: int, index: int, chain: Chain, *, flaw: str, error: float) -> str:
    """The teacher's demonstration of example `index` (its own random stream)."""
    return teacher_solution(chain, flaw=flaw, error=error, rng=_rng(seed, "teacher", index))
