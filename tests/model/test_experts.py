"""MoE dispatch (`espo.model.experts`) on every path against the plain per-expert loop."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import sharding, testing
from espo.model import RoutingMode, experts, grouped, moe
from espo.testing import raises_invalid

E, D, F, K, M = 8, 16, 24, 2, 37


@pytest.fixture(scope="module")
def weights():
    k = jax.random.split(jax.random.key(0), 4)
    return (
        jax.random.normal(k[0], (E, D, F)) / 4,
        jax.random.normal(k[1], (E, D, F)) / 4,
        jax.random.normal(k[2], (E, F, D)) / 4,
        jax.random.normal(k[3], (M, D)),
    )


def _routing(seed, *, unrecorded=0):
    logits = jax.random.normal(jax.random.key(seed), (M, E))
    ids, w = moe.route(logits, top_k=K, norm_topk_prob=True, mode=RoutingMode.FREE)
    if unrecorded:
        ids = ids.at[:unrecorded, 1].set(-1)
        w = w.at[:unrecorded, 1].set(0.3)  # a -1 id contributes nothing, whatever its weight
    return ids, w


# "mosaic_gpu" runs its custom VJP with reference matmuls off a GPU (espo.model.grouped);
# "triton" and "megablox" their kernels in Pallas' interpret mode.
IMPLS = ["capacity", "blocked", "ragged", "mosaic_gpu", "triton", "megablox"]


# Jitted (the paths always run jitted in a model): op by op, each dispatch and loop reference
# compiled dozens of small programs.
_reference = jax.jit(moe.moe_reference)


def _assert_dispatch_matches_reference(x, ids, w, w_gate, w_up, w_down, **kw):
    got = jax.jit(functools.partial(experts.dispatch, **kw))(x, ids, w, w_gate, w_up, w_down)
    want = _reference(x, ids, w, w_gate, w_up, w_down)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _sin_loss(fn, *args):
    return jnp.sum(jnp.sin(fn(*args)))


_GRAD_ARGNUMS = (0, 2, 3, 4, 5)  # x, the gate weights and the experts (not the ids)
_reference_grad = jax.jit(jax.grad(functools.partial(_sin_loss, moe.moe_reference), _GRAD_ARGNUMS))


def _assert_gradients_match_reference(x, ids, w, w_gate, w_up, w_down, **kw):
    args = (x, ids, w, w_gate, w_up, w_down)
    dispatch = functools.partial(experts.dispatch, **kw)
    got = jax.jit(jax.grad(functools.partial(_sin_loss, dispatch), _GRAD_ARGNUMS))(*args)
    want = _reference_grad(*args)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


def _skewed_routing():
    # Every token to experts 3 and 5: six groups of size 0 and two of M=37 rows, above any
    # capacity below M.
    ids = jnp.stack([jnp.full((M,), 3), jnp.full((M,), 5)], axis=1).astype(jnp.int32)
    return ids, jnp.full((M, K), 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("unrecorded", [0, 5])
def test_dispatch_matches_loop_reference(weights, impl, unrecorded):
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(1, unrecorded=unrecorded)
    _assert_dispatch_matches_reference(x, ids, w, w_gate, w_up, w_down, impl=impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_dispatch_gradients_match_reference(weights, impl):
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(2)
    _assert_gradients_match_reference(x, ids, w, w_gate, w_up, w_down, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_skewed_routing_all_tokens_to_one_expert(weights, impl):
    # The worst case of every layout: one group holds every row, most groups are empty.
    w_gate, w_up, w_down, x = weights
    ids, w = _skewed_routing()
    _assert_dispatch_matches_reference(x, ids, w, w_gate, w_up, w_down, impl=impl)


# Capacities around the group sizes of _routing (E=8, M*K=74: mean 9): 1 and 4 overflow almost
# every group (several tiles per group at 1), 12 some, 74 none (the R <= C shortcut).
@pytest.mark.slow
@pytest.mark.parametrize("capacity", [1, 4, 12, 74])
@pytest.mark.parametrize("routing", ["free", "unrecorded", "skewed"])
def test_capacity_dispatch_and_gradients_at_any_capacity(weights, capacity, routing):
    w_gate, w_up, w_down, x = weights
    if routing == "skewed":
        ids, w = _skewed_routing()
    else:
        ids, w = _routing(3, unrecorded=5 if routing == "unrecorded" else 0)
    kw = dict(impl="capacity", capacity=capacity)
    _assert_dispatch_matches_reference(x, ids, w, w_gate, w_up, w_down, **kw)
    _assert_gradients_match_reference(x, ids, w, w_gate, w_up, w_down, **kw)


# bfloat16 models (`ModelConfig(dtype="bfloat16")`) dispatch bf16 activations and weights: each
# path keeps that dtype in value and gradient (a stray float32 cast doubles the activation
# memory, and a float32 cotangent from a custom VJP is an error or a silent upcast) and equals
# the float32 loop on the same, bf16-rounded inputs to bf16's precision. Capacity 4 takes the
# streamed CPU matmul and its overflow loop, 24 the batched GEMM with a little overflow. A
# float32 value scattered into the bf16 output is JAX's FutureWarning (an error in later JAX).
@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize(
    "kw",
    [dict(impl="capacity", capacity=4), dict(impl="capacity", capacity=24)]
    + [dict(impl=i) for i in IMPLS if i != "capacity"],  # fmt: skip
    ids=str,
)
@pytest.mark.slow
def test_bfloat16_dispatch_keeps_its_dtype_and_the_float32_values(weights, kw):
    ids, w = _routing(5, unrecorded=3)
    args = [a.astype(jnp.bfloat16) for a in (weights[3], w, *weights[:3])]
    args.insert(1, ids)  # x, ids, weights, w_gate, w_up, w_down
    grad_argnums = (0, 2, 3, 4, 5)

    def run(fn, *a):
        return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a)).astype(jnp.float32)),
                                  grad_argnums)(*a)  # fmt: skip

    out = jax.jit(lambda *a: experts.dispatch(*a, **kw))(*args)
    _, grads = jax.jit(lambda *a: run(lambda *b: experts.dispatch(*b, **kw), *a))(*args)
    assert out.dtype == jnp.bfloat16
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 5
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    want = _reference(*f32)
    _, want_grads = jax.jit(lambda *a: run(moe.moe_reference, *a))(*f32)
    for got, ref in zip([out, *grads], [want, *want_grads], strict=True):
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(got.astype(jnp.float32), ref, atol=0.03 * scale, rtol=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [1, 2, 3])
def test_capacity_dispatch_at_decode_shapes(weights, num_tokens):
    # Decode: fewer assignments than experts (M*K = 2..6 < E = 8, default capacity 4); at M=1
    # the static R <= C shortcut skips the overflow loop. Routed through REPLAY_IDS with one
    # unrecorded (-1) id, whose gate is zero and which must contribute nothing.
    w_gate, w_up, w_down, x = weights
    logits = jax.random.normal(jax.random.key(4), (num_tokens, E))
    replay = jnp.array([[6, 2], [6, -1], [1, 6]], jnp.int32)[:num_tokens]
    ids, w = moe.route(
        logits, top_k=K, norm_topk_prob=True, mode=RoutingMode.REPLAY_IDS, replay_ids=replay
    )
    args = (x[:num_tokens], ids, w, w_gate, w_up, w_down)
    _assert_dispatch_matches_reference(*args, impl="capacity")
    _assert_gradients_match_reference(*args, impl="capacity")


def _shapes_in(jaxpr):
    """Every output shape of every equation, sub-jaxprs (loops, custom_vjp) included."""
    return (v.aval.shape for eqn, _ in testing.jaxpr_equations(jaxpr) for v in eqn.outvars)


@pytest.mark.parametrize("impl", ["capacity", "blocked"])
def test_dispatch_gradient_keeps_no_per_block_weight_copies(weights, impl):
    # The update differentiates dispatch: its forward and backward may hold weight-shaped
    # arrays [n, D, F] / [n, F, D] only for n = E (the weights and their gradients, read and
    # written in place) or n = 1 (one expert's slice per overflow tile), never a per-block
    # stack of gathered expert weights.
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(2)

    def loss(*a):
        return jnp.sum(experts.dispatch(*a, impl=impl, capacity=4))

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 3, 4, 5)))(x, ids, w, w_gate, w_up, w_down)
    stacks = {s for s in _shapes_in(jaxpr.jaxpr) if len(s) == 3 and s[1:] in ((D, F), (F, D))}
    if impl == "blocked":  # the old layout gathers a weight copy per block: the test sees it
        assert any(s[0] != E for s in stacks), stacks
    else:
        assert {s[0] for s in stacks} == {1, E}, stacks  # 1: one expert's slice in the loop


def test_auto_is_capacity_on_cpu_ragged_on_tpu_by_rows_and_kernel_on_gpu(weights, monkeypatch):
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(1)
    bf16 = jnp.bfloat16
    cases = (
        ("cpu", False, (bf16, 128, 128, 8), "capacity"),
        ("tpu", False, (bf16, 128, 128, 8), "ragged"),
        ("tpu", False, (bf16, 128, 1408, experts.DENSE_ROWS + 1), "megablox"),  # dw not dense
        ("tpu", False, (jnp.float32, 128, 128, 4096), "megablox"),
        ("tpu", False, (jnp.float16, 128, 128, 4096), "ragged"),  # megablox: bf16, f32
        ("tpu", False, (None, 128, 128, 4096), "ragged"),  # two operand types
        ("gpu", True, (bf16, 128, 1408, experts.DENSE_ROWS), "triton"),  # decode rows
        ("gpu", False, (jnp.float16, 128, 1408, 16), "triton"),  # any GPU
        ("gpu", True, (jnp.float32, 128, 1408, 16), "ragged"),  # no TF32 products
        ("gpu", True, (None, 128, 1408, 16), "ragged"),  # two operand types
        ("gpu", True, (bf16, 128, 1400, 16), "ragged"),  # F not a multiple of 16
        ("gpu", True, (bf16, 128, 1408, 4096), "mosaic_gpu"),  # Hopper, 16-bit, widths % 64
        ("gpu", True, (jnp.float32, 128, 128, 4096), "capacity"),  # no float32 kernel
        ("gpu", True, (bf16, 128, 100, 4096), "capacity"),  # F not a multiple of 64
        ("gpu", False, (bf16, 128, 128, experts.DENSE_ROWS + 1), "capacity"),  # not Hopper
    )
    for backend, hopper, args, want in cases:
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        monkeypatch.setattr(grouped, "hopper", lambda h=hopper: h)
        assert experts.default_impl(*args) == want, (backend, hopper, args)
    monkeypatch.undo()
    # No impl given is "auto": this backend's default path, the same numbers.
    chex.assert_trees_all_equal(
        experts.dispatch(x, ids, w, w_gate, w_up, w_down),
        experts.dispatch(x, ids, w, w_gate, w_up, w_down, impl=experts.default_impl()),
    )
    with raises_invalid("impl"):
        experts.dispatch(x, ids, w, w_gate, w_up, w_down, impl="dense")


@pytest.mark.slow
def test_expert_parallel_dispatch_off_an_expert_axis_is_dispatch_and_checks_its_inputs(weights):
    """Without an "expert" axis of size > 1 on the context mesh (none, no such axis, size 1)
    `expert_parallel_dispatch` is `dispatch`, with path counts [0, 0]; a mode it does not know
    or experts that do not split over the axis are refused by name. (The expert-parallel paths
    themselves run on 8 emulated devices: `sharded_steps.check_expert_parallel_paths`.)"""
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(6)
    args = (x, ids, w, w_gate, w_up, w_down)
    want = jax.jit(experts.dispatch)(*args)
    meshes = [None, ("data",), ("data", "fsdp", "expert")]  # the last: expert axis of size 1
    for names in meshes:
        mesh = sharding.abstract_mesh((1,) * len(names or ()), names or ())
        with jax.sharding.use_abstract_mesh(mesh):
            y, path = jax.jit(experts.expert_parallel_dispatch)(*args)
        np.testing.assert_array_equal(y, want, err_msg=str(names))
        np.testing.assert_array_equal(path, np.zeros(2, np.int32), strict=True)
    ragged = jax.make_jaxpr(functools.partial(experts.expert_parallel_dispatch, impl="ragged"))
    eqns = testing.jaxpr_equations(ragged(*args).jaxpr)  # the impl asked for is the one run
    assert any(e.primitive.name.startswith("ragged_dot") for e, _ in eqns)
    want = "expert-parallel mode 'ring': expected one of ('all_to_all', 'all_gather')"
    with pytest.raises(ValueError, match=re.escape(want)):
        experts.expert_parallel_dispatch(*args, mode="ring")
    with jax.sharding.use_abstract_mesh(sharding.abstract_mesh((1, 1, 3))):
        want = "8 experts do not split over the mesh's axes ('expert',) of size 3"
        with pytest.raises(ValueError, match=re.escape(want)):
            jax.make_jaxpr(experts.expert_parallel_dispatch)(*args)


def test_capacity_for_is_about_a_quarter_above_the_mean_group():
    # 1.25x the mean rounded up to a multiple of 4, at least 4: decode (M*K=256) and prefill.
    assert [experts.capacity_for(256, e) for e in (8, 32, 128)] == [40, 12, 4]
    assert [experts.capacity_for(4096, e) for e in (8, 32, 128)] == [640, 160, 40]
    assert experts.capacity_for(1, 128) == 4


def _capacity_jaxpr(capacity, weights):
    """The "capacity" dispatch at `capacity`, traced (routing of seed 1: M*K = 74 rows)."""
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(1)
    fn = lambda *a: experts.dispatch(*a, impl="capacity", capacity=capacity)  # noqa: E731
    return jax.make_jaxpr(fn)(x, ids, w, w_gate, w_up, w_down)


def _uses_streamed(capacity, weights):
    return "_streamed" in str(_capacity_jaxpr(capacity, weights))


@pytest.mark.slow
def test_small_capacities_stream_the_experts_on_cpu_and_equal_the_gemm(weights, monkeypatch):
    """Decode-sized groups (capacity <= SMALL_GROUP_ROWS) take the fused multiply-and-reduce on
    CPU, larger ones the batched GEMM; both equal the loop reference (tests above) and each
    other, in value and gradient."""
    if jax.default_backend() != "cpu":
        pytest.skip("the streamed path is CPU-only")
    assert _uses_streamed(4, weights) and _uses_streamed(experts.SMALL_GROUP_ROWS, weights)
    assert not _uses_streamed(experts.SMALL_GROUP_ROWS + 1, weights)
    w_gate, w_up, w_down, x = weights
    ids, w = _routing(2)
    args = (x, ids, w, w_gate, w_up, w_down)
    run = lambda: jax.jit(  # noqa: E731  (a new jit each call: traced with SMALL_GROUP_ROWS now)
        jax.value_and_grad(
            lambda *a: jnp.sum(jnp.sin(experts.dispatch(*a, impl="capacity", capacity=12))),
            (0, 3, 4, 5),
        )
    )(*args)
    streamed = run()
    monkeypatch.setattr(experts, "SMALL_GROUP_ROWS", 0)
    assert not _uses_streamed(4, weights)
    for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(run()), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_overflow_loop_is_built_only_when_a_group_can_exceed_the_capacity(weights):
    # R = M*K rows: at a capacity of R no group can overflow and the static shortcut leaves the
    # loop out; one row less and it is there (it runs no tile when nothing overflows).
    def loops(capacity):
        eqns = testing.jaxpr_equations(_capacity_jaxpr(capacity, weights).jaxpr)
        return sum(e.primitive.name == "while" for e, _ in eqns)

    assert (loops(M * K), loops(M * K - 1)) == (0, 1)


def test_block_size_is_the_power_of_two_nearest_below_half_the_mean_group():
    # (rows, experts, block): the mean group is rows // experts; the block doubles from 8 while
    # twice it is <= half the mean, up to 128 (9 -> 8; 33 -> 16, the boundary; 40 -> 16;
    # 64 -> 32; 1000 -> 128; fewer rows than experts -> 8).
    cases = [(74, 8, 8), (8 * 33, 8, 16), (8 * 40, 8, 16), (8 * 64, 8, 32), (8000, 8, 128)]
    for rows, num_experts, block in [*cases, (3, 8, 8)]:
        assert experts._block_size(rows, num_experts) == block, (rows, num_experts)


@pytest.mark.slow
def test_blocked_layout_fits_the_worst_case_padding():
    # E = 8 groups of one row each with blocks of 8 (`_block_size(8, 8)`): every group pads to
    # a full block, 64 slots, the bound R + E * (block - 1). One block fewer drops a group.
    assert experts._block_size(E, E) == 8
    k = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(k[0], (E, D))
    w_gate, w_up = (jax.random.normal(k[i], (E, D, F)) / 4 for i in (1, 2))
    w_down = jax.random.normal(k[3], (E, F, D)) / 4
    got = experts._blocked_ffn(x, jnp.ones(E, jnp.int32), w_gate, w_up, w_down)
    want = moe.moe_reference(x, jnp.arange(E)[:, None], jnp.ones((E, 1)), w_gate, w_up, w_down)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (np.abs(np.asarray(want)).sum(axis=-1) > 0.1).all()  # a dropped row (zeros) shows
