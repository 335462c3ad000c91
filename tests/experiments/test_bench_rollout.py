"""The rollout benchmark's pieces run on the real espo model (numbers are reported by the script,
not asserted here)."""

import pathlib

import jax
import numpy as np
import pytest

from espo import model, testing

PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench_rollout.py"


@pytest.fixture(scope="module")
def bench():
    return testing.load_script(PATH)


@pytest.mark.slow
def test_gpu_bandwidth_path_runs_on_a_tiny_config(bench):
    cfg = model.ModelConfig.tiny(param_dtype="bfloat16", dtype="bfloat16")
    out = bench.gpu_decode_bandwidth(cfg, batch=2, new_tokens=16, repeats=1)
    for name in ("bf16", "fp8"):
        assert out[name]["tokens_per_s"] > 0 and out[name]["GB_per_s"] > 0


@pytest.mark.slow
def test_padding_waste_section_decode_slots_beat_fifo(bench):
    pw = bench.padding_waste(num_prompts=16, group_size=2, max_new_tokens=128)
    fifo = pw["fifo"]
    # The real model (counting weights) generated exactly the workload's planned lengths: a
    # prompt ending in vocab - 1 - n gets n tokens, the last one the stop id vocab - 1, unless
    # max_new_tokens (128) cuts it.
    _, _, prompts, _, config = bench._lognormal_workload(
        num_prompts=16, group_size=2, max_new_tokens=128, step=1
    )
    planned = np.array([config.sampling.stop_ids[0] - p[1] for p in prompts])
    assert fifo["rollout/useful_tokens"] == np.minimum(planned, 128).sum()
    assert fifo["rollout/truncated_fraction"] == np.mean(planned > 128) > 0
    assert fifo["rollout/reprefill_positions"] == 0  # FIFO budgets max_new_tokens
    for statistic in ("mean", "max"):
        aware = pw[f"length_aware_{statistic}"]
        assert aware["rollout/decode_padding_waste"] < fifo["rollout/decode_padding_waste"]
        assert aware["rollout/decode_padding_waste"] <= aware["rollout/padding_waste"]
        assert aware["rollout/useful_tokens"] == fifo["rollout/useful_tokens"]
    # Chunks are padded to max_chunk_size (no batch buckets), so a continuation chunk costs a
    # whole chunk's slots and ending a chunk early never pays: the plan budgets each chunk to
    # its longest predicted row and beats FIFO counting re-prefill too (0.581 vs 0.668; always
    # budgeting at the mean, before the planner weighed re-prefill, lost: 0.671).
    mean = pw["length_aware_mean"]
    assert mean["rollout/reprefill_positions"] == 0
    assert mean["rollout/padding_waste"] < fifo["rollout/padding_waste"]


@pytest.mark.slow
def test_detokenization_section_and_the_byte_level_decoder(bench):
    decoder = bench.ByteLevelDecoder(50)
    assert decoder([3, 4]) == decoder([3]) + decoder([4]) and decoder([]) == ""
    assert all(1 <= len(decoder([t])) <= 6 for t in range(50))
    # In the test, workers cannot import this file's decoder (not a module): `str` stands in.
    dt = bench.detokenization(
        num_prompts=4, group_size=2, max_new_tokens=32, decoder=str, repeats=1
    )
    for where in ("host", "workers"):
        assert dt[where]["total_s"] >= dt[where]["host_handoff_s"] > 0


@pytest.mark.slow
def test_fp8_mismatch_section(bench):
    cfg = model.ModelConfig.tiny()
    params = model.init(cfg, jax.random.key(0))
    prompts = np.random.RandomState(0).randint(2, cfg.vocab_size, (2, 8))
    mm = bench.fp8_mismatch(cfg, params, prompts, new_tokens=8)
    assert 0 <= mm["mean_abs_dlogp"] < 0.5 and 0.5 < mm["greedy_agreement"] <= 1
    assert 0 <= mm["router_disagreement"] < 0.5 and mm["weight_bytes_ratio"] <= 0.55


def test_decode_step_bytes_by_hand(bench):
    # D=4, head 2, H=2, N=1, E=3, F=5, V=7, L=2, float32; B=3, 2.5 touched experts, length 10.
    # Per layer: attention (q, o: 2*4*2*2 = 32; k, v: 2*4*1*2 = 16; norms 2*4 + q/k norms 2*2)
    # = 60 floats; router 4*3 = 12; experts 2.5 * 3*4*5 = 150; KV 3 * 2*1*2 * 10 = 120: 342.
    # Model: 2 * 342 + LM head 4*7 + 3 embedding rows of 4 + final norm 4 = 728 floats.
    cfg = model.ModelConfig(
        vocab_size=7, d_model=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
        num_experts=3, top_k=2, moe_ffn_dim=5,
    )  # fmt: skip
    got = bench.decode_step_bytes(cfg, batch=3, touched_experts=2.5, mean_length=10)
    assert got == 728 * 4


def test_touched_experts_counts_distinct_experts_per_layer_and_step(bench):
    # [B=2, L=1, T=2, K=2]: step 0 touches {0, 1, 2}, step 1 {0, 1}: mean 2.5.
    ids = np.array([[[[0, 1], [0, 1]]], [[[1, 2], [1, 0]]]])
    assert bench._touched_experts(ids) == 2.5


@pytest.mark.slow
def test_engines_run_in_their_own_process(bench, tmp_path):
    path = testing.make_hf_checkpoint(tmp_path / "ckpt", num_experts=8, num_experts_per_tok=2)
    shape = dict(batch=2, prompt_len=4, new_tokens=4, dtype="float32")
    for impl in ("auto", "blocked+stacked"):
        out = bench.run_engine("espo", path, impl=impl, **shape)
        assert out["tokens_per_s"] > 0 and 1 <= out["touched_experts"] <= 8
        assert out["step_bytes"] > 0 and out["peak_rss_gb"] > 0
    # A failing worker (no checkpoint there) is reported and gives None, not a crash.
    assert bench.run_engine("espo", tmp_path / "missing", **shape) is None


@pytest.mark.slow
def test_fp8_read_check_names_the_dot_operand_dtype(bench):
    out = bench.fp8_read_check(experts=4, d=8, f=8, capacity=2)
    assert set(out) == {"f32", "bf16", "fp8 -> f32"}
    assert all(r["ms"] > 0 and r["reads_e4m3"] in (True, False) for r in out.values())


def test_moe_rounds_keep_each_engines_median_run(bench):
    runs = [{"tokens_per_s": 5.0}, None, {"tokens_per_s": 3.0}, {"tokens_per_s": 9.0}]
    assert bench._median_run(runs) == {"tokens_per_s": 5.0}
    assert bench._median_run(runs[:3]) == {"tokens_per_s": 3.0}  # the lower of two
    assert bench._median_run([None]) is None


def test_espo_over_vllm_takes_vllms_better_run(bench):
    run = lambda tps: {"tokens_per_s": tps}
    row = {"espo f32": run(6.0), "vLLM f32": None, "vLLM bf16": run(4.0)}
    assert bench._espo_over_vllm(row) == 1.5  # the failed f32 run left out
    assert bench._espo_over_vllm({**row, "vLLM f32": run(5.0)}) == 1.2
    assert bench._espo_over_vllm({"espo f32": run(6.0)}) is None


def test_read_bandwidth_is_the_fastest_layout_of_the_same_bytes(bench, monkeypatch):
    """Every layout in BANDWIDTH_ROWS is timed, and the fastest one sets the bandwidth of the
    `gib` read (the 64-row layout alone under-read it ~2x here): seconds faked per layout."""
    seconds = {64: 4.0, 2**12: 1.0, 2**16: 2.0}  # the middle layout fastest
    seen = []

    def timed(fn, repeats):
        out = fn()
        seen.append(out.shape[0])  # one sum a row
        return seconds[out.shape[0]]

    monkeypatch.setattr(bench, "_timed", timed)
    gbs = bench.read_bandwidth_gbs(gib=1 / 64, repeats=1)
    assert sorted(seen) == sorted(bench.BANDWIDTH_ROWS)
    assert gbs == pytest.approx(2**30 / 64 / 1.0 / 1e9)
