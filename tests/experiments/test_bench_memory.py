"""bench_memory.py's reading of XLA's buffer assignment, and bench_long_decode.py's cache size."""

import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))
import bench_long_decode  # noqa: E402
import bench_memory  # noqa: E402

from espo.model import handle, layers  # noqa: E402
from espo.model.config import ModelConfig  # noqa: E402

# A TPU-style dump: tiled layouts hold parentheses, temporaries come in several colours.
ASSIGNMENT = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <2 reduce_window_sum.5 @0> (size=512,offset=0): s32[]{:T(128)}
allocation 1: size 4096, maybe-live-out:
 value: <3 dus.1 @0> (size=4096,offset=0): bf16[2,1024]{1,0:T(8,128)(2,1)}
allocation 2: size 8192, parameter 0, shape |bf16[4,1024]| at ShapeIndex {}:
 value: <4 p.1 @0> (size=8192,offset=0): bf16[4,1024]{1,0:T(8,128)(2,1)}
allocation 3: size 64, color 1, preallocated-temp:
 value: <5 tok.1 @0> (size=0,offset=0): token[]
allocation 4: size 3072, preallocated-temp:
 value: <6 fusion.1 @0> (size=2048,offset=0): f32[512]{0:T(1024)}
 value: <7 fusion.2 @0> (size=1024,offset=0): bf16[512]{0:T(1024)(128)(2,1)}
 value: <8 tuple.1 @0> (size=16,offset=2048): (f32[512], bf16[512])
 value: <9 fusion.3 @0> (size=1024,offset=2048): bf16[2,256]{1,0:T(2,128)(2,1)}
"""


@pytest.fixture
def dump(tmp_path):
    name = "module_0000.jit_loss.cl_1.after_optimizations-buffer-assignment.txt"
    (tmp_path / name).write_text(ASSIGNMENT)
    return str(tmp_path)


def test_allocation_sizes_split_temporaries_arguments_and_outputs(dump):
    got = bench_memory.allocation_sizes(dump)
    GiB = bench_memory.GiB
    assert got == dict(temp_gib=(3072 + 64) / GiB, args_gib=8192 / GiB, out_gib=4096 / GiB)
    with pytest.raises(FileNotFoundError):  # another module's name: not an empty program
        bench_memory.allocation_sizes(dump, module="jit_eval")


def test_largest_temporaries_read_tiled_layouts(dump):
    """The main temp allocation's slots by offset, largest first (a layout's parentheses once
    hid every value but tokens and scalars)."""
    got = bench_memory.largest_temps(dump, 2)
    assert [r["gib"] * bench_memory.GiB for r in got] == [2048, 1024]
    assert got[0]["shapes"] == "f32[512], bf16[512]" and got[1]["shapes"] == "bf16[2,256]"


def test_kv_cache_size_is_the_caches_bytes():
    cfg = ModelConfig.tiny(num_layers=3, dtype="bfloat16")
    cache = handle.Model(cfg).init_cache(batch=2, max_length=37)
    nbytes = sum(a.nbytes for a in jax.tree.leaves((cache.k, cache.v)))
    assert bench_long_decode.kv_cache_gib(cfg, 2, 37) * 2**30 == nbytes


def test_long_decode_measures_a_step_over_the_cache():
    """A step's bytes count each MoE layer's experts the routing touched (between one row's
    top-k and every row's own), spread over the layers (layer 0 here is dense)."""
    cfg = ModelConfig.tiny(num_experts=16, num_layers=3, dense_layers=(0,), dense_ffn_dim=24)
    (r,) = bench_long_decode.measure(cfg, 40, rows=3, new=3, reps=1)
    assert r["step_ms"] > 0 and r["prefill_s"] > 0 and r["tokens_per_s"] > 0
    assert r["attention"] == "auto"
    assert cfg.top_k <= r["touched_experts"] <= 3 * cfg.top_k
    spread = r["touched_experts"] * len(cfg.moe_layers) / cfg.num_layers
    want = bench_long_decode.bench_rollout.decode_step_bytes(
        cfg, batch=3, touched_experts=spread, mean_length=40 + 1
    )
    assert r["read_gb"] == pytest.approx(want / 1e9)


def test_long_decode_traces_each_attention_arm_with_its_own_settings(monkeypatch):
    """Each arm's step is traced with its own settings: "kernel" with GPU_BLOCKED_DECODE on,
    "dense" and "blocked" with it off and model.attention_impl so named, "auto" with the flag
    as set (on this CPU they change nothing, so they are read where the step reads them)."""
    seen, attend = [], layers.attention.attend
    cfg = ModelConfig.tiny(num_layers=1)

    def spy(*args, impl, **kw):
        if not kw["own_keys"] and args[0].shape[2] == cfg.num_heads // cfg.num_kv_heads:
            seen.append((impl, layers.GPU_BLOCKED_DECODE))
        return attend(*args, impl=impl, **kw)

    monkeypatch.setattr(layers.attention, "attend", spy)
    monkeypatch.setattr(layers, "GPU_BLOCKED_DECODE", "as set")
    arms = ("kernel", "auto", "dense", "blocked")
    rows = bench_long_decode.measure(cfg, 40, rows=2, new=2, reps=2, arms=arms)
    assert [r["attention"] for r in rows] == list(arms)
    # a decode step (one token over the cache) of each arm, traced once, then its compiled
    # step reused
    want = [("auto", True), ("auto", "as set"), ("dense", False), ("blocked", False)]
    assert seen == want
    assert layers.GPU_BLOCKED_DECODE == "as set"


@pytest.mark.parametrize("arms", ["kernel", "dense", "blocked", "auto,auto", "auto,triton"])
def test_long_decode_refuses_an_arm_it_cannot_run(arms, capsys):
    with pytest.raises(SystemExit) as err:
        bench_long_decode.main(["--attention", arms, "--contexts", "40"])
    assert err.value.code == 2 and "--attention" in capsys.readouterr().err


def _temp_mib(*, unrolled: bool, remat: str) -> float:
    point = dict(
        model="default", length=128, rows=2, replay=False, overrides={"remat": remat},
        buffers=0, max_rss_gb=8, tpu=None, mesh=None, no_scan_hoisting=False, unrolled=unrolled,
    )  # fmt: skip
    r = bench_memory.measure(point)
    assert r["config"]["remat"] == remat
    return r["temp_gib"] * 1024


@pytest.mark.slow
def test_unrolled_measures_the_unrolled_loop_where_remat_keeps_its_temporaries():
    """--unrolled compiles the per-layer loop (train.scan_layers=False), another program than
    the scan's; the docs' finding it measures: on XLA:CPU, remat="full" gives the scanned loop's
    temporaries back (default model: 0.153 -> 0.045 GiB at 1,024 tokens) and the unrolled
    loop's it keeps (0.133 -> 0.124): transformer.remat_block's docstring."""
    scanned = {r: _temp_mib(unrolled=False, remat=r) for r in ("none", "full")}
    unrolled = {r: _temp_mib(unrolled=True, remat=r) for r in ("none", "full")}
    assert unrolled["none"] != pytest.approx(scanned["none"], rel=0.02)
    assert scanned["full"] < 0.5 * scanned["none"]
    assert unrolled["full"] > 0.8 * unrolled["none"]
