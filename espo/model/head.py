"""The output head's log-probs of given tokens and full-vocabulary entropies, in chunks of tokens.

`taken_logps(cfg, params, hidden, targets, scale=)`: for each of M hidden states [M, D] (the
final-norm hidden state `transformer.forward(..., return_logits=False)` returns), the
log-probability of its target token under softmax(scale * hidden @ W) and that distribution's
entropy, where W = `transformer.head_weight` [D, V] and the logits are formed exactly as the
forward forms them (the matmul in the compute dtype, then float32).

Memory: the float32 logits [M, V] never exist whole once M exceeds `cfg.logits_chunk_tokens`:
the forward takes the tokens a chunk at a time, and a custom VJP recomputes each chunk's logits
in the backward, accumulating the head's gradient in float32 (Liger's fused linear
cross-entropy; MaxText's vocabulary tiling). At most one chunk fits (the short rows of a CPU
run), the plain computation runs, differentiated by JAX: the same values, no recomputation.
Entropies are detached (no objective here differentiates them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from espo.model import config as config_lib
from espo.model import transformer


def taken_logps(
    cfg: config_lib.ModelConfig,
    params: dict,
    hidden: Float[Array, "M D"],
    targets: Int[Array, " M"],
    *,
    scale: float = 1.0,
) -> tuple[Float[Array, " M"], Float[Array, " M"]]:
    """(log p(target), entropy) of every row of `hidden` (module docstring); `scale` (1 /
    temperature) multiplies the float32 logits; differentiable in `params` and `hidden` through
    the log-probs only."""
    w = transformer.head_weight(cfg, params)  # [D, V]
    rows, chunk = hidden.shape[0], cfg.logits_chunk_tokens
    targets = targets.astype(jnp.int32)
    if rows <= chunk:
        logps, entropies = _chunk(w, hidden, targets, scale=scale, dtype=cfg.jnp_dtype)
    else:
        logps, entropies = _chunked(
            (float(scale), chunk, cfg.jnp_dtype), w, hidden.astype(cfg.jnp_dtype), targets
        )
    return logps, jax.lax.stop_gradient(entropies)


def _logits(w, h, *, scale, dtype) -> Float[Array, "c V"]:
    """The forward's logits of hidden states h [c, D] (its matmul, its dtypes), scaled."""
    return (h.astype(dtype) @ w.astype(dtype)).astype(jnp.float32) * scale  # [c, V]


def _chunk(w, h, targets, *, scale, dtype):
    """Log-probs of `targets` and entropies of one chunk of hidden states [c, D]."""
    logp = jax.nn.log_softmax(_logits(w, h, scale=scale, dtype=dtype), axis=-1)  # [c, V]
    taken = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]  # [c]
    probs = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)  # [c]
    return taken, jax.lax.stop_gradient(entropy)


def _split(x, chunk: int):
    """[M, ...] -> [ceil(M / chunk), chunk, ...], zero-padded at the end."""
    n = -(-x.shape[0] // chunk)
    pad = [(0, n * chunk - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape((n, chunk) + x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(static, w, hidden, targets):
    scale, chunk, dtype = static
    M = hidden.shape[0]
    one = lambda xs: _chunk(w, *xs, scale=scale, dtype=dtype)
    logps, entropies = jax.lax.map(one, (_split(hidden, chunk), _split(targets, chunk)))
    return logps.reshape(-1)[:M], entropies.reshape(-1)[:M]


def _chunked_fwd(static, w, hidden, targets):
    return _chunked(static, w, hidden, targets), (w, hidden, targets)


def _chunked_bwd(static, res, cotangents):
    """d log p(y) / d logits = scale * (onehot(y) - softmax), chunk by chunk: dh = dz W^T and
    dW += h^T dz, both with the compute-dtype operands of the forward's matmul, dW summed in
    float32. The entropies' cotangent is ignored (they are detached)."""
    scale, chunk, dtype = static
    w, hidden, targets = res
    M, V = hidden.shape[0], w.shape[1]
    d_logps = _split(cotangents[0].astype(jnp.float32), chunk)  # [n, chunk]

    def one(dw, xs):
        h, y, g = xs  # [chunk, D], [chunk], [chunk]
        probs = jax.nn.softmax(_logits(w, h, scale=scale, dtype=dtype), axis=-1)  # [chunk, V]
        dz = (jax.nn.one_hot(y, V, dtype=jnp.float32) - probs) * (g * scale)[:, None]
        dz = dz.astype(dtype)
        dh = jax.lax.dot(dz, w.astype(dtype).T, preferred_element_type=jnp.float32)  # [chunk, D]
        dw = dw + jax.lax.dot(h.astype(dtype).T, dz, preferred_element_type=jnp.float32)
        return dw, dh

    xs = (_split(hidden, chunk), _split(targets, chunk), d_logps)
    dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), xs)
    return dw.astype(w.dtype), dh.reshape(-1, hidden.shape[1])[:M].astype(hidden.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
