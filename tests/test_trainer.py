"""The trainer end to end on the tiny configs: runs, exact resume, SIGKILL, errors, HF export.

Every comparison is between two real runs of `espo.trainer.train` (or `experiments/run.py`):
an uninterrupted run is the reference for a resumed one and for one killed with SIGKILL, so
an RNG, data position, curriculum or history that is not checkpointed shows up as a metric
that differs. Timings and compile counts are the only metrics left out of the comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import (
    batching,
    checkpoint,
    generation,
    metrics,
    rollout,
    sharding,
    testing,
    train_step,
    trainer,
    zero_variance,
)
from espo import config as config_lib
from espo.data import sources, tokenizer
from espo.model import config as model_config
from espo.model import transformer
from espo.testing import raises_invalid

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = [sys.executable, str(ROOT / "experiments" / "run.py")]
# The same command, its end-of-run plots laid out but not drawn (no test of it reads a picture).
RUN_WITHOUT_PIXELS = [sys.executable, str(ROOT / "tests" / "run_without_pixels.py")]


def _config(file: str = "default", **overrides):
    cfg = testing.load_script(ROOT / "configs" / f"{file}.py").get_config("tiny")
    for key, value in overrides.items():
        section, field = key.split("__")
        cfg[section][field] = value
    return cfg


def _comparable(workdir) -> list[dict]:
    """metrics.jsonl without timings, throughput and compile counts (they vary run to run) and
    the expert-parallel paths (they vary with the mesh)."""
    skip = lambda k: (
        k.startswith("perf/") or k.endswith("_s") or "compile" in k or "per_s" in k
        or "moe_all_" in k
    )  # fmt: skip
    rows = metrics.read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
    return [{k: v for k, v in row.items() if not skip(k)} for row in rows]


def _assert_same_runs(a: list[dict], b: list[dict], *, rtol=1e-6, atol=1e-7) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys(), ra["step"]
        for k in ra:
            np.testing.assert_allclose(
                ra[k], rb[k], rtol=rtol, atol=atol, err_msg=f"{k} @ {ra['step']}"
            )


def _train_3_steps(workdir, **overrides) -> dict:
    return trainer.train(_config(train__steps=3, **overrides), str(workdir), progress=False)


def _resume_from_step_2(straight_workdir, workdir, **overrides) -> None:
    """Copies a 3-step run without its step-3 checkpoint and reruns it (resumes at step 2)."""
    shutil.copytree(straight_workdir, workdir)
    shutil.rmtree(workdir / "checkpoints" / "3")
    _train_3_steps(workdir, **overrides)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> types.SimpleNamespace:
    """The reference: 3 uninterrupted steps of the default tiny config (workdir, summary); what
    its warm start was given and made: the completions (what `sft.demonstration_batch` was
    given), the batches, and the params before and after (host copies)."""
    workdir = tmp_path_factory.mktemp("straight")
    seen = types.SimpleNamespace(sft_targets=[], sft_batches=[], warm=[])
    batch_fn, warm_start = trainer.sft.demonstration_batch, trainer._warm_start

    def spy(prompts, completions, **kw):
        seen.sft_targets.extend(completions)
        seen.sft_batches.append(batch_fn(prompts, completions, **kw))
        return seen.sft_batches[-1]

    def warm_spy(s, model_cfg, params, *args, **kw):
        before = jax.device_get(params)
        after = warm_start(s, model_cfg, params, *args, **kw)
        seen.warm = [model_cfg, before, jax.device_get(after)]
        return after

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer.sft, "demonstration_batch", spy)
        patch.setattr(trainer, "_warm_start", warm_spy)
        summary = _train_3_steps(workdir)
    return types.SimpleNamespace(workdir=workdir, summary=summary, **vars(seen))


@pytest.fixture(scope="module")
def straight(straight_run):
    return straight_run.workdir, straight_run.summary


@pytest.mark.slow
def test_tiny_run_writes_what_a_user_sees(straight):
    workdir, summary = straight
    rows = metrics.read_jsonl(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/pass@1" in rows[0] and "eval/pass@1" in rows[-1]
    keys = ("train/reward_mean", "train/accuracy", "zve/zvp_rate", "loss/clip_frac")
    keys += ("mismatch/k3_kl", "mismatch/router_agreement", "perf/step_s", "curriculum/stage")
    for key in keys:
        assert all(key in r for r in rows[1:]), key
    assert rows[1]["curriculum/stage"] == 0 and rows[3]["curriculum/stage"] == 1  # advanced
    assert rows[1]["mismatch/unrecorded_routes"] == 0
    # Fixed shapes: everything compiles in step 1 (and the start eval), nothing after it.
    assert rows[1]["perf/compiles"] > 0 and [r["perf/compiles"] for r in rows[2:]] == [0, 0]
    saved = json.loads((workdir / "summary.json").read_text())
    assert saved["steps"] == 3 and saved["start"].items() <= rows[0].items()
    assert (
        set(saved) >= {"start", "final", "steps", "wall_s"} and summary["final"] == saved["final"]
    )
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 3
    pngs = list((workdir / "plots").glob("*.png"))  # real pictures: `straight` is set up
    assert pngs and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)  # before conftest's patch
    assert list((workdir / "tensorboard").rglob("events.out.tfevents*"))


@pytest.mark.slow
def test_rerunning_a_finished_run_reports_its_final_eval(straight, tmp_path, monkeypatch):
    """The same command after the run finished trains nothing and summarises the same run: the
    final eval is evaluated again on the restored final params with the same key (it once
    reported the start eval as the final one; the tiny run's two evals happen to be equal, so
    the test watches the evaluation itself)."""
    workdir, summary = straight
    shutil.copytree(workdir, tmp_path / "again")
    evaluated, evaluate = [], trainer._evaluate
    spy = lambda *a, **k: evaluated.append(evaluate(*a, **k)) or evaluated[-1]
    monkeypatch.setattr(trainer, "_evaluate", spy)
    again = trainer.train(_config(train__steps=3), str(tmp_path / "again"), progress=False)
    assert evaluated == [again["final"]] and again["final"] == summary["final"]
    assert _comparable(tmp_path / "again") == _comparable(workdir)  # no step written again


@pytest.mark.slow
def test_init_from_starts_from_another_runs_params(straight, tmp_path, monkeypatch):
    """model.init_from: the arms of an experiment share one warm start. The new run reads only
    the params of the source's newest checkpoint (no SFT), so its step-0 eval (same seed, same
    eval key) is the source's final eval; the source directory is left as it was. The arm also
    samples in rollout.dtype=bfloat16 (the engine's model), while eval and training stay float32,
    and writes metrics every train.log_every=2 steps."""
    source, _ = straight
    before = sorted(p.name for p in (source / "checkpoints").iterdir())
    monkeypatch.setattr(trainer, "_warm_start", lambda *a, **k: pytest.fail("warm start ran"))
    dtypes, generate = [], rollout.generate_and_score
    spy = lambda handle, *a, **k: dtypes.append(handle.cfg.dtype) or generate(handle, *a, **k)
    monkeypatch.setattr(rollout, "generate_and_score", spy)
    workdir = tmp_path / "arm"
    cfg = _config(model__init_from=str(source), train__steps=3, rollout__dtype="bfloat16")
    cfg.rollout.fp8, cfg.train.log_every, cfg.checkpoint.keep = False, 2, 4
    trainer.train(cfg, str(workdir), progress=False)
    assert dtypes and set(dtypes) == {"bfloat16"}
    rows = metrics.read_jsonl(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 3]  # train.log_every=2, and the last step
    assert rows[1]["mismatch/k3_kl"] > 0
    start = metrics.read_jsonl(workdir / "metrics.jsonl")[0]
    final = metrics.read_jsonl(source / "metrics.jsonl")[-1]
    evals = {k: v for k, v in final.items() if k.startswith("eval/")}
    assert len(evals) > 3 and {k: start[k] for k in evals} == evals
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == before
    # The arm's step 0 holds exactly the source's newest params (the tiny model's evals are all
    # 0, so equal evals alone would not tell a fresh init from the source's params).
    read = lambda d, step: checkpoint.Checkpointer(
        d / "checkpoints", every_steps=1, keep=1, read_only=True
    ).restore_params(step)[0]
    jax.tree.map(np.testing.assert_array_equal, read(workdir, 0), read(source, 3))
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"d_model: checkpoint 32"):
        cfg = _config(model__init_from=str(source), model__d_model=48, train__steps=1)
        trainer.train(cfg, str(tmp_path / "other"), progress=False)
    with raises_invalid("init_from", where="--config.model", kind=config_lib.ConfigError):
        trainer.train(_config(model__init_from=str(tmp_path)), str(tmp_path / "x"))
    with raises_invalid("init_from", where="--config.model", kind=config_lib.ConfigError):
        config_lib.Settings.from_config(_config(model__init_from="a", model__hf_path="b"))


@pytest.mark.slow
def test_warm_start_trains_on_the_worked_solutions(straight_run, tmp_path):
    """The SFT targets are the demonstrations (steps, then the answer line), not the bare
    answers; a budget no demonstration fits is an error naming both limits. The held-out eval of
    the chains task reports the process check and the majority vote. (The run is `straight`'s,
    whose warm start recorded its targets.)"""
    seen = straight_run.sft_targets
    cfg = _config(train__steps=3)  # the chains task: the flawed teacher's demonstrations
    train_src, _ = sources.make_sources(config_lib.Settings.from_config(cfg).data)
    demonstrations = {e.demonstration for e in train_src}
    tok = tokenizer.CharTokenizer()
    texts = {tok.decode(c) for c in seen}
    assert len(seen) == cfg.sft.steps * cfg.sft.batch_size
    assert texts <= demonstrations and all("=" in t and "\n" in t for t in texts)
    # The warm start's params are its steps' (a loop that dropped them, or stepped uphill,
    # would hand the RL steps the init): its own batches' NLL went down.
    model_cfg, before, after = straight_run.warm
    nll = jax.jit(functools.partial(trainer.sft.nll, model_cfg))
    losses = [[float(nll(p, b)) for b in straight_run.sft_batches] for p in (before, after)]
    assert np.mean(losses[1]) < np.mean(losses[0]) - 0.01, losses
    summary = json.loads((straight_run.workdir / "summary.json").read_text())
    for key in ("eval/process_fidelity", "eval/right_answer_wrong_process", "eval/maj@2"):
        assert 0.0 <= summary["final"][key] <= 1.0, key
    cfg.curriculum.stages[1].max_new_tokens = cfg.curriculum.stages[0].max_new_tokens = 2
    with pytest.raises(ValueError, match="sft: no demonstration fits.*max_new_tokens=2"):
        trainer.train(cfg, str(tmp_path / "small"), progress=False)


def test_shuffled_rewards_permute_the_valid_rows_only():
    rewards = np.array([1.0, 0.0, 0.5, 9.0, 0.25], np.float32)
    ok = np.array([True, True, True, False, True])
    perms = {tuple(generation.shuffled(rewards, ok, jax.random.key(k))) for k in range(20)}
    assert len(perms) > 1  # the order changes with the key
    for p in perms:
        p = np.array(p)
        assert p[3] == 9.0 and sorted(p[ok]) == sorted(rewards[ok])
    again = generation.shuffled(rewards, ok, jax.random.key(3))
    np.testing.assert_array_equal(again, generation.shuffled(rewards, ok, jax.random.key(3)))


@pytest.mark.slow
def test_resume_equals_uninterrupted_with_the_state_in_host_memory_during_rollouts(
    straight, tmp_path, monkeypatch
):
    """2 steps + checkpoint + 1 more step == 3 straight steps (the step-3 checkpoint removed).
    The resumed step runs with rollout.offload_state, which changes where the training state
    is while the rollout generates, never a value: in host memory then, all of it (params and
    Adam's two moments: 3x the params' bytes), and the device holds less than the params; the
    sampler's FP8 weights are freed before the update. While the held-out eval decodes (the
    last step's), Adam's moments are in host memory and the params on the device."""
    seen, evaluating = [], []
    generate, evaluate = rollout.generate_and_score, trainer.evaluate.evaluate

    def bytes_by_memory() -> dict:
        by_kind = {}
        for a in jax.live_arrays():
            by_kind[a.sharding.memory_kind] = by_kind.get(a.sharding.memory_kind, 0) + a.nbytes
        return by_kind

    spy = lambda *a, **k: seen.append(bytes_by_memory()) or generate(*a, **k)  # noqa: E731
    monkeypatch.setattr(rollout, "generate_and_score", spy)
    spy_eval = lambda *a, **k: evaluating.append(bytes_by_memory()) or evaluate(*a, **k)  # noqa: E731
    monkeypatch.setattr(trainer.evaluate, "evaluate", spy_eval)
    updating = []  # the dtypes on the device while the update runs: the FP8 weights are gone
    minibatches = batching.minibatches

    def spy_update(*args, **kwargs):
        updating.append({x.dtype for x in jax.live_arrays()})
        return minibatches(*args, **kwargs)

    monkeypatch.setattr(batching, "minibatches", spy_update)
    _resume_from_step_2(straight[0], tmp_path / "resumed", rollout__offload_state=True)
    assert updating and not any(np.dtype(jnp.float8_e4m3fn) in u for u in updating), updating
    _assert_same_runs(_comparable(tmp_path / "resumed"), _comparable(straight[0]))
    shapes = transformer.param_shapes(config_lib.Settings.from_config(_config()).model)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    assert seen and all(s.get("pinned_host", 0) > 3 * param_bytes for s in seen), seen
    assert all(s["device"] < param_bytes for s in seen), (seen, param_bytes)
    assert evaluating and all(
        2 * param_bytes < e.get("pinned_host", 0) < 3 * param_bytes < e["device"] + e["pinned_host"]
        and e["device"] > param_bytes
        for e in evaluating
    ), (evaluating, param_bytes)


# Resample with carry-over; oversampling x16, at temperature 1 (more groups with a wrong sample
# than at the default 0.6), so that the tiny (nearly random) policy, which finds ~1 informative
# group in 8, leaves groups over for later steps.
# On configs/arithmetic.py: the tiny policy finds no informative group on the chains task.
# A checkpoint every 2 steps: the last step (3) is saved all the same, step 1 is not.
CARRY_OVER = dict(zve__mode="resample", zve__max_carry_over_steps=2, zve__oversample=16.0,
                  zve__max_oversample=16.0, rollout__temperature=1.0,
                  checkpoint__every_steps=2, file="arithmetic")  # fmt: skip


@pytest.mark.slow
def test_resume_with_carried_over_groups_equals_uninterrupted(tmp_path):
    """The resample buffer (groups with their rollout rows) is checkpointed: a run that resumes
    at step 2 serves step 3 from the same carried-over groups as the uninterrupted run.
    Wrong answer (the buffer not restored): step 3 generates instead, its metrics differ.
    With checkpoint.every_steps=2 the last step, 3, is saved although not a multiple of it."""
    _train_3_steps(tmp_path / "straight", **CARRY_OVER)
    rows = metrics.read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    # The test only means something if step 2 left groups over and step 3 used them.
    assert rows[2]["zve/carried_out"] >= 1 and rows[3]["zve/carried_in"] >= 1, rows[2:]
    with checkpoint.Checkpointer(tmp_path / "straight" / "checkpoints", every_steps=1, keep=9) as c:
        assert c.all_steps() == [2, 3]  # checkpoint.keep=2 of 0, 2 and the last step, 3
        host = c.restore_host(2)
    buffer = zero_variance.Groups.from_state_dict(checkpoint.arrays_from_json(host["buffer"]))
    assert buffer.num_groups == rows[2]["zve/carried_out"]
    assert set(buffer.rows) == set(batching.ROW_FIELDS)
    assert ((buffer.ages >= 1) & (buffer.ages <= 2)).all()  # zve.max_carry_over_steps=2
    _resume_from_step_2(tmp_path / "straight", tmp_path / "resumed", **CARRY_OVER)
    _assert_same_runs(_comparable(tmp_path / "resumed"), _comparable(tmp_path / "straight"))
    # A second run of the same settings in this process reuses the first's jitted steps
    # (`trainer._jit`): its step traces and compiles nothing.
    resumed = metrics.read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert resumed[-1]["step"] == 3 and resumed[-1]["perf/compiles"] == 0, resumed[-1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_mid_step_then_rerun_equals_uninterrupted(straight, tmp_path):
    """kill -9 while step 3 runs; the same command again continues as if never stopped."""
    workdir = tmp_path / "killed"
    shutil.copytree(straight[0], workdir)
    shutil.rmtree(workdir / "checkpoints" / "3")
    cmd = RUN_WITHOUT_PIXELS + ["--config", f"{ROOT}/configs/default.py:tiny", "--workdir",
                                str(workdir), "--config.train.steps=3"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # The resumed process truncates metrics.jsonl to step 2, then works on step 3: kill it then.
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        rows = metrics.read_jsonl(workdir / "metrics.jsonl")
        if rows and rows[-1]["step"] == 2:
            time.sleep(2.0)
            break
        time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    _assert_same_runs(_comparable(workdir), _comparable(straight[0]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_with_expert_parallelism_equal_one_process(straight, tmp_path):
    """The same 3 steps (warm start, FP8 rollouts, replay, updates, eval) as 2 processes of 4
    emulated CPU devices (jax.distributed, gloo), one mesh data=2 x expert=4 over all 8: batches
    split in two, each device holding 1 of the 4 experts (`experts.expert_parallel_dispatch`).
    Sums run in another order: equal within 1e-5. Only process 0 writes logs; its checkpoint
    then resumes in one process of one device, as if the run had never been split."""
    workdir = tmp_path / "two"
    flags = ["--config.train.steps=3", "--config.mesh.data=2", "--config.mesh.expert=4",
             f"--config.distributed.coordinator=127.0.0.1:{_free_port()}",
             "--config.distributed.num_processes=2"]  # fmt: skip
    cmd = RUN_WITHOUT_PIXELS + ["--config", f"{ROOT}/configs/default.py:tiny", "--workdir",
                                str(workdir), *flags]  # fmt: skip
    env = testing.emulated_devices_env(4)
    procs = [
        subprocess.Popen(cmd + [f"--config.distributed.process_id={i}"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outs)
    assert "logs:" in outs[0] and "logs:" not in outs[1]  # process 0 alone reports and writes
    # The MoE layers exchanged tokens over the expert axis (all-to-all, or all-gather where a
    # send buffer overflowed), and named the path in the metrics; one device has no such path.
    rows = lambda w: [r for r in metrics.read_jsonl(w / "metrics.jsonl") if "loss/loss" in r]
    ep = [(r["loss/num_moe_all_to_all"], r["loss/num_moe_all_gather"]) for r in rows(workdir)]
    assert len(ep) == 3 and all(a + g > 0 for a, g in ep) and sum(a for a, _ in ep) > 0, ep
    assert all(r["loss/num_moe_all_to_all"] == 0 for r in rows(straight[0]))
    _assert_same_runs(_comparable(workdir), _comparable(straight[0]), rtol=1e-5, atol=1e-6)
    resumed = tmp_path / "resumed"
    _resume_from_step_2(workdir, resumed)
    _assert_same_runs(_comparable(resumed), _comparable(straight[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--config.loss.nmae=x", "nmae"),
        ("--config.loss.name=ppo", "--config.loss.name='ppo' is invalid: one of"),
        ("--config.zve.mode=refill", "--config.zve.mode='refill' is invalid"),
        ("--config.train.micro_batch_size=0", "--config.train.micro_batch_size=0 is invalid"),
    ],
)
def test_bad_override_fails_before_compiling(flag, expected, tmp_path):
    cmd = RUN + ["--config", f"{ROOT}/configs/default.py:tiny", "--workdir", str(tmp_path), flag]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert expected in out.stdout + out.stderr
    assert not (tmp_path / "checkpoints").exists()  # nothing ran


def test_config_error_wording_names_the_key():
    with raises_invalid("b2", where="--config.optimizer", kind=config_lib.ConfigError):
        config_lib.Settings.from_config(_config(optimizer__b2=1.5))
    with raises_invalid(
        "group_size", where="--config.curriculum.stages[1]", kind=config_lib.ConfigError
    ):
        cfg = _config()
        cfg.curriculum.stages[1].group_size = 0
        config_lib.Settings.from_config(cfg)


class _Evals(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("eval_file", [False, True])
def test_eval_takes_the_test_half_or_a_held_out_file_whole(tmp_path, monkeypatch, eval_file):
    """Split by data.eval_fraction, the eval prompts are the held-out set's test half; a
    data.eval_path file is the test set whole."""
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(9) for b in range(9)
    ]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = dict(data__source="jsonl", data__path=str(data), eval__num_prompts=100)
    if eval_file:
        over["data__eval_path"] = str(data)
    seen, real = [], sources.eval_subset

    def spy(source, n, *, keep):  # the eval prompts, then stop the run
        seen.extend(e.prompt for e in real(source, n, keep=keep))
        raise _Evals

    monkeypatch.setattr(sources, "eval_subset", spy)
    with pytest.raises(_Evals):
        trainer.train(_config(**over), str(tmp_path / "run"), progress=False)
    if eval_file:
        assert sorted(seen) == sorted(r["prompt"] for r in rows)
    else:
        assert seen and {sources.eval_split_of(p) for p in seen} == {"test"}


def test_malformed_data_is_an_error_naming_file_and_line(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{bad\n')
    cfg = _config(data__source="jsonl", data__path=str(data), data__worked_solutions=False)
    with pytest.raises(ValueError, match=r"math\.jsonl.*line 3"):
        trainer.train(cfg, str(tmp_path / "run"), progress=False)


@pytest.mark.slow
def test_qwen3_moe_tiny_trains_and_its_export_loads_in_transformers(tmp_path):
    import torch
    import transformers

    ckpt = testing.make_hf_checkpoint(tmp_path / "ckpt", vocab_size=320)
    # The tiny byte-level BPE tokenizer with a Qwen chat template of the data tests (320 ids).
    testing.load_script(ROOT / "tests" / "data" / "conftest.py")._write_hf_tokenizer(ckpt)
    data = tmp_path / "math.jsonl"
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(6) for b in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config("qwen3_moe", model__hf_path=str(ckpt), data__path=str(data))
    workdir = tmp_path / "run"
    trainer.train(cfg, str(workdir), progress=False)
    assert [r["step"] for r in metrics.read_jsonl(workdir / "metrics.jsonl")] == [0, 1, 2]
    export = workdir / "export"
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert (export / "tokenizer.json").exists() and (export / "generation_config.json").exists()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 320) and torch.isfinite(logits).all()
    # The export holds the TRAINED policy, not the input checkpoint.
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        assert not torch.allclose(base(torch.tensor([[1, 2, 3, 4]])).logits, logits)


def test_reward_function_names_your_verifier():
    """reward.function ("module:name", verl's custom_reward_function) replaces the source's."""
    settings = lambda f: config_lib.Settings.from_config(_config(reward__function=f))
    assert trainer.reward_fn_of(settings("espo.testing:length_reward")) is testing.length_reward
    assert type(trainer.reward_fn_of(settings(""))).__name__ == "ChainReward"  # the default's
    arithmetic = config_lib.Settings.from_config(_config("arithmetic"))
    assert type(trainer.reward_fn_of(arithmetic)).__name__ == "ReasoningGymReward"
    with raises_invalid("function", where="--config.reward", kind=config_lib.ConfigError):
        trainer.reward_fn_of(settings("espo.testing:nope"))
    with raises_invalid("function", where="--config.reward", kind=config_lib.ConfigError):
        settings("no_colon")


class _ListStream:
    """The part of `stream.PromptStream` `trainer._prompts` reads: take(1, accept=) in order."""

    def __init__(self, examples):
        self.left = list(examples)

    def take(self, n, *, accept):
        while self.left:
            e = self.left.pop(0)
            if accept(e):
                return [e]
        return []


def _streamed_ids(history, ids, mode, downweight, *, step=0) -> list[str]:
    """The ids `trainer._prompts` lets through, in order, from prompts `ids` (pre-filter
    thresholds 0.01 / 0.99, every curriculum stage accepting, every prompt short enough)."""
    from types import SimpleNamespace

    from espo.data import examples as examples_lib

    exs = [examples_lib.Example(id=i, prompt=i, answer="1", difficulty=0.0,
                                meta={"answer": "1", "task": "t"}) for i in ids]  # fmt: skip
    zve = SimpleNamespace(prefilter=mode, prefilter_low=0.01, prefilter_high=0.99,
                          prefilter_downweight=downweight)  # fmt: skip
    s = SimpleNamespace(zve=zve, max_prompt_length=100)
    curr = SimpleNamespace(accepts=lambda state, difficulty, rate: True)
    host = SimpleNamespace(history=history, curriculum=None, stream=_ListStream(exs))
    return [e.id for e in trainer._prompts(s, curr, host, lambda e: [0], stage_seed=step)]


@pytest.mark.parametrize(
    "mode, downweight, want",
    [("drop", 1.0, ["mixed", "new"]), ("off", 0.1, ["solved", "failed", "mixed", "new"]),
     ("downweight", 0.0, ["mixed", "new"]),
     ("downweight", 1.0, ["solved", "failed", "mixed", "new"])],
)  # fmt: skip
def test_the_training_stream_prefilters_on_the_pass_rate_history(mode, downweight, want):
    """trainer._prompts drops (or keeps with probability zve.prefilter_downweight) the prompts
    whose online pass rate is at or past zve.prefilter_low / _high, and keeps unseen ones."""
    history = zero_variance.PassRateHistory(prior=(1e-6, 1e-6))
    for pid, rewards in (("solved", [1, 1, 1, 1]), ("failed", [0, 0, 0, 0]), ("mixed", [1, 0])):
        history.update(zero_variance.Groups.of(prompt_ids=[pid], rewards=[rewards]))
    ids = ["solved", "failed", "mixed", "new"]
    assert _streamed_ids(history, ids, mode, downweight) == want


def test_the_downweight_coin_keeps_its_share_and_changes_with_the_step():
    """Under "downweight" a flagged prompt is kept with probability zve.prefilter_downweight,
    by a coin of (prompt id, step): the same kept set on a rerun of a step (resume), another at
    the next step (a coin of the id alone would drop the same prompts all run)."""
    ids = [f"p{i}" for i in range(400)]
    history = zero_variance.PassRateHistory(prior=(1e-6, 1e-6))
    history.update(zero_variance.Groups.of(prompt_ids=ids, rewards=[[1, 1, 1, 1]] * len(ids)))

    def kept(step):
        return set(_streamed_ids(history, ids, "downweight", 0.25, step=step))

    first, again, second = kept(3), kept(3), kept(4)
    assert first == again
    for k in (first, second):  # Binomial(400, 0.25): 100 ± 8.7, bounds at ~4.6 sd
        assert 60 <= len(k) <= 140, len(k)
    assert len(first & second) < 0.5 * len(first)  # independent coins: ~25 shared


def test_every_field_of_the_host_state_comes_back_from_the_checkpoints_json():
    """`_Host.state_dict` -> JSON -> `load` into a fresh `_Host` gives back every field: one
    left out of the checkpoint, or saved but not restored, would resume as a fresh run's. The
    resume tests cannot see the pass-rate history or the length predictor: on the tiny config
    no prompt comes back within 3 steps and every chunk is budgeted max_new_tokens."""
    from espo import curriculum, scheduling
    from espo.data import examples as examples_lib
    from espo.data import stream as stream_lib

    exs = [examples_lib.Example(id=f"toy:{i}", prompt=f"p{i}", answer=str(i), difficulty=0.0,
                                meta={"answer": str(i), "task": "toy"})
           for i in range(5)]  # fmt: skip
    source = sources.Source(name="toy", examples=exs)
    fresh = lambda: trainer._Host(  # noqa: E731
        stream=stream_lib.PromptStream(source, seed=3),
        curriculum=curriculum.CurriculumState(),
        history=zero_variance.PassRateHistory(),
        predictor=scheduling.LengthPredictor(),
        buffer=zero_variance.Groups.empty(),
        start_eval={},
    )
    host = fresh()
    host.stream.take(7, accept=lambda e: e.id != "toy:2")  # past an epoch, some rejected
    host.curriculum = curriculum.CurriculumState(stage=1, steps_in_stage=2, accuracy_ema=0.25)
    host.history.update(zero_variance.Groups.of(prompt_ids=["toy:1"], rewards=[[1.0, 0.0, 0.0]]))
    requests = [scheduling.Request(prompt_id="toy:1", sample_index=j, prompt_length=4)
                for j in range(2)]  # fmt: skip
    host.predictor.observe_requests(requests, [3, 9])
    host.buffer = zero_variance.Groups.of(
        prompt_ids=["toy:4"], rewards=[np.array([1.0, 0.0], np.float32)],
        rows={"tokens": [np.arange(6, dtype=np.int32).reshape(2, 3)]}, ages=np.array([1]),
    )  # fmt: skip
    host.start_eval = {"eval/pass@1": 0.5}
    cfg = model_config.ModelConfig.tiny(vocab_size=64, num_layers=1)
    back = fresh()
    back.load(json.loads(json.dumps(host.state_dict(cfg))))

    def of(h, name):  # a field as comparable JSON
        value = getattr(h, name)
        value = value.state_dict() if hasattr(value, "state_dict") else value
        return json.dumps(checkpoint.arrays_to_json(value), sort_keys=True)

    for field in dataclasses.fields(trainer._Host):
        assert of(host, field.name) != of(fresh(), field.name), field.name  # a state to restore
        assert of(back, field.name) == of(host, field.name), field.name
    assert [e.id for e in back.stream.take(6)] == [e.id for e in host.stream.take(6)]


def test_a_checkpoints_model_is_computed_as_the_run_says(tmp_path):
    """model.attention_impl / moe_impl / remat / logits_chunk / moe_chunk reach a Hugging Face
    checkpoint's architecture (they once stayed at the library's defaults with model.hf_path)."""
    ckpt = testing.make_hf_checkpoint(tmp_path / "ckpt", vocab_size=320)
    cfg = _config("qwen3_moe", model__hf_path=str(ckpt))
    want = dict(
        attention_impl="blocked", moe_impl="ragged", remat="full", logits_chunk=64, moe_chunk=32
    )
    cfg.model.update(want)
    model_cfg, _ = trainer.initial_model(config_lib.Settings.from_config(cfg), None)
    got = {f: getattr(model_cfg, f) for f in model_config.COMPUTE_FIELDS}
    assert got == want
    assert model_cfg.vocab_size == 320  # the architecture is still the checkpoint's


def test_qwen3_moe_long_variant_holds_a_whole_reasoning_trace():
    cfg = testing.load_script(ROOT / "configs" / "qwen3_moe.py").get_config("long")
    s = config_lib.Settings.from_config(cfg)
    longest = s.max_prompt_length + s.curriculum.max_new_tokens
    assert longest == 32768 and s.train.packing
    assert s.train.max_tokens_per_micro_batch >= longest and s.compute["remat"] == "full"


class _Built(Exception):
    """Ends `trainer.train` once it has built its step config (nothing compiled yet)."""


def _trainer_steps(tmp_path, monkeypatch, **overrides):
    """The `train_step.StepConfig` and settings `trainer.train` builds for the tiny config with
    `overrides` (grpo: the ratio metric is the token ratio; no warmup, so the first update
    moves the policy), the run stopped there."""
    built, real = {}, trainer.step_config

    def spy(s, model_cfg, **kw):
        built.update(sc=real(s, model_cfg, **kw), s=s)
        raise _Built

    monkeypatch.setattr(trainer, "step_config", spy)
    defaults = dict(loss__name="grpo", optimizer__warmup_steps=0, optimizer__learning_rate=5e-2)
    with pytest.raises(_Built):
        trainer.train(_config(**(defaults | overrides)), str(tmp_path), progress=False)
    return built["sc"], built["s"]


def _ratio_means_of_one_step(sc, s):
    """One step as the trainer runs it on a random 16-row batch of the run's model (groups of
    4): `prepare`, then one epoch of the run's mini-batches, each a micro-batch. Per update:
    (its loss/ratio_mean, the token mean of exp(logp - pi_old) over its loss tokens, pi_old
    being the step's first policy, or the sampler's log-probs with train.old_logps="sampler")."""
    sc = dataclasses.replace(sc, num_groups=4, micro_batch_size=s.train.mini_batch_size or 16)
    batch, params = testing.random_train_batch(
        sc.model, num_rows=16, prompt_length=4, generation_length=6
    )
    optimizer, _ = train_step.make_optimizer(total_steps=1, **dataclasses.asdict(s.optimizer))
    state = train_step.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )
    batch, _ = jax.jit(lambda p, b: train_step.prepare(sc, p, None, b))(params, batch)
    logps = jax.jit(lambda p, b: train_step.old_logps(sc.model, p, *b).logps)
    update = jax.jit(lambda st, mini: train_step.train_step(sc, optimizer, st, mini))
    out = []
    for mini in batching.minibatches(
        batch, mini_batch_size=sc.micro_batch_size, micro_batch_size=sc.micro_batch_size,
        epochs=1, key=jax.random.key(0),
    ):  # fmt: skip
        rows = jax.tree.map(lambda a: a[0], mini)  # the one micro-batch
        inputs = (rows.tokens, rows.attention_mask, rows.router)
        pi_old = rows.sampler_logps if s.train.old_logps == "sampler" else logps(params, inputs)
        ratio = np.exp(np.asarray(logps(state.params, inputs)) - np.asarray(pi_old))
        want = ratio[np.asarray(rows.loss_mask)].mean()
        state, m = update(state, mini)
        out.append((float(m["loss/ratio_mean"]), float(want)))
    return out


@pytest.mark.slow
def test_sampler_pi_old_with_one_update_a_step_keeps_the_sampler_logps(tmp_path, monkeypatch):
    """train.old_logps="sampler" and one update over the whole batch: the update's ratio is
    against the sampler's log-probs (here the policy's +- N(0, 0.1)), not 1 (the update's own
    forward, which is pi_old only with train.old_logps="recompute")."""
    sc, s = _trainer_steps(tmp_path, monkeypatch, train__old_logps="sampler")
    assert s.train.batch_rows(8)[:2] == (16, 16)  # one update a step
    ((got, want),) = _ratio_means_of_one_step(sc, s)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert abs(want - 1) > 1e-3


@pytest.mark.slow
def test_one_epoch_of_several_mini_batches_takes_pi_old_before_the_first_update(
    tmp_path, monkeypatch
):
    """One epoch of two mini-batches: the second update's ratio is against the policy before
    the first update (the step's pi_old), not 1 (its own forward: no clip would ever act)."""
    sc, s = _trainer_steps(tmp_path, monkeypatch, train__mini_batch_size=8)
    assert s.train.batch_rows(8)[:2] == (16, 8) and s.train.ppo_epochs == 1
    (first, want_first), (second, want_second) = _ratio_means_of_one_step(sc, s)
    np.testing.assert_allclose([first, second], [want_first, want_second], rtol=1e-5)
    assert abs(want_first - 1) < 1e-5 < 1e-3 < abs(want_second - 1)


def test_train_accuracy_counts_rewards_above_success_threshold_only():
    """train/accuracy (what the curriculum's accuracy rule reads) counts the verifier rewards
    > advantage.success_threshold of the rows whose reward call succeeded: a reward exactly at
    it (a custom verifier's half credit at the default 0.5) is no success."""
    s = config_lib.Settings.from_config(_config())
    gen = generation.Generator(
        s=s, stage=s.curriculum.stages[0], handle=None, params=None, pool=None, host=None,
        encode=None, stop=dict(stop_ids=(1,), pad_id=0), key=None, Tp=32, Tg=16,
    )  # fmt: skip
    rows = types.SimpleNamespace(
        rewards=np.array([0.5, 1.0, 0.50001, 0.0, 1.0], np.float32),
        reward_ok=np.array([True, True, True, True, False]),  # the last call failed
        lengths=np.array([3, 4, 5, 6, 7]),
    )
    gen.parts.append((rollout.RolloutResult(rollout=rows, completions=(), metrics={}), np.zeros(5)))
    got = gen.metrics(zero_variance.Groups.empty())
    assert got["train/accuracy"] == 0.5  # 1.0 and 0.50001 of the 4 scored rows
    assert got["train/reward_mean"] == pytest.approx(2.00001 / 4)


def test_jitted_steps_are_shared_by_equal_settings_only():
    """`trainer._jit` hands a later run the jit object of an earlier one only when every setting
    it was built from is equal: the function's arguments (here the optimizer, whose settings make
    one object each: `train_step.make_optimizer` is cached), the donation and the placement of
    the outputs. A key missing any of them would train a run with another run's program."""
    opt = lambda **kw: train_step.make_optimizer(total_steps=10, **kw)[0]
    assert opt(learning_rate=1e-3) is opt(learning_rate=1e-3)
    assert opt(learning_rate=1e-3) is not opt(learning_rate=1e-3, b2=0.99)
    mesh = sharding.make_mesh(data=1, fsdp=1, expert=1)
    rep = sharding.replicated(mesh)
    cfg = model_config.ModelConfig.tiny(num_layers=1)
    kw = dict(donate_argnums=(0, 1), out_shardings=(rep, rep, rep))
    step = trainer._jit(trainer.sft.sft_step, cfg, opt(learning_rate=1e-3), **kw)
    assert step is trainer._jit(trainer.sft.sft_step, cfg, opt(learning_rate=1e-3), **kw)
    other_lr = trainer._jit(trainer.sft.sft_step, cfg, opt(learning_rate=2e-3), **kw)
    assert other_lr is not step
    kept = dict(kw, donate_argnums=())
    assert trainer._jit(trainer.sft.sft_step, cfg, opt(learning_rate=1e-3), **kept) is not step
    placed = dict(kw, out_shardings=(rep, None, rep))
    assert trainer._jit(trainer.sft.sft_step, cfg, opt(learning_rate=1e-3), **placed) is not step
    # And each program is its own settings': the two learning rates take different steps.
    params = transformer.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 2, cfg.vocab_size)
    batch = dict(tokens=tokens, attention_mask=jnp.ones((2, 6), bool),
                 loss_mask=jnp.ones((2, 6), bool).at[:, :2].set(False))  # fmt: skip
    moved = []
    for fn, lr in ((step, 1e-3), (other_lr, 2e-3)):
        p = jax.tree.map(jnp.copy, params)
        new, _, _ = fn(p, opt(learning_rate=lr).init(p), batch)
        diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new, params)
        moved.append(max(jax.tree.leaves(diff)))
    np.testing.assert_allclose(moved[1], 2 * moved[0], rtol=0.05)  # Adam: a step of size ~lr
