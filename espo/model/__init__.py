"""The pure-functional MoE transformer: config, init, forward, KV cache, HF interop.

`Model(cfg)` is the one handle (init / forward / init_cache) the sampler, trainer and tests use;
the module-level functions below take the config as their first argument. `__all__` lists the
public API and the modules that own it:
  * `config`: `ModelConfig` (frozen, validated) and `RoutingMode`;
  * `layers`: norms, rotary embeddings, GQA attention and the `KVCache` value;
  * `attention`: attention over a whole sequence, dense or in blocks (flash; GPU / TPU kernels);
  * `head`: the head's log-probs and entropies of given tokens, in chunks of tokens;
  * `moe`: the router, routing modes (free / replay), dropless and expert-parallel dispatch;
  * `transformer`: `init`, the pure `forward`, `ModelOutput` / `ModelAux`, replay checks;
  * `handle`: `Model`, the hashable handle;
  * `hf`: Hugging Face Qwen3-MoE / Mixtral checkpoints (`load_hf_checkpoint`,
    `save_hf_checkpoint`).
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

from espo.model import attention, experts, gpu_attention, grouped, head, moe  # noqa: E402

__all__ += [
    "attention", "config", "experts", "gpu_attention", "grouped", "handle", "head", "hf", "layers",
    "moe", "transformer",
]  # fmt: skip
