"""The decoder: `init(cfg, key) -> params` and the pure `forward(cfg, params, tokens, ...)`.

Layers are grouped into maximal runs of one kind (MoE or dense MLP) and every run is one
`nn.scan`, so compile time does not grow with depth. Each scanned block returns its new KV slice
and its routing (`MoeExtras`) as scan outputs, which `forward` stacks into a `KVCache` and a
`RouterTrace` [B, L, T, K] (dense layers hold -1 / 0). Params are a plain nested dict.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array, Bool, Float, Int

from espo import errors, types
from espo.model import config as config_lib
from espo.model import layers, moe

RoutingMode = config_lib.RoutingMode


@flax.struct.dataclass
class ModelAux:
    """Router statistics of a forward pass (means over MoE layers, real tokens only)."""

    load_balancing_loss: Float[Array, " "]
    z_loss: Float[Array, " "]
    expert_load: Float[Array, "L E"]  # fraction of assignments per expert; 0 for dense layers
    total: Float[Array, " "]  # aux_loss_coef * load_balancing_loss + z_loss_coef * z_loss
    # (real token, MoE layer) pairs replayed with an unrecorded (-1) id; 0 when FREE. Under
    # replay_missing="error" a caller that jits `forward` without `checkify` must check it is 0
    # (`check_replay` names the layer and positions); under "free" it counts the fallbacks.
    num_unrecorded_routes: Int[Array, " "]
    # MoE layers by the expert-parallel path they took (`experts.EP_PATHS`: all_to_all, all_gather);
    # zeros without an expert axis in the context mesh.
    expert_parallel: Int[Array, " 2"]
    # The router's own top-k at every layer [B, L, T, K] (-1 at dense layers): the experts used
    # unless replayed; under replay, what the router would choose on the replayed context.
    router_ids: Int[Array, "B L T K"] | None = None


@flax.struct.dataclass
class ModelOutput:
    logits: Float[Array, "B T V"] | None  # float32; None when forward(return_logits=False)
    cache: layers.KVCache | None
    router: types.RouterTrace
    aux: ModelAux
    hidden: Float[Array, "B T D"] | None = None  # final-norm hidden state, if return_hidden


def run_name(index: int) -> str:
    """Parameter-tree name of the `index`-th layer run (see `ModelConfig.layer_runs`)."""
    return f"blocks_{index}"


def layer_name(run: int, index: int) -> str:
    """Parameter-tree name of layer `index` of run `run` in per-layer params (`unstack_layers`)."""
    return f"{run_name(run)}_layer_{index}"


def unstack_layers(cfg: config_lib.ModelConfig, params: dict) -> dict:
    """`params` with every layer run split into per-layer subtrees, which `forward` runs as an
    unrolled loop instead of a scan.

    Why: inside a scan (or any loop) over stacked [L, ...] weights, XLA:CPU copies each layer's
    slice into a fresh buffer before its matmuls (a dot cannot read a dynamic slice in place),
    so every decode step writes and reads every weight once more. Per-layer buffers, split once
    before a decode loop, are read in place. Costs one copy of the weights per call and a
    compile that grows with depth; `Model.decode_params` applies it (on a GPU too: fewer
    kernels a decode step).
    """
    out = {k: v for k, v in params.items() if not k.startswith("blocks_")}
    for r, (_, _, length) in enumerate(cfg.layer_runs()):
        for i in range(length):
            out[layer_name(r, i)] = jax.tree.map(lambda a, i=i: a[i], params[run_name(r)])
    return out


def layer_names(cfg: config_lib.ModelConfig) -> list[str]:
    """The per-layer subtree names of `unstack_layers`' output, in order."""
    return [layer_name(r, i) for r, (_, _, n) in enumerate(cfg.layer_runs()) for i in range(n)]


def stack_layers(cfg: config_lib.ModelConfig, params: dict) -> dict:
    """The inverse of `unstack_layers`: per-layer subtrees back into stacked [L, ...] runs."""
    out = {k: v for k, v in params.items() if not k.startswith("blocks_")}
    for r, (_, _, length) in enumerate(cfg.layer_runs()):
        per_layer = [params[layer_name(r, i)] for i in range(length)]
        out[run_name(r)] = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    return out


_PER_LAYER_CTX = ("positions", "kv_positions", "segment_ids")


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp_or_moe(norm(x))."""

    cfg: config_lib.ModelConfig
    is_moe: bool
    mode: RoutingMode
    impl: str
    replay_missing: str

    @nn.compact
    def __call__(self, carry, layer_in, ctx):
        """carry: (x [B, T, D], KV cache or None); layer_in: this layer's scanned inputs. The
        cache is this layer's (k, v) [B, N, S, Dh], or in a scan every layer's [L, B, N, S, Dh]
        with layer_in["layer"] this layer's index in it."""
        cfg = self.cfg
        x, kv = carry
        layer = layer_in["layer"]
        ctx = ctx | layer_in.get("ctx", {})  # a scan's per-layer copies (Transformer)
        own = kv if kv is None or layer is None else tuple(c[layer] for c in kv)
        h = layers.RMSNorm(cfg.rms_eps, cfg.jnp_param_dtype, name="input_norm")(x)
        a, new_kv = layers.Attention(cfg, name="attn")(
            h,
            positions=ctx["positions"],
            kv_positions=ctx["kv_positions"],
            segment_ids=ctx["segment_ids"],
            kv=own,
            write_index=ctx["write_index"],
        )
        if kv is not None and layer is not None:
            put = lambda c, o: jax.lax.dynamic_update_index_in_dim(c, o, layer, 0)
            new_kv = tuple(map(put, kv, new_kv))
        x = x + a
        h = layers.RMSNorm(cfg.rms_eps, cfg.jnp_param_dtype, name="post_attn_norm")(x)
        if self.is_moe:
            m, extras = moe.MoeBlock(cfg, self.mode, self.impl, self.replay_missing, name="moe")(
                h,
                token_mask=ctx["token_mask"],
                replay_ids=layer_in["replay_ids"],
                replay_weights=layer_in["replay_weights"],
            )
        else:
            m, extras = layers.SwiGLU(cfg, cfg.dense_ffn_dim, name="mlp")(h), None
        return (x + m, new_kv), extras


def remat_block(cfg: config_lib.ModelConfig, *, scanned: bool):
    """`Block`, rematerialised in the backward as `cfg.remat` says: "none" keeps every
    intermediate of every layer for the backward; "full" keeps each layer's input and recomputes
    the rest of the layer; "dots_with_no_batch_dims_saveable" also keeps what that
    `jax.checkpoint_policies` policy saves. One setting for the scanned and the unrolled
    layer loops (MaxText's `remat_policy`); a forward without a backward is unchanged.
    On XLA:CPU only the scanned loop gets the memory back: unrolled, the recomputation is
    compiled but the temporaries stay (`bench_memory.py --models default --settings
    long,long+remat=none [--unrolled]`, GiB at 1,024 tokens, none -> full: scanned 0.153 ->
    0.045, unrolled 0.133 -> 0.124); compiled for a TPU v5p both loops do (2,048 tokens:
    0.227 -> 0.066 and 0.147 -> 0.079). So long traces on CPU scan (`train.scan_layers`)."""
    if cfg.remat == "none":
        return Block
    policy = None if cfg.remat == "full" else getattr(jax.checkpoint_policies, cfg.remat)
    # In a scan the loop already keeps XLA from merging the recomputation with the forward.
    return nn.remat(Block, policy=policy, prevent_cse=not scanned)


class Transformer(nn.Module):
    cfg: config_lib.ModelConfig
    mode: RoutingMode = RoutingMode.FREE
    impl: str = "auto"
    replay_missing: str = "error"
    unrolled: bool = False  # per-layer params (`unstack_layers`): a loop, not a scan
    logits: bool = True  # False: no head (the caller projects the hidden state in chunks)

    @nn.compact
    def __call__(self, tokens, *, ctx, kv, routing):
        """kv: (k, v), each a tuple of L per-layer [B, N, S, Dh] buffers, or None; routing:
        (ids, weights) [L, B, T, K] or None."""
        cfg = self.cfg
        dt = cfg.jnp_dtype
        embed = self.param(
            "embed", nn.initializers.normal(stddev=1.0), (cfg.vocab_size, cfg.d_model),
            cfg.jnp_param_dtype,
        )  # fmt: skip
        x = embed.astype(dt)[tokens]  # [B, T, D]
        run_extras, new_kv = [], []  # new_kv: each layer's (k, v)
        for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
            take = lambda a, s=start, n=length: None if a is None else a[s : s + n]
            layer_in = {
                "replay_ids": take(routing[0]) if (is_moe and routing) else None,
                "replay_weights": take(routing[1]) if (is_moe and routing) else None,
            }
            run_kv = [None] * length if kv is None else list(zip(*map(take, kv), strict=True))
            args = (cfg, is_moe, self.mode, self.impl, self.replay_missing)
            if self.unrolled:  # each layer reads and writes its own cache buffers
                per_layer = []
                for i in range(length):
                    layer_i = jax.tree.map(lambda a, i=i: a[i], layer_in) | {"layer": None}
                    block = remat_block(cfg, scanned=False)(*args, name=layer_name(r, i))
                    (x, run_kv[i]), extras = block((x, run_kv[i]), layer_i, ctx)
                    per_layer.append(extras)
                extras = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
            else:  # the scan carries the run's buffers stacked [length, ...]
                scanned = nn.scan(
                    remat_block(cfg, scanned=True),
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    in_axes=(0, nn.broadcast),
                    length=length,
                )
                stacked = None if kv is None else tuple(map(jnp.stack, zip(*run_kv, strict=True)))
                layer_in["layer"] = jnp.arange(length, dtype=jnp.int32)  # the index in the scan
                # Attention's positions as per-layer inputs, not loop-invariant ones: JAX's
                # partial evaluation of a differentiated scan hoists loop-invariant residuals out
                # of the loop (`_scan_known_hoisting`), and took the blocked attention's
                # position-only values (each tile's mask) out, stacked over every tile: memory
                # quadratic in T (tests/model/test_long_sequences.py).
                layer_in["ctx"] = jax.tree.map(
                    lambda a, n=length: jnp.broadcast_to(a, (n,) + a.shape),
                    {k: ctx[k] for k in _PER_LAYER_CTX},
                )
                (x, stacked), extras = scanned(*args, name=run_name(r))((x, stacked), layer_in, ctx)
                run_kv = (
                    run_kv if kv is None else list(zip(*map(jnp.unstack, stacked), strict=True))
                )
            new_kv += run_kv
            run_extras.append((is_moe, length, extras))
        new_kv = None if kv is None else tuple(zip(*new_kv, strict=True))  # (k, v): L buffers each
        x = layers.RMSNorm(cfg.rms_eps, cfg.jnp_param_dtype, name="final_norm")(x)
        hidden = x
        if not cfg.tie_embeddings:
            w_out = self.param(
                "lm_head", layers._dense_init(cfg.d_model), (cfg.d_model, cfg.vocab_size),
                cfg.jnp_param_dtype,
            )  # fmt: skip
        if not self.logits:
            return None, hidden, new_kv, run_extras
        w = embed.T if cfg.tie_embeddings else w_out  # [D, V]
        logits = x @ w.astype(dt)  # [B, T, V]
        return logits.astype(jnp.float32), hidden, new_kv, run_extras


def head_weight(cfg: config_lib.ModelConfig, params: dict) -> Float[Array, "D V"]:
    """The output projection [D, V] the forward's logits use (the embedding's transpose when
    tied), in its stored dtype: logits = final-norm hidden @ head_weight in the compute dtype."""
    return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


def init(cfg: config_lib.ModelConfig, key: jax.Array) -> dict:
    """Random parameters (a plain nested dict) for `cfg`."""
    return _init(cfg, key)


# One jit for every config (static): a process traces the Flax init of a config once, however
# many runs, `param_shapes` calls (checkpoint loading, sharding rules) or evaluations ask for it.
@functools.partial(jax.jit, static_argnums=0)
def _init(cfg: config_lib.ModelConfig, key: jax.Array) -> dict:
    tokens = jnp.zeros((1, 1), jnp.int32)
    ctx = _context(cfg, tokens, positions=None, attention_mask=None, cache=None, segment_ids=None)
    return Transformer(cfg).init(key, tokens, ctx=ctx, kv=None, routing=None)["params"]


def param_shapes(cfg: config_lib.ModelConfig) -> dict:
    """The parameter tree of `cfg` as `jax.ShapeDtypeStruct`s, allocating nothing."""
    return jax.eval_shape(functools.partial(init, cfg), jax.random.key(0))


def segment_positions(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """0, 1, ... within each run of equal segment ids (RoPE restarting per packed sequence)."""
    t = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )  # [B, T] first token of a segment
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # [B, T]


def _context(cfg, tokens, *, positions, attention_mask, cache, segment_ids):
    """Positions, key positions, segments and cache bookkeeping shared by every layer (each
    attention derives visibility from them, `espo.model.attention`: no [B, T, S] mask here)."""
    B, T = tokens.shape
    token_mask = jnp.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
    if segment_ids is not None and positions is None:  # (forward folded segment 0 into the mask)
        positions = segment_positions(segment_ids)  # [B, T]
    if positions is None:
        offset = 0 if cache is None else jnp.max(cache.kv_positions, axis=1, keepdims=True) + 1
        positions = offset + jnp.maximum(jnp.cumsum(token_mask, axis=1) - 1, 0)  # [B, T]
    positions = positions.astype(jnp.int32)
    kv_positions = jnp.where(token_mask, positions, -1)  # [B, T]
    write_index = None
    if cache is not None:
        write_index = cache.index
        kv_positions = jax.lax.dynamic_update_slice(
            cache.kv_positions, kv_positions, (0, cache.index)
        )  # [B, S]
    return {
        "positions": positions,
        "segment_ids": segment_ids,
        "token_mask": token_mask.astype(jnp.float32),
        "write_index": write_index,
        "kv_positions": kv_positions,
    }


def forward(
    cfg: config_lib.ModelConfig,
    params: dict,
    tokens: Int[Array, "B T"],
    *,
    positions: Int[Array, "B T"] | None = None,
    attention_mask: Bool[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    cache: layers.KVCache | None = None,
    routing: types.RouterTrace | None = None,
    routing_mode: RoutingMode = RoutingMode.FREE,
    dispatch_impl: str = "auto",
    return_hidden: bool = False,
    replay_missing: str = "error",
    return_logits: bool = True,
) -> ModelOutput:
    """Logits, updated cache, router trace and router statistics for `tokens`.

    Args:
      tokens: int [B, T].
      positions: int [B, T]; by default the count of real tokens before each one (continuing
        after the cache's last position), which handles left padding.
      attention_mask: bool [B, T]; False marks padding, which no query attends to.
      segment_ids: int [B, T], packed rows (`espo.packing`): several sequences end to end,
        numbered 1, 2, ... per row, 0 on padding. Attention is block-diagonal by segment and
        causal; positions default to 0, 1, ... restarting in every segment; segment 0 is
        padding everywhere (attention, router aux / z losses, replay checks), as if
        attention_mask were False there. `routing` is packed like the tokens. No cache.
      cache: a `KVCache`; the T tokens are written at slots [cache.index, cache.index + T).
      routing: a `RouterTrace` [B, L, T, K] to replay (required unless routing_mode is FREE).
      routing_mode: static; see `RoutingMode`.
      dispatch_impl: static; "auto" (`cfg.moe_impl`, whose "auto" is `experts.default_impl`:
        capacity on CPU, Triton / Mosaic GPU kernels on GPUs, ragged / megablox on TPUs, by
        rows), "capacity", "ragged", "blocked", "mosaic_gpu", "triton" or "megablox"
        (`experts.expert_ffn`).
      return_hidden: static; also return the final-norm hidden state [B, T, D] (for value or
        reward heads).
      return_logits: static; False skips the head: `logits` is None (callers that project
        `hidden` themselves, in chunks: `espo.train_step.token_logps`; implies return_hidden).
      replay_missing: static; what a replaying forward does with a real token (attention_mask
        True) whose recorded expert id in a MoE layer is -1 (never silent: the old behaviour, a
        zero gate and a zero MoE output for that token, moved logits by ~2 without a sign):
        * "error" (default): eagerly (concrete inputs) raise `UnrecordedRouteError` naming the
          layer, row and positions. Under `jit` the count is returned in
          `aux.num_unrecorded_routes`, which the caller must check (then `check_replay` names
          the positions), and a `checkify.debug_check` raises the same message when the caller
          wraps the function in `checkify.checkify`.
        * "free": those tokens take the router's own top-k and gates in that layer (counted in
          `aux.num_unrecorded_routes`); padding keeps its -1 ids.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    B, T = tokens.shape
    K, L = cfg.top_k, cfg.num_layers
    if segment_ids is not None:
        if segment_ids.shape != tokens.shape:
            raise ValueError(
                f"segment_ids must have the shape of tokens {tokens.shape}, got {segment_ids.shape}"
            )
        if cache is not None:
            raise ValueError("segment_ids (packed rows) are for full forwards: pass no cache")
        real = segment_ids > 0  # [B, T]
        attention_mask = real if attention_mask is None else attention_mask.astype(bool) & real
    if replay_missing not in moe.REPLAY_MISSING:
        raise errors.InvalidValue(
            "", "replay_missing", replay_missing, f"one of {moe.REPLAY_MISSING}"
        )
    if routing_mode is not RoutingMode.FREE:
        want = (B, L, T, K)
        if routing is None or routing.expert_ids.shape != want:
            got = None if routing is None else routing.expert_ids.shape
            raise ValueError(
                f"routing_mode={routing_mode.name} needs routing.expert_ids of shape "
                f"[B, L, T, K]={want}, got {got}"
            )
        if routing_mode is RoutingMode.REPLAY_IDS_AND_WEIGHTS and routing.expert_weights is None:
            raise ValueError(
                "routing_mode=REPLAY_IDS_AND_WEIGHTS needs routing.expert_weights; this trace "
                "holds ids only (sample with trace_weights=True, or replay with REPLAY_IDS)"
            )
        concrete = not isinstance(routing.expert_ids, jax.core.Tracer) and not isinstance(
            attention_mask, jax.core.Tracer
        )
        if replay_missing == "error" and concrete:
            check_replay(cfg, routing, attention_mask)
    ctx = _context(
        cfg,
        tokens,
        positions=positions,
        attention_mask=attention_mask,
        cache=cache,
        segment_ids=segment_ids,
    )
    kv = None if cache is None else (cache.k, cache.v)
    replay = None
    if routing is not None and routing_mode is not RoutingMode.FREE:
        to_layer_major = functools.partial(jnp.swapaxes, axis1=0, axis2=1)  # [L, B, T, K]
        weights = routing.expert_weights  # None: a trace of ids only (an RL rollout's)
        weights = None if weights is None else to_layer_major(weights)
        replay = (to_layer_major(routing.expert_ids), weights)
    unrolled = run_name(0) not in params  # per-layer params (`unstack_layers`)
    dispatch_impl = cfg.moe_impl if dispatch_impl == "auto" else dispatch_impl
    model = Transformer(cfg, routing_mode, dispatch_impl, replay_missing, unrolled, return_logits)
    logits, hidden, new_kv, run_extras = model.apply(
        {"params": params}, tokens, ctx=ctx, kv=kv, routing=replay
    )
    new_cache = None
    if cache is not None:
        new_cache = layers.KVCache(
            k=new_kv[0], v=new_kv[1], kv_positions=ctx["kv_positions"], index=cache.index + T
        )
    trace, aux, unrecorded = _collect_routing(cfg, run_extras, batch=B, length=T)
    if routing_mode is not RoutingMode.FREE and replay_missing == "error":
        # A no-op unless the caller wraps forward in `checkify.checkify` (then it raises there).
        layer, row, pos = jnp.unravel_index(
            jnp.argmax(jnp.swapaxes(unrecorded, 0, 1).reshape(-1)), (L, B, T)
        )
        checkify.debug_check(
            aux.num_unrecorded_routes == 0,
            "router replay: {n} real (token, MoE layer) pairs have an unrecorded expert id (-1), "
            "first at layer {layer}, row {row}, position {pos}",
            n=aux.num_unrecorded_routes,
            layer=layer,
            row=row,
            pos=pos,
        )
    return ModelOutput(
        logits=logits,
        cache=new_cache,
        router=trace,
        aux=aux,
        hidden=hidden.astype(jnp.float32) if return_hidden or not return_logits else None,
    )


def _collect_routing(cfg, run_extras, *, batch, length):
    """Stack per-run `MoeExtras` into a RouterTrace [B, L, T, K] and layer-averaged losses."""
    K, E = cfg.top_k, cfg.num_experts
    ids, weights, loads, lb, z, missing, paths, own = [], [], [], [], [], [], [], []
    for is_moe, n, extras in run_extras:
        if is_moe:
            missing.append(extras.unrecorded.reshape(n, batch, length))
            ids.append(extras.expert_ids.reshape(n, batch, length, K))
            own.append(extras.router_ids.reshape(n, batch, length, K))
            weights.append(extras.expert_weights.reshape(n, batch, length, K))
            loads.append(extras.expert_load)
            lb.append(extras.load_balancing_loss)
            z.append(extras.z_loss)
            paths.append(extras.expert_parallel.reshape(n, -1).sum(axis=0))
        else:
            missing.append(jnp.zeros((n, batch, length), bool))
            ids.append(jnp.full((n, batch, length, K), -1, jnp.int32))
            own.append(ids[-1])
            weights.append(jnp.zeros((n, batch, length, K), jnp.float32))
            loads.append(jnp.zeros((n, E), jnp.float32))
    trace = types.RouterTrace(
        expert_ids=jnp.swapaxes(jnp.concatenate(ids, axis=0), 0, 1),
        expert_weights=jnp.swapaxes(jnp.concatenate(weights, axis=0), 0, 1),
    )
    lb_loss = jnp.mean(jnp.concatenate(lb)) if lb else jnp.zeros((), jnp.float32)
    z_loss = jnp.mean(jnp.concatenate(z)) if z else jnp.zeros((), jnp.float32)
    unrecorded = jnp.swapaxes(jnp.concatenate(missing, axis=0), 0, 1)  # [B, L, T]
    aux = ModelAux(
        load_balancing_loss=lb_loss,
        z_loss=z_loss,
        expert_load=jnp.concatenate(loads, axis=0),
        total=cfg.aux_loss_coef * lb_loss + cfg.z_loss_coef * z_loss,
        num_unrecorded_routes=jnp.sum(unrecorded, dtype=jnp.int32),
        expert_parallel=sum(paths, jnp.zeros((2,), jnp.int32)),
        router_ids=jnp.swapaxes(jnp.concatenate(own, axis=0), 0, 1),
    )
    return trace, aux, unrecorded


class UnrecordedRouteError(ValueError):
    """A replayed forward was given -1 (unrecorded) expert ids for real tokens."""


def check_replay(
    cfg: config_lib.ModelConfig,
    routing: types.RouterTrace,
    attention_mask: Bool[Array, "B T"] | None = None,
) -> None:
    """Raise `UnrecordedRouteError` if a real token has a -1 replayed id in a MoE layer.

    Host-side (numpy) on concrete arrays: call it before a jitted replaying forward, or after one
    whose `aux.num_unrecorded_routes` is non-zero, to learn which layer and positions. Dense
    layers (whose trace is -1 by convention) and padding (attention_mask False) are ignored.
    """
    ids = np.asarray(routing.expert_ids)  # [B, L, T, K]
    B, _, T, _ = ids.shape
    real = np.ones((B, T), bool) if attention_mask is None else np.asarray(attention_mask, bool)
    problems = []
    for layer in cfg.moe_layers:
        bad = real & (ids[:, layer] < 0).any(-1)  # [B, T]
        for row in np.flatnonzero(bad.any(-1)):
            problems.append(
                f"layer {layer} row {row} positions {np.flatnonzero(bad[row]).tolist()}"
            )
    if problems:
        shown = "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
        raise UnrecordedRouteError(
            f"router replay: real tokens (attention_mask True) have unrecorded expert ids (-1) "
            f"in a MoE layer: {shown}. Record them, mask them out, or pass "
            f'replay_missing="free" to route them freely.'
        )
