"""`RewardPool`: score samples in worker processes with a per-sample timeout, asynchronously.

The rollout hands each finished chunk to the pool and goes on decoding the next one; the pool's
dispatcher thread feeds worker processes one sample at a time and collects the results. A
completion may be given as token ids: the worker detokenizes it (with the pool's `detokenize`)
before scoring and returns the text with the score, so detokenization runs in parallel, off the
host's decode loop (the first row of the paper's system table).

A sample whose worker dies (a crash, the OOM killer, an operator's kill) or hangs past
`timeout_s` has its worker killed and replaced and is retried once, on whichever worker is free
next (the dead one is replaced by a fresh process); a sample that fails twice is the sample's
fault and is recorded as failed. A reward function that raises or returns something that is not
a finite number is recorded as failed at once (a deterministic answer, not bad luck). Each
failure gets `failed_reward`, `ok=False` and a counter in `metrics()`, never a hung or crashed
run; retries are counted in `reward/retries`.

Workers are separate processes (started with "spawn": forking a process that runs JAX threads
can deadlock) because math verifiers time themselves out with `signal.alarm`, which works only in
a process's main thread. This module imports no JAX, so workers start fast.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import connection
from typing import Any

import numpy as np

from espo import errors

RewardFn = Callable[[str, str, Mapping[str, Any]], float]
Detokenize = Callable[[list[int]], str]
Completion = str | Sequence[int]  # text, or token ids the workers detokenize
STATUSES = ("ok", "timeout", "error", "crash", "invalid")
MAX_START_FAILURES = 3  # consecutive workers that die before "ready": the pool gives up
MAX_ATTEMPTS = 2  # a sample whose worker dies or hangs is tried once more before it fails


def _detokenized(detokenize: Detokenize | None, completion: Completion) -> str:
    """The completion's text: itself, or its token ids detokenized. Raises on a bad result."""
    if isinstance(completion, str):
        return completion
    text = detokenize(list(completion))
    if not isinstance(text, str):
        raise TypeError(f"returned {type(text).__name__}, not str")
    return text


def _worker_main(conn, reward_fn: RewardFn, detokenize: Detokenize | None) -> None:
    """Worker loop: receive (task_id, prompt, completion, meta), send (task_id, status, value,
    text) where text is the detokenized completion ("" if detokenization failed).

    The reward function (and whatever it imports) was unpickled before this runs; "ready" tells
    the dispatcher so, so start-up time never counts against a sample's timeout.
    """
    conn.send((None, "ready", None, ""))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        task_id, prompt, completion, meta = task
        try:
            text = _detokenized(detokenize, completion)
        except BaseException as e:  # noqa: BLE001
            conn.send((task_id, "error", f"detokenize: {type(e).__name__}: {e}", ""))
            continue
        try:
            value = reward_fn(prompt, text, meta)
        except BaseException as e:  # noqa: BLE001 - math-verify's timeout is a BaseException
            conn.send((task_id, "error", f"{type(e).__name__}: {e}", text))
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            detail = f"returned {type(value).__name__}: {value!r:.80}"
            conn.send((task_id, "invalid", detail, text))
        elif not math.isfinite(float(value)):
            conn.send((task_id, "invalid", f"returned {value!r}", text))
        else:
            conn.send((task_id, "ok", float(value), text))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any
    ready: bool = False
    task: int | None = None
    item: tuple | None = None  # the task's (prompt, completion, meta), kept for a retry
    started: float = 0.0


@dataclasses.dataclass(frozen=True)
class RewardResults:
    rewards: np.ndarray  # float32 [N]; failed samples hold `failed_reward`
    ok: np.ndarray  # bool [N]
    status: tuple[str, ...]  # one of STATUSES per sample
    detail: tuple[str, ...]  # the error message for failed samples, "" otherwise
    completions: tuple[str, ...]  # the text each sample was scored on ("" if its worker died)


class RewardPool:
    """A process pool for `fn(prompt, completion, meta) -> float` with per-sample timeouts.

    `reward_fn` and `detokenize` (token ids -> text, e.g. a tokenizer's `decode`) must pickle;
    each worker unpickles them once, at start-up.
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        failed_reward: float = 0.0,
        detokenize: Detokenize | None = None,
        start_method: str = "spawn",
    ):
        if num_workers < 1:
            raise errors.InvalidValue("", "num_workers", num_workers, ">= 1")
        if timeout_s <= 0:
            raise errors.InvalidValue("", "timeout_s", timeout_s, "> 0")
        self._fn = reward_fn
        self.detokenize = detokenize
        self._timeout = timeout_s
        self._failed_reward = failed_reward
        self._ctx = multiprocessing.get_context(start_method)
        self._lock = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._results: dict[int, tuple[str, Any, str]] = {}  # id -> (status, value, text)
        self._attempts: dict[int, int] = {}  # id -> attempts that died or timed out
        self._next_id = 0
        self._closed = False
        self._counts = collections.Counter()
        self._busy_s = 0.0
        self._start_failures = 0
        self._broken: str | None = None
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._dispatch, name="reward-pool", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------
    def submit(self, items: Sequence[tuple[str, Completion, Mapping[str, Any]]]) -> list[int]:
        """Queue (prompt, completion, meta) samples; returns their task ids (non-blocking).

        A completion given as token ids is detokenized in the worker (needs `detokenize`).
        """
        if self.detokenize is None and not all(isinstance(c, str) for _, c, _ in items):
            raise TypeError("completions given as token ids need RewardPool(detokenize=...)")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            ids = list(range(self._next_id, self._next_id + len(items)))
            self._next_id += len(items)
            self._queue.extend(zip(ids, items, strict=True))
            self._lock.notify_all()
        return ids

    def results(self, task_ids: Sequence[int], *, timeout: float | None = None) -> RewardResults:
        """Wait for the given tasks and return their scores (removing them from the pool)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not all(t in self._results for t in task_ids):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{len(task_ids)} reward tasks not done in {timeout}s")
                self._lock.wait(remaining if remaining is not None else 0.5)
            done = [self._results.pop(t) for t in task_ids]
        ok = np.array([s == "ok" for s, _, _ in done], bool)
        rewards = [v if s == "ok" else self._failed_reward for s, v, _ in done]
        return RewardResults(
            rewards=np.array(rewards, np.float32),
            ok=ok,
            status=tuple(s for s, _, _ in done),
            detail=tuple("" if s == "ok" else str(v) for s, v, _ in done),
            completions=tuple(t for _, _, t in done),
        )

    def score(self, items, *, timeout: float | None = None) -> RewardResults:
        """submit + results."""
        return self.results(self.submit(items), timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Counts per final status (`reward/num_<status>`), `reward/retries` (attempts repeated
        after a worker died or hung) and the workers' busy seconds."""
        with self._lock:
            out = {f"reward/num_{s}": float(self._counts[s]) for s in STATUSES}
            out["reward/retries"] = float(self._counts["retries"])
            out["reward/busy_s"] = self._busy_s
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        for w in self._workers:
            self._stop_worker(w, graceful=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- dispatcher ------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self._fn, self.detokenize), daemon=True
        )
        process.start()
        child.close()
        return _Worker(process=process, conn=parent)

    def _stop_worker(self, w: _Worker, *, graceful: bool) -> None:
        if graceful and w.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                w.conn.send(None)
            w.process.join(timeout=2)
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5)
        w.conn.close()

    def _finish(self, w: _Worker, status: str, value: Any, text: str) -> None:
        with self._lock:
            self._results[w.task] = (status, value, text)
            self._attempts.pop(w.task, None)
            self._counts[status] += 1
            self._busy_s += time.monotonic() - w.started
            self._lock.notify_all()
        w.task = w.item = None

    def _replace(self, i: int, status: str, detail: str) -> None:
        """Worker i died or hung on its task: retry the task once, else fail it; new worker."""
        w = self._workers[i]
        with self._lock:
            attempts = self._attempts.get(w.task, 0) + 1
            if attempts < MAX_ATTEMPTS:  # first of the queue: it keeps its place in line
                self._attempts[w.task] = attempts
                self._queue.appendleft((w.task, w.item))
                self._counts["retries"] += 1
                self._busy_s += time.monotonic() - w.started
                w.task = w.item = None
        if w.task is not None:
            self._finish(w, status, f"{detail} (failed twice: first try and retry)", "")
        self._stop_worker(w, graceful=False)
        self._workers[i] = self._start_worker()

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if self._closed and not self._queue and all(w.task is None for w in self._workers):
                    return
                if self._broken is not None:
                    self._fail_queue()
                for w in self._workers:
                    if w.ready and w.task is None and self._queue:
                        task_id, item = self._queue.popleft()
                        w.task, w.item, w.started = task_id, item, time.monotonic()
                        prompt, completion, meta = item
                        w.conn.send((task_id, prompt, completion, dict(meta)))
            watched = [i for i, w in enumerate(self._workers) if w.task is not None or not w.ready]
            if not watched:
                with self._lock:
                    if not self._queue and not self._closed:
                        self._lock.wait(0.05)
                continue
            waitables = {self._workers[i].conn: i for i in watched}
            waitables.update({self._workers[i].process.sentinel: i for i in watched})
            busy = [i for i in watched if self._workers[i].task is not None]
            now = time.monotonic()
            next_deadline = min(
                (self._workers[i].started + self._timeout for i in busy), default=now
            )
            timeout = max(0.0, min(next_deadline - now, 0.05)) if busy else 0.05
            handled = set()
            for obj in connection.wait(list(waitables), timeout=timeout):
                i = waitables[obj]
                if i in handled:
                    continue
                handled.add(i)
                self._receive(i)
            now = time.monotonic()
            for i in busy:
                w = self._workers[i]
                if i not in handled and w.task is not None and now - w.started > self._timeout:
                    self._replace(i, "timeout", f"no result after {self._timeout}s")

    def _receive(self, i: int) -> None:
        """Handle a readable pipe or a dead process of worker i."""
        w = self._workers[i]
        try:
            task_id, status, value, text = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=2)  # EOF can arrive before the process is reaped
            detail = f"worker process died (exit code {w.process.exitcode})"
            if w.task is not None:
                self._start_failures = 0
                self._replace(i, "crash", detail)
                return
            self._start_failures += 1  # died before "ready": the reward fn cannot load
            if self._start_failures >= MAX_START_FAILURES:
                self._broken = f"reward workers fail to start: {detail}"
            self._stop_worker(w, graceful=False)
            self._workers[i] = self._start_worker()
            return
        if status == "ready":
            w.ready = True
            self._start_failures = 0
        else:
            self._finish(w, status, value, text)

    def _fail_queue(self) -> None:
        """Give every queued task an error (called with the lock held)."""
        while self._queue:
            task_id, _ = self._queue.popleft()
            self._results[task_id] = ("error", self._broken, "")
            self._attempts.pop(task_id, None)
            self._counts["error"] += 1
        self._lock.notify_all()
