"""FP8 quantization against an independent numpy + ml_dtypes reference.

The reference (`_reference`) is written from the definition, not from `espo.quant`: view the
weight as [*lead, in, out] (the model computes x @ w, so the "out" axes are the trailing ones:
q/k/v [D, H, Dh] -> out H*Dh; o_proj [H, Dh, D] -> out D; experts [E, D, F] -> out F per expert;
down [.., F, D] -> out D), take the absmax of every output channel (column) or of every
block x block tile, scale = absmax / 448, and round w / scale to e4m3 with ml_dtypes' cast.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

from espo import model, quant, testing
from espo.testing import raises_invalid

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
NUM_AXES = {  # leaf name -> (in axes, out axes) after the stacked (layer, expert) axes
    "q_proj": (1, 2),
    "k_proj": (1, 2),
    "v_proj": (1, 2),
    "o_proj": (2, 1),
    "gate_proj": (1, 1),
    "up_proj": (1, 1),
    "down_proj": (1, 1),
}


def _reference(w, *, num_in_axes: int, num_out_axes: int, block: int = 0):
    """(scales [*lead, in_blocks, out_blocks], e4m3 values [*lead, in, out]) in numpy."""
    x = np.asarray(w, np.float32)
    lead = x.shape[: x.ndim - num_in_axes - num_out_axes]
    rows = math.prod(x.shape[len(lead) : len(lead) + num_in_axes])
    x = x.reshape(*lead, rows, -1)
    cols = x.shape[-1]
    if not block:
        amax = np.abs(x).max(axis=-2, keepdims=True)  # one per output channel
        full = lambda s: s
    else:
        nr, nc = -(-rows // block), -(-cols // block)
        amax = np.zeros((*lead, nr, nc), np.float32)
        for i in range(nr):
            for j in range(nc):
                tile = x[..., i * block : (i + 1) * block, j * block : (j + 1) * block]
                amax[..., i, j] = np.abs(tile).max(axis=(-2, -1))
        full = lambda s: np.repeat(np.repeat(s, block, -2), block, -1)[..., :rows, :cols]
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), 1.0).astype(np.float32)
    values = (x / full(scales)).astype(E4M3)
    return scales, values, full


def _assert_matches_reference(q: quant.Fp8Tensor, w, *, num_in_axes, num_out_axes, block=0):
    """Scales (shape and value), e4m3 values and the dequantized weight equal the reference."""
    scales, values, full = _reference(
        w, num_in_axes=num_in_axes, num_out_axes=num_out_axes, block=block
    )
    chex.assert_shape(q.scales, scales.shape)
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == w.shape
    # XLA divides by 448 as a multiply by 1/448: scales may differ from numpy's by one f32 ulp.
    np.testing.assert_allclose(q.scales, scales, rtol=2.5e-7, atol=0)
    got = np.asarray(q.values.astype(jnp.float32)).reshape(values.shape)
    want = values.astype(np.float32)
    # ... so a value sitting on an e4m3 rounding boundary may round to the neighbour: allow one
    # e4m3 step (2^-3 relative, 2^-9 subnormal) on at most 1% of the entries.
    step = np.maximum(np.abs(want) * 2.0**-3, 2.0**-9)
    assert (np.abs(got - want) <= step).all()
    assert np.mean(got != want) <= 0.01, np.mean(got != want)
    dq = np.asarray(q.astype(jnp.float32)).reshape(values.shape)
    np.testing.assert_allclose(dq, want * full(scales), rtol=2.0**-3 + 1e-6, atol=0)


def _quantize(granularity: str, block_size: int, num_in_axes: int, num_out_axes: int):
    return functools.partial(
        quant.quantize_tensor, num_in_axes=num_in_axes, num_out_axes=num_out_axes,
        granularity=granularity, block_size=block_size,
    )  # fmt: skip


def _spread_weight(shape=(64, 6), lo=-5.0, hi=0.0, seed=0):
    """Gaussian [in, out] whose output channels (columns) span 10^lo .. 10^hi in magnitude."""
    rng = np.random.RandomState(seed)
    return (rng.randn(*shape) * np.logspace(lo, hi, shape[-1])).astype(np.float32)


class Fp8Test(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("channel_2d", "channel", (40, 24), 1, 1),
        ("channel_experts", "channel", (3, 5, 40, 24), 1, 1),  # [L, E, in, out] stacked
        ("channel_heads_out", "channel", (2, 24, 3, 8), 1, 2),  # q_proj [L, D, H, Dh]
        ("channel_heads_in", "channel", (2, 3, 8, 24), 2, 1),  # o_proj [L, H, Dh, D]
        ("block_2d", "block", (40, 24), 1, 1),  # 16-tiles, both dims padded
        ("block_experts", "block", (3, 5, 40, 24), 1, 1),
        ("block_heads_out", "block", (2, 24, 3, 8), 1, 2),
    )
    def test_matches_the_numpy_reference(self, granularity, shape, num_in, num_out):
        # Every channel (and every leading matrix) has its own magnitude, 1e-4 .. 1e4, so any
        # other scale layout (per input row, per tensor, shared over the leading axes) differs.
        rng = np.random.RandomState(0)
        w = rng.randn(*shape) * 10.0 ** rng.uniform(-4, 4, (*shape[:-2], 1, shape[-1]))
        w = w.astype(np.float32)
        q = self.variant(_quantize(granularity, 16, num_in, num_out))(jnp.asarray(w))
        block = 16 if granularity == "block" else 0
        _assert_matches_reference(q, w, num_in_axes=num_in, num_out_axes=num_out, block=block)
        # The dequantizer (jitted too) agrees with the eager one.
        dq = self.variant(lambda t: t.astype(jnp.float32))(q)
        chex.assert_trees_all_close(dq, q.astype(jnp.float32), rtol=0, atol=0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_per_channel_error_bound_on_channels_1e5_apart(self):
        """Each output channel keeps e4m3's precision relative to its *own* magnitude.

        Columns of w span |w| ~ 1e-5 .. 1. With its own scale s_c = absmax_c / 448 a column
        has elementwise error <= 2^-4 |w| (3 mantissa bits, round to nearest) + 2^-10 s_c
        (half the subnormal step 2^-9 in scaled units), and relative RMS error ~2.5%. One scale
        for the whole tensor (s = 1 / 448) puts the 1e-5 column at 1e-5 * 448 = 4.5e-3 scaled
        units, below e4m3's smallest normal 2^-6, so it keeps ~1 bit: 23% RMS error.
        """
        w = _spread_weight()
        q = self.variant(_quantize("channel", 128, 1, 1))(jnp.asarray(w))
        err = np.abs(np.asarray(q.astype(jnp.float32)) - w)
        s = np.abs(w).max(axis=0) / E4M3_MAX  # [out], numpy
        assert (err <= (2.0**-4 * np.abs(w) + 2.0**-10 * s) * (1 + 1e-6)).all()
        rel = np.linalg.norm(err, axis=0) / np.linalg.norm(w, axis=0)  # [out]
        assert rel.max() < 0.04, rel
        # The wrong answer, computed independently: one scale for the whole tensor.
        s_tensor = np.abs(w).max() / E4M3_MAX
        per_tensor = (w / s_tensor).astype(E4M3).astype(np.float32) * s_tensor
        rel_tensor = np.linalg.norm(per_tensor - w, axis=0) / np.linalg.norm(w, axis=0)
        assert rel_tensor[0] > 0.15, rel_tensor

    def test_channels_of_a_row_with_one_huge_entry_keep_their_precision(self):
        # A per-input-row scale lets the 1e4 entry set the scale of its whole row: the other
        # entries of row 0 (|w| ~ 1) fall to e4m3 subnormals or 0. Per output channel, only
        # column 0 is coarse and every other column is exact to 2^-4.
        w = np.random.RandomState(1).uniform(0.5, 1.0, (8, 5)).astype(np.float32)
        w[0, 0] = 1e4
        q = quant.quantize_tensor(
            jnp.asarray(w), num_in_axes=1, num_out_axes=1, granularity="channel"
        )
        dq = np.asarray(q.astype(jnp.float32))
        np.testing.assert_allclose(dq[:, 1:], w[:, 1:], rtol=2.0**-4)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_scale_shapes_and_values_for_every_weight_kind(granularity):
    """Every matmul weight of a model with attention, routed + shared experts and a dense MLP."""
    cfg = model.ModelConfig.tiny(
        vocab_size=32, d_model=32, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
        num_experts=3, moe_ffn_dim=24, dense_layers=(0,), dense_ffn_dim=40,
        shared_expert_ffn_dim=16,
    )  # fmt: skip
    params = model.init(cfg, jax.random.key(0))
    b = 16
    # Jitted: op by op, the tree's ~150 small programs each compiled on its own.
    quantize = functools.partial(quant.quantize_fp8, granularity=granularity, block_size=b)
    qparams = jax.jit(quantize)(params)
    c = lambda n: -(-n // b)  # number of blocks
    D, HD, ND, E, F, Fd, Fs = 32, 48, 16, 3, 24, 40, 16
    # (layers in the run, [in, out] of the matrix, expert axis?) per leaf; scale shapes follow.
    kinds = {
        ("blocks_0", "attn", "q_proj"): (1, D, HD, ()),
        ("blocks_0", "attn", "o_proj"): (1, HD, D, ()),
        ("blocks_0", "mlp", "gate_proj"): (1, D, Fd, ()),
        ("blocks_0", "mlp", "down_proj"): (1, Fd, D, ()),
        ("blocks_1", "attn", "k_proj"): (2, D, ND, ()),
        ("blocks_1", "attn", "v_proj"): (2, D, ND, ()),
        ("blocks_1", "moe", "gate_proj"): (2, D, F, (E,)),
        ("blocks_1", "moe", "up_proj"): (2, D, F, (E,)),
        ("blocks_1", "moe", "down_proj"): (2, F, D, (E,)),
        ("blocks_1", "moe", "shared_expert", "up_proj"): (2, D, Fs, ()),
        ("blocks_1", "moe", "shared_expert", "down_proj"): (2, Fs, D, ()),
    }
    for path, (layers, rows, cols, experts) in kinds.items():
        leaf, w = qparams, params
        for k in path:
            leaf, w = leaf[k], w[k]
        assert isinstance(leaf, quant.Fp8Tensor), path
        want = (layers, *experts, 1, cols) if granularity == "channel" else (
            layers, *experts, c(rows), c(cols))  # fmt: skip
        assert leaf.scales.shape == want, (path, leaf.scales.shape, want)
        num_in, num_out = NUM_AXES[path[-1]]
        _assert_matches_reference(
            leaf, w, num_in_axes=num_in, num_out_axes=num_out,
            block=b if granularity == "block" else 0,
        )  # fmt: skip
    # Router, embeddings, LM head, norms and the shared-expert gate stay in bfloat16.
    moe = qparams["blocks_1"]["moe"]
    for leaf in (moe["router"], moe["shared_expert_gate"], qparams["embed"], qparams["lm_head"]):
        assert leaf.dtype == jnp.bfloat16


@pytest.mark.slow
def test_saturation_bound_is_e4m3_max_and_absmax_maps_to_it():
    assert quant.FP8_MAX == E4M3_MAX == 448.0
    w = _spread_weight((16, 4), -2.0, 3.0)
    for granularity in ("channel", "block"):
        q = quant.quantize_tensor(
            jnp.asarray(w), num_in_axes=1, num_out_axes=1, granularity=granularity, block_size=8
        )
        v = np.abs(np.asarray(q.values.astype(jnp.float32)))
        # Each channel's / tile's absmax entry maps to exactly +-448 (never NaN, never less).
        if granularity == "channel":
            np.testing.assert_array_equal(v.max(axis=0), 448.0)
        else:
            np.testing.assert_array_equal(v.reshape(2, 8, 1, 4).max(axis=(1, 3)), 448.0)


def test_plain_cast_overflows_to_nan_but_quantize_saturates():
    x = jnp.array([1000.0, -1e9])
    assert bool(jnp.isnan(x.astype(jnp.float8_e4m3fn).astype(jnp.float32)).any())
    w = jnp.array([[1.0, 0.0], [1e9, -3.0]])  # one channel with a huge value
    q = quant.quantize_tensor(w, num_in_axes=1, num_out_axes=1, granularity="channel")
    np.testing.assert_allclose(q.astype(jnp.float32)[1, 0], 1e9, rtol=2**-4)
    chex.assert_tree_all_finite(q.astype(jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_zero_and_tiny_channels_stay_finite(granularity):
    # A channel whose absmax is below 448 * 2^-126 (float32's smallest normal) would get a scale
    # amax / 448 that flushes to 0 on CPU: 0 / 0 = NaN in its zero entries. Zero channels get
    # scale 1; tiny ones keep a normal scale and their values up to e4m3 rounding.
    w = jnp.array([[1e-36, 0.0, 1.0], [0.0, 0.0, -0.5], [-3e-37, 0.0, 0.25]], jnp.float32)
    q = quant.quantize_tensor(
        w, num_in_axes=1, num_out_axes=1, granularity=granularity, block_size=1
    )
    dq = q.astype(jnp.float32)
    chex.assert_tree_all_finite((q.scales, dq))
    assert (q.scales > 0).all()
    np.testing.assert_allclose(dq, w, rtol=2.0**-4, atol=0)
    z = quant.quantize_tensor(
        jnp.zeros((4, 4)), num_in_axes=1, num_out_axes=1, granularity=granularity, block_size=2
    )
    np.testing.assert_array_equal(z.astype(jnp.float32), 0.0)
    np.testing.assert_array_equal(z.scales, 1.0)


@pytest.mark.slow
def test_tree_layout_bytes_and_mismatch():
    cfg = model.ModelConfig.tiny(param_dtype="bfloat16", dtype="bfloat16", num_layers=2)
    params = model.init(cfg, jax.random.key(0))
    qparams = quant.quantize_fp8(params)
    block = qparams["blocks_0"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(block["attn"][name], quant.Fp8Tensor)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(block["moe"][name], quant.Fp8Tensor)
    for leaf in (block["moe"]["router"], qparams["embed"], qparams["lm_head"]):
        assert leaf.dtype == jnp.bfloat16
    ratio = quant.tree_bytes(qparams, only_quantized_paths=True) / quant.tree_bytes(
        params, only_quantized_paths=True
    )
    assert ratio <= 0.55
    # The FP8 forward stays close to the bf16 one on the same tokens (the train-infer mismatch
    # that router replay exists to remove; measured in experiments/bench_rollout.py).
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
    forward = jax.jit(functools.partial(model.forward, cfg))  # op by op: ~200 small programs
    ref, got = forward(params, tokens), forward(qparams, tokens)
    dlogp = jnp.abs(jax.nn.log_softmax(ref.logits) - jax.nn.log_softmax(got.logits))
    assert float(jnp.mean(dlogp)) < 0.1
    agree = jnp.mean(jnp.argmax(ref.logits, -1) == jnp.argmax(got.logits, -1))
    assert float(agree) > 0.8
    assert float(jnp.mean(ref.router.expert_ids != got.router.expert_ids)) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_fp8_weights_multiply_as_values_then_scales(granularity):
    """The forward on FP8 params equals the forward on their dequantized copy (float32
    compute) on every dispatch path, stacked or per-layer weights; with per-channel scales no
    multiply writes a weight-shaped array (the dequantized copy XLA:GPU would materialize):
    the scales go on the products (`quant.ScaledWeight`). Per-block scales keep the copy."""
    cfg = model.ModelConfig.tiny(num_layers=2, d_model=48, moe_ffn_dim=40, num_experts=6)
    params = model.init(cfg, jax.random.key(0))
    # Jitted: op by op, ~90 small programs each compiled on its own.
    quantize = functools.partial(
        quant.quantize_fp8, granularity=granularity, block_size=16, keep_dtype="float32"
    )
    q = jax.jit(quantize)(params)
    dq = jax.jit(quant.dequantize, static_argnums=1)(q, "float32")
    tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, cfg.vocab_size)
    per_layer = jax.jit(model.Model(cfg).decode_params)(q)
    # One reference for every path (test_transformer checks the paths agree in float32).
    want = jax.jit(functools.partial(model.forward, cfg, dispatch_impl="ragged"))(dq, tokens)
    for impl in ("ragged", "capacity", "blocked", "triton"):
        forward = jax.jit(functools.partial(model.forward, cfg, dispatch_impl=impl))
        # Every path on the sampler's per-layer weights, the stacked ones on one path: a path
        # is handed the same per-layer expert weights in both layouts (the scan slices them).
        for p in (per_layer, q) if impl == "ragged" else (per_layer,):
            got = forward(p, tokens)
            np.testing.assert_allclose(got.logits, want.logits, rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(got.router.expert_ids, want.router.expert_ids)
    weight_shapes = set()  # each weight's shape and its [*lead, in, out] view
    for leaf in jax.tree.leaves(per_layer, is_leaf=lambda x: hasattr(x, "scales")):
        if isinstance(leaf, quant.Fp8Tensor):
            n_out, n_lead = (
                leaf.num_out_axes,
                leaf.values.ndim - leaf.num_in_axes - leaf.num_out_axes,
            )
            lead, out = leaf.shape[:n_lead], leaf.shape[leaf.values.ndim - n_out :]
            weight_shapes |= {
                leaf.shape,
                (*lead, leaf.values.size // math.prod((*lead, *out)), math.prod(out)),
            }
    jaxpr = jax.make_jaxpr(functools.partial(model.forward, cfg, dispatch_impl="ragged"))(
        per_layer, tokens
    ).jaxpr
    copies = [
        eqn
        for eqn, _ in testing.jaxpr_equations(jaxpr)
        if eqn.primitive.name == "mul" and tuple(eqn.outvars[0].aval.shape) in weight_shapes
    ]
    # Per-block: one dequantized copy per weight of the decode params, 2 layers x (q/k/v fused
    # into one, o; 3 experts).
    assert len(copies) == (0 if granularity == "channel" else 2 * 2 + 2 * 3)
    # A ScaledWeight's dense form is the dequantized weight (experts: a leading axis).
    w = q["blocks_0"]["moe"]["gate_proj"]
    if granularity == "channel":
        scaled = quant.compute_weight(w, jnp.float32)
        assert isinstance(scaled, quant.ScaledWeight) and scaled.scale.shape == (2, 6, 40)
        np.testing.assert_allclose(scaled.dense(), w.astype(jnp.float32), rtol=1e-6)


# ---------------------------------------------------------------- mutation audit (issue 13)
# Each test below kills mutants that survived `mutmut` on espo/quant.py (see notes/mutmut.md).


def _hand_tree():
    """A param tree by hand: a q_proj [D=16, H=2, Dh=8] f32, a norm [16] bf16, a router that is
    a dict holding a matmul-named leaf (must stay unquantized), and a list of layers."""
    rng = np.random.RandomState(0)
    w = lambda *s: jnp.asarray(rng.randn(*s).astype(np.float32))
    return {
        "blocks": {
            "attn": {"q_proj": w(16, 2, 8)},
            "norm": jnp.ones(16, jnp.bfloat16),
            "moe": {"router": {"gate_proj": w(16, 4)}},
        },
        "layers": [{"up_proj": w(16, 4)}],
    }


def test_quantize_fp8_by_path_and_tree_bytes_by_hand():
    params = _hand_tree()
    q = quant.quantize_fp8(params, keep_dtype="float32")
    assert isinstance(q["blocks"]["attn"]["q_proj"], quant.Fp8Tensor)
    assert isinstance(q["layers"][0]["up_proj"], quant.Fp8Tensor)  # leaf under a list index
    router = q["blocks"]["moe"]["router"]["gate_proj"]  # named like a matmul, but the router's
    assert not isinstance(router, quant.Fp8Tensor) and router.dtype == jnp.float32
    # Bytes: q_proj 256 fp8 values + 16 f32 channel scales = 320; up_proj 64 + 4 * 4 = 80;
    # router 64 f32 = 256; norm 16 bf16 (kept as float32 here: 64). Unquantized: 256 * 4 = 1024,
    # 64 * 4 = 256, 256, 32.
    assert quant.tree_bytes(q) == 320 + 80 + 256 + 64
    assert quant.tree_bytes(q, only_quantized_paths=True) == 320 + 80 + 256
    assert quant.tree_bytes(params) == 1024 + 256 + 256 + 32
    assert quant.tree_bytes(params, only_quantized_paths=True) == 1024 + 256 + 256
    # A router at another depth stays unquantized too; a leaf directly in a list is counted.
    shallow = quant.quantize_fp8({"moe": {"router": {"up_proj": jnp.ones((4, 2))}}})
    assert not isinstance(shallow["moe"]["router"]["up_proj"], quant.Fp8Tensor)
    assert quant.tree_bytes({"stack": [jnp.ones(3), jnp.ones(2, jnp.bfloat16)]}) == 12 + 4


def test_default_block_size_is_128():
    # 129 rows: two row blocks of 128 (one of 129 would give one).
    w = jnp.ones((129, 8))
    q = quant.quantize_fp8({"up_proj": w}, granularity="block")["up_proj"]
    assert q.block == 128 and q.scales.shape == (2, 1)


def test_dequantize_tree():
    params = _hand_tree()
    q = quant.quantize_fp8(params)
    dq = quant.dequantize(q, "float32")
    want = jax.tree.map(
        lambda x: x.astype(jnp.float32), q, is_leaf=lambda x: isinstance(x, quant.Fp8Tensor)
    )
    chex.assert_trees_all_equal(dq, want)
    assert dq["blocks"]["attn"]["q_proj"].dtype == jnp.float32
    # Default dtype bfloat16, every leaf a plain array.
    for leaf in jax.tree.leaves(quant.dequantize(q)):
        assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.bfloat16


def test_quantize_tensor_defaults_errors_and_bf16_input():
    # Default block_size 128 (129 rows -> 2 row blocks); a channel tensor records block 0.
    q = quant.quantize_tensor(
        jnp.ones((129, 8)), num_in_axes=1, num_out_axes=1, granularity="block"
    )
    assert q.block == 128 and q.scales.shape == (2, 1)
    q = quant.quantize_tensor(
        jnp.ones((4, 8)), num_in_axes=1, num_out_axes=1, granularity="channel"
    )
    assert q.block == 0
    # block_size is only checked (and only used) for granularity="block".
    quant.quantize_tensor(
        jnp.ones((4, 8)), num_in_axes=1, num_out_axes=1, granularity="channel", block_size=0
    )
    with raises_invalid("block_size"):
        quant.quantize_tensor(
            jnp.ones((4, 8)), num_in_axes=1, num_out_axes=1, granularity="block", block_size=0
        )
    with raises_invalid("granularity"):
        quant.quantize_tensor(jnp.ones((4, 8)), num_in_axes=1, num_out_axes=1, granularity="tensor")
    # A bfloat16 weight is quantized from its float32 value: scales = absmax / 448 in float32
    # (bf16 arithmetic would round the scale to 8 bits).
    w = jnp.asarray(_spread_weight((40, 24), -2.0, 2.0), jnp.bfloat16)
    for granularity, block in (("channel", 0), ("block", 16)):
        q = quant.quantize_tensor(
            w, num_in_axes=1, num_out_axes=1, granularity=granularity, block_size=16
        )
        assert q.scales.dtype == jnp.float32
        _assert_matches_reference(q, w, num_in_axes=1, num_out_axes=1, block=block)
