"""The device mesh and the shardings of the train step (one device today; the scale-out issue
extends it with fsdp / expert axes and logical parameter rules).

Axes are ("data", "fsdp", "expert"). Batches are sharded along ("data", "fsdp") on their leading
axis; parameters and optimizer state are replicated. Every jitted step states its shardings
explicitly, so moving to more devices changes the mesh, not the step.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "expert")
BATCH_AXES = ("data", "fsdp")


def make_mesh(*, data: int = -1, fsdp: int = 1, expert: int = 1) -> jax.sharding.Mesh:
    """A mesh over all local devices; one axis may be -1 (the rest)."""
    sizes = [data, fsdp, expert]
    n = jax.device_count()
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh sizes {dict(zip(AXES, sizes, strict=True))}: at most one may be -1")
    known = 1
    for s in sizes:
        known *= s if s != -1 else 1
    sizes = [n // known if s == -1 else s for s in sizes]
    if sizes[0] * sizes[1] * sizes[2] != n:
        raise ValueError(
            f"mesh sizes {dict(zip(AXES, sizes, strict=True))} do not multiply to {n} devices"
        )
    # Auto axes: XLA propagates the batch sharding through the model (no explicit-mode typing).
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh, *, leading: int = 0) -> NamedSharding:
    """Shards axis `leading` of every leaf along (data, fsdp); other axes replicated."""
    return NamedSharding(mesh, P(*([None] * leading), BATCH_AXES))


def put_batch(tree, mesh: jax.sharding.Mesh, *, leading: int = 0):
    """Host arrays -> device arrays sharded along the batch axis (the one host->device copy)."""
    return jax.device_put(tree, batch_sharding(mesh, leading=leading))
