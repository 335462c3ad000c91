"""Loading checkpoints without torch: dtype spellings, and bad files named in a CheckpointError.

The checkpoints are written by espo itself (`save_hf_checkpoint`), so these tests run in every
environment; parity with transformers is `test_hf.py`'s job.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from espo import model
from espo.model import hf
from espo.testing import raises_invalid

CFG = model.ModelConfig.tiny(num_layers=1, vocab_size=32, num_experts=4, d_model=32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    params = model.init(CFG, jax.random.key(0))
    path = model.save_hf_checkpoint(CFG, params, tmp_path_factory.mktemp("ckpt") / "tiny")
    return path, params


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the saved checkpoint that a test may corrupt."""
    src, _ = saved
    dst = tmp_path / "copy"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


BF16_SPELLINGS = ["bfloat16", jnp.bfloat16, jnp.dtype("bfloat16"), ml_dtypes.bfloat16]
F32_SPELLINGS = ["float32", jnp.float32, np.float32, np.dtype("float32"), jnp.dtype("float32")]


@pytest.mark.slow
@pytest.mark.parametrize("spelling", BF16_SPELLINGS + F32_SPELLINGS, ids=repr)
def test_load_accepts_every_dtype_spelling(saved, spelling):
    # Bug caught: `dtype=jnp.bfloat16` rejected as "param_dtype=<class ...bfloat16'> is invalid",
    # and np.dtype objects (falsy, len 0) silently ignored by `dtype or default`.
    path, params = saved
    want = "bfloat16" if spelling in BF16_SPELLINGS else "float32"
    cfg, loaded = model.load_hf_checkpoint(path, dtype=spelling)
    assert cfg.param_dtype == want and cfg.dtype == want
    assert cfg == CFG.replace(param_dtype=want, dtype=want)
    leaves = jax.tree.leaves(loaded)
    assert all(x.dtype == jnp.dtype(want) for x in leaves)
    expect = jax.tree.map(lambda p: np.asarray(p.astype(want)), params)
    jax.tree.map(np.testing.assert_array_equal, loaded, expect)


@pytest.mark.parametrize("bad", [np.float64, "bf16", 3])
def test_load_rejects_unsupported_dtypes_by_name(saved, bad):
    path, _ = saved
    with pytest.raises(ValueError, match=r"load_hf_checkpoint\(dtype\)=.*one of"):
        model.load_hf_checkpoint(path, dtype=bad)


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (lambda data: data[: len(data) // 2], "truncated"),
        (lambda data: data[:20], "header cut"),
        (lambda data: b"garbage" * 10, "garbage"),
        (lambda data: b"", "empty"),
    ],
)
def test_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(ckpt, content, what):
    # Bug caught: safetensors' own SafetensorError ("incomplete metadata...") without the path.
    file = ckpt / "model.safetensors"
    file.write_bytes(content(file.read_bytes()))
    with raises_invalid("contents", where=str(file), kind=hf.CheckpointError):
        model.load_hf_checkpoint(ckpt)


def test_config_that_is_not_json_is_a_checkpoint_error_naming_the_file(ckpt):
    # Bug caught: a bare json.JSONDecodeError without the file.
    (ckpt / "config.json").write_text("{not json")
    with raises_invalid("contents", where=str(ckpt / "config.json"), kind=hf.CheckpointError):
        model.load_hf_checkpoint(ckpt)
    (ckpt / "config.json").write_text("[1, 2]")
    with raises_invalid("contents", where=str(ckpt / "config.json"), kind=hf.CheckpointError):
        model.load_hf_checkpoint(ckpt)


def test_bad_shard_index_is_a_checkpoint_error_naming_the_file(saved, tmp_path):
    _, params = saved
    path = model.save_hf_checkpoint(CFG, params, tmp_path / "sharded", max_shard_bytes=50_000)
    index = path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with raises_invalid("contents", where=str(index), kind=hf.CheckpointError):
        model.load_hf_checkpoint(path)
    index.write_text('{"metadata": {}}')
    with raises_invalid("weight_map", where=str(index), kind=hf.CheckpointError):
        model.load_hf_checkpoint(path)
