"""espo.metrics: metrics.jsonl, TensorBoard events, resume truncation, non-finite guard, timers."""

import json
import math
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from espo import metrics


def _strict_json(line: str) -> dict:
    """json.loads that rejects NaN / Infinity tokens (Python's json accepts them by default)."""

    def reject(token):
        raise ValueError(f"invalid JSON constant {token}")

    return json.loads(line, parse_constant=reject)


def _events(logdir):
    """Every event of every TFRecord event file in `logdir`, in file-name order."""
    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            pos += 12  # length + its masked crc
            out.append(event_pb2.Event.FromString(data[pos : pos + length]))
            pos += length + 4  # payload + its masked crc
    return out


def _scalars(logdir):
    return [
        (value.tag, event.step, value.simple_value)
        for event in _events(logdir)
        for value in event.summary.value
    ]


def _logger(workdir, **kwargs):
    return metrics.MetricsLogger(workdir, total_steps=10, progress=False, **kwargs)


def test_write_valid_json_lines_and_tensorboard(tmp_path):
    with _logger(tmp_path) as logger:
        logger.write(1, {"train/reward_mean": np.float32(0.5), "perf/num_tokens": jnp.int32(7)})
        logger.write(2, {"train/reward_mean": jnp.asarray(0.25), "zve/ok": np.bool_(True)})
        logger.write(3, {"train/reward_mean": float("nan"), "loss/value": -math.inf})
        # Each line is flushed when written: readable before close (and after a kill -9).
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3
    records = [_strict_json(line) for line in lines]
    assert records == [
        {"step": 1, "train/reward_mean": 0.5, "perf/num_tokens": 7},
        {"step": 2, "train/reward_mean": 0.25, "zve/ok": 1},
        {"step": 3, "train/reward_mean": None, "loss/value": None},  # JSON has no NaN
    ]
    assert isinstance(records[0]["perf/num_tokens"], int)
    assert metrics.read_jsonl(tmp_path / "metrics.jsonl") == records
    scalars = _scalars(tmp_path / "tensorboard")
    rewards = [(step, v) for tag, step, v in scalars if tag == "train/reward_mean"]
    assert rewards[:2] == [(1, 0.5), (2, 0.25)]
    assert rewards[2][0] == 3 and math.isnan(rewards[2][1])  # TensorBoard keeps the NaN
    assert ("perf/num_tokens", 1, 7.0) in scalars
    assert ("loss/value", 3, -math.inf) in scalars


def test_write_rejects_what_is_not_one_number(tmp_path):
    with _logger(tmp_path) as logger:
        with pytest.raises(TypeError, match=r"metric 'loss/x' at step 1 must be a scalar.*\(2,\)"):
            logger.write(1, {"loss/x": np.zeros(2)})
        with pytest.raises(TypeError, match="metric 'data/name' at step 1 must be a real number"):
            logger.write(1, {"data/name": "gsm8k"})
        with pytest.raises(ValueError, match="other than 'step'"):
            logger.write(1, {"step": 3})
        logger.write(2, {"a": 1.0})
        with pytest.raises(ValueError, match="step 2 is not after the last step 2"):
            logger.write(2, {"a": 1.0})
    assert len(metrics.read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_resume_truncates_and_appends(tmp_path, monkeypatch):
    # tensorboardX names event files by the second: make both loggers open in the same one.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    path = tmp_path / "metrics.jsonl"
    with _logger(tmp_path) as logger:
        for step in range(1, 5):
            logger.write(step, {"train/accuracy": step / 10})
    with open(path, "a") as f:
        f.write('{"step": 5, "train/accu')  # a kill -9 in the middle of a write
    with pytest.raises(ValueError, match="torn line.*truncate_jsonl"):
        _logger(tmp_path, start_step=2)
    assert metrics.truncate_jsonl(path, last_step=2) == 2
    with _logger(tmp_path, start_step=2) as logger, pytest.raises(ValueError, match="not after"):
        logger.write(2, {"train/accuracy": 0.0})
    with _logger(tmp_path, start_step=2) as logger:
        logger.write(3, {"train/accuracy": 0.9})
    assert [(r["step"], r["train/accuracy"]) for r in metrics.read_jsonl(path)] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.9),
    ]
    # One event file per logger, all opened in the same second; a resumed one hides the earlier
    # events from step 3 on.
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 3
    scalars = _scalars(tmp_path / "tensorboard")
    assert ("train/accuracy", 4, pytest.approx(0.4)) in scalars  # first run, kept on disk
    assert ("train/accuracy", 3, pytest.approx(0.9)) in scalars  # resumed run
    purges = [e.step for e in _events(tmp_path / "tensorboard") if e.session_log.status == 1]
    assert purges == [3, 3]  # SessionLog.START at start_step + 1, one per resumed logger


def test_truncate_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert metrics.truncate_jsonl(path, last_step=3) == 0  # a fresh run: no file
    path.write_text('{"step": 1}\n{"step": 2, "a": 1}\n{"step": 3}\n{"step": 4}\n{"step": 5, "a')
    assert metrics.truncate_jsonl(path, last_step=3) == 3
    assert path.read_text() == '{"step": 1}\n{"step": 2, "a": 1}\n{"step": 3}\n'
    assert not list(tmp_path.glob("*.tmp"))
    assert metrics.truncate_jsonl(path, last_step=3) == 3  # idempotent
    path.write_text('{"step": 1}\n{"step": 2}')  # complete but for its newline: kept
    assert metrics.truncate_jsonl(path, last_step=2) == 2
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON object"):
        metrics.truncate_jsonl(path, last_step=3)
    path.write_text('{"step": 1}\n["step", 2]\n')
    with pytest.raises(ValueError, match=f"{path}:2: expected an object with an int 'step'"):
        metrics.read_jsonl(path)


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "a": null}\n\n{"step": 2, "a": 0.5}\n{"step": 3, "a": 0.')
    assert metrics.read_jsonl(path) == [{"step": 1, "a": None}, {"step": 2, "a": 0.5}]
    with pytest.raises(FileNotFoundError):
        metrics.read_jsonl(tmp_path / "missing.jsonl")


def test_other_processes_write_nothing(tmp_path):
    logger = metrics.MetricsLogger(tmp_path / "w", total_steps=3, is_main_process=False)
    logger.write(1, {"a": 1.0})
    with pytest.raises(TypeError, match="'b' at step 2"):
        logger.write(2, {"b": np.ones(3)})  # every process validates
    logger.close()
    assert not (tmp_path / "w").exists()


def test_progress_postfix_shows_key_numbers(tmp_path):
    assert metrics.progress_postfix(
        {
            "train/reward_mean": 0.51234,
            "zve/optimizer_zvp_rate": 0.25,
            "perf/tokens_per_s": 1234.56,
            "curriculum/stage": 2,
            "loss/value": 3.0,
        }
    ) == {"reward": "0.512", "zvp": "0.25", "tok/s": "1235", "stage": "2"}
    both = {"zve/zvp_rate": 0.5, "zve/optimizer_zvp_rate": 0.25}
    assert metrics.progress_postfix(both) == {"zvp": "0.5"}
    with _logger(tmp_path) as logger:
        logger.write(1, {"train/accuracy": 0.5, "eval/pass@1": 0.125, "mismatch/k3_kl": 1e-4})
        logger.write(2, {"train/accuracy": 0.75, "loss/clip_frac": 0.03})
        assert logger.postfix() == {
            "acc": "0.75",
            "clip": "0.03",
            "k3": "0.0001",
            "pass@1": "0.125",
        }


def test_check_finite_names_step_and_metric():
    metrics.check_finite(3, {"loss/value": jnp.float32(1.0), "grad/norm": 2})
    with pytest.raises(metrics.NonFiniteError, match=r"step 7: grad/norm = inf") as err:
        metrics.check_finite(7, {"loss/value": 1.0, "grad/norm": np.float32(np.inf)})
    assert isinstance(err.value, FloatingPointError)
    assert (err.value.step, err.value.keys) == (7, ("grad/norm",))
    with pytest.raises(metrics.NonFiniteError, match="loss/value = nan, grad/norm = nan"):
        metrics.check_finite(1, {"loss/value": jnp.nan, "grad/norm": float("nan")})
    # Only the named keys are guarded; a named key that is missing is a KeyError.
    metrics.check_finite(2, {"loss/value": 1.0, "eval/x": math.nan}, keys=["loss/value"])
    with pytest.raises(KeyError, match="no metric \\['loss/valu'\\]"):
        metrics.check_finite(2, {"loss/value": 1.0}, keys=["loss/valu"])


def test_phase_timer_accumulates_per_phase():
    now = [0.0]
    timer = metrics.PhaseTimer(clock=lambda: now[0])
    with timer.phase("rollout"):
        now[0] += 2.0
    with timer.phase("update"):
        now[0] += 0.5
        with timer.phase("old_logps"):
            now[0] += 0.25
    with pytest.raises(RuntimeError), timer.phase("rollout"):
        now[0] += 1.0
        raise RuntimeError("a failed phase still counts")
    assert timer.metrics() == {
        "perf/rollout_s": 3.0,
        "perf/update_s": 0.75,
        "perf/old_logps_s": 0.25,
    }
    with (
        pytest.raises(ValueError, match="already running"),
        timer.phase("eval"),
        timer.phase("eval"),
    ):
        pass
    with pytest.raises(ValueError, match="phase name"), timer.phase("perf/x"):
        pass
    timer.reset()
    assert timer.metrics() == {}


def test_compile_counter_counts_jit_cache_misses():
    a, b, c = np.ones(3, np.float32), np.full(3, 2.0, np.float32), np.ones(5, np.float32)
    f = jax.jit(lambda x: x * 3 + 1)
    counter = metrics.CompileCounter()
    f(a)
    assert counter.take() == 1
    f(b)  # same shape: a cache hit
    assert counter.take() == 0
    f(c)  # new shape: compiles again
    assert counter.take() == 1
