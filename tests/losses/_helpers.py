"""Helpers shared by the espo.losses tests (tests/losses/test_*.py).

- `run`: (loss, d loss / d logps, LossOutput) of compute_loss, eagerly, on inputs zero-padded to
  one shape [B_PAD, T_PAD] (checking that the padding gets exactly zero gradient);
- `random_batch`: random float64 [B, T] inputs with ragged masks and one all-padding row;
- `one_row_batch`: compute_loss inputs of one row with a given log-ratio logps - old_logps.

Not a test module; the tests load it by path (`espo.testing.load_script`), since tests/ is not a
package and pytest runs with --import-mode=importlib.
"""

import jax
import jax.numpy as jnp
import numpy as np

from espo import losses

TOL = dict(rtol=1e-5, atol=1e-6)
B_PAD, T_PAD = 4, 6  # every compute_loss call in these tests sees this shape


def run(cfg, logps, **kw):
    """(loss, d loss / d logps, LossOutput) of compute_loss, eagerly, on inputs padded to [4, 6].

    Eager JAX compiles every primitive once per shape (about 2 s for a loss), so all tests share
    one shape: inputs are zero-padded with mask 0, and padding must change nothing, which is
    checked here: the padded positions get exactly zero gradient.
    """
    b, t = np.shape(logps)

    def pad(x):
        x = np.asarray(x, np.float64)
        widths = [(0, B_PAD - b)] + [(0, T_PAD - t)] * (x.ndim - 1)
        return jnp.asarray(np.pad(x, widths), jnp.float32)

    kw = {k: pad(v) for k, v in kw.items()}

    def f(lp):
        out = losses.compute_loss(cfg, logps=lp, **kw)
        return out.loss, out

    (loss, out), grad = jax.value_and_grad(f, has_aux=True)(pad(logps))
    grad = np.asarray(grad)
    assert not grad[b:].any() and not grad[:, t:].any()
    return float(loss), grad[:b, :t], out


def random_batch(seed, *, b=4, t=6, scale=0.3, empty_row=True):
    """Random [B, T] inputs with ragged masks (and one all-padding row), in float64 NumPy."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (b, t))
    logps = old + rng.normal(0.0, scale, (b, t))
    lengths = rng.integers(1, t + 1, b)
    if empty_row:
        lengths[1] = 0
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(0.0, 1.0, b)
    entropies = rng.uniform(0.0, 3.0, (b, t))
    return dict(logps=logps, old_logps=old, advantages=adv, mask=mask, entropies=entropies)


def one_row_batch(d, advantages, **kw):
    """compute_loss inputs with logps - old_logps = d (one row)."""
    d = jnp.asarray([d], jnp.float32)
    return dict(
        logps=d - 1.0,
        old_logps=jnp.full_like(d, -1.0),
        advantages=jnp.asarray([advantages], jnp.float32),
        mask=jnp.ones_like(d, bool),
        **kw,
    )
