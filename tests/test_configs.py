"""The shipped configs: one default per setting. configs/default.py sets every field of every
section, and a value differs from the library's default (the section's dataclass) only where its
DEVIATIONS says why."""

import dataclasses
import math
import pathlib

import jax

from espo import config as config_lib
from espo import model, testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
_NOT_MODEL = {"hf_path", "init_from"}  # model section fields that are not ModelConfig's


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_default_config_deviates_only_where_it_says_why():
    module = testing.load_script(ROOT / "configs" / "default.py")
    config = module.get_config()
    differ = set()
    for section, cls in config_lib.sections().items():
        for field, default in _defaults(cls).items():
            value = config[section].get(field, default)
            if isinstance(value, tuple | list) or isinstance(default, tuple | list):
                value, default = list(value), list(default)
            if value != default:
                differ.add(f"{section}.{field}")
    assert differ - set(module.DEVIATIONS) == set(), "deviations without a reason"
    assert set(module.DEVIATIONS) - differ == set(), "DEVIATIONS lists library defaults"
    assert all(isinstance(why, str) and why for why in module.DEVIATIONS.values())


def test_every_section_field_is_in_the_default_config():
    """A user reads every setting in configs/default.py (placeholders hold None defaults)."""
    config = testing.load_script(ROOT / "configs" / "default.py").get_config()
    for section, cls in config_lib.sections().items():
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        injected = {
            "loss": {"vocab_size"},
            "advantage": {"rl_zvp", "atol"},
            "model": {"expert_axes"},
        }.get(section, {"max_new_tokens"})
        # set from another section: the model's vocabulary, zve.mode and zve.atol, a stage's
        # budget, the sampler's expert axes from rollout.param_layout
        missing = names - set(config[section]) - injected - {"seed"}
        assert not missing, f"{section}: {sorted(missing)}"


def test_qwen3_shape_variant_has_qwen3_30b_a3b_layers():
    """The GPU bench variant: a model whose layer has Qwen3-30B-A3B's parameters (its
    config.json: D=2048, 32 query / 4 kv heads of 128, 128 experts of width 768, top-8; q/k
    norms), counted by hand against the initialised shapes."""
    config = testing.load_script(ROOT / "configs" / "default.py").get_config("qwen3_shape")
    cfg = model.ModelConfig(**{k: v for k, v in config.model.items() if k not in _NOT_MODEL})
    shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    D, V = 2048, config.model.vocab_size
    attention = D * 128 * (32 + 4 + 4) + 32 * 128 * D + 2 * 128  # q, k, v, o; q/k norms
    layer = attention + 128 * 3 * D * 768 + D * 128 + 2 * D  # experts, router, two norms
    assert total == 4 * layer + 2 * V * D + D  # embeddings (untied), final norm
    assert (cfg.top_k, cfg.param_dtype, cfg.dtype) == (8, "bfloat16", "bfloat16")
