"""Shared pytest configuration: float32 matmuls at full precision on every backend."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
