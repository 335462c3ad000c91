"""Held-out evaluation: hand-derived pass@1 / avg@k / pass@k, keys per batch, no recompiles.

Fakes (`espo.testing.CountingModel`): the default one continues a prompt ending in t with
t+1, t+2, ... up to EOS = 7 (near-certain), so every completion, greedy or sampled, is known;
`UNIFORM` draws every token with probability 1/8, so samples differ unless keys repeat.
"""

from __future__ import annotations

import functools
import inspect
from unittest import mock

import jax
import numpy as np
import pytest

from espo import evaluate, model, sampler, scheduling, testing
from espo.testing import raises_invalid

EOS, PAD = 7, 0  # the fakes' vocabulary is 0..7; CountingModel reaches 7 last
UNIFORM = testing.CountingModel(sharpness=0.0)


def _sampling_kw(eos: int, pad: int) -> dict:
    """The stop / pad arguments `sampler.sample` takes (eos_id, or stop_ids once it has them)."""
    if "stop_ids" in inspect.signature(sampler.sample).parameters:
        return dict(stop_ids=(eos,), pad_id=pad)
    return dict(eos_id=eos, pad_id=pad)


def _detokenize(tokens) -> str:
    return "".join(str(t) for t in tokens)


class Recorder:
    """reward = 1.0 when the completion equals meta["answer"]; records every call in order."""

    def __init__(self, correct=None):
        self.calls: list[tuple[int, str]] = []
        self.correct = correct or (lambda completion, meta: completion == meta["answer"])

    def __call__(self, prompt_text, completion, meta):
        assert prompt_text == f"prompt {meta['i']}"  # texts and metas stay aligned with prompts
        self.calls.append((meta["i"], completion))
        return 1.0 if self.correct(completion, meta) else 0.0


def _run(fake, prompts, *, reward, cfg, key=0, **kw):
    P = len(prompts)
    return evaluate.evaluate(
        fake, None, prompts=prompts, metas=kw.pop("metas", [dict(i=i) for i in range(P)]),
        prompt_texts=[f"prompt {i}" for i in range(P)], reward_fn=reward,
        detokenize=_detokenize, key=jax.random.key(key), cfg=cfg,
        sampling_kw=kw.pop("sampling_kw", _sampling_kw(EOS, PAD)), **kw,
    )  # fmt: skip


@pytest.mark.slow
def test_counting_model_metrics_by_hand():
    # Completions (EOS 7 included, budget 4): 4567, 67, 7, 3456 (cut by the budget), 567.
    prompts = [[1, 3], [5], [2, 6], [1, 2], [4]]
    answers = ["4567", "67", "wrong", "34567", "567"]  # prompts 0, 1 and 4 are answered right
    metas = [dict(i=i, answer=a) for i, a in enumerate(answers)]
    reward = Recorder()
    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=4, batch_size=4)
    got = _run(testing.CountingModel(), prompts, reward=reward, cfg=cfg, metas=metas)
    assert got == {
        "eval/pass@1": 3 / 5,
        "eval/avg@2": 3 / 5,
        "eval/pass@2": 3 / 5,
        "eval/reward_mean": 3 / 5,
        "eval/mean_length": (4 + 2 + 1 + 4 + 3) / 5,
        "eval/greedy_mean_length": (4 + 2 + 1 + 4 + 3) / 5,
        "eval/num_prompts": 5.0,
        "eval/num_sampled_prompts": 5.0,
    }
    # One reward call per real completion, greedy pass first: the padding copies of the last
    # prompt (3 in the greedy pass's second batch, 1 in the sampled pass's third) are dropped.
    completions = ["4567", "67", "7", "3456", "567"]
    assert reward.calls == list(enumerate(completions)) + [
        (i, c) for i, c in enumerate(completions) for _ in range(2)
    ]


@pytest.mark.slow
def test_pass_at_k_and_avg_at_k_differ_by_hand():
    """A reward right on the 2nd sampled completion of prompt 0 only (the fake repeats itself,
    so the reward counts its calls per prompt: call 1 is greedy, calls 2..4 the k=3 samples):
    pass@1 = 0, avg@3 = 1/9 (1 of 9 samples), pass@3 = 1/3 (1 of 3 prompts)."""
    calls = {0: 0, 1: 0, 2: 0}

    def third_call_of_prompt_0(completion, meta):
        calls[meta["i"]] += 1
        return meta["i"] == 0 and calls[0] == 3

    cfg = evaluate.EvalConfig(samples=3, max_new_tokens=4, batch_size=3)
    reward = Recorder(third_call_of_prompt_0)
    got = _run(testing.CountingModel(), [[3], [5], [6]], reward=reward, cfg=cfg)
    assert got["eval/pass@1"] == 0.0
    assert got["eval/avg@3"] == pytest.approx(1 / 9) and got["eval/pass@3"] == pytest.approx(1 / 3)
    assert got["eval/reward_mean"] == pytest.approx(1 / 9)
    assert calls == {0: 4, 1: 4, 2: 4}


def test_per_group_pass_rates_by_hand():
    """Groups a, b, a (prompt order not grouped). The reward counts its calls per prompt (call 1
    is greedy, calls 2-3 the k=2 samples): prompt 0 is right on its 2nd sample only, prompt 2 on
    every call, prompt 1 never. So pass@1/a = 1/2 (prompt 2), pass@2/a = 1 (both), b = 0 and 0;
    the overall pass@1 stays 1/3. One group reports nothing per group."""
    calls = {0: 0, 1: 0, 2: 0}

    def right(completion, meta):
        calls[meta["i"]] += 1
        return meta["i"] == 2 or (meta["i"] == 0 and calls[0] == 3)

    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=4, batch_size=4)
    run = functools.partial(
        _run, testing.CountingModel(), [[1, 3], [5], [4]], reward=Recorder(right), cfg=cfg
    )
    got = run(groups=["a", "b", "a"])
    assert got["eval/pass@1"] == pytest.approx(1 / 3)
    assert got["eval/pass@1/a"] == 0.5 and got["eval/pass@2/a"] == 1.0
    assert got["eval/pass@1/b"] == got["eval/pass@2/b"] == 0.0
    assert calls == {0: 3, 1: 3, 2: 3}
    assert not any(k.count("/") > 1 for k in run(groups=["a", "a", "a"]))


def test_process_fidelity_and_majority_vote_by_hand():
    """Completions (budget 4, EOS 7): prompt [1, 3] -> "4567", [5] -> "67", [2, 6] -> "7". The
    reward calls "4567" and "7" right; the process check calls "4567" and "67" right. So greedy:
    process_fidelity 2/3, right answers 2 of which 1 ("7") has a wrong process -> 1/2. The
    answers of the k=2 samples repeat the greedy ones, so maj@2 = pass@1 = 2/3."""
    prompts = [[1, 3], [5], [2, 6]]
    reward = Recorder(correct=lambda completion, meta: completion in ("4567", "7"))
    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=4, batch_size=4)
    got = _run(
        testing.CountingModel(), prompts, reward=reward, cfg=cfg,
        process_fn=lambda prompt, completion, meta: completion in ("4567", "67"),
        answer_fn=lambda completion: completion[-2:],
    )  # fmt: skip
    assert got["eval/process_fidelity"] == pytest.approx(2 / 3)
    assert got["eval/right_answer_wrong_process"] == pytest.approx(1 / 2)
    assert got["eval/maj@2"] == pytest.approx(2 / 3)
    plain = _run(testing.CountingModel(), prompts, reward=Recorder(lambda c, m: False), cfg=cfg)
    assert not {"eval/process_fidelity", "eval/maj@2"} & set(plain)


def test_majority_takes_the_most_frequent_answer_first_on_ties():
    answers = np.array(["a", "b", "b", "c"], object)
    assert evaluate._majority_correct(answers, np.array([True, False, False, True])) is False
    assert evaluate._majority_correct(answers, np.array([False, True, True, False])) is True
    # Both twice: "x" was sampled first ("y" reached its second vote first; not the rule).
    tie = np.array(["x", "y", "y", "x"], object)
    assert evaluate._majority_correct(tie, np.array([True, False, False, True])) is True


def test_sampled_prompts_limits_the_sampled_pass_to_the_first_prompts():
    reward = Recorder(lambda completion, meta: False)
    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=4, batch_size=4, sampled_prompts=2)
    got = _run(testing.CountingModel(), [[1, 3], [5], [2, 6]], reward=reward, cfg=cfg)
    assert got["eval/num_prompts"] == 3.0 and got["eval/num_sampled_prompts"] == 2.0
    sampled_calls = reward.calls[3:]  # after the greedy pass's three
    assert sorted({i for i, _ in sampled_calls}) == [0, 1] and len(sampled_calls) == 4
    with pytest.raises(ValueError, match="EvalConfig.sampled_prompts=-1"):
        evaluate.EvalConfig(max_new_tokens=4, sampled_prompts=-1)


@pytest.mark.slow
def test_a_reward_of_one_half_is_not_correct():
    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=4, batch_size=2)
    got = _run(testing.CountingModel(), [[3], [5]], reward=lambda p, c, m: 0.5, cfg=cfg)
    assert got["eval/pass@1"] == got["eval/avg@2"] == got["eval/pass@2"] == 0.0
    assert got["eval/reward_mean"] == 0.5


@pytest.mark.slow
def test_samples_1_keeps_the_greedy_pass_at_1():
    reward = Recorder(correct=lambda completion, meta: completion == "0")  # greedy: argmax = 0
    cfg = evaluate.EvalConfig(samples=1, max_new_tokens=1, batch_size=2)
    got = _run(UNIFORM, [[3]] * 8, reward=reward, cfg=cfg)
    assert got["eval/pass@1"] == 1.0  # not overwritten by the sampled pass (mostly wrong)
    assert got["eval/avg@1"] < 1.0 and "eval/pass@1" in got and len(got) == 7


@pytest.mark.slow
def test_batches_get_different_keys_and_pass_k_bounds_avg_k():
    # Identical prompts, one per sampler call: only the key tells the calls apart.
    P, k = 6, 4
    reward = Recorder(correct=lambda completion, meta: completion[0] in "012")
    cfg = evaluate.EvalConfig(samples=k, max_new_tokens=6, batch_size=k, temperature=1.0)
    first = lambda completion: completion[0]  # noqa: E731  the answer maj@k votes on
    got = _run(UNIFORM, [[3]] * P, reward=reward, cfg=cfg, answer_fn=first)
    sampled = reward.calls[P:]
    per_prompt = [tuple(c for i, c in sampled if i == p) for p in range(P)]
    assert all(len(s) == k for s in per_prompt)
    assert len(set(per_prompt)) == P, per_prompt  # a reused key repeats a batch's samples
    # The metrics are what the recorded completions give (3/8 of tokens are "correct").
    correct = np.array([[c[0] in "012" for c in s] for s in per_prompt])
    assert got["eval/avg@4"] == pytest.approx(correct.mean())
    assert got["eval/pass@4"] == pytest.approx(correct.any(axis=1).mean())
    assert got["eval/mean_length"] == pytest.approx(np.mean([len(c) for _, c in sampled]))
    assert 1.0 > got["eval/pass@4"] > got["eval/avg@4"] > 0.0
    # maj@4 by a loop over the sampled answers: the most frequent, on a tie the one seen first.
    majority = [
        max(s, key=lambda c: ([a[0] for a in s].count(c[0]), -s.index(c))) for s in per_prompt
    ]
    assert got["eval/maj@4"] == pytest.approx(np.mean([m[0] in "012" for m in majority]))
    assert got["eval/maj@4"] != pytest.approx(correct[:, 0].mean())  # not the first sample's
    # Same key: the same evaluation; another key: other samples.
    again = Recorder(reward.correct)
    assert _run(UNIFORM, [[3]] * P, reward=again, cfg=cfg, answer_fn=first) == got
    assert again.calls == reward.calls
    other = Recorder(reward.correct)
    _run(UNIFORM, [[3]] * P, reward=other, cfg=cfg, key=1)
    assert other.calls[P:] != sampled


@pytest.mark.slow
def test_no_recompile_on_later_calls_and_a_padded_last_batch():
    fake = testing.CountingModel(spread=1e-3)  # a model no other test compiled for
    # Prompt 0 needs the 32 bucket (the others fit in 16): every batch is padded to 32.
    prompts = [[1] * 17 + [2, 3], [4], [2, 5], [1], [6], [3, 3]]
    reward = Recorder(correct=lambda completion, meta: True)
    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=5, batch_size=4)
    before = sampler.compile_count()
    stop = _sampling_kw(EOS, PAD)  # read sampler.sample's signature before it is wrapped
    with mock.patch.object(sampler, "sample", wraps=sampler.sample) as spy:
        _run(fake, prompts, reward=reward, cfg=cfg, sampling_kw=stop)
    # Greedy: batches of 4 and 2 (+2 padding); sampled: 3 batches of 2 prompts: 2 shapes.
    assert sampler.compile_count() - before == 2
    rows = [(len(c.args[2]), c.kwargs["num_samples"]) for c in spy.call_args_list]
    assert rows == [(4, 1)] * 2 + [(2, 2)] * 3  # at most batch_size=4 rows per call
    before = sampler.compile_count()
    _run(fake, prompts, reward=reward, cfg=cfg, key=5)
    _run(fake, prompts[:5], reward=reward, cfg=cfg, key=6)  # another ragged last batch
    assert sampler.compile_count() == before


CFG = model.ModelConfig.tiny(vocab_size=64, num_layers=1)


@pytest.mark.slow
def test_real_model_greedy_matches_the_sampler_and_does_not_recompile():
    params = model.init(CFG, jax.random.key(0))
    rng = np.random.RandomState(0)
    lengths = [5, 9, 3, 7]
    prompts = [rng.randint(2, 64, n).tolist() for n in lengths]
    even_start = lambda completion, meta: int(completion.split()[0]) % 2 == 0  # noqa: E731
    reward = Recorder(correct=even_start)
    detok = lambda tokens: " ".join(str(t) for t in tokens)  # noqa: E731
    kw = dict(
        prompts=prompts, metas=[dict(i=i) for i in range(4)],
        prompt_texts=[f"prompt {i}" for i in range(4)], reward_fn=reward, detokenize=detok,
        cfg=evaluate.EvalConfig(samples=2, max_new_tokens=6, batch_size=4),
        sampling_kw=_sampling_kw(1, 0),
    )  # fmt: skip
    got = evaluate.evaluate(CFG, params, key=jax.random.key(1), **kw)
    # Reference: all prompts greedily in one sampler call (evaluate's greedy shape, so no new
    # compile), scored by hand.
    ref = sampler.sample(
        CFG, params, prompts, lengths, key=jax.random.key(0), num_samples=1, max_new_tokens=6,
        temperature=0.0, **_sampling_kw(1, 0),
        buckets=scheduling.LengthBuckets(prompt_buckets=(16,), generation_buckets=(16,)),
    )  # fmt: skip
    greedy = [np.asarray(ref.tokens[i, : ref.lengths[i]]).tolist() for i in range(4)]
    assert [c for _, c in reward.calls[:4]] == [detok(t) for t in greedy]
    assert got["eval/pass@1"] == np.mean([t[0] % 2 == 0 for t in greedy])
    assert got["eval/greedy_mean_length"] == np.mean([len(t) for t in greedy])
    assert 0.0 <= got["eval/avg@2"] <= got["eval/pass@2"] <= 1.0
    assert len(reward.calls) == 4 * 3
    before = sampler.compile_count()
    again = evaluate.evaluate(CFG, params, key=jax.random.key(1), **kw)
    assert again == got and sampler.compile_count() == before


def test_errors_name_the_field():
    for field, value, valid in [
        ("samples", 0, "an int >= 1"),
        ("temperature", 0.0, "a finite number > 0"),
        ("max_new_tokens", 0, "an int >= 1"),
        ("batch_size", 4, "an int >= samples=8"),
        ("min_difficulty", 1.5, "a number in [0, 1]"),
        ("min_difficulty", -0.1, "a number in [0, 1]"),
        ("min_difficulty", True, "a number in [0, 1]"),
    ]:
        with raises_invalid(field, where="EvalConfig") as info:
            evaluate.EvalConfig(**(dict(max_new_tokens=4) | {field: value}))
        assert info.value.valid.startswith(valid)
    cfg = evaluate.EvalConfig(samples=2, max_new_tokens=4, batch_size=4)
    fake = testing.CountingModel()
    with pytest.raises(ValueError, match=r"sampling_kw sets \['temperature'\]"):
        _run(
            fake,
            [[1]],
            reward=Recorder(),
            cfg=cfg,
            sampling_kw=_sampling_kw(EOS, PAD) | dict(temperature=0.5),
        )
    with pytest.raises(ValueError, match=r"one entry per prompt, got 2, 1, 2 and 2"):
        _run(fake, [[1], [2]], reward=Recorder(), cfg=cfg, metas=[dict(i=0)])
    with pytest.raises(ValueError, match=r"prompts is empty"):
        _run(fake, [], reward=Recorder(), cfg=cfg)
    with pytest.raises(ValueError, match=r"prompts\[1\] are empty"):
        _run(fake, [[1], []], reward=Recorder(), cfg=cfg)
    with pytest.raises(ValueError, match=r"reward_fn returned nan for held-out prompt 0"):
        _run(fake, [[1]], reward=lambda p, c, m: float("nan"), cfg=cfg)
