"""roofline.py: matmul FLOPs and bytes read from jaxprs, collectives read from compiled HLO text,
the per-matmul roofline, against hand-derived numbers."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))
import roofline  # noqa: E402

from espo import testing  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


def dots_of(f, *args, **kwargs):
    return roofline.jaxpr_dots(jax.make_jaxpr(f)(*args), **kwargs)


def spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_a_matmul_counts_2mkn_flops_and_its_three_arrays_in_their_dtype():
    (dot,) = dots_of(jnp.matmul, spec(4, 3, dtype=jnp.bfloat16), spec(3, 5, dtype=jnp.bfloat16))
    assert dot.flops == 2 * 4 * 3 * 5
    assert dot.bytes == (4 * 3 + 3 * 5 + 4 * 5) * 2  # bf16; counting elements would give 47
    assert dot.count == 1
    assert dot.where.startswith("dot_general bfloat16[4,3] x bfloat16[3,5] @ ")


def test_a_batched_matmul_counts_batch_and_contraction():
    f = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)
    (dot,) = dots_of(f, spec(6, 4, 3), spec(6, 3, 5))
    assert dot.flops == 2 * 6 * 4 * 3 * 5  # 2 |out| x contraction; 2 |out| alone is 240
    assert dot.bytes == (6 * 4 * 3 + 6 * 3 * 5 + 6 * 4 * 5) * 4


def test_a_scan_multiplies_its_body_by_its_length():
    def f(h, ws):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]

    (dot,) = dots_of(f, spec(4, 8), spec(7, 8, 8))
    assert (dot.flops, dot.count) == (2 * 4 * 8 * 8, 7)
    assert dot.where.startswith("scan x7/dot_general")
    assert roofline.total_flops([dot]) == 7 * 2 * 4 * 8 * 8


def test_a_scans_constants_reach_a_loop_in_its_body_in_either_jax_form():
    """A while bound that is a scan constant is known inside the body (10 trips x 3 steps);
    the constants' count from JAX 0.10's `num_consts` and from 0.11's `ft_in` (consts, carry,
    xs) alike (a stand-in for 0.11's FlatTree: aot.py's count raised KeyError on an H200)."""
    loop = lambda x, n: lax.while_loop(
        lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ c[1]), (0, x)
    )
    inner = jax.jit(lambda xs, n: lax.scan(lambda _, x: (None, loop(x, n)[1]), None, xs)[1])
    (dot,) = dots_of(lambda xs: inner(xs, 10), spec(3, 4, 4))  # n: the scan's constant
    assert dot.count == 30 and "while x10" in dot.where

    class Tree:  # FlatTree's `unpack`: one tree per part
        def __init__(self, *parts):
            self.parts = parts

        def unpack(self):
            return self.parts

    assert roofline._scan_consts({"num_consts": 2, "length": 5}) == 2
    assert roofline._scan_consts({"ft_in": Tree([0, 0, 0], [0], [0, 0]), "length": 5}) == 3


@pytest.mark.parametrize(
    "remat, value_too, times",
    [
        # y = tanh(x @ w): forward + dL/dx + dL/dw = 3 matmuls of the forward's size.
        (False, True, 3),
        (False, False, 3),  # the backward needs tanh(y): the forward stays live
        # jax.checkpoint recomputes the forward inside the backward: 4 with the loss returned ...
        (True, True, 4),
        # ... 3 when only the gradient is: the first forward then feeds nothing (DCE'd, as XLA
        # would). Without DCE (or without recursing into remat2) this reads 4 (or 1).
        (True, False, 3),
    ],
)
def test_grad_of_a_layer_counts_the_backward_and_the_remat_recompute(remat, value_too, times):
    layer = lambda x, w: jnp.tanh(x @ w)
    layer = jax.checkpoint(layer) if remat else layer
    grad = (jax.value_and_grad if value_too else jax.grad)(
        lambda x, w: layer(x, w).sum(), argnums=(0, 1)
    )
    forward = 2 * 4 * 3 * 5
    assert roofline.total_flops(dots_of(grad, spec(4, 3), spec(3, 5))) == times * forward


def test_without_dce_a_dead_forward_counts():
    layer = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
    grad = jax.grad(lambda x, w: layer(x, w).sum(), argnums=(0, 1))
    dots = dots_of(grad, spec(4, 3), spec(3, 5), dce=False)
    assert roofline.total_flops(dots) == 4 * 2 * 4 * 3 * 5


@pytest.mark.parametrize("big_first", [True, False])
def test_a_cond_counts_its_largest_branch(big_first):
    big = lambda a: (a @ a) @ a  # 2 matmuls of 2 x 8^3
    small = lambda a: a * 2.0
    branches = (big, small) if big_first else (small, big)
    f = lambda p, a: lax.cond(p, *branches, a)
    dots = dots_of(f, spec(dtype=jnp.bool_), spec(8, 8))
    assert roofline.total_flops(dots) == 2 * (2 * 8**3)
    # The jaxpr lists the false branch first: the big one is branch 1 when it is true_fun.
    assert len(dots) == 2 and all(f"cond branch {int(big_first)} of 2" in d.where for d in dots)


def test_a_cond_does_not_add_its_branches():
    f = lambda p, a: lax.cond(p, lambda a: a @ a, lambda a: (a @ a) @ a, a)
    assert roofline.total_flops(dots_of(f, spec(dtype=jnp.bool_), spec(8, 8))) == 2 * (2 * 8**3)


def test_a_shard_map_body_counts_on_every_device_of_its_manual_axes():
    plain = 2 * 8 * 4 * 6  # the unsharded matmul
    mesh = AbstractMesh((4,), ("x",))  # tracing only: no devices needed
    g = jax.shard_map(jnp.matmul, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    (dot,) = dots_of(g, spec(8, 4), spec(4, 6))
    assert (dot.flops, dot.count) == (2 * 2 * 4 * 6, 4)  # per-shard rows 2, on 4 devices
    assert roofline.total_flops([dot]) == plain
    # Manual over "x" only of a (4, 2) mesh: 4 devices' worth, not the mesh's 8.
    mesh = AbstractMesh((4, 2), ("x", "y"))
    g = jax.shard_map(
        jnp.matmul, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), axis_names={"x"}
    )
    (dot,) = dots_of(g, spec(8, 4), spec(4, 6))
    assert dot.count == 4 and roofline.total_flops([dot]) == plain


def test_a_ragged_dot_counts_each_row_against_one_group():
    m, k, n, g = 8, 4, 5, 3
    group_sizes = jnp.array([2, 3, 3], jnp.int32)
    f = lambda x, w: lax.ragged_dot(x, w, group_sizes)
    (dot,) = dots_of(f, spec(m, k), spec(g, k, n))
    assert dot.flops == 2 * m * k * n  # not 2 m k n g
    assert dot.bytes == (m * k + g * k * n + m * n) * 4
    # The backward's two ragged dots (d lhs: [M, N] x [G, K, N]; d rhs: a ragged contraction
    # [M, K] x [M, N] -> [G, K, N]) are 2 M K N each too: 2 |out| x contraction would give G x.
    # (value_and_grad: under grad alone the linear forward is dead code.)
    grad = jax.value_and_grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))
    dots = dots_of(grad, spec(m, k), spec(g, k, n))
    assert [d.flops for d in dots] == [2 * m * k * n] * 3


def test_a_counted_while_multiplies_by_its_trip_count():
    # (i, hi, x) from (1, 6): i = 1, 3, 5 -> 3 iterations; the bound is a carry passed through.
    body = lambda c: (c[0] + 2, c[1], c[2] @ c[2])
    f = lambda x: lax.while_loop(lambda c: c[0] < c[1], body, (1, 6, x))[2]
    (dot,) = dots_of(f, spec(4, 4))
    assert dot.count == 3 and dot.where.startswith("while x3/")
    # A literal bound, inside a scan of 2: 2 x 10.
    loop = lambda x: lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] @ c[1]), (0, x))
    f = lambda xs: lax.scan(lambda _, x: (None, loop(x)[1]), None, xs)[1]
    (dot,) = dots_of(f, spec(2, 4, 4))
    assert dot.count == 20
    # Bounds passed into a jit as Python ints reach the loop inside it.
    inner = jax.jit(lambda x, n: lax.fori_loop(0, n, lambda i, c: c @ c, x))
    (dot,) = dots_of(lambda x: inner(x, 4), spec(4, 4))
    assert dot.count == 4


def test_a_while_with_a_runtime_bound_is_counted_once_and_says_so():
    f = jax.jit(lambda x, n: lax.fori_loop(0, n, lambda i, c: c @ c, x))
    (dot,) = dots_of(f, spec(4, 4), spec(dtype=jnp.int32))
    assert dot.count == 1 and roofline.UNKNOWN_WHILE in dot.where


def _pallas_matmul(x, **kwargs):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] @ x_ref[...]

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=out, interpret=True, **kwargs)(x)


def test_a_pallas_call_counts_its_cost_estimate_or_says_it_is_opaque():
    cost = pl.CostEstimate(flops=1024, transcendentals=0, bytes_accessed=768)
    f = lambda xs: lax.scan(lambda _, x: (None, _pallas_matmul(x, cost_estimate=cost)), None, xs)
    (dot,) = dots_of(f, spec(3, 8, 8))
    assert (dot.flops, dot.bytes, dot.count) == (1024, 768, 3)
    (dot,) = dots_of(_pallas_matmul, spec(8, 8))  # the kernel's own dot is on blocks: not read
    assert (dot.flops, dot.bytes) == (0, 0) and "opaque, not counted" in dot.where


def test_call_like_primitives_are_entered():
    @jax.custom_vjp
    def custom(x, w):
        return x @ w

    custom.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    @jax.custom_jvp
    def smooth(x):
        return jnp.sin(x @ x.T)

    smooth.defjvp(lambda p, t: (smooth(p[0]), t[0] @ p[0].T))
    f = lambda x, w: (custom(x, w), smooth(x), jax.jit(lambda a: a @ w)(x))
    dots = dots_of(f, spec(4, 3), spec(3, 5))
    assert sorted(d.flops for d in dots) == [2 * 4 * 3 * 4, 2 * 4 * 3 * 5, 2 * 4 * 3 * 5]
    assert any(d.where.startswith("jit(<lambda>)/dot_general") for d in dots)


TOY = roofline.Chip(name="toy", peak_flops=100, hbm_bytes=1, hbm_bw=10, link_bw=1, source="-")


def test_roofline_takes_the_slower_of_compute_and_memory_per_dot():
    compute_bound = roofline.Dot(flops=1000, bytes=10, count=2, where="a")  # 10 s vs 1 s, x2
    memory_bound = roofline.Dot(flops=10, bytes=1000, count=1, where="b")  # 0.1 s vs 100 s
    assert roofline.roofline_seconds([compute_bound], TOY) == 20
    assert roofline.roofline_seconds([memory_bound], TOY) == 100
    assert roofline.roofline_seconds([compute_bound, memory_bound], TOY) == 120
    assert roofline.roofline_seconds([compute_bound, memory_bound], TOY, devices=4) == 30
    with pytest.raises(ValueError, match="devices=0"):
        roofline.roofline_seconds([compute_bound], TOY, devices=0)


def test_the_chip_table():
    assert set(roofline.CHIPS) == {"v5p", "v5e", "v6e", "v4", "h100", "h200"}
    for name, chip in roofline.CHIPS.items():
        assert chip.name == name and chip.source
        assert chip.link_bw < chip.hbm_bw < chip.peak_flops
    # Ridge points (FLOPs per HBM byte) as usually quoted: v5p ~166, H100 SXM ~295.
    ridge = {n: c.peak_flops / c.hbm_bw for n, c in roofline.CHIPS.items()}
    assert round(ridge["v5p"]) == 166 and round(ridge["h100"]) == 295
    with pytest.raises(ValueError, match="hbm_bw=0"):
        roofline.Chip(name="x", peak_flops=1, hbm_bytes=1, hbm_bw=0, link_bw=1, source="-")


# Nested counted whiles (2 x 3), a while without a trip count, async pairs (all-gather-start/
# done; async-start wrapping a reduce-scatter), the iota, list, empty and mesh replica groups,
# a tuple-shaped all-to-all, a conditional (the larger branch is listed second).
HLO = """\
HloModule snippet, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p: bf16[64]) -> bf16[16] {
  %p = bf16[64]{0} parameter(0)
  ROOT %rs = bf16[16]{0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

%inner_body (t: (s32[], bf16[4,8], f32[4,8])) -> (s32[], bf16[4,8], f32[4,8]) {
  %t = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}) parameter(0)
  %a = bf16[4,8]{1,0} get-tuple-element(%t), index=1
  %ag-start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%a), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(f)/all_gather" source_file="x.py" source_line=3}
  %ag-done = bf16[16,8]{1,0} all-gather-done(%ag-start)
  %b = f32[4,8]{1,0} get-tuple-element(%t), index=2
  %s0 = f32[2,8]{1,0} slice(%b), slice={[0:2], [0:8]}
  %s1 = f32[2,8]{1,0} slice(%b), slice={[2:4], [0:8]}
  %a2a = (f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%s0, %s1), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}
  ROOT %r = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}) tuple(%i, %a, %b)
}

%inner_cond (t: (s32[], bf16[4,8], f32[4,8])) -> pred[] {
  %t = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (u: (s32[], bf16[4,8], f32[4,8], bf16[64])) -> (s32[], bf16[4,8], f32[4,8], bf16[64]) {
  %u = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}, bf16[64]{0}) parameter(0)
  %w = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %rs-start = ((bf16[64]{0}), bf16[16]{0}) async-start(%v), calls=%wrapped_reduce_scatter
  %rs-done = bf16[16]{0} async-done(%rs-start)
  ROOT %r = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}, bf16[64]{0}) tuple(%i, %a, %b, %v)
}

%outer_cond (u: (s32[], bf16[4,8], f32[4,8], bf16[64])) -> pred[] {
  %u = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}, bf16[64]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%dynamic_body (d: (s32[], f32[10])) -> (s32[], f32[10]) {
  %d = (s32[], f32[10]{0}) parameter(0)
  %ar = f32[10]{0} all-reduce(%e), channel_id=4, replica_groups={}, to_apply=%add
  ROOT %r = (s32[], f32[10]{0}) tuple(%i, %ar)
}

%dynamic_cond (d: (s32[], f32[10])) -> pred[] {
  %d = (s32[], f32[10]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%small (q: f32[10]) -> f32[10] {
  %q = f32[10]{0} parameter(0)
  %cp1 = f32[10]{0} collective-permute(%q), channel_id=5, source_target_pairs={{0,1},{1,0}}
  ROOT %cp2 = f32[10]{0} collective-permute(%cp1), channel_id=6, source_target_pairs={{0,1},{1,0}}
}

%big (q: f32[10]) -> f32[10] {
  %q = f32[10]{0} parameter(0)
  %cp = f32[100]{0} collective-permute(%q), channel_id=7, source_target_pairs={{0,1},{1,0}}
  ROOT %sl = f32[10]{0} slice(%cp), slice={[0:10]}
}

ENTRY %main (p0: (s32[], bf16[4,8], f32[4,8], bf16[64]), p1: (s32[], f32[10]), p2: s32[], p3: f32[10]) -> f32[16] {
  %p0 = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}, bf16[64]{0}) parameter(0)
  %w0 = (s32[], bf16[4,8]{1,0}, f32[4,8]{1,0}, bf16[64]{0}) while(%p0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"2"}}
  %p1 = (s32[], f32[10]{0}) parameter(1)
  %w1 = (s32[], f32[10]{0}) while(%p1), condition=%dynamic_cond, body=%dynamic_body
  %c = f32[10]{0} conditional(%p2, %p3, %p3), branch_computations={%small, %big}
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%f), channel_id=8, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  ROOT %ar2 = f32[16]{0} all-reduce(%g), channel_id=9, replica_groups=@mesh<a=2,b=4>(devices=[2,4]<=[8]) {a,b:(1)2}, to_apply=%add
}
"""  # noqa: E501  (HLO lines as XLA prints them)


def test_hlo_collectives_of_a_hand_written_module():
    got = roofline.hlo_collectives(HLO)

    def row(count, nbytes, unknown=0):
        return {"count": count, "bytes": nbytes, "in_unknown_loop": unknown}

    assert got == {
        # bf16[16,8] = 256 B gathered over 4: 192 B sent, 3 x 2 times; the -done not counted.
        "all-gather": row(6, 6 * 192),
        # 2 x f32[2,8] = 128 B over pairs: 64 B sent, 6 times.
        "all-to-all": row(6, 6 * 64),
        # bf16[16] = 32 B scattered from 4 x 32: 96 B sent, once per outer iteration.
        "reduce-scatter": row(2, 2 * 96),
        # f32[10] over all 8 (replica_groups={}): 2 x 40 x 7/8, in the unknown loop; f32[16]
        # over the mesh axes a (2) and b's sub-axis of 2: 2 x 64 x 3/4.
        "all-reduce": row(2, 70 + 96, unknown=1),
        # The big branch (400 B), not both (480) nor the first (80); the -start's data is its
        # second tuple element (32 B), not the whole tuple (72).
        "collective-permute": row(2, 400 + 32),
        "ragged-all-to-all": row(0, 0.0),
    }
    # A decode loop of 5 steps: only the loop without a recorded trip count runs 5 times; the
    # computations of async ops and conditionals elsewhere run once (XLA:TPU wraps a
    # reduce-scatter in a fusion: once, not once per decode step).
    five = roofline.hlo_collectives(HLO, unknown_trip=5)
    assert five["all-reduce"] == row(6, 5 * 70 + 96, unknown=5)
    assert {k: v for k, v in five.items() if k != "all-reduce"} == {
        k: v for k, v in got.items() if k != "all-reduce"
    }


COMPILE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, "experiments")
import roofline

mesh = Mesh(np.array(jax.devices()[:4]), ("m",))
def layers(x, ws):  # FSDP-style: each layer's weight is all-gathered inside the scan
    def body(h, w):
        w = lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        return jnp.tanh(h @ w), None
    return lax.scan(body, x, ws)[0]
x = jax.ShapeDtypeStruct((4, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
ws = jax.ShapeDtypeStruct((5, 16, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "m")))
scan = jax.jit(layers).lower(x, ws).compile().as_text()

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("d", "m"))
def body(a):  # a: the [8, 8] f32 block of a [16, 32] array
    return (lax.psum(lax.all_to_all(a, "m", 0, 0, tiled=True), "d"),
            lax.psum_scatter(a, "m", scatter_dimension=0, tiled=True),
            lax.ppermute(a, "m", [(i, (i + 1) % 4) for i in range(4)]),
            lax.all_gather(a, "m", tiled=True))
specs = (P("d", "m"), P("d", "m"), P("d", "m"), P("d"))
f = jax.shard_map(body, mesh=mesh, in_specs=P("d", "m"), out_specs=specs, check_vma=False)
collectives = jax.jit(f).lower(jax.ShapeDtypeStruct((16, 32), jnp.float32)).compile().as_text()
print(json.dumps(dict(
    scan=roofline.hlo_collectives(scan), collectives=roofline.hlo_collectives(collectives),
    trip_count_written='"known_trip_count":{"n":"5"}' in scan)))
"""


@pytest.mark.multiprocess
def test_hlo_collectives_of_programs_compiled_for_8_cpu_devices():
    r = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=REPO, env=testing.emulated_devices_env(8),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["trip_count_written"]  # XLA:CPU records the scan's trip count
    scan = got["scan"]
    # One all-gather of a [16, 16] f32 weight over 4 devices a layer: 1024 x 3/4 B, 5 times.
    assert scan["all-gather"] == {"count": 5, "bytes": 5 * 768.0, "in_unknown_loop": 0}
    assert sum(v["count"] for v in scan.values()) == 5
    c = got["collectives"]
    assert c["all-to-all"]["bytes"] == 256 * 3 / 4  # tuple of 4 x f32[2,8] over "m" (4)
    assert c["all-reduce"]["bytes"] == 2 * 256 * 1 / 2  # psum over "d" (2)
    assert c["reduce-scatter"]["bytes"] == 64 * 3  # f32[2,8] out of 4 x that
    assert c["collective-permute"]["bytes"] == 256
    assert c["all-gather"]["bytes"] == 1024 * 3 / 4  # f32[32,8] gathered over "m"
    assert all(v["count"] == 1 for k, v in c.items() if k != "ragged-all-to-all")


_TPU_STYLE = """HloModule t, num_partitions=4

%body (d: (s32[], f32[8])) -> (s32[], f32[8]) {
  %d = (s32[], f32[8]{0}) parameter(0)
  %ar = f32[8]{0} all-reduce(%e), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%fused_lt (x: s32[]) -> pred[] {
  %x = s32[] parameter(0)
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%x, %n), direction=LT
}

%counted_cond (d: (s32[], f32[8])) -> pred[] {
  %d = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%d), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

%live_cond (d: (s32[], f32[8])) -> pred[] {
  %d = (s32[], f32[8]{0}) parameter(0)
  %n = s32[] constant(6)
  %lt = pred[] compare(%i, %n), direction=LT
  %any = pred[] compare(%j, %k), direction=NE
  ROOT %and = pred[] and(%lt, %any)
}

ENTRY %main (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%p), condition=%counted_cond, body=%body
  ROOT %v = (s32[], f32[8]{0}) while(%w), condition=%live_cond, body=%body
}
"""


def test_a_loop_without_a_recorded_trip_count_takes_its_conditions_bound():
    """XLA:TPU records no known_trip_count: `i < 6` in the condition (here inside a fusion) is
    a loop of 6; a condition that also tests data (a decode loop's live rows) stays unknown,
    counted `unknown_trip` times."""
    got = roofline.hlo_collectives(_TPU_STYLE, unknown_trip=10)["all-reduce"]
    assert got["count"] == 6 + 10 and got["in_unknown_loop"] == 10
    assert got["bytes"] == pytest.approx(16 * 2 * 32 * 3 / 4)
