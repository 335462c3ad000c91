"""The head's log-probs and entropies in chunks of tokens (`espo.model.head.taken_logps`).

The reference is the same function in one chunk (the plain computation JAX differentiates):
the chunked forward and its custom VJP must give its values and gradients, in bf16 as in
float32 (tests/model/test_long_sequences.py runs the float32 model end to end).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo.model import head, transformer
from espo.model.config import ModelConfig

M = 13  # rows: chunks of 5 leave a remainder of 3


def _logps_and_grads(cfg, params, hidden, targets, weights):
    """(log-probs, entropies) and the gradient of sum(weights * logps) in params and hidden."""

    @jax.jit
    def run(params, hidden):
        def loss(params, hidden):
            logps, ents = head.taken_logps(cfg, params, hidden, targets, scale=1 / 0.7)
            return jnp.sum(weights * logps), (logps, ents)

        return jax.grad(loss, (0, 1), has_aux=True)(params, hidden)

    (d_params, d_hidden), (logps, ents) = run(params, hidden)
    head_grad = d_params["lm_head"]  # [D, V]
    return [np.asarray(a, np.float32) for a in (logps, ents, head_grad, d_hidden)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_equal_one_chunk_in_the_compute_dtype(dtype):
    """13 rows in chunks of 5 (the last one padded) against one chunk: the logits are formed
    in the compute dtype (bf16 rounds them as the forward does), the gradients match."""
    cfg = ModelConfig.tiny(num_layers=1, vocab_size=97, dtype=dtype)
    params = transformer.init(cfg, jax.random.key(0))
    ks = jax.random.split(jax.random.key(1), 3)
    hidden = 2.0 * jax.random.normal(ks[0], (M, cfg.d_model))
    targets = jax.random.randint(ks[1], (M,), 0, cfg.vocab_size)
    weights = jax.random.normal(ks[2], (M,))
    want = _logps_and_grads(cfg.replace(logits_chunk=M), params, hidden, targets, weights)
    got = _logps_and_grads(cfg.replace(logits_chunk=5), params, hidden, targets, weights)
    # Values: the same logits, the same float32 softmax. Gradients: both take d logits in the
    # compute dtype; bf16 rounds the chunked and the plain products differently.
    tols = (1e-5, 1e-5, 1e-5, 1e-5) if dtype == "float32" else (1e-5, 1e-5, 2e-2, 2e-2)
    for a, b, tol in zip(got, want, tols, strict=True):
        np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)
