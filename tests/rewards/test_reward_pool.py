"""The reward pool: results, and survival of hanging, crashing and misbehaving reward functions."""

import time

import numpy as np
import pytest

from espo import testing
from espo.rewards import pool


@pytest.fixture(scope="module")
def misbehaving():
    with pool.RewardPool(testing.misbehaving_reward, num_workers=2, timeout_s=1.0) as p:
        yield p


def test_failures_are_scored_and_counted_never_fatal(misbehaving):
    kinds = ["fine", "hang", "crash", "raise", "garbage", "nan", "fine"]
    t0 = time.monotonic()
    res = misbehaving.score([("p", k, {}) for k in kinds], timeout=60)
    assert time.monotonic() - t0 < 20  # the hang costs one timeout, not an hour
    assert res.status == ("ok", "timeout", "crash", "error", "invalid", "invalid", "ok")
    np.testing.assert_array_equal(res.ok, [True, False, False, False, False, False, True])
    np.testing.assert_array_equal(res.rewards, [1, 0, 0, 0, 0, 0, 1])
    assert "RuntimeError: reward function failed" in res.detail[3]
    assert "exit code 3" in res.detail[2]
    m = misbehaving.metrics()
    assert (m["reward/num_timeout"], m["reward/num_crash"], m["reward/num_error"]) == (1, 1, 1)
    assert m["reward/num_invalid"] == 2
    # The pool still works after replacing its workers.
    assert misbehaving.score([("p", "fine", {})], timeout=30).ok.all()


def test_results_keep_submission_order_and_run_concurrently():
    items = [("p", "x" * n, {"sleep": 0.5}) for n in range(6)]
    with pool.RewardPool(testing.length_reward, num_workers=3, timeout_s=20) as p:
        p.score([("p", "warm", {})] * 3, timeout=60)  # workers started
        t0 = time.monotonic()
        res = p.score(items, timeout=60)
        elapsed = time.monotonic() - t0
    np.testing.assert_allclose(res.rewards, np.arange(6) / 10)
    assert elapsed < 2.5  # 6 x 0.5 s on 3 workers: ~1 s, not 3 s


def test_invalid_arguments():
    with pytest.raises(ValueError, match="num_workers=0"):
        pool.RewardPool(testing.length_reward, num_workers=0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        pool.RewardPool(testing.length_reward, timeout_s=0)


def test_worker_start_up_does_not_count_against_the_timeout():
    # Loading the reward function takes 1.5 s in each worker; the per-sample limit is 1 s.
    with pool.RewardPool(testing.SlowLoadingReward(1.5), num_workers=2, timeout_s=1.0) as p:
        res = p.score([("p", "abc", {})] * 3, timeout=60)
    assert res.status == ("ok",) * 3


def test_a_reward_function_that_cannot_load_fails_its_tasks_clearly():
    with pool.RewardPool(testing.UnloadableReward(), num_workers=1, timeout_s=5) as p:
        res = p.score([("p", "abc", {})] * 2, timeout=120)
    assert res.status == ("error", "error")
    assert "reward workers fail to start" in res.detail[0] and "exit code 5" in res.detail[0]


def test_math_verify_runs_in_the_pool():
    """math-verify times itself out with signal.alarm: it must run in a worker's main thread."""
    from espo.rewards import math as math_rewards

    items = [
        ("q", r"so the answer is \boxed{\frac{1}{2}}", {"answer": "0.5"}),
        ("q", r"\boxed{3}", {"answer": "4"}),
        ("q", "no answer at all", {"answer": "4"}),
    ]
    with pool.RewardPool(math_rewards.math_reward, num_workers=1, timeout_s=30) as p:
        res = p.score(items, timeout=120)
    assert res.status == ("ok", "ok", "ok")
    np.testing.assert_array_equal(res.rewards, [1.0, 0.0, 0.0])
