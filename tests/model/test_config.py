"""ModelConfig validation: every invalid value names the field, the value and the valid range."""

import pytest

from espo.model import ModelConfig


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


def test_config_is_frozen_and_hashable():
    cfg = ModelConfig.tiny()
    with pytest.raises(AttributeError):
        cfg.top_k = 3
    assert hash(cfg) == hash(ModelConfig.tiny())
