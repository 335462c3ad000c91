"""What a run reports: `metrics.jsonl`, TensorBoard events, a progress bar, phase timers, and the
non-finite guard.

Owns `WORKDIR/metrics.jsonl` and `WORKDIR/tensorboard/`. Invariants:
- `metrics.jsonl` holds one JSON object per line, `{"step": step, **metrics}`, with strictly
  increasing steps; each line is flushed when written, so a killed run leaves complete lines and
  at most one torn last line. Values are JSON numbers: integer metrics stay ints, floats are
  floats, booleans become 0/1, and NaN/+-inf are written as `null` (JSON has no NaN), so every
  line is valid JSON for any reader; TensorBoard gets the NaN/inf as they are.
- On resume the trainer calls `truncate_jsonl(path, last_step=checkpoint_step)` before opening a
  `MetricsLogger`, so no step appears twice; the logger refuses a step that is not after the
  last one in the file (and a torn last line) instead of writing a duplicate.
- Each logger writes its own TensorBoard event file; on resume, events of the earlier run at
  steps >= `start_step + 1` are hidden (`SummaryWriter(purge_step=...)`), so the curves show one
  value per step.
- Only the main process writes files and draws the bar; the others validate and drop.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import math
import os
import pathlib
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from espo import errors

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class NonFiniteError(FloatingPointError):
    """A metric that must stay finite (loss, gradient norm) is NaN or infinite."""

    def __init__(self, message: str, *, step: int, keys: tuple[str, ...]):
        super().__init__(message)
        self.step = step
        self.keys = keys


def to_scalar(key: str, value: Any, *, step: int) -> int | float:
    """A metric value as a Python int or float (numpy / jax scalars converted).

    Raises TypeError naming the step and key for anything that is not one number.
    """
    arr = np.asarray(value)
    if arr.ndim != 0:
        raise TypeError(
            f"metric {key!r} at step {step} must be a scalar, got shape {arr.shape}: {value!r:.80}"
        )
    if arr.dtype.kind in "biu":  # booleans as 0/1
        return int(arr)
    if arr.dtype.kind == "f":
        return float(arr)
    raise TypeError(
        f"metric {key!r} at step {step} must be a real number, got {type(value).__name__} "
        f"{value!r:.80}"
    )


def check_finite(step: int, metrics: Mapping[str, Any], keys: Iterable[str] | None = None) -> None:
    """Raises NonFiniteError naming `step` and every non-finite metric among `keys` (None: all).

    A key in `keys` that is missing from `metrics` is a KeyError: a guard on a misspelt name
    would never fire.
    """
    names = list(metrics) if keys is None else list(keys)
    missing = [k for k in names if k not in metrics]
    if missing:
        raise KeyError(
            f"check_finite at step {step}: no metric {missing}; metrics are {sorted(metrics)}"
        )
    bad = []
    for key in names:
        value = to_scalar(key, metrics[key], step=step)
        if not math.isfinite(value):
            bad.append((key, value))
    if bad:
        listed = ", ".join(f"{k} = {v}" for k, v in bad)
        raise NonFiniteError(
            f"non-finite metric at step {step}: {listed}. The last good checkpoint is kept; "
            "change the config (e.g. a lower learning rate) and rerun the same command to resume.",
            step=step,
            keys=tuple(k for k, _ in bad),
        )


_PHASE_NAME = re.compile(r"^[A-Za-z0-9_]+$")


_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # jax._src.dispatch
_lowerings = [0]  # process-wide: lowerings seen by the listener below
_listening = [False]


def _count_lowering(event: str, duration_s: float, **kwargs) -> None:
    if event == _LOWERING_EVENT:
        _lowerings[0] += 1


class CompileCounter:
    """Counts XLA compilations (each lowering of a jitted function to MLIR: a cache miss of
    `jax.jit`, also when the persistent compilation cache then supplies the executable), through
    `jax.monitoring`'s event listener. `take()` returns the count since the last `take()`."""

    def __init__(self) -> None:
        if not _listening[0]:
            jax.monitoring.register_event_duration_secs_listener(_count_lowering)
            _listening[0] = True
        self._seen = _lowerings[0]

    def take(self) -> int:
        new, self._seen = _lowerings[0] - self._seen, _lowerings[0]
        return new


class PhaseTimer:
    """Wall time per named phase of a step: `with timer.phase("rollout"): ...` accumulates.

    `metrics()` returns `{"perf/<phase>_s": seconds}`; `reset()` starts the next step. Blocking on
    asynchronously dispatched jax arrays inside a phase is the caller's job (otherwise the time
    lands in whichever phase first waits on them). `clock` is injectable for tests.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._totals: dict[str, float] = {}
        self._open: set[str] = set()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not _PHASE_NAME.match(name):
            raise ValueError(f"phase name must match {_PHASE_NAME.pattern}, got {name!r}")
        if name in self._open:
            raise ValueError(f"phase {name!r} is already running (nested in itself)")
        self._open.add(name)
        start = self._clock()
        try:
            yield
        finally:
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - start)
            self._open.discard(name)

    def metrics(self) -> dict[str, float]:
        return {f"perf/{name}_s": seconds for name, seconds in self._totals.items()}

    def reset(self) -> None:
        self._totals.clear()


# (metric, label) pairs shown in the progress bar when present; the first present of a tuple wins.
PROGRESS_KEYS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("train/reward_mean",), "reward"),
    (("train/accuracy",), "acc"),
    (("zve/zvp_rate", "zve/optimizer_zvp_rate"), "zvp"),
    (("loss/clip_frac",), "clip"),
    (("mismatch/k3_kl",), "k3"),
    (("perf/tokens_per_s",), "tok/s"),
    (("curriculum/stage",), "stage"),
    (("eval/pass@1",), "pass@1"),
)


def progress_postfix(latest: Mapping[str, int | float]) -> dict[str, str]:
    """The progress bar's key numbers, from the latest value of each metric seen so far."""
    out = {}
    for names, label in PROGRESS_KEYS:
        name = next((n for n in names if n in latest), None)
        if name is None:
            continue
        value = latest[name]
        if isinstance(value, int):
            out[label] = str(value)
        elif label == "tok/s" and math.isfinite(value):
            out[label] = f"{value:.0f}"
        else:
            out[label] = f"{value:.3g}"
    return out


def _json_value(value: int | float) -> int | float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _scan(path: pathlib.Path, raw: bytes) -> list[tuple[bytes, dict]]:
    """The (line, record) pairs of `raw`, the bytes of `path`.

    A bad line before the last is an error naming the file and line. A last line without its
    newline is torn (a run killed mid-write, or a reader racing the writer) and skipped when it
    does not parse; one that parses is kept.
    """
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    out = [(line, _parse(path, i, line)) for i, line in enumerate(lines, 1) if line.strip()]
    if tail.strip():
        with contextlib.suppress(ValueError):
            out.append((tail, _parse(path, len(lines) + 1, tail)))
    return out


def _parse(path: pathlib.Path, lineno: int, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON object ({e}): {line[:80]!r}") from e
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError(f"{path}:{lineno}: expected an object with an int 'step': {line[:80]!r}")
    return record


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl (or a gzipped copy, *.gz), in file order; a torn last line
    is skipped.

    Non-finite values read back as None (see the module docstring).
    """
    path = pathlib.Path(path)
    data = path.read_bytes()
    records = _scan(path, gzip.decompress(data) if path.suffix == ".gz" else data)
    return [record for _, record in records]


def truncate_jsonl(path: str | os.PathLike, *, last_step: int) -> int:
    """Drops every line with step > `last_step` and a torn last line; returns the lines kept.

    Used on resume from the checkpoint of `last_step`. The rewrite is atomic (a temporary file
    beside `path`, then `os.replace`); a missing file is fine (0).
    """
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    raw = path.read_bytes()
    records = _scan(path, raw)
    kept = [line for line, record in records if record["step"] <= last_step]
    if len(kept) == len(records) and (not raw or raw.endswith(b"\n")):
        return len(kept)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(line + b"\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and TensorBoard and updates the progress bar."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        total_steps: int,
        start_step: int = 0,
        is_main_process: bool = True,
        progress: bool = True,
        tensorboard: bool = True,
    ):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise errors.InvalidValue("MetricsLogger", "total_steps", total_steps, "an int >= 0")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise errors.InvalidValue("MetricsLogger", "start_step", start_step, "an int >= 0")
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / METRICS_FILE
        self.is_main_process = is_main_process
        self._last_step: int | None = None
        self._latest: dict[str, int | float] = {}
        self._file = self._writer = self._bar = None
        if not is_main_process:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            raw = self.path.read_bytes()
            if raw and not raw.endswith(b"\n"):
                raise ValueError(
                    f"{self.path} ends with a torn line (a killed run); call "
                    f"metrics.truncate_jsonl({str(self.path)!r}, last_step=...) before resuming"
                )
            records = _scan(self.path, raw)
            if records:
                self._last_step = max(record["step"] for _, record in records)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard:
            import tensorboardX  # imported here: plots and readers do not need it

            self._writer = tensorboardX.SummaryWriter(
                logdir=str(self.workdir / TENSORBOARD_DIR),
                purge_step=start_step + 1 if start_step > 0 else None,
                # tensorboardX names a file by the second it opened it and truncates an existing
                # one: a resume within the same second would erase the first run's events.
                filename_suffix=f".{os.getpid()}.{time.time_ns()}",
            )
        import tqdm

        self._bar = tqdm.tqdm(
            total=total_steps,
            initial=min(start_step, total_steps),
            desc="espo",
            unit="step",
            dynamic_ncols=True,
            disable=not progress,
        )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Appends `{"step": step, **metrics}` as one flushed JSON line; logs it to TensorBoard."""
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"metrics step must be an int >= 0, got {step!r}")
        step = int(step)
        record: dict[str, Any] = {"step": step}
        values = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key or key == "step":
                raise ValueError(
                    f"metric names must be non-empty strings other than 'step': {key!r}"
                )
            values[key] = to_scalar(key, value, step=step)
            record[key] = _json_value(values[key])
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} is not after the last step {self._last_step} in {self.path}: on "
                "resume call metrics.truncate_jsonl(path, last_step=checkpoint_step) first"
            )
        self._last_step = step
        if not self.is_main_process:
            return
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=step)
            self._writer.flush()
        self._latest.update(values)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        self._bar.set_postfix(collections.OrderedDict(self.postfix()), refresh=True)

    def postfix(self) -> dict[str, str]:
        """The key numbers the bar shows: the latest value of each (eval/pass@1 stays shown)."""
        return progress_postfix(self._latest)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
