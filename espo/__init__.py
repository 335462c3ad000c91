"""espo: each-prompt-matters RL post-training of Mixture-of-Experts models in JAX/Flax."""

from espo import advantages, losses, model, types

__all__ = ["advantages", "losses", "model", "types"]
__version__ = "0.1.0"
