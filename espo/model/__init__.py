"""The pure-functional MoE transformer: config, init, forward, KV cache, HF interop.

`Model(cfg)` is the one handle (init / forward / init_cache) the sampler, trainer and tests use;
the module-level functions below take the config as their first argument.
"""

from espo.model.config import ModelConfig, RoutingMode
from espo.model.handle import Model
from espo.model.layers import KVCache, init_cache
from espo.model.transformer import (
    ModelAux,
    ModelOutput,
    UnrecordedRouteError,
    check_replay,
    forward,
    init,
    param_shapes,
)

__all__ = [
    "KVCache",
    "Model",
    "ModelAux",
    "ModelConfig",
    "ModelOutput",
    "RoutingMode",
    "UnrecordedRouteError",
    "check_replay",
    "forward",
    "init",
    "init_cache",
    "param_shapes",
]

from espo.model.hf import CheckpointError, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

__all__ += ["CheckpointError", "load_hf_checkpoint", "save_hf_checkpoint"]
