"""espo.checkpoint: round trip, save schedule, retention, mismatch errors, and SIGKILL mid-save."""

import os
import random
import signal
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from espo import checkpoint
from espo.testing import raises_invalid


def _train_state():
    params = {
        "embed": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "layers": {"w": jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16).reshape(2, 4), "b": jnp.ones(4)},
    }
    opt_state = optax.adamw(1e-3).init(params)  # tuple of NamedTuples with nested dicts
    opt_state = jax.tree.map(lambda x: x + 0.5 if x.dtype != jnp.int32 else x + 3, opt_state)
    key = jax.random.split(jax.random.key(7))[1]
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key_data(key),
        "step": jnp.asarray(4, jnp.int32),
    }


HOST = {
    "data": {"iterator": {"next_index": 17, "seed": 3}},
    "curriculum": {"stage": 1, "steps_in_stage": 2},
    "pass_rates": {"rg/chain_sum/5": [1.0, 0.0, 0.5]},
    "model_config": {"num_layers": 2, "dtype": "float32"},
    "carried_groups": [],
}


@pytest.mark.slow
def test_round_trip_state_and_host(tmp_path):
    state = _train_state()
    with checkpoint.Checkpointer(tmp_path / "ckpt", every_steps=2, keep=3) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(4, state=state, host=HOST)
        assert ckpt.latest_step() == 4
        restored, host = ckpt.restore(abstract_state=jax.eval_shape(_train_state))
        assert ckpt.restore_host() == HOST
    chex.assert_trees_all_equal(restored, state)  # values, dtypes and the NamedTuple structure
    chex.assert_trees_all_equal_structs(restored, state)
    assert host == HOST
    key = jax.random.wrap_key_data(restored["rng"])
    np.testing.assert_array_equal(
        jax.random.normal(key, (5,)),
        jax.random.normal(jax.random.split(jax.random.key(7))[1], (5,)),
    )


def test_resume_in_a_new_process_restores_without_orbax_warnings(tmp_path, caplog):
    """A resume opens a fresh manager; orbax then warns "Item ... could not be restored" for
    every item whose handler it was not told (the trainer's resume log was full of them)."""
    state = _train_state()
    with checkpoint.Checkpointer(tmp_path, every_steps=1, keep=2) as ckpt:
        ckpt.save(1, state=state, host=HOST)
    with caplog.at_level("WARNING"), checkpoint.Checkpointer(tmp_path, every_steps=1, keep=2) as c:
        assert c.restore_host() == HOST
        restored, _ = c.restore(abstract_state=jax.eval_shape(_train_state))
    chex.assert_trees_all_equal(restored, state)
    assert not [r.getMessage() for r in caplog.records if "could not be restored" in r.getMessage()]


def test_save_schedule_and_force(tmp_path):
    state = {"x": np.arange(3, dtype=np.float32)}
    with checkpoint.Checkpointer(tmp_path, every_steps=3, keep=5) as ckpt:
        assert [ckpt.should_save(s) for s in range(7)] == [1, 0, 0, 1, 0, 0, 1]
        assert not ckpt.save(1, state=state, host={})
        assert ckpt.latest_step() is None
        assert ckpt.save(3, state=state, host={})
        assert ckpt.save(4, state=state, host={}, force=True)  # the last step of a run
        assert not ckpt.save(4, state=state, host={}, force=True)  # already on disk: no-op
        assert ckpt.save(np.int64(6), state=state, host={})  # numpy / jax int steps too
        assert ckpt.all_steps() == [3, 4, 6]
        with pytest.raises(ValueError, match="newer step 6"):
            ckpt.save(5, state=state, host={}, force=True)
        with raises_invalid("step"):
            ckpt.save(9.0, state=state, host={})


def test_keep_keeps_the_newest(tmp_path):
    with checkpoint.Checkpointer(tmp_path, every_steps=1, keep=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, state={"x": np.full((2,), step, np.int32)}, host={"step": step})
        assert ckpt.all_steps() == [4, 5]
        assert ckpt.latest_step() == 5
        abstract = {"x": jax.ShapeDtypeStruct((2,), np.int32)}
        state, host = ckpt.restore(4, abstract_state=abstract)
        np.testing.assert_array_equal(state["x"], [4, 4])
        assert host == {"step": 4}
        with pytest.raises(FileNotFoundError, match=r"step 3 .*available steps: \[4, 5\]"):
            ckpt.restore(3, abstract_state=abstract)
    # A new Checkpointer on the directory sees the same steps (what a resumed run does).
    with checkpoint.Checkpointer(tmp_path, every_steps=1, keep=2) as ckpt:
        assert ckpt.latest_step() == 5


def test_restore_without_checkpoint_names_the_directory(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path / "c", every_steps=1, keep=1)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint in {tmp_path / 'c'}"):
        ckpt.restore(abstract_state={})


def test_restore_into_other_shapes_or_dtypes_is_a_mismatch(tmp_path):
    state = {"params": {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}}
    with checkpoint.Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, state=state, host={})
        abstract = {
            "params": {
                "w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16),  # orbax alone would cast
                "b": jax.ShapeDtypeStruct((5,), jnp.float32),
            }
        }
        with pytest.raises(checkpoint.CheckpointMismatchError) as err:
            ckpt.restore(abstract_state=abstract)
        assert "params.w: checkpoint float32[3, 4], expected bfloat16[3, 4]" in str(err.value)
        assert "params.b: checkpoint float32[4], expected float32[5]" in str(err.value)
        extra = {"params": {**state["params"], "c": jax.ShapeDtypeStruct((2,), jnp.float32)}}
        with pytest.raises(checkpoint.CheckpointMismatchError, match="step 1"):
            ckpt.restore(abstract_state=extra)


def test_host_must_be_json(tmp_path):
    with checkpoint.Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        with pytest.raises(TypeError, match=r"host\['curriculum'\]\['rates'\] is a ndarray"):
            ckpt.save(1, state={}, host={"curriculum": {"rates": np.zeros(2)}})
        with pytest.raises(TypeError, match="non-string key 3"):
            ckpt.save(1, state={}, host={"lengths": {3: 1}})
        assert ckpt.latest_step() is None


def test_bad_arguments_name_the_field(tmp_path):
    with raises_invalid("every_steps", where="Checkpointer"):
        checkpoint.Checkpointer(tmp_path, every_steps=0, keep=1)
    with raises_invalid("keep", where="Checkpointer"):
        checkpoint.Checkpointer(tmp_path, every_steps=1, keep=0)


def test_model_config_mismatch_names_every_field():
    saved = {"num_layers": 2, "moe": {"num_experts": 4, "top_k": 2}, "dims": [8, 16], "x": "a"}
    current = {"num_layers": 4, "moe": {"num_experts": 8, "top_k": 2}, "dims": (8, 16), "y": 1}
    with pytest.raises(checkpoint.CheckpointMismatchError) as err:
        checkpoint.check_model_config(saved, current)
    lines = err.value.valid.split(": ", 1)[1].split("; ")
    assert "num_layers: checkpoint 2, config 4" in lines
    assert "moe.num_experts: checkpoint 4, config 8" in lines
    assert 'x: checkpoint "a", config <absent>' in lines
    assert lines[-1].startswith("y: checkpoint <absent>, config 1")
    assert err.value.field == "moe.num_experts" and "\n" not in str(err.value)
    assert "4 fields differ" in err.value.valid and "another workdir" in lines[-1]
    assert "top_k" not in str(err.value) and "dims" not in str(err.value)  # equal, tuple == list
    checkpoint.check_model_config(saved, dict(saved))  # equal configs pass
    # A field newer than the checkpoint matches at its default, and only there.
    newer = {**saved, "axes": ("expert",)}
    checkpoint.check_model_config(saved, newer, {"axes": ["expert"], "x": "b"})
    with pytest.raises(checkpoint.CheckpointMismatchError) as err:
        checkpoint.check_model_config(saved, {**saved, "axes": ("fsdp",)}, {"axes": ("expert",)})
    assert err.value.field == "axes"
    with pytest.raises(checkpoint.CheckpointMismatchError) as err:  # not a missing current one
        checkpoint.check_model_config({**saved, "axes": ["expert"]}, saved, {"axes": ("expert",)})
    assert err.value.field == "axes"


# -- SIGKILL during save --------------------------------------------------------------------------
# The child saves a state whose every element equals its step, forever, and prints "done <step>"
# after each save returns. In "self_kill" mode a thread SIGKILLs the process as soon as the
# temporary directory of a new step appears, i.e. certainly in the middle of a save.
_CHILD = r"""
import os, signal, sys, threading, time
import numpy as np
from espo import checkpoint

directory, first, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ckpt = checkpoint.Checkpointer(directory, every_steps=1, keep=2)
if mode == "self_kill":
    def watch():
        while True:
            for name in os.listdir(directory):
                stem, _, rest = name.partition(".")
                if "tmp" in rest and int(stem) > first:
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0002)
    threading.Thread(target=watch, daemon=True).start()
step = first
while True:
    print("begin", step, time.monotonic(), flush=True)
    state = {"w": np.full((1024, 1024), step, np.float32), "i": np.full((7,), step, np.int32)}
    ckpt.save(step, state=state, host={"step": step, "note": "x" * 1000})
    print("done", step, time.monotonic(), flush=True)
    step += 1
"""
_ABSTRACT = {
    "w": jax.ShapeDtypeStruct((1024, 1024), np.float32),
    "i": jax.ShapeDtypeStruct((7,), np.int32),
}


def _start_child(directory, first, mode, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    err = open(tmp_path / f"child_{first}_{mode}.err", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(first), mode],
        stdout=subprocess.PIPE,
        stderr=err,
        env=env,
        text=True,
    )
    return proc, err


def _read_until_killed(proc):
    done = []
    for line in proc.stdout:
        word, step, _ = line.split()
        if word == "done":
            done.append(int(step))
    return done


def _assert_restores_latest(directory, *, at_least):
    with checkpoint.Checkpointer(directory, every_steps=1, keep=2) as ckpt:
        latest = ckpt.latest_step()
        assert latest is not None and latest >= at_least  # a returned save is on disk
        # Only the newest step is promised: a kill while orbax deletes an old step can leave
        # that one half deleted.
        state, host = ckpt.restore(abstract_state=_ABSTRACT)
        assert host["step"] == latest
        np.testing.assert_array_equal(np.asarray(state["w"])[::97, ::89], latest)
        np.testing.assert_array_equal(state["i"], latest)
    leftovers = [n for n in os.listdir(directory) if "tmp" in n]
    assert not leftovers, f"a new Checkpointer removes unfinished saves, left {leftovers}"
    return latest


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    proc, err = _start_child(directory, 1, "self_kill", tmp_path)
    done = _read_until_killed(proc)
    assert proc.wait(timeout=120) == -signal.SIGKILL, tmp_path / "child_1_self_kill.err"
    err.close()
    unfinished = [n for n in os.listdir(directory) if "tmp" in n]
    assert unfinished, "the child should have died with a save half written"
    killed_step = int(unfinished[0].split(".")[0])
    assert done and killed_step == done[-1] + 1
    assert _assert_restores_latest(directory, at_least=done[-1]) == done[-1]


@pytest.mark.slow
def test_sigkill_at_a_random_moment_leaves_a_restorable_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    rng = random.Random(0)
    first = 1
    for _ in range(2):  # kill, resume from the newest checkpoint, kill again
        proc, err = _start_child(directory, first, "run", tmp_path)
        done, begun = [], {}
        for line in proc.stdout:
            word, step, stamp = line.split()
            if word == "begin":
                begun[int(step)] = float(stamp)
            else:
                done.append(int(step))
                if len(done) == 2:
                    save_s = float(stamp) - begun[int(step)]
                    time.sleep(rng.uniform(0, 2 * save_s))  # most likely inside the next save
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        done += _read_until_killed(proc)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        err.close()
        latest = _assert_restores_latest(directory, at_least=done[-1])
        first = latest + 1
