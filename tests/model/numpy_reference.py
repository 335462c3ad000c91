"""An independent float64 NumPy reference of the espo MoE decoder forward (tests only).

Written from the formulas, token by token and head by head, sharing no code with `espo.model`:
it reads only the parameter tree's layout (`blocks_{run}` stacks, see `ModelConfig.layer_runs`).
Semantics are those of Hugging Face's Qwen3-MoE / Mixtral / Qwen2-MoE decoders:

  RMSNorm       y = x / sqrt(mean(x^2) + eps) * scale                       (Zhang & Sennrich 2019)
  RoPE          rotate-half: [x1 cos - x2 sin, x2 cos + x1 sin], angle = pos * theta^(-2i/Dh)
  attention     softmax(q k^T / sqrt(Dh)) v per query head h, kv head h // (H / N) (GQA);
                key j visible to query i iff j is real, pos_j <= pos_i, pos_i - pos_j < window
  q/k norm      RMSNorm over each head's Dh features, before RoPE (Qwen3)
  router        p = softmax(h W_r) over all E experts; ids = top-K of p; w_k = p[id_k],
                divided by sum_k p[id_k] when norm_topk_prob (Qwen3 / Mixtral)
  experts       expert_e(h) = (silu(h W_g) * (h W_u)) W_d;  moe(h) = sum_k w_k expert_{id_k}(h)
  shared expert moe(h) += sigmoid(h w_sg) * swiglu_shared(h)      (Qwen2-MoE; no sigmoid if off)
  dense layers  swiglu(h) instead of the MoE block (Qwen3 mlp_only_layers)
  layer         x += attn(norm1(x)); x += mlp(norm2(x)); logits = norm_f(x) W_out (or embed^T)
  replay        ids given; REPLAY_IDS: w_k = p[id_k] (0 for id -1), renormalised as above;
                REPLAY_IDS_AND_WEIGHTS: w given (0 for id -1); "free": real tokens with any -1
                id take the free top-K instead
  router losses over real tokens only (n = number of real tokens), per MoE layer, then averaged:
                lb = E * sum_e (assignments to e / n) * (sum_t p_te / n);  z = sum_t lse_t^2 / n
                total = aux_loss_coef * lb + z_loss_coef * z

Padding positions (attention_mask False) get arbitrary outputs; compare real positions only.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Reference:
    logits: np.ndarray  # [B, T, V]
    expert_ids: np.ndarray  # [B, L, T, K], -1 for dense layers and padding
    expert_weights: np.ndarray  # [B, L, T, K]
    load_balancing_loss: float  # mean over MoE layers
    z_loss: float
    total: float
    num_unrecorded_routes: int


def _f64(tree):
    if isinstance(tree, dict):
        return {k: _f64(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """x: [Dh] of one head at position `pos`."""
    half = x.shape[-1] // 2
    angle = pos * theta ** (-2.0 * np.arange(half) / x.shape[-1])
    x1, x2 = x[:half], x[half:]
    return np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)]
    )


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(h, w_gate, w_up, w_down):
    return (silu(h @ w_gate) * (h @ w_up)) @ w_down


def _take(tree, j):
    return {k: _take(v, j) for k, v in tree.items()} if isinstance(tree, dict) else tree[j]


def _layer_params(cfg, params, layer):
    """The parameters of model layer `layer` (unstacked from its run)."""
    for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
        if start <= layer < start + length:
            return is_moe, _take(params[f"blocks_{r}"], layer - start)
    raise AssertionError(layer)


def attention(cfg, p, h, positions, real):
    """h: [T, D] one row; positions: [T]; real: [T] bool. Returns [T, D]."""
    T = h.shape[0]
    H, N, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = np.zeros((T, H, Dh))
    q_all = np.einsum("td,dhk->thk", h, p["q_proj"])
    k_all = np.einsum("td,dnk->tnk", h, p["k_proj"])
    v_all = np.einsum("td,dnk->tnk", h, p["v_proj"])
    for head in range(H):
        n = head // (H // N)
        for i in range(T):
            scores, values = [], []
            for j in range(T):
                visible = real[j] and positions[j] <= positions[i]
                if cfg.sliding_window is not None:
                    visible = visible and positions[i] - positions[j] < cfg.sliding_window
                if not visible:
                    continue
                q, k = q_all[i, head], k_all[j, n]
                if cfg.qk_norm:
                    q = rms_norm(q, p["q_norm"]["scale"], cfg.rms_eps)
                    k = rms_norm(k, p["k_norm"]["scale"], cfg.rms_eps)
                q = rope(q, positions[i], cfg.rope_theta)
                k = rope(k, positions[j], cfg.rope_theta)
                scores.append(q @ k / np.sqrt(Dh))
                values.append(v_all[j, n])
            if not scores:  # a padding query: nothing visible, output unused
                continue
            a = np.exp(np.array(scores) - max(scores))
            out[i, head] = (a / a.sum()) @ np.array(values)
    return np.einsum("thk,hkd->td", out, p["o_proj"])


def _free_top_k(probs, k):
    ids = np.argsort(-probs, kind="stable")[:k]
    return ids, probs[ids]


def moe(cfg, p, h, real, *, mode, replay_ids, replay_weights, replay_missing):
    """h: [T, D] one row. Returns (out [T, D], router logits [T, E], ids [T, K], weights [T, K],
    number of real tokens replayed with a -1 id)."""
    T = h.shape[0]
    K = cfg.top_k
    logits = h @ p["router"]  # [T, E]
    out = np.zeros_like(h)
    ids = np.full((T, K), -1)
    weights = np.zeros((T, K))
    unrecorded = 0
    for t in range(T):
        z = logits[t] - logits[t].max()
        probs = np.exp(z) / np.exp(z).sum()
        free_ids, free_w = _free_top_k(probs, K)
        if cfg.norm_topk_prob:
            free_w = free_w / free_w.sum()
        if mode == "free":
            i, w = free_ids, free_w
        else:
            i = np.asarray(replay_ids[t])
            if mode == "replay_ids_and_weights":
                w = np.where(i >= 0, replay_weights[t], 0.0)
            else:
                w = np.where(i >= 0, probs[np.maximum(i, 0)], 0.0)
                if cfg.norm_topk_prob and w.sum() > 0:
                    w = w / w.sum()
            if real[t] and (i < 0).any():
                unrecorded += 1
                if replay_missing == "free":
                    i, w = free_ids, free_w
        ids[t], weights[t] = i, w
        for e, we in zip(i, w, strict=True):
            if e >= 0:
                out[t] += we * swiglu(h[t], p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
        if cfg.shared_expert_ffn_dim:
            s = p["shared_expert"]
            shared = swiglu(h[t], s["gate_proj"], s["up_proj"], s["down_proj"])
            if cfg.shared_expert_gate:
                shared = shared / (1.0 + np.exp(-(h[t] @ p["shared_expert_gate"])[0]))
            out[t] += shared
    return out, logits, ids, weights, unrecorded


def router_losses(logits, ids, real):
    """(load-balancing loss, z-loss) of one layer over the real tokens (see module docstring)."""
    E = logits.shape[-1]
    n = max(int(np.sum(real)), 1)
    assignments, prob_sum, z_sum = np.zeros(E), np.zeros(E), 0.0
    for t in np.flatnonzero(real):
        m = logits[t].max()
        lse = m + np.log(np.exp(logits[t] - m).sum())
        prob_sum += np.exp(logits[t] - lse)
        z_sum += lse**2
        for e in ids[t]:
            if e >= 0:
                assignments[e] += 1
    return E * np.sum((assignments / n) * (prob_sum / n)), z_sum / n


def forward(
    cfg,
    params,
    tokens,
    *,
    attention_mask=None,
    routing=None,
    mode="free",
    replay_missing="error",
) -> Reference:
    """The float64 forward of `cfg` with espo's `params` (see the module docstring).

    mode: "free", "replay_ids" or "replay_ids_and_weights"; routing: (ids, weights) [B, L, T, K].
    """
    params = _f64(params)
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    L, K, V = cfg.num_layers, cfg.top_k, cfg.vocab_size
    mask = np.ones((B, T), bool) if attention_mask is None else np.asarray(attention_mask, bool)
    logits = np.zeros((B, T, V))
    all_ids = np.full((B, L, T, K), -1)
    all_w = np.zeros((B, L, T, K))
    router_logits = np.zeros((B, L, T, cfg.num_experts))
    unrecorded = 0
    for b in range(B):
        real = mask[b]
        positions = np.maximum(np.cumsum(real) - 1, 0)
        x = params["embed"][tokens[b]]  # [T, D]
        for layer in range(L):
            is_moe, p = _layer_params(cfg, params, layer)
            h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_eps)
            x = x + attention(cfg, p["attn"], h, positions, real)
            h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_eps)
            if is_moe:
                replay = (None, None) if routing is None else (
                    np.asarray(routing[0])[b, layer], np.asarray(routing[1])[b, layer]
                )  # fmt: skip
                m, router_logits[b, layer], ids, w, n = moe(
                    cfg, p["moe"], h, real, mode=mode, replay_ids=replay[0],
                    replay_weights=replay[1], replay_missing=replay_missing,
                )  # fmt: skip
                all_ids[b, layer], all_w[b, layer] = ids, w
                unrecorded += n
            else:
                m = swiglu(h, p["mlp"]["gate_proj"], p["mlp"]["up_proj"], p["mlp"]["down_proj"])
            x = x + m
        x = rms_norm(x, params["final_norm"]["scale"], cfg.rms_eps)
        w_out = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
        logits[b] = x @ w_out
    # Router losses: over the real tokens of the whole batch, per MoE layer, then averaged.
    per_layer = [
        router_losses(
            router_logits[:, layer].reshape(B * T, -1),
            all_ids[:, layer].reshape(B * T, K),
            mask.reshape(B * T),
        )
        for layer in cfg.moe_layers
    ]
    lb = float(np.mean([x[0] for x in per_layer])) if per_layer else 0.0
    z = float(np.mean([x[1] for x in per_layer])) if per_layer else 0.0
    return Reference(
        logits=logits,
        expert_ids=all_ids,
        expert_weights=all_w,
        load_balancing_loss=lb,
        z_loss=z,
        total=cfg.aux_loss_coef * lb + cfg.z_loss_coef * z,
        num_unrecorded_routes=unrecorded,
    )
