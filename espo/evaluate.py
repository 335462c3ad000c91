"""Held-out evaluation: greedy pass@1, and avg@k / pass@k over k sampled completions.

Owns the eval metrics the trainer logs at the start, every `eval.every_steps` and at the end:
  eval/pass@1          share of prompts whose greedy completion is correct;
  eval/avg@{k}         share of the k sampled completions (at `temperature`) that are correct,
                       averaged over prompts (the mean per-prompt accuracy);
  eval/pass@{k}        share of prompts with at least one correct sampled completion (left out
                       when k == 1: it equals avg@1, and its name is the greedy pass@1's);
  eval/reward_mean     mean reward of the sampled completions (shaped rewards included);
  eval/mean_length     mean sampled completion length in tokens (EOS included);
  eval/greedy_mean_length, eval/num_prompts, eval/num_sampled_prompts (the sampled pass may
                       cover only the first `sampled_prompts`: pass@k on a subset);
  eval/maj@{k}         (with an answer_fn) share of prompts whose most frequent sampled answer
                       is correct: majority voting, the baseline RL is compared with;
  eval/process_fidelity, eval/right_answer_wrong_process  (with a process_fn) share of greedy
                       completions whose steps are right, and of right greedy answers whose
                       steps are not;
  eval/pass@1/{group}, eval/pass@{k}/{group}  the same per group when prompts carry several groups.
A completion is correct when reward_fn(prompt_text, completion_text, meta) > 0.5 (the verifiers
return 1.0 / 0.0), so pass@k >= avg@k >= 0 always holds.

Invariants:
- Compiles once per (model, prompt bucket, generation bucket, batch size): every sampler call of
  an evaluation has the same padded batch (the last batch is filled with copies of the last
  prompt whose outputs are dropped), the same prompt bucket (the bucket of the longest held-out
  prompt) and the same generation bucket, so repeated evaluations never recompile.
- Every sampler call gets its own key: greedy and sampled passes split `key`, and batch b of a
  pass uses `jax.random.fold_in(pass_key, b)`.
- Rewards are computed in-process while the next batch decodes (JAX dispatch is asynchronous).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from espo import errors, sampler, scheduling
from espo.model import config as config_lib

CORRECT_ABOVE = 0.5  # reward > this counts as a correct completion
EVAL_SPLITS = ("test", "dev")  # the halves of a held-out set (espo.data.sources.eval_split_of)

# Arguments of `sampler.sample` that `evaluate` sets itself (not allowed in `sampling_kw`).
_RESERVED = ("key", "num_samples", "max_new_tokens", "temperature", "buckets")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """How held-out prompts are evaluated, and (the trainer's part) when and on how many."""

    samples: int = 8  # k: sampled completions per prompt for avg@k / pass@k
    temperature: float = 1.0  # sampling temperature of the k samples (greedy pass@1 uses 0)
    max_new_tokens: int  # generation budget of every completion
    batch_size: int = 64  # rows per sampler call (prompts x samples); >= samples
    # Prompts of the sampled pass (avg@k, pass@k, maj@k): the first this many; 0 = all.
    sampled_prompts: int = 0
    # The trainer's schedule: every this many RL steps (0: only at the start and the end), on the
    # first `num_prompts` held-out prompts of `split` (test: report | dev: tune).
    every_steps: int = 0
    num_prompts: int = 256
    split: str = "test"
    # Only held-out prompts of at least this difficulty level (`Example.difficulty`, in [0, 1]);
    # 0 = every prompt. Above 0, prompts without a level (NaN) are left out.
    min_difficulty: float = 0.0

    def __post_init__(self):
        checks = {
            "samples": (_is_int(self.samples) and self.samples >= 1, "an int >= 1"),
            "temperature": (
                isinstance(self.temperature, int | float) and 0 < self.temperature < math.inf,
                "a finite number > 0 (greedy pass@1 is always computed)",
            ),
            "max_new_tokens": (
                _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                "an int >= 1",
            ),
            "sampled_prompts": (
                _is_int(self.sampled_prompts) and self.sampled_prompts >= 0,
                "an int >= 0 (0: every prompt)",
            ),
            "batch_size": (
                _is_int(self.batch_size)
                and self.batch_size >= (self.samples if _is_int(self.samples) else 1),
                f"an int >= samples={self.samples!r} (a sampler call holds whole prompts)",
            ),
            "every_steps": (_is_int(self.every_steps) and self.every_steps >= 0, "an int >= 0"),
            "num_prompts": (_is_int(self.num_prompts) and self.num_prompts >= 1, "an int >= 1"),
            "split": (self.split in EVAL_SPLITS, " | ".join(EVAL_SPLITS)),
            "min_difficulty": (
                errors.is_real(self.min_difficulty) and 0 <= self.min_difficulty <= 1,
                "a number in [0, 1] (0: every prompt)",
            ),
        }
        errors.check(self, checks)


_is_int = errors.is_int


@dataclasses.dataclass(frozen=True)
class _Pass:
    """Per-prompt results of one pass (greedy or sampled): [P, G] rewards and lengths."""

    rewards: np.ndarray
    lengths: np.ndarray
    faithful: np.ndarray  # [P, G] bool: process_fn's verdict (True without one)
    answers: np.ndarray  # [P, G] object: answer_fn's text ("" without one)


def _run_pass(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    temperature: float,
    key: jax.Array,
    score: Callable[[int, list[int]], tuple[float, bool, str]],
    cfg: EvalConfig,
    buckets: scheduling.LengthBuckets,
    sampling_kw: Mapping,
) -> _Pass:
    """Sample `num_samples` completions of every prompt in fixed-size batches and score them."""
    P, G = len(prompts), num_samples
    per_call = min(cfg.batch_size // G, P)  # prompts per sampler call, the same for every call
    rewards = np.zeros((P, G), np.float64)
    lengths = np.zeros((P, G), np.int64)
    faithful = np.ones((P, G), bool)
    answers = np.full((P, G), "", object)

    def dispatch(b: int):
        idx = list(range(b * per_call, min((b + 1) * per_call, P)))
        padded = idx + [idx[-1]] * (per_call - len(idx))  # copies of the last prompt
        out = sampler.sample(
            model, params, [prompts[i] for i in padded], [len(prompts[i]) for i in padded],
            key=jax.random.fold_in(key, b), num_samples=G, max_new_tokens=cfg.max_new_tokens,
            temperature=temperature, buckets=buckets, trace_weights=False, **sampling_kw,
        )  # fmt: skip
        return idx, out

    def collect(idx, out):
        tokens, lens = np.asarray(out.tokens), np.asarray(out.lengths)  # rows prompt-major
        for j, i in enumerate(idx):  # padding prompts (j >= len(idx)) are dropped
            for g in range(G):
                r = j * G + g
                lengths[i, g] = lens[r]
                rewards[i, g], faithful[i, g], answers[i, g] = score(
                    i, tokens[r, : lens[r]].tolist()
                )

    num_batches = -(-P // per_call)
    pending = dispatch(0)
    for b in range(1, num_batches + 1):
        current = pending
        pending = dispatch(b) if b < num_batches else None  # decodes while we score `current`
        collect(*current)
    return _Pass(rewards=rewards, lengths=lengths, faithful=faithful, answers=answers)


def _majority_correct(answers: np.ndarray, correct: np.ndarray) -> bool:
    """Whether the most frequent of one prompt's sampled answers (on a tie, the one sampled
    first) is a correct one."""
    texts = list(answers)
    top = max(texts, key=lambda a: (texts.count(a), -texts.index(a)))
    return bool(correct[texts.index(top)])


def evaluate(
    model: config_lib.ModelConfig | sampler.SamplingModel,
    params,
    *,
    prompts: Sequence[Sequence[int]],
    metas: Sequence[Mapping],
    prompt_texts: Sequence[str],
    groups: Sequence[str] | None = None,
    reward_fn: Callable[[str, str, Mapping], float],
    detokenize: Callable[[Sequence[int]], str],
    key: jax.Array,
    cfg: EvalConfig,
    sampling_kw: Mapping,
    buckets: scheduling.LengthBuckets = sampler.DEFAULT_BUCKETS,
    process_fn: Callable[[str, str, Mapping], bool] | None = None,
    answer_fn: Callable[[str], str] | None = None,
) -> dict[str, float]:
    """Greedy pass@1 and avg@k / pass@k of `params` on held-out prompts (see the module doc).

    Args:
      model: a `ModelConfig` or a `SamplingModel`, as `sampler.sample` takes.
      prompts: P token sequences (unpadded); `metas[i]` and `prompt_texts[i]` go to reward_fn.
      groups: optional group name per prompt (a task or difficulty level); with more than one
        distinct name, greedy pass@1 and pass@k are also reported per group.
      reward_fn: reward_fn(prompt_text, completion_text, meta) -> float, called in-process;
        the completion is `detokenize(tokens)` of the completion's tokens (EOS included, as in
        the rollout).
      key: split between the greedy and the sampled pass, then folded per batch.
      sampling_kw: passed unchanged to `sampler.sample` (eos / pad ids, top_p, ...); it must not
        set what evaluate sets itself: key, num_samples, max_new_tokens, temperature, buckets.
      buckets: the prompt bucket is the smallest of these holding the longest prompt and the
        generation bucket the smallest holding cfg.max_new_tokens, fixed for the whole call.
      process_fn: process_fn(prompt_text, completion_text, meta) -> bool, whether a completion's
        steps are right (e.g. `espo.data.chains.process_faithful`); adds
        "eval/process_fidelity" (share of greedy completions whose process is right) and
        "eval/right_answer_wrong_process" (share of the correct greedy completions whose
        process is wrong).
      answer_fn: answer_fn(completion_text) -> the final answer's text; adds f"eval/maj@{k}":
        the share of prompts whose most frequent sampled answer (on a tie, the one sampled
        first) is correct.
    Returns:
      Python floats keyed "eval/pass@1", f"eval/avg@{k}", f"eval/pass@{k}" (k > 1),
      "eval/reward_mean", "eval/mean_length", "eval/greedy_mean_length", "eval/num_prompts".
    """
    P = len(prompts)
    if P == 0:
        raise ValueError("evaluate: prompts is empty; the held-out set needs at least one prompt")
    groups = list(groups) if groups is not None else [""] * P
    if not len(metas) == len(prompt_texts) == len(groups) == P:
        raise ValueError(
            f"evaluate: prompts, metas, prompt_texts and groups must have one entry per prompt, "
            f"got {P}, {len(metas)}, {len(prompt_texts)} and {len(groups)}"
        )
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"evaluate: prompts{empty[:5]} are empty; every prompt needs a token")
    reserved = sorted(set(sampling_kw) & set(_RESERVED))
    if reserved:
        raise ValueError(
            f"evaluate: sampling_kw sets {reserved}, which evaluate sets itself "
            f"(from cfg and key); sampling_kw may hold the other sampler.sample arguments"
        )
    fixed = _fixed_buckets(prompts, cfg, buckets)

    def score(i: int, completion_tokens: list[int], *, greedy: bool) -> tuple[float, bool, str]:
        """(reward, process right, answer): the process is checked on the greedy pass only
        (what the process metrics read), the answer taken on the sampled pass only (maj@k)."""
        completion = detokenize(completion_tokens)
        value = _reward(
            reward_fn, prompt_texts[i], completion, metas[i], where=f"held-out prompt {i}"
        )
        faithful = not (greedy and process_fn) or bool(
            process_fn(prompt_texts[i], completion, metas[i])
        )
        return value, faithful, answer_fn(completion) if answer_fn and not greedy else ""

    greedy_key, sample_key = jax.random.split(key)
    common = dict(cfg=cfg, buckets=fixed, sampling_kw=sampling_kw)
    greedy = _run_pass(
        model, params, prompts, num_samples=1, temperature=0.0, key=greedy_key,
        score=functools.partial(score, greedy=True), **common,
    )  # fmt: skip
    k = cfg.samples
    n_sampled = min(cfg.sampled_prompts or P, P)  # the sampled pass: the first n_sampled prompts
    sampled = _run_pass(
        model, params, prompts[:n_sampled], num_samples=k, temperature=float(cfg.temperature),
        key=sample_key, score=functools.partial(score, greedy=False), **common,
    )  # fmt: skip
    correct = sampled.rewards > CORRECT_ABOVE  # [P, k]
    metrics = {
        "eval/pass@1": float(np.mean(greedy.rewards[:, 0] > CORRECT_ABOVE)),
        f"eval/avg@{k}": float(np.mean(correct)),
    }
    if k > 1:
        metrics[f"eval/pass@{k}"] = float(np.mean(correct.any(axis=1)))
    metrics |= {
        "eval/reward_mean": float(np.mean(sampled.rewards)),
        "eval/mean_length": float(np.mean(sampled.lengths)),
        "eval/greedy_mean_length": float(np.mean(greedy.lengths)),
        "eval/num_prompts": float(P),
        "eval/num_sampled_prompts": float(n_sampled),
    }
    if process_fn is not None:
        right = greedy.rewards[:, 0] > CORRECT_ABOVE
        metrics["eval/process_fidelity"] = float(np.mean(greedy.faithful[:, 0]))
        wrong_process = right & ~greedy.faithful[:, 0]
        metrics["eval/right_answer_wrong_process"] = float(
            wrong_process.sum() / max(right.sum(), 1)
        )
    if answer_fn is not None:
        metrics[f"eval/maj@{k}"] = float(
            np.mean(
                [_majority_correct(a, c) for a, c in zip(sampled.answers, correct, strict=True)]
            )
        )
    names, distinct = np.asarray(groups), sorted(set(groups))
    for name in distinct if len(distinct) > 1 else ():
        rows = names == name
        metrics[f"eval/pass@1/{name}"] = float(np.mean(greedy.rewards[rows, 0] > CORRECT_ABOVE))
        sampled_rows = rows[:n_sampled]
        if k > 1 and sampled_rows.any():
            metrics[f"eval/pass@{k}/{name}"] = float(np.mean(correct[sampled_rows].any(axis=1)))
    return metrics


def sampled_rewards(
    model,
    params,
    *,
    prompts: Sequence[Sequence[int]],
    metas: Sequence[Mapping],
    prompt_texts: Sequence[str],
    reward_fn: Callable[[str, str, Mapping], float],
    detokenize: Callable[[Sequence[int]], str],
    key: jax.Array,
    cfg: EvalConfig,
    sampling_kw: Mapping,
    buckets: scheduling.LengthBuckets = sampler.DEFAULT_BUCKETS,
) -> np.ndarray:
    """float64 [P, cfg.samples]: the rewards of cfg.samples completions of every prompt, sampled
    at cfg.temperature in `evaluate`'s fixed-size batches (a policy's pass rates before training:
    `espo.pass_rates`). Arguments as `evaluate`'s."""
    if not len(metas) == len(prompt_texts) == len(prompts):
        raise ValueError(
            f"sampled_rewards: prompts, metas and prompt_texts need one entry per prompt, got "
            f"{len(prompts)}, {len(metas)} and {len(prompt_texts)}"
        )

    def score(i: int, completion_tokens: list[int]) -> tuple[float, bool, str]:
        completion = detokenize(completion_tokens)
        return (
            _reward(reward_fn, prompt_texts[i], completion, metas[i], where=f"prompt {i}"),
            True,
            "",
        )

    return _run_pass(
        model, params, prompts, num_samples=cfg.samples, temperature=float(cfg.temperature),
        key=key, score=score, cfg=cfg, buckets=_fixed_buckets(prompts, cfg, buckets),
        sampling_kw=sampling_kw,
    ).rewards  # fmt: skip


def _fixed_buckets(
    prompts: Sequence[Sequence[int]], cfg: EvalConfig, buckets: scheduling.LengthBuckets
) -> scheduling.LengthBuckets:
    """One prompt bucket (the longest prompt's) and one generation bucket for a whole call."""
    buckets.check_max_new_tokens(cfg.max_new_tokens)
    return scheduling.LengthBuckets(
        prompt_buckets=(buckets.prompt_bucket(max(len(p) for p in prompts)),),
        generation_buckets=(buckets.generation_bucket(cfg.max_new_tokens),),
    )


def _reward(reward_fn, prompt: str, completion: str, meta: Mapping, *, where: str) -> float:
    """reward_fn's value as a float; a value that is not a finite number is a ValueError."""
    value = reward_fn(prompt, completion, meta)
    ok = isinstance(value, int | float | np.number) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)):
        raise ValueError(
            f"evaluate: reward_fn returned {value!r} for {where} "
            f"(completion {completion!r}); it must return a finite float"
        )
    return float(value)
