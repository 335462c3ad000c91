"""espo: each-prompt-matters RL post-training of Mixture-of-Experts models in JAX/Flax.

The package owns nothing itself: its public API is its submodules (`__all__`), loaded lazily
(`espo.model`, `espo.losses`...), so a reward worker process that only needs
`espo.rewards.math` does not pay for importing JAX. Entry point: `espo.trainer.train`.
docs/architecture.md lists what each submodule owns and how they depend on each other.
"""

import importlib

_SUBMODULES = (
    "advantages",
    "batching",
    "checkpoint",
    "config",
    "correction",
    "curriculum",
    "data",
    "errors",
    "evaluate",
    "generation",
    "losses",
    "metrics",
    "model",
    "packing",
    "pass_rates",
    "plots",
    "quant",
    "rewards",
    "rollout",
    "sampler",
    "scheduling",
    "sft",
    "sharding",
    "testing",
    "train_step",
    "trainer",
    "types",
    "zero_variance",
)
__all__ = list(_SUBMODULES)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"espo.{name}")
    raise AttributeError(f"module 'espo' has no attribute {name!r}")
