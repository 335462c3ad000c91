"""The device mesh and the shardings of the train step.

Axes are ("data", "fsdp", "expert"). Batches are sharded along all three on their leading axis
(as in maxtext: the expert axis splits the batch too, so attention and the dense layers are not
computed twice, and the MoE blocks exchange tokens with an all-to-all,
`experts.expert_parallel_dispatch`). Every parameter dimension has a logical name (`logical_axes`:
"embed", "heads", "expert", "mlp", "vocab", ...) and `RULES` map logical names to mesh axes in
the style of big_vision / maxtext rule lists (first match wins; None = replicated): by default
the model dimension is sharded along "fsdp" (ZeRO-3 style: XLA gathers a weight where a matmul
needs it) and the expert dimension along "expert". Optimizer state follows its parameters. Every
jitted step states its shardings explicitly, so moving to more devices changes the mesh, not the
step.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from espo import errors

AXES = ("data", "fsdp", "expert")
BATCH_AXES = ("data", "fsdp", "expert")

# Logical parameter axis -> mesh axis (or a tuple of them, or None: replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("expert", "expert"),
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("router", None),  # the router's output (one logit per expert): small, replicated
    ("norm", None),
    ("layers", None),
)

# The rollout's layouts (`rollout.param_layout`): the mesh axes its experts are split over,
# every other dimension replicated, so a decode step gathers no weight (unruled names are
# replicated). "experts": over "expert", as trained; "experts_all": over every axis, expert
# parallelism over all the devices (a model whose experts over "expert" alone do not fit).
EXPERT_AXES = {"experts": ("expert",), "experts_all": BATCH_AXES}


def rollout_rules(layout: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The parameter rules of the rollout's `layout` (a key of EXPERT_AXES)."""
    return (("expert", EXPERT_AXES[layout]),)


# Logical axes of each parameter by its name (the last key of its path); MoE expert weights
# (under a "moe" key) have a leading expert axis; stacked layer runs ("blocks_<r>") a leading
# "layers" axis.
_LOGICAL = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "q_proj": ("embed", "heads", "head_dim"),
    "k_proj": ("embed", "kv_heads", "head_dim"),
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "o_proj": ("heads", "head_dim", "embed"),
    "router": ("embed", "router"),
    "shared_expert_gate": ("embed", None),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes (`espo.sharding.make_mesh`); their product is the device count."""

    data: int = -1  # data parallelism; -1 = the devices the other axes leave
    fsdp: int = 1  # parameters and optimizer state sharded along the model dimension
    expert: int = 1  # experts split over devices

    def __post_init__(self):
        valid = "an int >= 1, or -1 (the devices the other axes leave)"
        ok = lambda x: errors.is_int(x) and (x >= 1 or x == -1)
        errors.check(self, {f: (ok(getattr(self, f)), valid) for f in ("data", "fsdp", "expert")})
        rest = [f for f in ("data", "fsdp", "expert") if getattr(self, f) == -1]
        if len(rest) > 1:
            raise errors.InvalidValue("MeshConfig", rest[1], -1, f"at most one axis -1 ({rest[0]})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """`jax.distributed.initialize` arguments: an empty coordinator = one process, or what the
    environment says (JAX_COORDINATOR_ADDRESS; TPU pod slices and SLURM / Open MPI)."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        n = self.num_processes
        errors.check(
            self,
            {
                "coordinator": (isinstance(self.coordinator, str), "a 'host:port' string"),
                "num_processes": (errors.is_int(n) and n >= 1, "an int >= 1"),
                "process_id": (
                    errors.is_int(self.process_id) and 0 <= self.process_id < max(n, 1),
                    f"an int in [0, num_processes={n})",
                ),
            },
        )


def logical_axes(params) -> dict:
    """The logical axis names of every parameter (a tree of tuples, one name per dimension)."""

    def axes(path, leaf):
        keys = [getattr(k, "key", str(k)) for k in path]
        name = keys[-1]
        if name == "scale":  # RMSNorm; q/k norms act on the head dimension
            base = ("head_dim",) if keys[-2] in ("q_norm", "k_norm") else ("norm",)
        elif name in _LOGICAL:
            base = _LOGICAL[name]
            if len(keys) >= 2 and keys[-2] == "moe" and name.endswith("_proj"):
                base = ("expert", *base)
        else:
            raise ValueError(f"parameter {'/'.join(keys)} has no logical axes in espo.sharding")
        stacked = keys[0].startswith("blocks_") and "_layer_" not in keys[0]
        out = ("layers", *base) if stacked else base
        if len(out) != len(leaf.shape):
            raise ValueError(
                f"parameter {'/'.join(keys)} of shape {tuple(leaf.shape)} does not match its "
                f"logical axes {out}"
            )
        return out

    return jax.tree_util.tree_map_with_path(axes, params)


def spec(logical: tuple, rules=RULES) -> P:
    """The PartitionSpec of one array with these logical axes (unnamed or unruled: replicated)."""
    table = dict(rules)
    return P(*(table.get(name) if name is not None else None for name in logical))


def _axis_size(mesh: jax.sharding.Mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def param_shardings(mesh: jax.sharding.Mesh, params, rules=RULES):
    """NamedShardings of `params` (arrays or `jax.ShapeDtypeStruct`s) under `rules`.

    A dimension its mesh axes do not divide is an error naming the parameter, the logical and
    mesh axes and the sizes (e.g. 8 experts on an expert axis of 3)."""
    logical = logical_axes(params)

    def one(path, leaf, names):
        pspec = spec(names, rules)
        for dim, (name, axes) in enumerate(zip(names, pspec, strict=True)):
            n = _axis_size(mesh, axes)
            if leaf.shape[dim] % n:
                raise ValueError(
                    f"mesh {dict(mesh.shape)} does not divide parameter "
                    f"{jax.tree_util.keystr(path)}: its {name!r} dimension has size "
                    f"{leaf.shape[dim]}, not a multiple of mesh axes {axes} (size {n})"
                )
        return NamedSharding(mesh, pspec)

    return jax.tree_util.tree_map_with_path(one, params, logical)


def state_shardings(mesh: jax.sharding.Mesh, optimizer, abstract_state, rules=RULES):
    """Shardings of a `train_step.TrainState` (abstract or not): params and reference params by
    `rules`, every copy of the params inside the optimizer state (Adam's moments) like its
    params, everything else (step, counts) replicated."""
    params = param_shardings(mesh, abstract_state.params, rules)
    rep = replicated(mesh)
    opt = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sh: sh, abstract_state.opt_state, params,
        transform_non_params=lambda _: rep,
    )  # fmt: skip
    ref = None if abstract_state.ref_params is None else params
    return abstract_state.replace(step=rep, params=params, opt_state=opt, ref_params=ref)


HOST_MEMORY = "pinned_host"  # host memory the devices copy to and from directly (DMA)


def in_memory(shardings, kind: str | None):
    """`shardings` (a tree) placing the same shards in memory `kind` of their devices
    (`HOST_MEMORY`; None: the device's own): `jax.device_put(tree, in_memory(sh, HOST_MEMORY))`
    moves a placed tree to host memory and back without a reshard."""
    return jax.tree.map(lambda sh: sh.with_memory_kind(kind or "device"), shardings)


def check_host_memory(where: str, field: str) -> None:
    """A ConfigError naming `where.field` (set True) unless this backend's devices have
    `HOST_MEMORY`."""
    kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    if HOST_MEMORY not in kinds:
        raise errors.ConfigError(
            where, field, True, f"False on {jax.default_backend()}: its devices have no "
            f"{HOST_MEMORY!r} memory (only {', '.join(sorted(kinds))})",
        )  # fmt: skip


def batch_shards(mesh) -> int:
    """How many shards a batch splits into: the size of (data x fsdp x expert)."""
    return _axis_size(mesh, BATCH_AXES)


def _batch_spec(leading: int = 0) -> P:
    """Axis `leading` along the batch axes, the others replicated."""
    return P(*([None] * leading), BATCH_AXES)


def check_batch(mesh: jax.sharding.Mesh, num_rows: int, *, what: str = "the batch") -> None:
    """`num_rows` must split evenly over the batch axes (data x fsdp x expert)."""
    n = batch_shards(mesh)
    if num_rows % n:
        raise ValueError(
            f"mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']} x expert="
            f"{mesh.shape['expert']} = {n} does not divide "
            f"{what} ({num_rows} rows)"
        )


# Auto axes: XLA propagates the batch sharding through the model (no explicit-mode typing; JAX's
# default for a new mesh is Explicit, under which e.g. `ragged_dot` has no sharding rule).
_AUTO = jax.sharding.AxisType.Auto


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
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(_AUTO,) * len(AXES))


def abstract_mesh(sizes: tuple[int, ...], names: tuple[str, ...] = AXES):
    """A mesh of `make_mesh`'s kind without devices, to trace layouts on one device
    (`jax.sharding.use_abstract_mesh`)."""
    return jax.sharding.AbstractMesh(sizes, names, axis_types=(_AUTO,) * len(names))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh, *, leading: int = 0) -> NamedSharding:
    """Shards axis `leading` of every leaf along the batch axes; other axes replicated."""
    return NamedSharding(mesh, _batch_spec(leading))


def constrain_rows(x, *, axis: int = 0):
    """Inside a jitted function: `x` with its `axis` (rows) sharded along the batch axes of the
    context mesh (`jax.set_mesh`), so each data shard computes its own rows; unchanged without
    a context mesh or when the rows do not split evenly."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or x.shape[axis] % batch_shards(mesh):
        return x
    return jax.lax.with_sharding_constraint(x, _batch_spec(axis))


def replicate(tree):
    """Inside a jitted function: `tree` replicated over the context mesh, if any (the host reads
    every row of it, in every process)."""
    if jax.sharding.get_abstract_mesh().empty:
        return tree
    return jax.lax.with_sharding_constraint(tree, P())


def put_batch(tree, mesh: jax.sharding.Mesh, *, leading: int = 0):
    """Host arrays -> device arrays sharded along the batch axis (the one host->device copy).

    With several processes each one feeds only the rows its own devices hold
    (`jax.make_array_from_process_local_data`), whatever else its host has."""
    where = batch_sharding(mesh, leading=leading)
    if jax.process_count() == 1:
        return jax.device_put(tree, where)

    def one(x):
        x = np.asarray(x)
        rows = process_rows(where, x.shape, axis=leading)
        local = x[(slice(None),) * leading + (rows,)]
        return jax.make_array_from_process_local_data(where, local, x.shape)

    return jax.tree.map(one, tree)


def process_rows(where: NamedSharding, shape: tuple[int, ...], *, axis: int = 0) -> slice:
    """The rows (along `axis`) of a global array of `shape` that this process's devices hold
    under `where`: one contiguous block, as the batch axes lay the processes out."""
    spans = {
        (idx[axis].start or 0, shape[axis] if idx[axis].stop is None else idx[axis].stop)
        for idx in where.addressable_devices_indices_map(shape).values()
    }
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    if sum(b - a for a, b in spans) != stop - start:
        raise ValueError(f"this process's rows of {shape} under {where.spec} are not contiguous")
    return slice(start, stop)
