"""Matmul FLOPs from a jaxpr, collectives from compiled HLO text, and a roofline step time.

  dots = roofline.jaxpr_dots(jax.jit(step).trace(*args).jaxpr)   # or jax.make_jaxpr(step)(*args)
  roofline.total_flops(dots)                                      # global FLOPs of one step
  roofline.roofline_seconds(dots, roofline.CHIPS["v5p"], devices=64)
  roofline.hlo_collectives(compiled.as_text())                    # per device, per step

For experiments/aot.py (one RL step of a real-size model compiled for a TPU topology or a GPU
node, not run). Nothing here runs a program: `jaxpr_dots` reads a traced jaxpr (shape structs
are enough), `hlo_collectives` the text of a compiled, SPMD-partitioned module.

`jaxpr_dots` lists every matmul the program executes as `Dot(flops, bytes, count, where)`: FLOPs
and HBM bytes (operands + result, in their dtypes) of one execution, and `count`, the product of
the loop multipliers around it (totals are flops x count). FLOPs are global: a `shard_map` body,
traced on per-shard shapes, is multiplied by the devices of its manual axes; a jit's
GSPMD-sharded matmuls are traced at global shapes. `where`: the enclosing primitives, operand
shapes, source line. The jaxpr is dead-code eliminated first (`dce=True`), as XLA would: under
`jax.grad` alone the forward's value is dead, so a remat'd layer's forward counts once (the
recomputation).

`hlo_collectives` counts per kind the executions and the bytes one device sends per step, with
the trip counts of the while loops around them (XLA's `known_trip_count`; XLA:CPU writes it
too). Per execution, S the result's bytes and n the replica group's size: all-gather S (n-1)/n,
reduce-scatter S (n-1) (its operand is n S), all-reduce 2 S (n-1)/n (ring), all-to-all S (n-1)/n,
collective-permute S, ragged-all-to-all as all-to-all of its whole output buffer (an upper
bound: what it sends is data-dependent).

Caveats. Matmuls only: elementwise ops, softmax, norms, reductions and gathers are not counted
(a few percent of a transformer's FLOPs, more of its HBM traffic). `roofline_seconds` splits the
work evenly over the devices: dividing bytes by the device count is optimistic for weights every
device reads whole after an all-gather (FSDP) and for replicated work, and no collective time is
added (compare `hlo_collectives`' bytes / `Chip.link_bw`). A `pallas_call` counts its
`cost_estimate`, else it is a zero Dot whose `where` says "opaque, not counted". A `while` whose
bounds are computed at run time counts once and its Dots' `where` says so; a `cond` counts its
largest branch; other primitives holding jaxprs (jit, remat, custom_vjp/jvp, ...) count each
once, an upper bound where they are alternatives. `hlo_collectives` reads one instruction a line
(as `compiled.as_text()` prints) and counts a conditional's largest branch (by bytes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import numpy as np
from jax._src import source_info_util  # no public API for these two in jax 0.10: an
from jax._src.interpreters import partial_eval as pe  # equation's file:line, and DCE
from jax.extend import core as jex_core

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator chip, in bytes, seconds and FLOPs."""

    name: str
    peak_flops: float  # dense (not 2:4 sparse) bf16 FLOP/s
    hbm_bytes: float  # HBM capacity
    hbm_bw: float  # HBM bandwidth, bytes/s
    # Interconnect for collectives (TPU ICI, GPU NVLink): the bytes/s one chip can send out over
    # all its links together, ONE direction (half the "bidirectional" figure vendors print). A
    # collective over one axis of a TPU torus uses only that axis' links, so this is optimistic.
    link_bw: float
    source: str
    # Host memory <-> one chip, bytes/s one way (PCIe): the state a rollout offloads
    # (rollout.offload_state) goes out and back at it; 0 = not known.
    host_bw: float = 0.0

    def __post_init__(self):
        for field in ("peak_flops", "hbm_bytes", "hbm_bw", "link_bw", "host_bw"):
            value = getattr(self, field)
            if not (value > 0 or field == "host_bw" and value == 0):
                raise ValueError(f"Chip {self.name!r}: {field}={value!r}, must be > 0")


# Figures as the vendors print them. TPU HBM "GB" are GiB (power-of-two stacks), NVIDIA's are
# decimal. Interconnect: Google prints ICI as Gbps one way (older pages) or "bidirectional GBps"
# (current pages, twice that), NVIDIA NVLink as bidirectional GB/s; link_bw is the one-way figure.
# v6e's page changed: 1640 GBps HBM and 3584 Gbps ICI before, 1600 GBps and bidirectional 800
# GBps (3200 Gbps) now; the latter ICI is used. NVIDIA's datasheets are not in the offline
# copies: their figures are checked against the pages named.
# Host links: a TPU's PCIe, 1.5e10 bytes/s, is the figure the JAX scaling book's TPU chapter
# works with (v6e; Google's pages print none per chip), taken for every TPU here; an H100 /
# H200 SXM has PCIe Gen5 x16, 64 GB/s one way (PCI-SIG's 32 GT/s x 16 lanes).
_TPU = "Google Cloud TPU docs, 'TPU {}' system architecture table: "
_PCIE_TPU, _PCIE5 = 1.5e10, 64e9
CHIPS = {c.name: c for c in (
    Chip(name="v5p", peak_flops=459e12, hbm_bytes=95 * GiB, hbm_bw=2765e9, link_bw=600e9,
         source=_TPU.format("v5p") + "459 TFLOPs bf16, 95 GiB, 2765 GBps, ICI 4800 Gbps",
         host_bw=_PCIE_TPU),
    Chip(name="v5e", peak_flops=197e12, hbm_bytes=16 * GiB, hbm_bw=819e9, link_bw=200e9,
         source=_TPU.format("v5e") + "197 TFLOPs bf16, 16 GB, 819 GBps, ICI 1600 Gbps",
         host_bw=_PCIE_TPU),
    Chip(name="v6e", peak_flops=918e12, hbm_bytes=32 * GiB, hbm_bw=1640e9, link_bw=400e9,
         source=_TPU.format("v6e") + "918 TFLOPs bf16, 32 GB, 1640 GBps, ICI bidirectional"
         " 800 GBps",
         host_bw=_PCIE_TPU),
    Chip(name="v4", peak_flops=275e12, hbm_bytes=32 * GiB, hbm_bw=1200e9, link_bw=300e9,
         source=_TPU.format("v4") + "275 TFLOPs bf16, 32 GiB, 1200 GBps; ICI not there: 6 links"
         " x 400 Gbps each way (glennklockwood.com/garden/processors/TPUv4)",
         host_bw=_PCIE_TPU),
    Chip(name="h100", peak_flops=989e12, hbm_bytes=80e9, hbm_bw=3.35e12, link_bw=450e9,
         source="NVIDIA H100 SXM datasheet (not found offline): 989 TFLOPS dense bf16, 80 GB,"
         " 3.35 TB/s, NVLink 900 GB/s bidirectional (glennklockwood.com/garden/processors/h100,"
         " NVIDIA/nccl issue 1264: 450 GB/s unidirectional)",
         host_bw=_PCIE5),
    Chip(name="h200", peak_flops=989e12, hbm_bytes=141e9, hbm_bw=4.8e12, link_bw=450e9,
         source="NVIDIA H200 SXM datasheet (not found offline): H100 compute (same GH100), 141 GB"
         " HBM3e, 4.8 TB/s, NVLink 900 GB/s bidirectional (MLCommons H200-SXM-141GB system)",
         host_bw=_PCIE5),
)}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Matmuls of a jaxpr


class Dot(NamedTuple):
    flops: float  # one execution
    bytes: float  # one execution: operands + result
    count: float  # executions (product of the enclosing multipliers)
    where: str


UNKNOWN_WHILE = "while (trip count unknown, counted once)"


def jaxpr_dots(closed_jaxpr, *, dce: bool = True) -> list[Dot]:
    """Every matmul `closed_jaxpr` (a ClosedJaxpr or Jaxpr) executes, in program order; see the
    module docstring. `dce`: drop equations whose results nothing uses first (as XLA does)."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    env = _sub_env(closed_jaxpr, (), {})
    if dce:
        jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    out: list[Dot] = []
    _walk(jaxpr, 1, "", env, out)
    return out


def total_flops(dots: list[Dot]) -> float:
    return sum(d.flops * d.count for d in dots)


def roofline_seconds(dots: list[Dot], chip: Chip, devices: int = 1) -> float:
    """Sum over dots of count x max(compute time, HBM time), the work split evenly over
    `devices` chips: flops / (devices x peak) against bytes / (devices x HBM bandwidth)."""
    if devices < 1:
        raise ValueError(f"roofline_seconds: devices={devices!r}, must be >= 1")
    flops_per_s, bytes_per_s = devices * chip.peak_flops, devices * chip.hbm_bw
    return sum(d.count * max(d.flops / flops_per_s, d.bytes / bytes_per_s) for d in dots)


def _walk(jaxpr, mult: float, path: str, env: dict, out: list[Dot]) -> None:
    for eqn in jaxpr.eqns:
        name, p = eqn.primitive.name, eqn.params
        here = _join(path, name)
        if name in ("dot_general", "ragged_dot_general"):
            flops, nbytes = _dot_cost(eqn)
            lhs, rhs = (v.aval.str_short() for v in eqn.invars[:2])
            at = source_info_util.summarize(eqn.source_info)
            out.append(Dot(flops, nbytes, mult, f"{here} {lhs} x {rhs} @ {at}"))
        elif name == "pallas_call":
            cost, kernel = p.get("cost_estimate"), f"{here} {p.get('name') or ''}".rstrip()
            if cost is not None:
                out.append(Dot(cost.flops, cost.bytes_accessed, mult, kernel))
            else:
                out.append(Dot(0.0, 0.0, mult, f"{kernel} (opaque, not counted)"))
        elif name == "scan":
            body = p["jaxpr"]
            sub_env = _sub_env(body, eqn.invars[: _scan_consts(p)], env)
            _walk(body.jaxpr, mult * p["length"], _join(path, f"scan x{p['length']}"), sub_env, out)
        elif name == "while":
            trip = _trip_count(eqn, env)
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            label = UNKNOWN_WHILE if trip is None else f"while x{trip}"
            sub_env = _sub_env(p["body_jaxpr"], eqn.invars[cn : cn + bn], env)
            times = 1 if trip is None else trip
            _walk(p["body_jaxpr"].jaxpr, mult * times, _join(path, label), sub_env, out)
        elif name == "cond":
            branches = p["branches"]
            found = []
            for i, branch in enumerate(branches):
                dots: list[Dot] = []
                label = _join(path, f"cond branch {i} of {len(branches)}")
                _walk(branch.jaxpr, mult, label, _sub_env(branch, eqn.invars[1:], env), dots)
                found.append(dots)
            out.extend(max(found, key=total_flops))  # the first of equals
        elif name == "shard_map":
            n = _manual_devices(p)
            sub_env = _sub_env(p["jaxpr"], eqn.invars, env)
            inner = getattr(p["jaxpr"], "jaxpr", p["jaxpr"])
            _walk(inner, mult * n, _join(path, f"shard_map x{n}"), sub_env, out)
        elif name == "xla_pmap":
            n = p["axis_size"]
            sub_env = _sub_env(p["call_jaxpr"], eqn.invars, env)
            _walk(p["call_jaxpr"], mult * n, _join(path, f"pmap x{n}"), sub_env, out)
        else:  # jit, remat, custom_jvp/vjp calls, closed_call, and anything new holding jaxprs
            if name in ("jit", "pjit"):
                here = _join(path, f"jit({p.get('name', '')})")
            for sub in _jaxprs_in_params(p):
                inner = getattr(sub, "jaxpr", sub)
                same = len(inner.invars) == len(eqn.invars)  # operands bound in order
                _walk(inner, mult, here, _sub_env(sub, eqn.invars if same else (), env), out)


def _scan_consts(params) -> int:
    """How many of a scan's operands are its constants: `num_consts` up to JAX 0.10; from 0.11
    (jax-ml/jax 08958bdf) a FlatTree `ft_in` of (consts, carry, xs) replaces it."""
    if "num_consts" in params:
        return params["num_consts"]
    return len(params["ft_in"].unpack()[0])


def _join(path: str, part: str) -> str:
    return f"{path}/{part}" if path else part


def _dot_cost(eqn) -> tuple[float, float]:
    """(FLOPs, bytes) of one dot_general or ragged_dot_general: 2 x |lhs| x the rhs dimensions
    that are neither contracted, batch nor group. For a dot_general that is 2 x |out| x the
    contracted size; for a ragged dot each lhs row meets one group's matrix (2 M K N for the
    MoE's [M, K] x [G, K, N]), also in its transposes (ragged contraction: [M, K] x [M, N] ->
    [G, K, N] is still 2 M K N, not 2 G K N M)."""
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    p = eqn.params
    if eqn.primitive.name == "dot_general":
        (_, rhs_contract), (_, rhs_batch) = p["dimension_numbers"]
        rhs_group: tuple = ()
    else:
        dims = p["ragged_dot_dimension_numbers"]
        (_, rhs_contract), (_, rhs_batch) = dims.dot_dimension_numbers
        rhs_group = tuple(dims.rhs_group_dimensions)
    skip = {*rhs_contract, *rhs_batch, *rhs_group}
    rhs_free = math.prod(d for i, d in enumerate(rhs.shape) if i not in skip)
    flops = 2.0 * math.prod(lhs.shape) * rhs_free
    avals = (lhs, rhs, *(v.aval for v in eqn.outvars))
    nbytes = float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals))
    return flops, nbytes


def _jaxprs_in_params(params) -> list:
    """The Jaxprs and ClosedJaxprs among `params`' values (also inside tuples and lists)."""
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                found.append(v)
    return found


def _manual_devices(params) -> int:
    """Devices a shard_map's body runs on: the product of its manual mesh axes' sizes (jax 0.10
    names them `newly_manual_axes`; every mesh axis if the parameter is missing)."""
    sizes = dict(params["mesh"].shape)
    return math.prod(sizes[a] for a in params.get("newly_manual_axes", sizes))


# Known integer scalars (Var -> int), to read a while loop's bounds: literals, closed-over
# constants, and the operands a call passes into its sub-jaxpr.
def _as_int(value) -> int | None:
    a = np.asarray(value)
    return int(a) if a.ndim == 0 and a.dtype.kind in "iu" else None


def _value(atom, env: dict) -> int | None:
    if isinstance(atom, jex_core.Literal):
        return _as_int(atom.val)
    return env.get(atom)


def _sub_env(sub, operands, env: dict) -> dict:
    """Known scalars of `sub` (a Jaxpr or ClosedJaxpr): its constants and, position by position,
    its first invars bound to `operands` of the calling equation."""
    jaxpr = getattr(sub, "jaxpr", sub)
    consts = zip(jaxpr.constvars, getattr(sub, "consts", ()), strict=False)
    known = {v: x for v, c in consts if (x := _as_int(c)) is not None}
    for var, atom in zip(jaxpr.invars, operands, strict=False):
        if (x := _value(atom, env)) is not None:
            known[var] = x
    return known


def _index(atoms, atom) -> int | None:
    return next((i for i, a in enumerate(atoms) if a is atom), None)


def _trip_count(eqn, env: dict) -> int | None:
    """Iterations of a counted `while` (i < hi, i += step, step > 0) whose start, bound and step
    are known scalars (a literal, a constant, or a carry the body passes through); else None."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    carries = eqn.invars[cn + bn :]
    cond_carries, body_carries = cond.invars[cn:], body.invars[bn:]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    compare = cond.eqns[0]
    if compare.outvars[0] is not cond.outvars[0]:
        return None
    lhs, rhs = compare.invars
    k = _index(cond_carries, lhs)
    if k is None:
        return None
    start = _value(carries[k], env)
    j = _index(cond_carries, rhs)
    if j is None:
        bound = _value(rhs, _sub_env(p["cond_jaxpr"], eqn.invars[:cn], env))
    elif body.outvars[j] is body_carries[j]:  # a bound the body passes through unchanged
        bound = _value(carries[j], env)
    else:
        return None
    body_env = _sub_env(p["body_jaxpr"], eqn.invars[cn : cn + bn], env)
    step = None
    for e in body.eqns:
        if e.primitive.name == "add" and e.outvars[0] is body.outvars[k]:
            a, b = e.invars
            other = b if a is body_carries[k] else a if b is body_carries[k] else None
            step = None if other is None else _value(other, body_env)
    if start is None or bound is None or step is None or step <= 0:
        return None
    return max(0, -(-(bound - start) // step))


# ---------------------------------------------------------------------------------------------
# Collectives of compiled HLO text

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")  # fmt: skip
# Bytes of an element (sub-byte types packed); "f8" / "f4" stand for every f8e4m3fn, f4e2m1fn, ...
_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "f8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
    "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5,
    "u4": 0.5, "f4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0,
}  # fmt: skip
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_METADATA = re.compile(r'metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEE_LIST = re.compile(r"\b(calls|called_computations|branch_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def hlo_collectives(hlo_text: str, *, unknown_trip: int = 1) -> dict[str, dict]:
    """{kind: {"count", "bytes", "in_unknown_loop"}} for each of KINDS: executions per step,
    bytes one device sends per step (summed over the executions), and how many of the
    executions sit in a while loop whose trip count XLA did not record (counted `unknown_trip`
    times: once by default, warn; a caller that knows the loop, e.g. a decode loop of n steps,
    passes n).
    An async `-start` counts, its `-done` does not; see the module docstring for the bytes."""
    comps, entry, devices = _parse_module(hlo_text)
    memo: dict[str, dict] = {}

    def totals(name: str, active: frozenset) -> dict:
        if name in memo:
            return memo[name]
        if name in active or name not in comps:
            return {}
        got: dict[str, list] = {}
        for opcode, shape, rest in comps[name]:
            kind = opcode.removesuffix("-start")
            if kind in KINDS and not opcode.endswith("-done"):
                _add(got, {kind: [1, _collective_bytes(kind, opcode, shape, rest, devices), 0]})
            if opcode in ("async-done", "async-update"):
                continue  # the computation is counted at its async-start
            callees = _callees(rest)
            if opcode == "conditional":
                branches = [totals(c, active | {name}) for c in callees]
                if branches:
                    _add(got, max(branches, key=lambda t: sum(v[1] for v in t.values())))
                continue
            trip = None
            if opcode == "while":
                m, cond = _TRIP.search(rest), re.search(r"\bcondition=%?([\w.\-]+)", rest)
                trip = int(m.group(1)) if m else _condition_trip(comps, cond and cond.group(1))
            times = 1  # a fusion's, call's or async op's computation runs once
            if opcode == "while":
                times = unknown_trip if trip is None else trip
            for callee in callees:
                child = totals(callee, active | {name})
                if opcode == "while" and trip is None:
                    child = {k: [c, b, c] for k, (c, b, _) in child.items()}
                _add(got, child, times)
        memo[name] = got
        return got

    found, keys = totals(entry, frozenset()), ("count", "bytes", "in_unknown_loop")
    return {kind: dict(zip(keys, found.get(kind, (0, 0.0, 0)), strict=True)) for kind in KINDS}


def _add(into: dict, other: dict, times: int = 1) -> None:
    for kind, values in other.items():
        current = into.setdefault(kind, [0, 0.0, 0])
        for i, v in enumerate(values):
            current[i] += times * v


def _parse_module(text: str) -> tuple[dict[str, list], str, int]:
    """({computation: [(opcode, result shape, rest of the line)]}, entry name, devices)."""
    comps: dict[str, list] = {}
    entry = current = None
    devices = 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            for key in ("num_partitions", "replica_count"):
                m = re.search(rf"\b{key}=(\d+)", line)
                devices *= int(m.group(1)) if m else 1
        elif line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            rest = _METADATA.sub("", m.group(4))
            comps[current].append((m.group(3), m.group(2), rest))
    if not comps:
        raise ValueError("hlo_collectives: no computation found in the HLO text")
    return comps, entry or list(comps)[-1], devices


def _condition_trip(comps: dict, name: str | None) -> int | None:
    """A counted loop's trip count from its condition when XLA recorded none (XLA:TPU does not
    write known_trip_count): a condition (with what it calls) holding one `compare`,
    direction=LT, and one integer scalar constant N is `i < N` from 0, a scan's form; anything
    else (a data-dependent loop such as a decode loop) is unknown."""
    seen, todo, instructions = set(), [name], []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        instructions += comps[c]
        todo += [callee for _, _, rest in comps[c] for callee in _callees(rest)]
    consts = [
        int(m.group(1))
        for opcode, shape, rest in instructions
        if opcode == "constant" and re.match(r"[su]\d+\[\]", shape.strip())
        and (m := re.match(r"\s*(-?\d+)\)", rest))
    ]  # fmt: skip
    compares = [rest for opcode, _, rest in instructions if opcode == "compare"]
    if len(consts) == 1 and len(compares) == 1 and "direction=LT" in compares[0]:
        return consts[0] if consts[0] > 0 else None
    return None


def _callees(rest: str) -> list[str]:
    found = [m.group(2) for m in _CALLEE.finditer(rest)]
    for m in _CALLEE_LIST.finditer(rest):
        found += [c.strip().lstrip("%") for c in m.group(2).split(",") if c.strip()]
    return found


def _collective_bytes(kind: str, opcode: str, shape: str, rest: str, devices: int) -> float:
    """Bytes one device sends for one execution (module docstring)."""
    parts = _tuple_elements(shape)
    if opcode.endswith("-start") and kind != "all-reduce" and len(parts) >= 2:
        shape = parts[1]  # (operands, result[, contexts]); an all-reduce-start is its result
    size = _shape_bytes(shape)
    if kind == "collective-permute":
        return size
    n = _group_size(rest, devices)
    if kind == "reduce-scatter":
        return size * (n - 1)
    return size * (n - 1) / n * (2 if kind == "all-reduce" else 1)


def _group_size(rest: str, devices: int) -> int:
    """Devices per replica group: {{0,1,2,3},...}, the iota form [groups,size]<=[...], the mesh
    form mesh['x'=2,'y'=4] {'y'} / @mesh<x=2,y=4> {x,y:(1)2}; {} or none: every device."""
    if m := re.search(r"replica_groups=\{\{([^}]*)\}", rest):
        return len([x for x in m.group(1).split(",") if x.strip()])
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", rest):
        return int(m.group(1).split(",")[-1])
    if m := re.search(r"replica_groups=@?mesh\s*[<\[]([^>\]]*)[>\]].*?\{([^}]*)\}", rest):
        sizes = {}
        for item in m.group(1).split(","):
            axis, _, size = item.partition("=")
            sizes[axis.strip().strip("'\"")] = int(size)
        n = 1
        for item in filter(None, (x.strip() for x in m.group(2).split(","))):
            axis, _, sub = item.partition(":")
            n *= int(sub.split(")")[-1]) if sub else sizes[axis.strip("'\"")]
        return n
    return devices


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape "(a, (b, c), d)"; [] for an array shape."""
    shape = shape.strip()
    if not shape.startswith("("):
        return []
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "," and depth == 1) or depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [p for p in parts if p]


def _shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape: bf16[8,128]{1,0}, f32[<=8], or a (nested) tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        itemsize = _ITEMSIZE.get(dtype, _ITEMSIZE.get(dtype[:2]))
        if itemsize is None:
            raise ValueError(f"hlo_collectives: unknown element type {dtype!r} in {shape!r}")
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        total += itemsize * math.prod(sizes)
    return total
