"""The reward pool: results, survival of hanging, crashing and misbehaving reward functions,
retries of samples whose worker died, detokenisation in the workers.

Concurrency is proven by order of events (a barrier that only opens when the samples run at the
same time), never by elapsed time; `pytest.mark.timeout` turns a deadlock into a failure.
"""

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from espo import testing
from espo.rewards import pool

pytestmark = pytest.mark.multiprocess  # every test starts worker processes

# Each sample creates <dir>/<completion> and returns only once `meta["parties"]` files exist:
# `parties` samples finish only if they run at the same time (else TimeoutError after wait_s).
BARRIER = testing.FromSource(
    """
def reward(prompt, completion, meta):
    import os, time
    open(os.path.join(meta["dir"], completion), "w").close()
    deadline = time.monotonic() + meta["wait_s"]
    while len(os.listdir(meta["dir"])) < meta["parties"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the other samples never ran alongside this one")
        time.sleep(0.005)
    return len(completion) / 10
"""
)

# The first attempt of a sample writes its worker's pid to <dir>/<completion>.pid and then
# sleeps (to be killed from outside); an attempt that finds the file scores the sample. Every
# attempt appends the completion to <dir>/log first.
KILLABLE = testing.FromSource(
    """
def reward(prompt, completion, meta):
    import os, time
    with open(os.path.join(meta["dir"], "log"), "a") as f:  # the order attempts start in
        f.write(completion + "\\n")
    path = os.path.join(meta["dir"], completion + ".pid")
    if completion.startswith("victim") and not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(600)
    return len(completion) / 10
"""
)

# Returns what meta["kind"] asks for: a bool, an int, garbage, or raises.
ANSWERS = testing.FromSource(
    """
def reward(prompt, completion, meta):
    kind = meta["kind"]
    if kind == "raise":
        raise ValueError("no answer")
    return {"bool": True, "int": len(completion), "garbage": "not a number"}[kind]
"""
)


@pytest.fixture(scope="module")
def misbehaving():
    with pool.RewardPool(testing.misbehaving_reward, num_workers=2, timeout_s=1.0) as p:
        yield p


@pytest.mark.timeout(120)  # the hang costs two timeouts (the retry), not an hour
def test_failures_are_scored_and_counted_never_fatal(misbehaving):
    kinds = ["fine", "hang", "crash", "raise", "garbage", "nan", "fine"]
    res = misbehaving.score([("p", k, {}) for k in kinds], timeout=60)
    assert res.status == ("ok", "timeout", "crash", "error", "invalid", "invalid", "ok")
    np.testing.assert_array_equal(res.ok, [True, False, False, False, False, False, True])
    np.testing.assert_array_equal(res.rewards, [1, 0, 0, 0, 0, 0, 1])
    assert "RuntimeError: reward function failed" in res.detail[3]
    assert "exit code 3" in res.detail[2] and "failed twice" in res.detail[2]
    assert "failed twice" in res.detail[1]
    # The text each sample was scored on; none for samples whose worker died.
    assert res.completions == ("fine", "", "", "raise", "garbage", "nan", "fine")
    m = misbehaving.metrics()
    assert (m["reward/num_timeout"], m["reward/num_crash"], m["reward/num_error"]) == (1, 1, 1)
    assert m["reward/num_invalid"] == 2
    # The hang and the crash were each retried once (a worker killed from outside is not the
    # sample's fault); raising and garbage are the reward function's answer: never retried.
    assert m["reward/retries"] == 2
    # The pool still works after replacing its workers.
    assert misbehaving.score([("p", "fine", {})], timeout=30).ok.all()


def test_failed_rewards_get_the_configured_value():
    with pool.RewardPool(testing.misbehaving_reward, num_workers=1, failed_reward=-0.5) as p:
        res = p.score([("p", "raise", {}), ("p", "fine", {})], timeout=60)
    np.testing.assert_array_equal(res.rewards, [-0.5, 1.0])


def _kill_first_attempt(directory, name: str) -> None:
    """SIGKILL the worker running KILLABLE's first attempt at sample `name`, once it runs."""
    pid_file = directory / f"{name}.pid"
    while not pid_file.exists():
        time.sleep(0.01)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_worker_killed_from_outside_gets_its_sample_retried(tmp_path):
    """os.kill(SIGKILL) mid-task (the OOM killer): the sample is rescored on a fresh worker."""
    items = [("p", name, {"dir": str(tmp_path)}) for name in ("ok-1", "victim-22", "ok-333")]
    with pool.RewardPool(KILLABLE, num_workers=2, timeout_s=300) as p:
        ids = p.submit(items)
        _kill_first_attempt(tmp_path, "victim-22")
        res = p.results(ids, timeout=100)
        m = p.metrics()
    assert res.status == ("ok", "ok", "ok") and res.ok.all()
    np.testing.assert_allclose(res.rewards, [0.4, 0.9, 0.6])  # its real score, not failed
    assert (m["reward/retries"], m["reward/num_crash"], m["reward/num_ok"]) == (1, 0, 3)


@pytest.mark.timeout(120)
def test_results_keep_submission_order_and_run_concurrently(tmp_path):
    """Six samples on three workers, in two barriers of three: finishing proves concurrency."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    items = [
        ("p", "x" * (n + 1), {"dir": str(tmp_path / "ab"[n // 3]), "parties": 3, "wait_s": 60})
        for n in range(6)
    ]
    with pool.RewardPool(BARRIER, num_workers=3, timeout_s=100) as p:
        res = p.score(items, timeout=100)
    assert res.status == ("ok",) * 6, res.detail
    np.testing.assert_allclose(res.rewards, np.arange(1, 7) / 10)  # submission order
    assert sorted(os.listdir(tmp_path / "b")) == ["x" * n for n in range(4, 7)]


@pytest.mark.timeout(120)
def test_the_barrier_does_not_open_for_fewer_parties(tmp_path):
    """The barrier's control: two samples of a barrier of three time out waiting."""
    meta = {"dir": str(tmp_path), "parties": 3, "wait_s": 0.5}
    with pool.RewardPool(BARRIER, num_workers=2, timeout_s=100) as p:
        res = p.score([("p", "x" * n, meta) for n in range(1, 3)], timeout=100)
    assert res.status == ("error", "error") and "never ran alongside" in res.detail[0]


def test_workers_detokenize_and_return_the_text():
    """Token ids are detokenized in the worker (off the host); results carry the text."""
    with pool.RewardPool(testing.length_reward, num_workers=2, detokenize=str) as p:
        res = p.score([("p", [1, 2, 3], {}), ("p", "abc", {}), ("p", [], {})], timeout=60)
    assert res.completions == ("[1, 2, 3]", "abc", "[]")
    np.testing.assert_allclose(res.rewards, [0.9, 0.3, 0.2])
    with (
        pool.RewardPool(testing.length_reward, num_workers=1) as p,
        pytest.raises(TypeError, match="detokenize"),
    ):
        p.submit([("p", [1, 2], {})])


def test_a_detokenizer_that_raises_fails_only_its_sample():
    with pool.RewardPool(testing.length_reward, num_workers=1, detokenize=bytes) as p:
        res = p.score([("p", [104, 105], {}), ("p", [-1], {})], timeout=60)
    assert res.status == ("error", "error")  # b"hi" is not a str; bytes([-1]): ValueError
    assert "detokenize" in res.detail[0] and "detokenize" in res.detail[1]


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


def test_booleans_are_invalid_rewards_but_integers_are_scores():
    """A verifier that returns True/False forgot to map its verdict to a number: invalid."""
    items = [("p", "abc", {"kind": "bool"}), ("p", "abc", {"kind": "int"})]
    with pool.RewardPool(ANSWERS, num_workers=1) as p:
        res = p.score(items, timeout=60)
    assert res.status == ("invalid", "ok")
    np.testing.assert_array_equal(res.ok, [False, True])
    np.testing.assert_array_equal(res.rewards, [0.0, 3.0])


def test_failed_samples_report_their_detokenized_text():
    with pool.RewardPool(ANSWERS, num_workers=1, detokenize=str) as p:
        items = [("p", [1, 2], {"kind": "raise"}), ("p", [3], {"kind": "garbage"})]
        res = p.score(items, timeout=60)
    assert res.status == ("error", "invalid")
    assert res.completions == ("[1, 2]", "[3]")


def test_token_ids_anywhere_in_a_batch_need_a_detokenizer():
    with pool.RewardPool(testing.length_reward, num_workers=1) as p:
        with pytest.raises(TypeError):
            p.submit([("p", "abc", {}), ("p", [1, 2], {})])
        # Nothing of the refused batch was queued: the next batch is scored alone.
        res = p.score([("p", "abcd", {})], timeout=60)
    np.testing.assert_allclose(res.rewards, [0.4])


def test_task_ids_are_unique_across_submits_and_results_match_their_ids():
    with pool.RewardPool(testing.length_reward, num_workers=2) as p:
        first = p.submit([("p", "a", {}), ("p", "bb", {})])
        second = p.submit([("p", "cccc", {})])
        assert not set(first) & set(second)
        np.testing.assert_allclose(p.results(second, timeout=60).rewards, [0.4])
        np.testing.assert_allclose(p.results(first, timeout=60).rewards, [0.1, 0.2])


@pytest.mark.timeout(120)
def test_results_times_out_and_the_tasks_stay_collectable(tmp_path):
    """results(timeout=) raises TimeoutError for unfinished tasks and keeps them for later; a
    task already collected is gone (asking for it again times out)."""
    # The sample's barrier of two parties: its own file, and the gate the test opens.
    meta = {"dir": str(tmp_path), "parties": 2, "wait_s": 30}
    with pool.RewardPool(BARRIER, num_workers=1, timeout_s=100) as p:
        ids = p.submit([("p", "ab", meta)])
        with pytest.raises(TimeoutError):
            p.results(ids, timeout=0.2)
        (tmp_path / "gate").touch()
        res = p.results(ids, timeout=60)
        assert res.status == ("ok",)
        np.testing.assert_allclose(res.rewards, [0.2])
        with pytest.raises(TimeoutError):
            p.results(ids, timeout=0.2)


@pytest.mark.timeout(120)
def test_a_retried_sample_keeps_its_place_in_the_queue(tmp_path):
    """One worker, the first sample's worker killed: its retry runs before the queued samples."""
    items = [("p", name, {"dir": str(tmp_path)}) for name in ("victim-1", "a", "bb")]
    with pool.RewardPool(KILLABLE, num_workers=1, timeout_s=300) as p:
        ids = p.submit(items)
        _kill_first_attempt(tmp_path, "victim-1")
        res = p.results(ids, timeout=100)
    assert res.status == ("ok", "ok", "ok")
    assert (tmp_path / "log").read_text().split() == ["victim-1", "victim-1", "a", "bb"]


@pytest.mark.timeout(120)
def test_a_pool_whose_workers_cannot_start_counts_the_failed_tasks():
    with pool.RewardPool(testing.UnloadableReward(), num_workers=1, timeout_s=5) as p:
        p.score([("p", "abc", {})] * 2, timeout=120)
        m = p.metrics()
    assert (m["reward/num_error"], m["reward/num_ok"], m["reward/retries"]) == (2, 0, 0)


def test_busy_seconds_add_up_the_scoring_time():
    """A lower bound only: each of the two samples sleeps 0.3 s in its worker."""
    with pool.RewardPool(testing.length_reward, num_workers=2) as p:
        p.score([("p", "a", {"sleep": 0.3})] * 2, timeout=60)
        assert p.metrics()["reward/busy_s"] >= 0.6


@pytest.mark.timeout(120)
def test_close_stops_every_worker_including_replacements():
    before = {c.pid for c in multiprocessing.active_children()}
    p = pool.RewardPool(testing.misbehaving_reward, num_workers=2, timeout_s=30)
    res = p.score([("p", "crash", {}), ("p", "fine", {})], timeout=60)  # two replacements
    assert res.status == ("crash", "ok")
    assert {c.pid for c in multiprocessing.active_children()} - before  # the workers run
    p.close()
    assert not {c.pid for c in multiprocessing.active_children()} - before


def test_a_closed_pool_refuses_new_samples():
    p = pool.RewardPool(testing.length_reward, num_workers=1)
    p.close()
    with pytest.raises(RuntimeError):
        p.submit([("p", "abc", {})])
