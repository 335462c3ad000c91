"""espo: each-prompt-matters RL post-training of Mixture-of-Experts models in JAX/Flax.

Submodules load lazily (`espo.model`, `espo.losses`...), so a reward worker process that only
needs `espo.rewards.math` does not pay for importing JAX.
"""

import importlib

_SUBMODULES = (
    "advantages",
    "losses",
    "model",
    "quant",
    "rewards",
    "rollout",
    "sampler",
    "scheduling",
    "testing",
    "types",
    "zero_variance",
)
__all__ = list(_SUBMODULES)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"espo.{name}")
    raise AttributeError(f"module 'espo' has no attribute {name!r}")
