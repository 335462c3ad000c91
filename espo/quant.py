"""FP8 (e4m3fn) weight quantization for the rollout copy of the parameters.

`quantize_fp8(params)` replaces every large matmul weight (attention q/k/v/o projections, routed
and shared expert SwiGLU weights, dense MLP weights) by an `Fp8Tensor`: float8_e4m3fn values plus
float32 scales, per output channel or per (block x block) tile of the [in, out] view. Everything
else stays in `keep_dtype` (bfloat16 by default): embeddings and the LM head (they set the sampled
log-probs directly), norms, and the router (routing decisions are the most precision-sensitive
part of a MoE; router replay exists because they flip).

The model reads every weight through `compute_weight(w, dtype)`: a dense weight, or one with
per-block scales, as `w.astype(dtype)` (`Fp8Tensor.astype` dequantizes); a per-channel FP8 weight
as a `ScaledWeight`, its values converted to `dtype` and its scales applied to the matmul's
output (`project`; the MoE's ragged path per row), so XLA:GPU converts the values inside the
GEMM instead of writing a dequantized copy first. Quantized params thus go through
`espo.model.forward` and the sampler transparently. FP8 x FP8 GEMMs (cuBLASLt on Hopper, FP8
activations) were slower at decode rows on an H100 and are not used (docs/gpu/README.md).

Casting saturates: values are clipped to +-448 before the cast, because a plain cast to e4m3fn
turns overflow into NaN.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from espo import errors

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
GRANULARITIES = ("channel", "block")

# Leaf name -> (number of leading "in" axes after the stacked axes, number of "out" axes).
_MATMUL_AXES = {
    "q_proj": (1, 2),  # [.., D, H, Dh]
    "k_proj": (1, 2),  # [.., D, N, Dh]
    "v_proj": (1, 2),
    "o_proj": (2, 1),  # [.., H, Dh, D]
    "gate_proj": (1, 1),  # [.., (E,) D, F]
    "up_proj": (1, 1),
    "down_proj": (1, 1),  # [.., (E,) F, D]
}


@flax.struct.dataclass
class Fp8Tensor:
    """An FP8 weight: `values` in the original shape, `scales` [*lead, in_blocks, out_blocks]."""

    values: jax.Array
    scales: jax.Array
    num_in_axes: int = flax.struct.field(pytree_node=False)
    num_out_axes: int = flax.struct.field(pytree_node=False)
    block: int = flax.struct.field(pytree_node=False)  # 0 = per output channel

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def astype(self, dtype) -> jax.Array:
        """The dequantized weight: values * scales in float32, then cast to `dtype`."""
        lead, rows, cols = _canonical_shape(self.shape, self.num_in_axes, self.num_out_axes)
        v = self.values.reshape(*lead, rows, cols).astype(jnp.float32)
        s = _expand_scales(self.scales, self.block, rows=rows, cols=cols)
        return (v * s).astype(dtype).reshape(self.shape)


def _expand_scales(scales, block: int, *, rows: int, cols: int):
    """Per-block scales [*lead, nr, nc] repeated to [*lead, rows, cols]; channel ones as is."""
    if not block:
        return scales
    full = jnp.repeat(jnp.repeat(scales, block, axis=-2), block, axis=-1)
    return full[..., :rows, :cols]


def _canonical_shape(shape, num_in, num_out):
    lead = shape[: len(shape) - num_in - num_out]
    rows = math.prod(shape[len(lead) : len(lead) + num_in])
    cols = math.prod(shape[len(shape) - num_out :])
    return lead, rows, cols


def quantize_tensor(
    w: jax.Array, *, num_in_axes: int, num_out_axes: int, granularity: str, block_size: int = 128
) -> Fp8Tensor:
    """Quantize one weight to FP8 with per-channel or per-block absmax scales."""
    if granularity not in GRANULARITIES:
        raise errors.InvalidValue("", "granularity", granularity, f"{GRANULARITIES}")
    if granularity == "block" and block_size < 1:
        raise errors.InvalidValue("", "block_size", block_size, ">= 1")
    lead, rows, cols = _canonical_shape(w.shape, num_in_axes, num_out_axes)
    x = jnp.asarray(w, jnp.float32).reshape(*lead, rows, cols)
    if granularity == "channel":
        amax = jnp.max(jnp.abs(x), axis=-2, keepdims=True)  # [*lead, 1, cols]
        block = 0
    else:
        block = block_size
        nr, nc = -(-rows // block), -(-cols // block)
        pad = [(0, 0)] * len(lead) + [(0, nr * block - rows), (0, nc * block - cols)]
        tiles = jnp.pad(jnp.abs(x), pad).reshape(*lead, nr, block, nc, block)
        amax = jnp.max(tiles, axis=(-3, -1))  # [*lead, nr, nc]
    # An all-zero channel / block gets scale 1. A tiny one (amax < 448 * 2^-126) gets float32's
    # smallest normal: amax / 448 would be subnormal, flushed to 0 on CPU, and 0 / 0 = NaN.
    tiny = jnp.finfo(jnp.float32).tiny
    scales = jnp.where(amax > 0, jnp.maximum(amax / FP8_MAX, tiny), 1.0)
    full = _expand_scales(scales, block, rows=rows, cols=cols)
    values = jnp.clip(x / full, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE).reshape(w.shape)
    return Fp8Tensor(
        values=values,
        scales=scales.astype(jnp.float32),
        num_in_axes=num_in_axes,
        num_out_axes=num_out_axes,
        block=block,
    )


def quantize_fp8(
    params: dict,
    *,
    granularity: str = "channel",
    block_size: int = 128,
    keep_dtype: str = "bfloat16",
) -> dict:
    """A copy of `params` with every large matmul weight as an `Fp8Tensor` (see module doc)."""

    def convert(path, leaf):
        names = [getattr(k, "key", str(k)) for k in path]
        axes = _MATMUL_AXES.get(names[-1])
        if axes is None or names[-2:-1] == ["router"]:
            return jnp.asarray(leaf, keep_dtype)
        return quantize_tensor(
            leaf,
            num_in_axes=axes[0],
            num_out_axes=axes[1],
            granularity=granularity,
            block_size=block_size,
        )

    return jax.tree_util.tree_map_with_path(convert, params)


@flax.struct.dataclass
class ScaledWeight:
    """A per-output-channel FP8 weight as the matmul reads it: `values` (the FP8 values as
    stored; `operand()` converts them to the compute dtype `dtype`, a plain convert that XLA:GPU
    fuses into the GEMM's operand load, and a kernel may read them as FP8 and convert in
    registers) and the float32 `scale` [*lead, *out] applied to the product's output.
    Multiplying the scales in first writes a dequantized copy of every weight before each
    matmul (on an H100, M=8 rows times 8 [2048, 8192] weights, `bench_moe.py --only fp8`: 16
    copies and 0.40x bf16's time, against no copy and 0.93x with the scale after the dot;
    0.47x / 1.13x at M=64). The product is exact in the values (e4m3 is exact in bf16) with
    float32 accumulation."""

    values: jax.Array
    scale: jax.Array
    num_out_axes: int = flax.struct.field(pytree_node=False)
    compute_dtype: str = flax.struct.field(pytree_node=False, default="bfloat16")

    shape = property(lambda self: self.values.shape)
    dtype = property(lambda self: jnp.dtype(self.compute_dtype))

    def operand(self) -> jax.Array:
        """The values in the compute dtype (exact: e4m3 values are exact in bf16)."""
        return self.values.astype(self.dtype)

    def dense(self) -> jax.Array:
        """values * scale as one weight in the compute dtype (paths with no scaled form)."""
        lead = self.scale.ndim - self.num_out_axes
        n_in = self.values.ndim - lead - self.num_out_axes
        scale = self.scale.reshape(*self.scale.shape[:lead], *(1,) * n_in, *self.scale.shape[lead:])
        return (self.values.astype(jnp.float32) * scale).astype(self.dtype)


def compute_weight(w, dtype):
    """`w` as a matmul reads it: a `ScaledWeight` for an FP8 weight with per-channel scales,
    else `w.astype(dtype)` (dense weights, per-block scales: those vary along the contraction)."""
    if isinstance(w, Fp8Tensor) and not w.block:
        lead, _, _ = _canonical_shape(w.values.shape, w.num_in_axes, w.num_out_axes)
        out = w.values.shape[w.values.ndim - w.num_out_axes :]
        return ScaledWeight(
            values=w.values,
            scale=w.scales.reshape(*lead, *out),
            num_out_axes=w.num_out_axes,
            compute_dtype=jnp.dtype(dtype).name,
        )
    return w.astype(dtype)


def project(equation: str, x: jax.Array, w, dtype) -> jax.Array:
    """`jnp.einsum(equation, x, w.astype(dtype))` for a weight whose output axes end the
    product's: an FP8 weight multiplies as its values, then its scales (`ScaledWeight`)."""
    w = compute_weight(w, dtype)
    if not isinstance(w, ScaledWeight):
        return jnp.einsum(equation, x, w)
    y = jnp.einsum(equation, x, w.operand(), preferred_element_type=jnp.float32)
    return (y * w.scale).astype(dtype)


def dequantize(params: dict, dtype="bfloat16") -> dict:
    """Every `Fp8Tensor` as a plain `dtype` array (other leaves cast to `dtype`)."""
    is_q = lambda x: isinstance(x, Fp8Tensor)
    return jax.tree.map(lambda x: x.astype(dtype), params, is_leaf=is_q)


def tree_bytes(params: dict, *, only_quantized_paths: bool = False) -> int:
    """Bytes of a param tree; with `only_quantized_paths`, of the matmul weights alone."""
    total = 0
    is_q = lambda x: isinstance(x, Fp8Tensor)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]:
        name = getattr(path[-1], "key", str(path[-1]))
        if only_quantized_paths and name not in _MATMUL_AXES:
            continue
        total += leaf.nbytes if is_q(leaf) else int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    return total
