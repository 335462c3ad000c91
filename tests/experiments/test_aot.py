"""experiments/aot.py: the presets' shapes, the memory breakdown against XLA's, the fit verdict,
the mesh search and the step projection."""

import dataclasses
import json
import math
import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
import aot  # noqa: E402
import aot_programs  # noqa: E402
import roofline  # noqa: E402

from espo.model import transformer  # noqa: E402
from espo.model.config import ModelConfig  # noqa: E402

GiB = 2**30


def _param_count(cfg) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(transformer.param_shapes(cfg)))


@pytest.mark.parametrize(
    "preset, total, active",  # Qwen3 technical report: total and activated parameters
    [("qwen3_30b_a3b", 30.5e9, 3.3e9), ("qwen3_235b_a22b", 235e9, 22e9)],
)
def test_presets_have_the_published_parameter_counts(preset, total, active):
    cfg = getattr(ModelConfig, preset)()
    assert _param_count(cfg) == pytest.approx(total, rel=0.01)
    embedding = cfg.vocab_size * cfg.d_model  # "activated" counts the embedding too
    got = aot_programs.model_flops_per_token(cfg, context=0)["active_params"] + embedding
    assert got == pytest.approx(active, rel=0.02)


def test_config_presets_build_the_real_shapes():
    """The qwen3_moe presets: the architecture, T, rows a step and the reasoning-length settings."""
    s, cfg = aot_programs.settings_of("configs/qwen3_moe.py:30b_a3b_long")
    assert cfg == ModelConfig.qwen3_30b_a3b(remat="full", moe_chunk=4096)
    shp = aot_programs.shapes_of(s, cfg, devices=8)
    assert (shp["T"], shp["rows_per_device"], shp["step_rows"]) == (32768, 1, 512)
    assert shp["chunk_rows"] % 8 == 0 and shp["chunk_rows"] % shp["G"] == 0
    # the same on 8 x 80 GB: one prompt's group (16 rows) a GPU, the state offloaded
    s8, cfg8 = aot_programs.settings_of("configs/qwen3_moe.py:30b_a3b_long_h100")
    assert cfg8 == cfg and aot_programs.shapes_of(s8, cfg8, devices=8)["chunk_rows"] == 128
    assert s8.rollout.offload_state and not s.rollout.offload_state
    assert dataclasses.replace(s8.rollout, max_chunk_size=256, offload_state=False) == s.rollout
    assert aot_programs.shapes_of(s8, cfg8, devices=8)["eval_rows"] == 64  # 16 prompts x 4
    s, cfg = aot_programs.settings_of("configs/qwen3_moe.py:235b_a22b")
    assert cfg.num_layers == 94 and aot_programs.shapes_of(s, cfg, devices=64)["T"] == 8192


def test_static_bytes_and_the_mesh_search():
    """Params + Adam's two moments, per device: the whole f32 state unsharded, and meshes whose
    state cannot fit the HBM are not tried (the tiny model: 4 experts, width 32)."""
    s, cfg = aot_programs.settings_of("configs/default.py:tiny")
    whole = 3 * 4 * _param_count(cfg)  # float32 params, mu and nu
    assert aot.static_bytes(s, cfg, (8, 1, 1)) == pytest.approx(whole, rel=1e-3)
    assert aot.static_bytes(s, cfg, (1, 2, 4)) < whole / 3  # norms stay replicated
    tried = aot.candidate_meshes(s, cfg, 8, hbm=whole / 2)
    assert tried and all(c["static"] < whole / 2 for c in tried)
    assert {"data": 8, "fsdp": 1, "expert": 1} not in [c["mesh"] for c in tried]
    least = min(c["static"] for c in tried)  # least state first, then the widest expert axis
    ties = [
        c for c in tried if round(c["static"] / (whole / 2), 2) == round(least / (whole / 2), 2)
    ]
    assert tried[0] == max(ties, key=lambda c: c["mesh"]["expert"])
    every = aot.candidate_meshes(s, cfg, 8, hbm=whole * 2)
    assert {"data": 8, "fsdp": 1, "expert": 1} in [c["mesh"] for c in every]
    assert all(cfg.num_experts % c["mesh"]["expert"] == 0 for c in every)


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    """The tiny config's three programs on 2 emulated devices (fsdp=2), two updates a step (a
    pi_old forward of its own, as the presets)."""
    out = tmp_path_factory.mktemp("aot")
    args = ["--config", "configs/default.py:tiny", "--gpus", "2", "--mesh", "fsdp=2"]
    return aot.main([*args, "--set", "train.ppo_epochs=2", "--json", str(out / "fits.json")])


def test_one_update_a_step_has_no_pi_old_forward():
    """One update over the whole batch (the tiny config): pi_old is that update's own forward
    (`StepConfig.fused_old_logps`), so the pi_old program reads no params."""
    args = ["--config", "configs/default.py:tiny", "--gpus", "1", "--programs", "old"]
    (res,) = aot.main([*args, "--local", "--run"])["results"]
    old = res["programs"]["old"]
    assert old["measured_s"] > 0  # --run: the compiled program timed here
    assert old["params"] == 0 and old["flops"] == 0
    assert old["resident"] == pytest.approx(
        aot.static_bytes(*aot_programs.settings_of(args[1]), (1, 1, 1))
    )
    assert old["inputs"] >= 0


def test_breakdown_adds_up_to_xla(two_devices):
    (res,) = two_devices["results"]
    assert not res.get("error"), res.get("error")
    for name, row in res["programs"].items():
        parts = ("params", "opt_state", "inputs", "temporaries", "outputs", "resident")
        assert sum(row[k] for k in parts) == pytest.approx(row["total"]), name
        # XLA's arguments: the params and optimiser state (exact, from their shardings) and
        # the inputs it keeps of those placed
        assert 0 <= row["inputs"] <= row["placed_inputs"] * (1 + 1e-6), name
    up, old, roll = (res["programs"][k] for k in ("update", "old", "rollout"))
    assert up["opt_state"] == pytest.approx(2 * up["params"], rel=1e-3)  # Adam's mu and nu
    assert up["outputs"] < 0.01 * up["opt_state"]  # the new state aliases the donated one
    assert old["resident"] == up["opt_state"]  # the state pi_old does not take
    assert up["flops"] > 3 * old["flops"] * 0.9  # forward + backward (+ remat) vs a forward
    assert roll["resident"] == pytest.approx(up["params"] + up["opt_state"])
    assert roll["params"] < up["params"] / 2  # FP8 weights (f32 training params)
    # The eval decodes from a per-layer copy of the training params, the state resident.
    ev = res["programs"]["eval"]
    assert ev["params"] == pytest.approx(up["params"], rel=0.02)
    assert ev["resident"] == pytest.approx(up["params"] + up["opt_state"])
    assert "projection" in two_devices and two_devices["projection"]["tokens_per_s_per_chip"] > 0


def test_the_rollout_layout_gathers_no_weight_at_decode(two_devices):
    """fsdp=2: on the training layout each decode step all-gathers every layer's weights;
    rollout.param_layout="experts" (experts over the expert axis, here of size 1) holds them
    whole, converted once a step, so the rollout chunk sends a tenth or less (the outputs'
    replication is what is left: 7% here) and holds twice the weights."""
    args = ["--config", "configs/default.py:tiny", "--gpus", "2", "--mesh", "fsdp=2"]
    args += ["--programs", "rollout", "--set", "rollout.param_layout=experts"]
    (res,) = aot.main(args)["results"]
    sent = lambda row: sum(c["bytes"] for c in row["collectives"].values())  # noqa: E731
    training, own = two_devices["results"][0]["programs"]["rollout"], res["programs"]["rollout"]
    assert sent(own) < 0.1 * sent(training), (sent(own), sent(training))
    assert own["params"] == pytest.approx(2 * training["params"], rel=0.1)


@pytest.mark.parametrize("fp8", [True, False])
def test_an_offloaded_state_is_not_resident_while_the_rollout_decodes(fp8):
    """rollout.offload_state: the rollout's resident state is what stays on the device (nothing
    with the sampler's own FP8 copy; the params it reads as they are without one), the rest is
    counted as offloaded (the bytes the step copies out and back)."""
    sets = ("rollout.offload_state=true", f"rollout.fp8={str(fp8).lower()}")
    s, cfg = aot_programs.settings_of("configs/default.py:tiny", sets)
    assert s.rollout.offload_state and s.rollout.fp8 == fp8
    mesh = aot_programs.mesh_over(jax.devices()[:1], {})
    progs = aot_programs.programs(s, cfg, mesh, aot_programs.shapes_of(s, cfg, devices=1))
    state = progs["update"][2]
    _, _, sizes, resident = progs["rollout"]
    assert resident == (0.0 if fp8 else state["params"])
    assert resident + sizes["offloaded"] == state["params"] + state["opt_state"]
    _, _, old, old_resident = progs["old"]  # back on the device for pi_old
    assert old["params"] + old_resident == state["params"] + state["opt_state"]
    _, _, ev, ev_resident = progs["eval"]  # the eval reads the params: the moments wait
    assert ev_resident == state["params"] and ev["offloaded"] == state["opt_state"]
    # Each program lowers to the HLO module its name gives (a TPU's sizes are read off the
    # compiler's dump of module jit_<name>: another name reads as nothing there).
    for name, (fn, args, *_) in progs.items():
        with jax.set_mesh(mesh):
            assert f"module @jit_{name} " in fn.trace(*args).lower().as_text(), name


def test_a_config_that_cannot_fit_is_reported_as_such(two_devices):
    (res,) = two_devices["results"]
    total = max(r["total"] for r in res["programs"].values())
    assert all(aot.fits(res, hbm=total).values())
    smaller = aot.fits(res, hbm=total - 1)
    assert not all(smaller.values()) and set(smaller) == {"update", "old", "rollout", "eval"}
    refused = dict(res, programs={"update": dict(res["programs"]["update"], refused="HBM")})
    assert aot.fits(refused, hbm=total) == {"update": False}  # the TPU compiler said no
    assert aot.fits({"error": "timeout"}, hbm=total) == {}
    # Memory that shrank from 2 to 4 layers extrapolates to nothing trustworthy (a v5p
    # compile's temporaries went to -44 GiB at 48 layers): never "fits".
    shrank = dict(res, programs={"update": dict(res["programs"]["update"], shrinks=["total"])})
    assert aot.fits(shrank, hbm=10 * total) == {"update": False}


def test_step_projection_counts_every_micro_batch_chunk_and_decode_step():
    chip = roofline.CHIPS["h100"]
    shapes = dict(T=100, Tg=60, micro_rows=4, step_rows=32, chunk_rows=16, epochs=2)
    row = lambda **kw: dict(dict(matmul_s=1.0, collectives={}), **kw)  # noqa: E731
    res = dict(
        shapes=shapes, devices=4,
        programs=dict(update=row(), old=row(matmul_s=0.5),
                      rollout=row(matmul_s=0.3, decode_matmul_s=0.01)),
    )  # fmt: skip
    cfg = ModelConfig.tiny()
    p = aot.step_projection(res, cfg, chip, None)
    assert p["update_s"] == pytest.approx(8 * 2 * 1.0)  # 8 micro-batches x 2 epochs
    assert p["old_s"] == pytest.approx(8 * 0.5)
    assert p["rollout_s"] == pytest.approx(2 * (0.3 + 59 * 0.01))  # 2 chunks
    assert p["tokens_per_s_per_chip"] == pytest.approx(32 * 100 / (p["step_s"] * 4))
    assert "offload_s" not in p and p["step_s"] == pytest.approx(16 + 4 + p["rollout_s"])
    # rollout.offload_state: the state out to host memory and back over the chip's host link,
    # once a step; not counted on a chip whose link is not known.
    res["programs"]["rollout"]["offloaded"] = 3e9
    p = aot.step_projection(res, cfg, chip, None)
    assert p["offload_s"] == pytest.approx(2 * 3e9 / chip.host_bw)
    assert p["step_s"] == pytest.approx(16 + 4 + p["rollout_s"] + p["offload_s"])
    unknown = dataclasses.replace(chip, host_bw=0.0)
    q = aot.step_projection(res, cfg, unknown, None)
    assert q["offload_s"] is None and q["step_s"] == pytest.approx(16 + 4 + p["rollout_s"])
    res["programs"]["rollout"].pop("offloaded")
    # Collectives slower than the matmuls bind the update.
    slow = {"all-gather": dict(count=1, bytes=3.0 * chip.link_bw)}
    res["programs"]["update"] = row(collectives=slow)
    assert aot.step_projection(res, cfg, chip, None)["update_s"] == pytest.approx(8 * 2 * 3.0)


def test_flops_per_token_counts_every_decode_step_of_a_chunk():
    shapes = dict(T=100, Tg=60, micro_rows=4, chunk_rows=16)
    res = dict(
        shapes=shapes,
        programs=dict(update=dict(flops=4e6), rollout=dict(flops=5e6, decode_flops=1e4)),
    )
    assert aot.flops_per_token(res, "update") == pytest.approx(4e6 / 400)
    assert aot.flops_per_token(res, "rollout") == pytest.approx((5e6 + 59 * 1e4) / 1600)


def test_deep_models_are_extrapolated_from_two_depths():
    """Every number of a 5-layer rollout (the unrolled decode: the least linear program) from
    its 2- and 4-layer compiles against the whole 5-layer compile: exact but the temporaries
    (XLA reuses buffers across unrolled layers: within 10%)."""
    args = ["--config", "configs/default.py:tiny", "--gpus", "1", "--programs", "rollout"]
    args += ["--set", "model.num_layers=5"]
    (got,) = aot.main(args)["results"]
    (whole,) = aot.main([*args, "--full"])["results"]
    got, whole = got["programs"]["rollout"], whole["programs"]["rollout"]
    assert got["extrapolated_from"] == [2, 4] and "extrapolated_from" not in whole
    assert got["shrinks"] == [] and set(got["at_depths"]) == {"2", "4"}
    assert got["at_depths"]["4"]["total"] > got["at_depths"]["2"]["total"]
    for key in ("params", "inputs", "outputs", "resident", "flops", "decode_flops", "matmul_s"):
        assert got[key] == pytest.approx(whole[key], rel=1e-6), key
    assert got["temporaries"] == pytest.approx(whole["temporaries"], rel=0.1)


def test_extrapolate_is_linear_in_depth_through_nested_results():
    a = dict(x=10.0, c={"all-gather": dict(count=2, bytes=100.0)}, flag=True, note="a")
    b = dict(x=14.0, c={"all-gather": dict(count=4, bytes=180.0)}, flag=False, note="b")
    got = aot.extrapolate(a, b, 2, 4, 48)
    assert got["x"] == 14.0 + 44 * 2.0 and got["c"]["all-gather"] == dict(count=48, bytes=1940.0)
    assert got["flag"] is False and got["note"] == "b"


def test_the_update_keeps_the_state_dtypes_of_bf16_params():
    """The update's new state has its input's dtypes with bf16 params (a float32 mean gradient
    made Adam's moments float32 after the first update: a recompile, twice their memory, and
    the donated state not aliased)."""
    s, cfg = aot_programs.settings_of(
        "configs/qwen3_moe.py:tiny", ('model.param_dtype="bfloat16"', 'model.dtype="bfloat16"')
    )
    mesh = aot_programs.mesh_over(jax.devices()[:1], {})
    fn, (state, mini), *_ = aot_programs.programs(s, cfg, mesh, aot_programs.shapes_of(s, cfg, 1))[
        "update"
    ]
    new, _ = jax.eval_shape(fn, state, mini)
    dtypes = lambda tree: [a.dtype for a in jax.tree.leaves(tree)]  # noqa: E731
    assert dtypes(new.opt_state) == dtypes(state.opt_state)
    assert dtypes(new.params) == dtypes(state.params) and "bfloat16" in map(str, dtypes(new.params))


def test_a_failed_compile_names_where_it_was_raised(monkeypatch, capsys):
    """A compiling subprocess that fails reports the innermost frames (here the helper's
    `raise` line, then its caller's, then aot's), so an error from inside a library names the
    library."""

    def deep():
        raise KeyError("num_consts")

    def measure(point):
        deep()

    monkeypatch.setattr(aot, "measure", measure)
    aot.main(["--point", "{}"])
    error = json.loads(capsys.readouterr().out)["error"]
    line = deep.__code__.co_firstlineno + 1
    caller = measure.__code__.co_firstlineno + 1
    where = f"test_aot.py:{line} <- test_aot.py:{caller} <- aot.py:"
    assert error.startswith(where) and "KeyError: " in error, error


def test_a_compile_past_its_timeout_says_where_the_subprocess_was(monkeypatch):
    """On a timeout the subprocess is killed and its last progress lines (stderr, among other
    output) name what had compiled and what was compiling."""
    progress = [aot_programs.PROGRESS + "update: compiled in 31 s", "W0000 noise"]
    progress += [aot_programs.PROGRESS + "old: compiling"]

    def run(cmd, *, timeout, **kw):
        raise aot.subprocess.TimeoutExpired(cmd, timeout, stderr="\n".join(progress).encode())

    monkeypatch.setattr(aot.subprocess, "run", run)
    got = aot.run_point({"programs": ["update", "old"]}, timeout=150)
    assert got == {"error": "timeout after 150 s (update: compiled in 31 s; old: compiling)"}
