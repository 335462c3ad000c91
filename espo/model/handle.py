"""`Model`: the one handle on the espo transformer, used by the sampler, trainer and tests alike.

A `Model` is a frozen, hashable value wrapping a `ModelConfig`: pass it as a `jax.jit` static
argument, or jit its bound methods (`jax.jit(m.forward, static_argnames="routing_mode")`). It
owns no parameters and no state; `init` returns a plain params pytree and `forward` is the pure
`espo.model.transformer.forward` with the config bound. It satisfies the sampler's
`SamplingModel` protocol (`num_layers`, `top_k`, `forward`, `init_cache`), which test fakes
(`espo.testing.CountingModel`) implement too.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Array, Int

from espo import errors
from espo.model import config as config_lib
from espo.model import layers, transformer


@dataclasses.dataclass(frozen=True)
class Model:
    """The espo MoE transformer described by `cfg`: `Model(cfg)` or `Model(cfg=cfg)`."""

    cfg: config_lib.ModelConfig

    def __post_init__(self):
        if not isinstance(self.cfg, config_lib.ModelConfig):
            raise errors.InvalidValue(
                "Model", "cfg", self.cfg,
                "an espo.model.ModelConfig (load_hf_checkpoint returns one for a Hugging Face "
                "checkpoint)",
            )  # fmt: skip

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def top_k(self) -> int:
        return self.cfg.top_k

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def init(self, key: jax.Array) -> dict:
        """Random parameters, a plain nested dict (`transformer.init`)."""
        return transformer.init(self.cfg, key)

    def param_shapes(self) -> dict:
        """The parameter tree as `jax.ShapeDtypeStruct`s, allocating nothing."""
        return transformer.param_shapes(self.cfg)

    def forward(
        self, params: dict, tokens: Int[Array, "B T"], **options
    ) -> transformer.ModelOutput:
        """`transformer.forward(cfg, params, tokens, **options)`: every keyword of that function
        (positions, attention_mask, segment_ids, cache, routing, routing_mode, dispatch_impl,
        return_hidden, replay_missing) with its meaning and default."""
        return transformer.forward(self.cfg, params, tokens, **options)

    def decode_params(self, params: dict) -> dict:
        """`params` laid out for a decode loop: per-layer buffers (`transformer.unstack_layers`),
        on every backend. A loop over stacked [L, ...] weights copies each layer's slice every
        step on CPU, and on a GPU runs the layers as a nested loop: on an H100 (bench_moe.py,
        the 1.2B bench MoE, bf16, B=8) per-layer weights take 429 kernels a decode step against
        783 and give 1.94-2.05x the tokens/s (two runs, docs/gpu). `forward` takes either
        layout. Each layer's q/k/v weights become one (`layers.fuse_qkv`). The sampler calls
        it per chunk."""
        out = transformer.unstack_layers(self.cfg, params)
        for name in transformer.layer_names(self.cfg):
            out[name] = {**out[name], "attn": layers.fuse_qkv(out[name]["attn"])}
        return out

    def init_cache(self, *, batch: int, max_length: int) -> layers.KVCache:
        """An empty KV cache for `batch` rows of at most `max_length` tokens."""
        return layers.init_cache(self.cfg, batch=batch, max_length=max_length)
