"""`ModelConfig`: the frozen, validated description of a decoder-only MoE transformer.

Covers Qwen3-MoE and Mixtral (and Qwen2-MoE-style shared experts). Every invalid value raises a
`ValueError` naming the field, the value and the valid range, at construction time, so that no
shape error surfaces deep inside a jitted forward.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp

from espo import errors

_DTYPES = ("float32", "bfloat16", "float16")

ATTENTION_IMPLS = ("auto", "dense", "blocked", "triton", "splash")  # espo.model.attention
# (Not "dots_saveable": it also saves the blocked attention's per-tile logits, stacked over
# every tile: quadratic in T. "dots_with_no_batch_dims_saveable" skips those batched dots.)
REMAT_POLICIES = ("none", "full", "dots_with_no_batch_dims_saveable")
# The fields that say how to compute, not what the model is: a run's config sets them on a
# Hugging Face checkpoint's architecture too (espo.trainer.initial_model).
COMPUTE_FIELDS = ("attention_impl", "moe_impl", "remat", "logits_chunk", "moe_chunk")
# espo.model.experts.expert_ffn's paths (`experts.DISPATCH_IMPLS`)
MOE_IMPLS = ("auto", "ragged", "capacity", "blocked", "mosaic_gpu", "triton", "megablox")
LOGITS_CHUNK_ELEMENTS = 2**26  # float32 logits of one chunk when logits_chunk is 0 (256 MiB)

DTypeLike = Any  # a dtype name ("bfloat16"), a scalar type (jnp.bfloat16, np.float32), a np.dtype


def dtype_name(value: DTypeLike, *, field: str = "dtype") -> str:
    """The canonical name ("float32", "bfloat16", "float16") of a dtype given in any spelling.

    Accepts names and anything `jnp.dtype` understands (jnp.bfloat16, np.float32,
    jnp.dtype("bfloat16"), ml_dtypes.bfloat16); raises ValueError naming `field`, the value and
    the valid dtypes otherwise (None, float64, unknown names).
    """
    try:
        name = None if value is None or isinstance(value, bool) else jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        where, _, name = field.rpartition(".")  # "ModelConfig.dtype" or "dtype"
        raise errors.InvalidValue(where, name, value, f"one of {_DTYPES} (a name or a dtype)")
    return name


class RoutingMode(enum.Enum):
    """How a forward pass chooses experts (a static argument of `forward`).

    FREE: the router's own top-k.
    REPLAY_IDS: the experts given in `routing.expert_ids`; gate weights are recomputed with the
      model's own gating (softmax over all experts, gathered at the given ids, renormalised when
      the model renormalises), so the router keeps its gradient. Ids of -1 get zero weight;
      on a real (unmasked) token in a MoE layer they are an error, or route freely, as
      `forward(..., replay_missing=)` says: never silently.
    REPLAY_IDS_AND_WEIGHTS: ids and gate weights exactly as given; no gradient reaches the router
      through the gates.
    """

    FREE = "free"
    REPLAY_IDS = "replay_ids"
    REPLAY_IDS_AND_WEIGHTS = "replay_ids_and_weights"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a MoE decoder. Field names follow the shape letters of STYLE.md."""

    vocab_size: int  # V
    d_model: int  # D, residual width
    num_layers: int  # L
    num_heads: int  # H, query heads
    num_kv_heads: int  # N, key/value heads (GQA when N < H)
    head_dim: int  # per-head width
    num_experts: int  # E, routed experts per MoE layer
    top_k: int  # K, experts per token
    moe_ffn_dim: int  # F, hidden width of one routed expert
    dense_layers: tuple[int, ...] = ()  # layers with a dense SwiGLU MLP instead of a MoE block
    dense_ffn_dim: int = 0  # hidden width of the dense MLP (required when dense_layers is set)
    shared_expert_ffn_dim: int = 0  # width of an always-on shared expert; 0 disables it
    shared_expert_gate: bool = True  # sigmoid gate on the shared expert (Qwen2-MoE style)
    rms_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3) before RoPE
    norm_topk_prob: bool = True  # renormalise the top-k gate weights to sum to one
    tie_embeddings: bool = False  # output projection shares the input embedding
    sliding_window: int | None = None  # attend to at most this many previous positions
    # Dtypes: any spelling `dtype_name` accepts ("bfloat16", jnp.bfloat16, np.float32,
    # jnp.dtype("float16")); stored as the canonical name, so configs compare and hash by value.
    param_dtype: str = "float32"  # storage dtype of the parameters
    dtype: str = "float32"  # compute dtype of activations and matmuls
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss in `aux.total`
    z_loss_coef: float = 0.0  # weight of the router z-loss in `aux.total`
    # How long sequences are computed (no effect on values beyond float rounding):
    # attention over a whole sequence (espo.model.attention): "auto" (by backend and length),
    # "dense" (the [B, N, T, G, S] logits at once), "blocked" (flash in XLA, memory linear in
    # T), "triton" (JAX's Pallas GPU flash kernel) or "splash" (JAX's TPU splash attention)
    attention_impl: str = "auto"
    # the MoE blocks' grouped matmuls (`MOE_IMPLS`, espo.model.experts): "auto"
    # (`experts.default_impl`: by backend and rows), or one path for every forward, the
    # sampler's and the update's
    moe_impl: str = "auto"
    # rematerialisation of each layer in the backward (`REMAT_POLICIES`): "none" keeps every
    # layer's activations, "full" only each layer's input (the long-trace setting: least memory,
    # bench_memory.py), "dots_with_no_batch_dims_saveable" also the unbatched matmul outputs
    remat: str = "none"
    # tokens per chunk of the head's log-probs and entropies (`train_step.token_logps`): the
    # [tokens, V] float32 logits exist one chunk at a time; 0: as many as keep one chunk's
    # logits at LOGITS_CHUNK_ELEMENTS
    logits_chunk: int = 0
    # tokens of each row per chunk of the MoE blocks' dispatch (`experts.dispatch_in_chunks`): the
    # per-(token, expert) buffers exist one chunk at a time, each recomputed in the backward;
    # 0: the whole rows at once
    moe_chunk: int = 0
    # the mesh axes the experts are split over in the MoE blocks' expert parallelism
    # (`experts.expert_parallel_dispatch`): ("expert",) as trained; the rollout's "experts_all"
    # layout (`sharding.EXPERT_AXES`) splits them over every axis of the mesh
    expert_axes: tuple[str, ...] = ("expert",)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
            errors.require(
                self,
                isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                name,
                ">= 1",
            )
        for name in ("head_dim", "num_experts", "top_k", "moe_ffn_dim"):
            errors.require(
                self,
                isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                name,
                ">= 1",
            )
        errors.require(
            self,
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads={self.num_heads}",
        )
        errors.require(
            self, self.head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs)"
        )
        errors.require(
            self,
            self.top_k <= self.num_experts,
            "top_k",
            f"must be in [1, num_experts={self.num_experts}]",
        )
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        errors.require(
            self,
            all(0 <= i < self.num_layers for i in self.dense_layers),
            "dense_layers",
            f"layer indices must be in [0, num_layers={self.num_layers})",
        )
        errors.require(
            self,
            not self.dense_layers or self.dense_ffn_dim >= 1,
            "dense_ffn_dim",
            ">= 1 when dense_layers is non-empty",
        )
        errors.require(
            self, self.shared_expert_ffn_dim >= 0, "shared_expert_ffn_dim", ">= 0 (0 disables it)"
        )
        errors.require(self, self.rms_eps > 0, "rms_eps", "> 0")
        errors.require(self, self.rope_theta > 0, "rope_theta", "> 0")
        errors.require(
            self,
            self.sliding_window is None or self.sliding_window >= 1,
            "sliding_window",
            "None or >= 1",
        )
        for name in ("param_dtype", "dtype"):
            object.__setattr__(
                self, name, dtype_name(getattr(self, name), field=f"ModelConfig.{name}")
            )
        errors.require(
            self,
            self.attention_impl in ATTENTION_IMPLS,
            "attention_impl",
            f"one of {ATTENTION_IMPLS}",
        )
        errors.require(self, self.moe_impl in MOE_IMPLS, "moe_impl", f"one of {MOE_IMPLS}")
        errors.require(self, self.remat in REMAT_POLICIES, "remat", f"one of {REMAT_POLICIES}")
        errors.require(
            self,
            isinstance(self.logits_chunk, int) and self.logits_chunk >= 0,
            "logits_chunk",
            ">= 0 (0: sized from the vocabulary)",
        )
        errors.require(
            self,
            isinstance(self.moe_chunk, int) and self.moe_chunk >= 0,
            "moe_chunk",
            ">= 0 (0: whole rows)",
        )
        axes = self.expert_axes
        object.__setattr__(self, "expert_axes", (axes,) if isinstance(axes, str) else tuple(axes))
        errors.require(
            self,
            len(self.expert_axes) >= 1
            and len(set(self.expert_axes)) == len(self.expert_axes)
            and all(isinstance(a, str) for a in self.expert_axes),
            "expert_axes",
            'distinct mesh axis names, e.g. ("expert",)',
        )
        errors.require(self, self.aux_loss_coef >= 0, "aux_loss_coef", ">= 0")
        errors.require(self, self.z_loss_coef >= 0, "z_loss_coef", ">= 0")

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def layer_runs(self) -> tuple[tuple[bool, int, int], ...]:
        """Maximal runs of consecutive layers of one kind, as (is_moe, start, length).

        Each run is one `nn.scan`, so compile time grows with the number of runs (1 for an all-MoE
        model, 2 for DeepSeek-style leading dense layers), not with depth.
        """
        runs: list[tuple[bool, int, int]] = []
        for i in range(self.num_layers):
            kind = self.is_moe_layer(i)
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((kind, i, 1))
        return tuple(runs)

    @property
    def logits_chunk_tokens(self) -> int:
        """Tokens per chunk of the head's log-probs (`logits_chunk`, or sized from V)."""
        return self.logits_chunk or max(1, LOGITS_CHUNK_ELEMENTS // self.vocab_size)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- presets ------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """A few-hundred-kilobyte MoE used by tests, demos and CPU runs."""
        base = dict(
            vocab_size=256,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            num_experts=8,
            top_k=2,
            moe_ffn_dim=64,
            qk_norm=True,
            rope_theta=10000.0,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> ModelConfig:
        """Qwen3-30B-A3B's architecture (48 layers, 128 experts, top-8)."""
        widths = dict(d_model=2048, num_layers=48, num_heads=32, moe_ffn_dim=768)
        return cls(**{**_QWEN3_MOE, **widths, **overrides})

    @classmethod
    def qwen3_235b_a22b(cls, **overrides) -> ModelConfig:
        """Qwen3-235B-A22B's architecture (94 layers, 128 experts, top-8; its config.json)."""
        widths = dict(d_model=4096, num_layers=94, num_heads=64, moe_ffn_dim=1536)
        return cls(**{**_QWEN3_MOE, **widths, **overrides})


# What the Qwen3-MoE checkpoints share (their config.json): vocabulary, 4 kv heads of 128, 128
# experts top-8, q/k norms, RoPE base 1e6, bf16, router aux loss 0.001.
_QWEN3_MOE = dict(
    vocab_size=151936,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    top_k=8,
    qk_norm=True,
    norm_topk_prob=True,
    rope_theta=1_000_000.0,
    rms_eps=1e-6,
    param_dtype="bfloat16",
    dtype="bfloat16",
    aux_loss_coef=0.001,
)
