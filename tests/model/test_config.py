"""ModelConfig validation: every invalid value names the field, the value and the valid range."""

import jax.numpy as jnp
import numpy as np
import pytest

from espo.model import ModelConfig
from espo.testing import raises_invalid


@pytest.mark.parametrize(
    ("overrides", "field", "hint"),
    [
        (dict(top_k=9), "top_k", "num_experts=8"),
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads", "divide num_heads=4"),
        (dict(head_dim=15), "head_dim", "even"),
        (dict(dense_layers=(5,)), "dense_layers", "[0, num_layers=2)"),
        (dict(dense_layers=(0,), dense_ffn_dim=0), "dense_ffn_dim", ">= 1"),
        (dict(param_dtype="float64"), "param_dtype", "bfloat16"),
        (dict(vocab_size=0), "vocab_size", ">= 1"),
        (dict(sliding_window=0), "sliding_window", "None or >= 1"),
        (dict(rms_eps=0.0), "rms_eps", "> 0"),
        (dict(moe_chunk=-1), "moe_chunk", ">= 0"),
        (dict(moe_impl="gmm"), "moe_impl", "megablox"),
        (dict(logits_chunk=2.5), "logits_chunk", ">= 0"),
        (dict(expert_axes=()), "expert_axes", "distinct mesh axis names"),
        (dict(expert_axes=("expert", "expert")), "expert_axes", "distinct mesh axis names"),
        (dict(expert_axes=(1,)), "expert_axes", "distinct mesh axis names"),
    ],
)
def test_invalid_values_name_the_field(overrides, field, hint):
    with pytest.raises(ValueError) as err:
        ModelConfig.tiny(**overrides)
    message = str(err.value)
    assert f"ModelConfig.{field}=" in message
    assert hint in message


def test_layer_runs_group_consecutive_kinds():
    cfg = ModelConfig.tiny(num_layers=5, dense_layers=(0, 1, 3), dense_ffn_dim=32)
    assert cfg.layer_runs() == ((False, 0, 2), (True, 2, 1), (False, 3, 1), (True, 4, 1))
    assert cfg.moe_layers == (2, 4)
    assert ModelConfig.tiny(num_layers=4).layer_runs() == ((True, 0, 4),)


def test_expert_axes_take_one_name_or_several():
    assert ModelConfig.tiny(expert_axes="fsdp").expert_axes == ("fsdp",)
    assert ModelConfig.tiny(expert_axes=["fsdp", "expert"]).expert_axes == ("fsdp", "expert")
    hash(ModelConfig.tiny(expert_axes=["fsdp", "expert"]))  # a list from JSON: still static


def test_config_is_frozen_and_hashable():
    cfg = ModelConfig.tiny()
    with pytest.raises(AttributeError):
        cfg.top_k = 3
    assert hash(cfg) == hash(ModelConfig.tiny())


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("bfloat16", "bfloat16"),
        (jnp.bfloat16, "bfloat16"),
        (jnp.dtype("bfloat16"), "bfloat16"),
        (np.float32, "float32"),
        (jnp.float16, "float16"),
        (np.dtype("float16"), "float16"),
    ],
    ids=repr,
)
def test_dtype_fields_accept_dtype_likes_and_store_the_name(spelling, name):
    cfg = ModelConfig.tiny(param_dtype=spelling, dtype=spelling)
    assert cfg.param_dtype == name and cfg.dtype == name
    assert cfg == ModelConfig.tiny(param_dtype=name, dtype=name)  # hash/eq by value
    assert cfg.jnp_dtype == jnp.dtype(name) and cfg.jnp_param_dtype == jnp.dtype(name)


@pytest.mark.parametrize("bad", [np.float64, None, "bf16", True])
def test_dtype_fields_reject_other_values_by_name(bad):
    with raises_invalid("dtype", where="ModelConfig"):
        ModelConfig.tiny(dtype=bad)
