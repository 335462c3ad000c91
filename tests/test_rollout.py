"""generate_and_score: exact rollouts on a fake model, scheduling, overlap of rewards."""

import time

import jax
import numpy as np
import pytest

from espo import rollout, sampler, scheduling, testing
from espo.rewards import pool as pool_lib

V = 64
EOS = V - 1
SAMPLING = sampler.SamplingParams(max_new_tokens=40, eos_id=EOS, pad_id=0)
BUCKETS = scheduling.LengthBuckets(prompt_buckets=(4, 8), generation_buckets=(8, 16, 32, 48))


def detokenize(tokens):
    return " ".join(map(str, tokens))


def _prompts():
    # Last token t -> the completion counts t+1 .. 63 (EOS): length 63 - t, capped at 40.
    rng = np.random.RandomState(0)
    lasts = [62, 60, 55, 50, 40, 30, 20, 10]
    return [list(rng.randint(0, 60, size=1 + i % 6)) + [t] for i, t in enumerate(lasts)], lasts


@pytest.fixture(scope="module")
def reward_pool():
    with pool_lib.RewardPool(testing.length_reward, num_workers=2, timeout_s=30) as p:
        yield p


def _run(reward_pool, model, *, schedule="length_aware", predictor=None, sampling=SAMPLING):
    prompts, _ = _prompts()
    return rollout.generate_and_score(
        model, None, prompts=prompts, prompt_texts=[f"p{i}" for i in range(8)],
        metas=[{}] * 8, group_sizes=[2, 1, 3, 2, 1, 2, 2, 1], key=jax.random.key(0),
        sampling=sampling, buckets=BUCKETS, max_chunk_size=4, reward_pool=reward_pool,
        detokenize=detokenize, predictor=predictor, schedule=schedule,
    )  # fmt: skip


def test_exact_rollout_continuations_rewards_and_trace(reward_pool):
    # A predictor that guesses 4 tokens: chunks get budget 8 and long rows must be continued.
    short = scheduling.LengthPredictor(default_length=4)
    out = _run(reward_pool, testing.CountingModel(vocab=V), predictor=short)
    prompts, lasts = _prompts()
    sizes = [2, 1, 3, 2, 1, 2, 2, 1]
    np.testing.assert_array_equal(out.group_ids, np.repeat(np.arange(8), sizes))
    for r, p in enumerate(out.group_ids):
        n = min(63 - lasts[p], 40)  # never truncated by the scheduler, only by max_new_tokens
        want = list(range(lasts[p] + 1, lasts[p] + 1 + n))
        assert out.lengths[r] == n and out.tokens[r, :n].tolist() == want
        assert out.finished[r] == (63 - lasts[p] <= 40)
        assert out.completions[r] == detokenize(want)
        assert out.rewards[r] == pytest.approx(len(detokenize(want)) / 10)
    assert out.reward_ok.all()
    # Rows that needed more than one chunk were continued (budget 8 < their length).
    assert out.metrics["rollout/num_chunks"] > 5
    # The router trace covers prompt + completion in the training layout (-1 on padding).
    tokens, mask = out.training_inputs()
    np.testing.assert_array_equal(out.router.expert_ids[:, 0, :, 0], np.where(mask, tokens % 3, -1))
    np.testing.assert_allclose(out.logps[out.mask], 0.0, atol=1e-6)


def test_fifo_and_length_aware_agree_and_waste_less(reward_pool):
    model = testing.CountingModel(vocab=V)
    predictor = scheduling.LengthPredictor()
    _run(reward_pool, model, predictor=predictor)  # one step of history
    aware = _run(reward_pool, model, predictor=predictor)
    fifo = _run(reward_pool, model, schedule="fifo")
    for field in ("tokens", "lengths", "finished", "rewards", "group_ids"):
        np.testing.assert_array_equal(getattr(aware, field), getattr(fifo, field))
    np.testing.assert_array_equal(aware.router.expert_ids, fifo.router.expert_ids)
    assert aware.metrics["rollout/padding_waste"] < fifo.metrics["rollout/padding_waste"]


def test_rewards_overlap_generation():
    """A slow reward adds far less than its full time: it runs while later chunks decode."""
    model = testing.CountingModel(vocab=V, step_delay_s=0.01)
    with pool_lib.RewardPool(testing.length_reward, num_workers=4, timeout_s=30) as fast:
        _run(fast, model)  # compile
        gen_only = _run(fast, model).metrics["rollout/total_s"]
    slow_meta = [{"sleep": 0.25}] * 8
    with pool_lib.RewardPool(testing.length_reward, num_workers=4, timeout_s=30) as slow:
        slow.score([("p", "warm", {})] * 4, timeout=60)
        t0 = time.perf_counter()
        slow.score([("p", "x", slow_meta[0])] * 14, timeout=60)
        reward_only = time.perf_counter() - t0
        prompts, _ = _prompts()
        out = rollout.generate_and_score(
            model, None, prompts=prompts, prompt_texts=["p"] * 8, metas=slow_meta,
            group_sizes=[2, 1, 3, 2, 1, 2, 2, 1], key=jax.random.key(0), sampling=SAMPLING,
            buckets=BUCKETS, max_chunk_size=4, reward_pool=slow, detokenize=detokenize,
        )  # fmt: skip
    wall = out.metrics["rollout/total_s"]
    assert wall < gen_only + 0.6 * reward_only, (wall, gen_only, reward_only)


def test_bad_arguments(reward_pool):
    with pytest.raises(ValueError, match="schedule='lifo'"):
        _run(reward_pool, testing.CountingModel(vocab=V), schedule="lifo")
    with pytest.raises(ValueError, match="SamplingParams.top_p=0"):
        sampler.SamplingParams(max_new_tokens=4, top_p=0, eos_id=1, pad_id=0)
    big = sampler.SamplingParams(max_new_tokens=100, eos_id=EOS, pad_id=0)
    with pytest.raises(ValueError, match="max_new_tokens=100"):
        _run(reward_pool, testing.CountingModel(vocab=V), sampling=big)
