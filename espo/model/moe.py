"""The MoE block: router, routing modes (free / replay), and the block that dispatches its
routed tokens to the experts (`espo.model.experts`: dropless, per backend, expert-parallel).

The block returns its routing decisions as values, `(out, MoeExtras)`, and the layer scan stacks
them into a `RouterTrace`; nothing is computed and then dropped, nothing is `sow`n.

`moe_reference` is the plain per-expert loop that the tests hold every dispatch path against.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from espo import quant
from espo.model import config as config_lib
from espo.model import experts, layers

RoutingMode = config_lib.RoutingMode
# What a replayed forward does with a real token whose recorded expert id is -1 (see `forward`).
REPLAY_MISSING = ("error", "free")


@flax.struct.dataclass
class MoeExtras:
    """Per-layer routing output of one MoE block (tokens flattened to M = B*T)."""

    expert_ids: Int[Array, "M K"]
    expert_weights: Float[Array, "M K"]
    load_balancing_loss: Float[Array, " "]
    z_loss: Float[Array, " "]
    expert_load: Float[Array, " E"]  # fraction of (valid) assignments per expert
    unrecorded: Bool[Array, " M"]  # real tokens replayed with a -1 id (always False when FREE)
    expert_parallel: Int[Array, " 2"]  # 1 at the path taken (experts.EP_PATHS), or 0s
    router_ids: Int[Array, "M K"]  # the router's own top-k (= expert_ids unless replayed)


def unrecorded_routes(
    replay_ids: Int[Array, "M K"], token_mask: Float[Array, " M"]
) -> Bool[Array, " M"]:
    """Real (token_mask > 0) tokens with at least one unrecorded (-1) replayed expert."""
    return (token_mask > 0) & jnp.any(replay_ids < 0, axis=-1)


def route(
    router_logits: Float[Array, "M E"],
    *,
    top_k: int,
    norm_topk_prob: bool,
    mode: RoutingMode,
    replay_ids: Int[Array, "M K"] | None = None,
    replay_weights: Float[Array, "M K"] | None = None,
    free_mask: Bool[Array, " M"] | None = None,
) -> tuple[Int[Array, "M K"], Float[Array, "M K"]]:
    """Chosen experts and gate weights, float32, in Qwen3-MoE / Mixtral semantics.

    Gates are the softmax over *all* experts (float32) gathered at the chosen ids, renormalised
    to sum to one when `norm_topk_prob`: p = softmax(logits), w_k = p[id_k] / sum_j p[id_j]
    (HF `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`). Under REPLAY_IDS that gather
    happens at the replayed ids from the live logits, so it equals a softmax restricted to the
    replayed experts and the router gets gradient; ids of -1 get weight exactly zero (selected
    with `where`, whatever the replayed weight holds).

    free_mask: rows that take the router's own top-k and gates whatever the replay says (the
      `replay_missing="free"` fallback for real tokens with unrecorded ids). Replacing the whole
      row, not only its -1 slots, keeps the K experts of a token distinct.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [M, E]
    free_weights, free_ids = jax.lax.top_k(probs, top_k)  # [M, K]
    free_ids = free_ids.astype(jnp.int32)
    if norm_topk_prob:
        free_weights = _renormalise(free_weights)  # [M, K]
    if mode is RoutingMode.FREE:
        return free_ids, free_weights
    if replay_ids is None:
        raise ValueError(f"routing_mode={mode.name} needs `routing` (a RouterTrace)")
    ids = jax.lax.stop_gradient(replay_ids).astype(jnp.int32)  # [M, K]
    valid = ids >= 0  # [M, K]
    if mode is RoutingMode.REPLAY_IDS_AND_WEIGHTS:
        given = jax.lax.stop_gradient(replay_weights).astype(jnp.float32)  # [M, K]
        weights = jnp.where(valid, given, 0.0)  # [M, K]
    else:
        gathered = jnp.take_along_axis(probs, jnp.maximum(ids, 0), axis=-1)  # [M, K]
        weights = jnp.where(valid, gathered, 0.0)  # [M, K]
        if norm_topk_prob:
            weights = _renormalise(weights)  # the zero weight of -1 ids stays zero
    if free_mask is not None:
        ids = jnp.where(free_mask[:, None], free_ids, ids)  # [M, K]
        weights = jnp.where(free_mask[:, None], free_weights, weights)  # [M, K]
    return ids, weights


def own_top_k(router_logits: Float[Array, "M E"], top_k: int) -> Int[Array, "M K"]:
    """The experts the router would choose itself: `route`'s free top-k (of the float32
    softmax, so ties break as routing does)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [M, E]
    return jax.lax.top_k(probs, top_k)[1].astype(jnp.int32)


def _renormalise(weights: Float[Array, "M K"]) -> Float[Array, "M K"]:
    return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)


def moe_reference(
    x: Float[Array, "M D"],
    ids: Int[Array, "M K"],
    weights: Float[Array, "M K"],
    w_gate: Float[Array, "E D F"],
    w_up: Float[Array, "E D F"],
    w_down: Float[Array, "E F D"],
) -> Float[Array, "M D"]:
    """The plain loop: every expert on every token, combined with its routing weight."""
    out = jnp.zeros_like(x)
    for e in range(w_gate.shape[0]):
        combine = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)  # [M]
        h = experts.swiglu_rows(x @ w_gate[e], x @ w_up[e]) @ w_down[e]  # [M, D]
        out = out + combine[:, None].astype(x.dtype) * h
    return out


def router_losses(
    router_logits: Float[Array, "M E"],
    ids: Int[Array, "M K"],
    token_mask: Float[Array, " M"],
) -> tuple[Float[Array, " "], Float[Array, " "], Float[Array, " E"]]:
    """Load-balancing loss, router z-loss and expert load over the real (unmasked) tokens.

    Load balancing follows Hugging Face's `load_balancing_loss_func` for one layer:
    E * sum_e f_e * P_e with f_e = assignments to e per token and P_e = mean router probability,
    so a perfectly balanced router scores K. z-loss = mean logsumexp(logits)^2 (ST-MoE).
    Both means run over the real tokens (token_mask > 0) only; padded rows may hold any value.
    """
    E = router_logits.shape[-1]
    real = token_mask > 0  # [M]
    # Select before any arithmetic: padding may hold anything (inf, NaN) and must reach neither
    # the value nor the gradient (0 * inf would be NaN).
    logits = jnp.where(real[:, None], router_logits.astype(jnp.float32), 0.0)  # [M, E]
    num_tokens = jnp.maximum(jnp.sum(real), 1).astype(jnp.float32)
    probs = jnp.where(real[:, None], jax.nn.softmax(logits, axis=-1), 0.0)  # [M, E]
    one_hot = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32), axis=1)  # [M, E]; -1 -> zeros
    assignments = jnp.sum(jnp.where(real[:, None], one_hot, 0.0), axis=0)  # [E]
    tokens_per_expert = assignments / num_tokens  # [E], f_e
    prob_per_expert = jnp.sum(probs, axis=0) / num_tokens  # [E], P_e over real tokens only
    lb_loss = E * jnp.sum(tokens_per_expert * prob_per_expert)
    z = jax.nn.logsumexp(logits, axis=-1)  # [M]
    z_loss = jnp.sum(jnp.where(real, z * z, 0.0)) / num_tokens
    load = assignments / jnp.maximum(jnp.sum(assignments), 1.0)  # [E]
    return lb_loss, z_loss, load


class MoeBlock(nn.Module):
    """Router + routed SwiGLU experts (+ optional shared expert)."""

    cfg: config_lib.ModelConfig
    mode: RoutingMode = RoutingMode.FREE
    impl: str = "auto"
    replay_missing: str = "error"  # "free": real tokens with unrecorded ids route freely

    @nn.compact
    def __call__(
        self,
        x: Float[Array, "B T D"],
        *,
        token_mask: Float[Array, "B T"],
        replay_ids: Int[Array, "B T K"] | None,
        replay_weights: Float[Array, "B T K"] | None,
    ) -> tuple[Float[Array, "B T D"], MoeExtras]:
        cfg = self.cfg
        D, E, F, K = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim, cfg.top_k
        pd, dt = cfg.jnp_param_dtype, cfg.jnp_dtype
        init_d, init_f = layers._dense_init(D), layers._dense_init(F)
        w_router = self.param("router", init_d, (D, E), pd)
        w_gate = self.param("gate_proj", init_d, (E, D, F), pd)
        w_up = self.param("up_proj", init_d, (E, D, F), pd)
        w_down = self.param("down_proj", init_f, (E, F, D), pd)

        B, T = x.shape[:2]
        xf = x.reshape(B * T, D)  # [M, D]
        # Router logits in float32 whatever the compute dtype: routing decisions are sensitive.
        logits = xf.astype(jnp.float32) @ w_router.astype(jnp.float32)  # [M, E]
        flat = lambda a: None if a is None else a.reshape(B * T, K)
        flat_mask = token_mask.reshape(B * T)  # [M]
        if self.mode is RoutingMode.FREE or replay_ids is None:
            unrecorded = jnp.zeros((B * T,), bool)  # [M]
        else:
            unrecorded = unrecorded_routes(flat(replay_ids), flat_mask)  # [M]
        ids, weights = route(
            logits,
            top_k=K,
            norm_topk_prob=cfg.norm_topk_prob,
            mode=self.mode,
            replay_ids=flat(replay_ids),
            replay_weights=flat(replay_weights),
            free_mask=unrecorded if self.replay_missing == "free" else None,
        )  # [M, K] each
        out, ep_path = experts.dispatch_in_chunks(
            x,
            ids.reshape(B, T, K),
            weights.astype(dt).reshape(B, T, K),
            # w.astype(dt), or an FP8 weight's values and scales (quant.ScaledWeight)
            quant.compute_weight(w_gate, dt),
            quant.compute_weight(w_up, dt),
            quant.compute_weight(w_down, dt),
            chunk=cfg.moe_chunk,
            impl=self.impl,
            axes=cfg.expert_axes,
        )
        out = out.reshape(B * T, D)  # [M, D]
        if cfg.shared_expert_ffn_dim:
            shared = layers.SwiGLU(cfg, cfg.shared_expert_ffn_dim, name="shared_expert")(xf)
            if cfg.shared_expert_gate:
                w_sg = self.param("shared_expert_gate", init_d, (D, 1), pd)
                shared = jax.nn.sigmoid(xf @ w_sg.astype(dt)) * shared  # [M, D]
            out = out + shared
        lb_loss, z_loss, load = router_losses(logits, ids, flat_mask)
        extras = MoeExtras(
            expert_ids=ids,
            expert_weights=weights,
            load_balancing_loss=lb_loss,
            z_loss=z_loss,
            expert_load=load,
            unrecorded=unrecorded,
            expert_parallel=ep_path,
            router_ids=ids if self.mode is RoutingMode.FREE else own_top_k(logits, K),
        )
        return out.reshape(B, T, D), extras
