"""espo: each-prompt-matters RL post-training of Mixture-of-Experts models in JAX/Flax."""

from espo import model, types

__all__ = ["model", "types"]
__version__ = "0.1.0"
