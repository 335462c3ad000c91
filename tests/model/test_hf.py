"""Hugging Face parity: logits and expert choices equal transformers'; round trips are exact."""

import json
import subprocess
import sys
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from espo import model, testing
from espo.model import hf
from espo.testing import raises_invalid

pytest.importorskip("transformers")

TOKENS = np.array(
    [[3, 17, 42, 5, 88, 9, 61, 2, 33, 70], [11, 4, 95, 27, 8, 50, 1, 19, 64, 7]], np.int32
)

CASES = {
    # GQA ratio 2, renormalised top-k, a dense layer in the middle (mlp_only_layers).
    "qwen3_norm_dense": (hf.QWEN3_MOE, dict(norm_topk_prob=True, mlp_only_layers=[1])),
    # GQA ratio 4, no renormalisation, tied embeddings, the num_local_experts spelling.
    "qwen3_raw_tied": (
        hf.QWEN3_MOE,
        dict(norm_topk_prob=False, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "mixtral": (hf.MIXTRAL, dict()),
}


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    """Every case of CASES as transformers writes it, made once."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in sorted(CASES)}
    for name, path in dirs.items():
        arch, overrides = CASES[name]
        testing.make_hf_checkpoint(path, architecture=arch, **overrides)
    return dirs


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, checkpoint_dirs):
    path = checkpoint_dirs[request.param]
    cfg, params = model.load_hf_checkpoint(path)
    return path, cfg, params


def _assert_expert_ids_equal(cfg, ours, theirs, mask):
    """ours: [B, L, T, K]; theirs: {layer: [B*T, K]}; compare real tokens, as sets per token."""
    assert sorted(theirs) == list(cfg.moe_layers)
    for layer, hf_ids in theirs.items():
        got = np.sort(np.asarray(ours[:, layer]).reshape(-1, cfg.top_k), axis=-1)
        want = np.sort(hf_ids, axis=-1)
        real = np.asarray(mask).reshape(-1)
        np.testing.assert_array_equal(got[real], want[real], err_msg=f"layer {layer}")


# Jitted (the config static): op by op, a forward compiled ~150 small programs.
_forward = jax.jit(model.forward, static_argnums=0)


@pytest.mark.slow
def test_logits_and_experts_match_transformers(checkpoint):
    path, cfg, params = checkpoint
    want_logits, want_ids = testing.hf_forward(path, TOKENS)
    out = _forward(cfg, params, jnp.asarray(TOKENS))
    np.testing.assert_allclose(out.logits, want_logits, atol=1e-4, rtol=1e-4)
    assert np.abs(want_logits).max() > 1.0  # the comparison is not between near-zero logits
    _assert_expert_ids_equal(cfg, out.router.expert_ids, want_ids, np.ones(TOKENS.shape, bool))


@pytest.mark.slow
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_transformers(checkpoint, side):
    path, cfg, params = checkpoint
    lengths = np.array([10, 6])
    mask = np.arange(10)[None] < lengths[:, None]
    if side == "left":
        mask = mask[:, ::-1]
    tokens = np.where(mask, TOKENS, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    want_logits, want_ids = testing.hf_forward(
        path, tokens, attention_mask=mask.astype(np.int64), position_ids=positions
    )
    out = _forward(cfg, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(out.logits[mask], want_logits[mask], atol=1e-4, rtol=1e-4)
    _assert_expert_ids_equal(cfg, out.router.expert_ids, want_ids, mask)


def test_save_round_trip_is_exact_and_transformers_loads_it(checkpoint, tmp_path):
    path, cfg, params = checkpoint
    saved = model.save_hf_checkpoint(cfg, params, tmp_path / "out")
    cfg2, params2 = model.load_hf_checkpoint(saved)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    # Every tensor transformers wrote comes back bit for bit.
    original, rewritten = (
        load_file(path / "model.safetensors"),
        load_file(saved / "model.safetensors"),
    )
    assert sorted(original) == sorted(rewritten)
    for key, value in original.items():
        np.testing.assert_array_equal(rewritten[key], value, err_msg=key)
    want_logits, _ = testing.hf_forward(path, TOKENS)
    got_logits, _ = testing.hf_forward(saved, TOKENS)
    np.testing.assert_array_equal(got_logits, want_logits)


@pytest.mark.slow
def test_sharded_checkpoint_and_bf16_round_trip(tmp_path):
    cfg = model.ModelConfig.tiny(param_dtype="bfloat16", dtype="bfloat16")
    params = model.init(cfg, jax.random.key(3))
    path = model.save_hf_checkpoint(cfg, params, tmp_path / "sharded", max_shard_bytes=100_000)
    assert len(list(path.glob("model-*.safetensors"))) > 1
    assert (path / "model.safetensors.index.json").exists()
    cfg2, params2 = model.load_hf_checkpoint(path)
    assert cfg2.param_dtype == "bfloat16"
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_save_refuses_to_overwrite_and_unrepresentable_configs(checkpoint, tmp_path):
    _, cfg, params = checkpoint
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        model.save_hf_checkpoint(cfg, params, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    with raises_invalid("shared_expert_ffn_dim"):
        model.save_hf_checkpoint(cfg.replace(shared_expert_ffn_dim=8), params, tmp_path / "x")


@pytest.fixture
def qwen_dir(tmp_path):
    return testing.make_hf_checkpoint(tmp_path / "qwen", num_hidden_layers=1)


def _one_device(cfg):
    """Shardings of every parameter on this process's one device (the sharded load's path)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, model.param_shapes(cfg))


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("shardings", [None, _one_device], ids=["whole", "sharded"])
def test_missing_tensor_names_the_key(qwen_dir, shardings):
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    _rewrite(qwen_dir, lambda t: t.pop(key))
    with raises_invalid(key, kind=hf.CheckpointError):
        model.load_hf_checkpoint(qwen_dir, shardings=shardings)


@pytest.mark.parametrize("shardings", [None, _one_device], ids=["whole", "sharded"])
def test_unexpected_tensor_names_the_key(qwen_dir, shardings):
    _rewrite(qwen_dir, lambda t: t.update({"model.layers.7.mystery.weight": np.zeros(3, "f4")}))
    with raises_invalid("tensors", kind=hf.CheckpointError) as info:
        model.load_hf_checkpoint(qwen_dir, shardings=shardings)
    assert "model.layers.7.mystery.weight" in info.value.value


@pytest.mark.parametrize("shardings", [None, _one_device], ids=["whole", "sharded"])
def test_shape_mismatch_names_file_key_and_shapes(qwen_dir, shardings):
    key = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(qwen_dir, lambda t: t.update({key: np.zeros((31, 32), "f4")}))
    with raises_invalid(f"{key}.shape", kind=hf.CheckpointError) as info:
        model.load_hf_checkpoint(qwen_dir, shardings=shardings)
    assert info.value.value == (31, 32) and info.value.where.endswith("model.safetensors")


def test_shardings_not_of_the_params_tree_name_the_argument(qwen_dir):
    with raises_invalid("shardings", where="load_hf_checkpoint"):
        model.load_hf_checkpoint(qwen_dir, shardings=lambda cfg: {"embed": None})


def test_unsupported_architecture_and_bad_config(qwen_dir):
    config_file = qwen_dir / "config.json"
    original = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(original | {"architectures": ["LlamaForCausalLM"]}))
    with raises_invalid("architectures", where=str(config_file), kind=hf.CheckpointError) as info:
        model.load_hf_checkpoint(qwen_dir)
    assert info.value.value == ["LlamaForCausalLM"]
    config_file.write_text(json.dumps(original | {"num_experts_per_tok": 99}))
    with raises_invalid("top_k", where=str(config_file), kind=hf.CheckpointError):
        model.load_hf_checkpoint(qwen_dir)
    config_file.write_text(json.dumps(original | {"rope_parameters": {"rope_type": "yarn"}}))
    with raises_invalid("rope_type", where=str(config_file), kind=hf.CheckpointError):
        model.load_hf_checkpoint(qwen_dir)


def test_both_config_spellings(qwen_dir):
    hf_cfg = json.loads((qwen_dir / "config.json").read_text())
    legacy = {k: v for k, v in hf_cfg.items() if k not in ("rope_parameters", "num_local_experts")}
    legacy |= {"num_experts": 6, "rope_theta": 5000.0}
    cfg, _ = hf.config_from_hf(legacy)
    assert cfg.num_experts == 6 and cfg.rope_theta == 5000.0


def test_fused_expert_layout_loads_the_same(qwen_dir):
    _, want = model.load_hf_checkpoint(qwen_dir)

    def fuse(t):
        prefix = "model.layers.0.mlp.experts."
        per = lambda name: np.stack([t.pop(f"{prefix}{e}.{name}.weight") for e in range(6)])
        gate, up, down = per("gate_proj"), per("up_proj"), per("down_proj")
        t[prefix + "gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2F, D]
        t[prefix + "down_proj"] = down  # [E, D, F]

    _rewrite(qwen_dir, fuse)
    _, got = model.load_hf_checkpoint(qwen_dir)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    _assert_blocks_equal(qwen_dir, want)  # a device's block of the fused tensors too


# ---- sharded loading: a device reads its block, bit for bit ---------------------------------


def _random_index(rng, shape):
    """A non-empty sub-box of `shape`, its bounds at random (a partial head, a partial head_dim,
    an offset along every axis)."""
    bounds = (np.sort(rng.choice(n + 1, 2, replace=False)) for n in shape)
    return tuple(slice(int(a), int(b)) for a, b in bounds)


def _assert_blocks_equal(path, params, *, per_leaf=4):
    """Each leaf's blocks read alone (as `jax.make_array_from_callback` asks for them) are the
    same bits as the whole load's slices."""
    ckpt = hf._open_checkpoint(path, None)
    rng = np.random.default_rng(0)
    for leaf in ckpt.leaves:
        whole = np.asarray(hf._get(params, leaf.path))
        # The brief's example on [n, E, D, F] expert weights: layer 1, experts 0-1, F 8-16.
        given = [(slice(1, 2), slice(0, 2), slice(None), slice(8, 16))] * (whole.shape[0] > 1)
        given = [i for i in given if leaf.spec.per_expert]
        for index in given + [_random_index(rng, leaf.shape) for _ in range(per_leaf)]:
            got = leaf.read(ckpt.files, index, ckpt.dtype)
            assert got.shape == whole[index].shape, (leaf.path, index)
            assert got.tobytes() == whole[index].tobytes(), (leaf.path, index)


def test_a_devices_block_is_the_whole_loads_slice_bit_for_bit(checkpoint):
    # Bugs caught: the HF index not reversed for a transposed tensor; a head_dim slice dropped
    # (whole heads returned); the expert offset of the block ignored.
    path, _, params = checkpoint
    _assert_blocks_equal(path, params)


def test_a_devices_block_reads_only_its_bytes(checkpoint, monkeypatch):
    # Bug caught: each HF tensor read whole (`get_tensor`, or `get_slice` of everything) and
    # cut after the transpose: the right values from n times the bytes.
    path, _, _ = checkpoint
    ckpt = hf._open_checkpoint(path, None)
    n = [0]
    opened = hf._open_safetensors
    monkeypatch.setattr(
        hf, "_open_safetensors", lambda f: testing.CountingSafetensors(opened(f), n)
    )
    for leaf in ckpt.leaves:
        # The second half of every even axis, as a device of a mesh of 2s would hold; the
        # head_dim axis whole (espo.sharding never splits it; a split one is read whole-heads).
        lead = 2 if leaf.spec.per_expert else int(isinstance(leaf.sources, tuple))
        whole_axis = lead + leaf.spec.split + 1 if leaf.spec.split is not None else None
        index = tuple(
            slice(size // 2, size) if size % 2 == 0 and axis != whole_axis else slice(None)
            for axis, size in enumerate(leaf.shape)
        )
        n[0] = 0
        block = leaf.read(ckpt.files, index, ckpt.dtype)
        assert n[0] == block.nbytes, (leaf.path, index, n[0], block.nbytes)
        halved = sum(s.start is not None for s in index)
        assert n[0] * 2**halved == np.asarray(hf._get(checkpoint[2], leaf.path)).nbytes
        assert halved >= 2 or not leaf.spec.per_expert  # an expert weight: at most a quarter


_EIGHT_DEVICES = """
import sys, pathlib, filecmp
import jax, numpy as np
from espo import model, sharding
mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
for path in map(pathlib.Path, sys.argv[2:]):
    shardings = lambda cfg: sharding.param_shardings(mesh, model.param_shapes(cfg))
    cfg, whole = model.load_hf_checkpoint(path)
    _, split = model.load_hf_checkpoint(path, shardings=shardings)
    want = shardings(cfg)
    flat = lambda t: jax.tree_util.tree_leaves_with_path(t)
    for (key, a), (_, b), (_, sh) in zip(flat(whole), flat(split), flat(want), strict=True):
        assert b.sharding == sh, (key, b.sharding, sh)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), key
        for shard in b.addressable_shards:
            assert np.asarray(shard.data).tobytes() == np.asarray(a)[shard.index].tobytes(), key
    out = pathlib.Path(sys.argv[1]) / path.name
    model.save_hf_checkpoint(cfg, whole, out / "whole", max_shard_bytes=20_000)
    model.save_hf_checkpoint(cfg, split, out / "split", max_shard_bytes=20_000)
    files = sorted(f.name for f in (out / "whole").iterdir())
    assert files == sorted(f.name for f in (out / "split").iterdir()) and len(files) > 3
    assert all(filecmp.cmp(out / "whole" / f, out / "split" / f, shallow=False) for f in files)
    print("ok", path.name, len(files))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sharded_load_over_eight_devices_equals_the_whole_load(checkpoint_dirs, tmp_path):
    # Bugs caught: devices of one block (replicated along "data") given another's cached block;
    # a block read at the wrong offset. The export of the sharded params (gathered a layer
    # slice at a time) is byte for byte the export of the whole ones.
    dirs = [str(checkpoint_dirs[name]) for name in sorted(CASES)]
    out = subprocess.run(
        [sys.executable, "-c", _EIGHT_DEVICES, str(tmp_path), *dirs],
        env=testing.emulated_devices_env(8), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("ok ") == len(CASES), out.stdout


# ---- export: the reference tensors, one shard file at a time ---------------------------------

EXPORT_CFG = model.ModelConfig.tiny(
    num_layers=4, dense_layers=(1,), dense_ffn_dim=24, tie_embeddings=False
)


@pytest.fixture(scope="module")
def export_params():
    """Random host params of EXPORT_CFG (no init to compile)."""
    rng = np.random.default_rng(5)
    draw = lambda s: rng.standard_normal(s.shape).astype(s.dtype)
    return jax.tree.map(draw, model.param_shapes(EXPORT_CFG))


def _reference_tensors(cfg, params) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of `params`, written out name by name (not from hf's table)."""
    p = jax.tree.map(np.asarray, params)
    D, H, N, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ref = {
        "model.embed_tokens.weight": p["embed"],
        "model.norm.weight": p["final_norm"]["scale"],
        "lm_head.weight": p["lm_head"].T,
    }
    for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
        b = p[f"blocks_{r}"]
        for j in range(length):
            at = f"model.layers.{start + j}."
            ref[at + "input_layernorm.weight"] = b["input_norm"]["scale"][j]
            ref[at + "post_attention_layernorm.weight"] = b["post_attn_norm"]["scale"][j]
            for name, heads in (("q_proj", H), ("k_proj", N), ("v_proj", N)):
                ref[at + f"self_attn.{name}.weight"] = b["attn"][name][j].reshape(D, heads * Dh).T
            ref[at + "self_attn.o_proj.weight"] = b["attn"]["o_proj"][j].reshape(H * Dh, D).T
            ref[at + "self_attn.q_norm.weight"] = b["attn"]["q_norm"]["scale"][j]
            ref[at + "self_attn.k_norm.weight"] = b["attn"]["k_norm"]["scale"][j]
            for name in ("gate_proj", "up_proj", "down_proj"):
                if not is_moe:
                    ref[at + f"mlp.{name}.weight"] = b["mlp"][name][j].T
                    continue
                for e in range(cfg.num_experts):
                    ref[at + f"mlp.experts.{e}.{name}.weight"] = b["moe"][name][j, e].T
            if is_moe:
                ref[at + "mlp.gate.weight"] = b["moe"]["router"][j].T
    return ref


def test_export_writes_the_reference_tensors_in_shards_with_their_index(export_params, tmp_path):
    # Bugs caught: a tensor filed under another shard in the index; a layer slice reused for
    # the next layer's tensors.
    params = jax.tree.map(jnp.asarray, export_params)  # jax.Arrays: gathered a layer at a time
    ref = _reference_tensors(EXPORT_CFG, params)
    total = sum(t.nbytes for t in ref.values())
    path = model.save_hf_checkpoint(EXPORT_CFG, params, tmp_path / "out", max_shard_bytes=8_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": total}
    files = sorted(path.glob("model-*.safetensors"))
    assert len(files) > 10 and files[-1].name.endswith(f"-of-{len(files):05d}.safetensors")
    got = {}
    for file in files:
        tensors = load_file(file)
        assert sum(t.nbytes for t in tensors.values()) <= 8_000 or len(tensors) == 1
        assert all(index["weight_map"][name] == file.name for name in tensors)
        got |= tensors
    assert sorted(got) == sorted(ref) == sorted(index["weight_map"])
    for name, want in ref.items():
        assert got[name].shape == want.shape and got[name].tobytes() == want.tobytes(), name


def test_export_holds_one_shard_at_a_time(export_params, tmp_path, monkeypatch):
    # Bug caught: every tensor of the model converted (transposed copies) before the first
    # file is written: the host holds the whole model (the old exporter did).
    params = export_params  # on the host: slicing them allocates nothing
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    live = []  # host bytes allocated by the export and alive at each file write
    write = hf.save_file
    monkeypatch.setattr(hf, "save_file", lambda t, *a, **k: (
        live.append(tracemalloc.get_traced_memory()[0]), write(t, *a, **k)))  # fmt: skip
    tracemalloc.start()
    try:
        model.save_hf_checkpoint(EXPORT_CFG, params, tmp_path / "out", max_shard_bytes=8_000)
    finally:
        tracemalloc.stop()
    # The model is 1.5 MB; at a write the export holds that file's tensors (8 kB, or one
    # bigger tensor: lm_head's 64 kB) and ~50 kB of bookkeeping, never most of the model.
    assert len(live) > 10 and total > 1_500_000
    assert max(live) < total / 8, (max(live), total)
