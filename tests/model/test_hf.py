"""Hugging Face parity: logits and expert choices equal transformers'; round trips are exact."""

import json

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


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    testing.make_hf_checkpoint(path, architecture=arch, **overrides)
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


@pytest.mark.slow
def test_logits_and_experts_match_transformers(checkpoint):
    path, cfg, params = checkpoint
    want_logits, want_ids = testing.hf_forward(path, TOKENS)
    out = model.forward(cfg, params, jnp.asarray(TOKENS))
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
    out = model.forward(cfg, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
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


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_names_the_key(qwen_dir):
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    _rewrite(qwen_dir, lambda t: t.pop(key))
    with raises_invalid(key, kind=hf.CheckpointError):
        model.load_hf_checkpoint(qwen_dir)


def test_unexpected_tensor_names_the_key(qwen_dir):
    _rewrite(qwen_dir, lambda t: t.update({"model.layers.7.mystery.weight": np.zeros(3, "f4")}))
    with raises_invalid("tensors", kind=hf.CheckpointError) as info:
        model.load_hf_checkpoint(qwen_dir)
    assert "model.layers.7.mystery.weight" in info.value.value


def test_shape_mismatch_names_file_key_and_shapes(qwen_dir):
    key = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(qwen_dir, lambda t: t.update({key: np.zeros((31, 32), "f4")}))
    with raises_invalid(f"{key}.shape", kind=hf.CheckpointError) as info:
        model.load_hf_checkpoint(qwen_dir)
    assert info.value.value == (31, 32) and info.value.where.endswith("model.safetensors")


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
