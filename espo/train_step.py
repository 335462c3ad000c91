"""Token log-probs and entropies from ONE forward, old log-probs with router replay, entropy choice.

Owns the only place where the trainer turns a forward into per-token log-probs: `token_logps`.
The same function gives pi_old's log-probs (`old_logps`: a stop-gradient forward that replays
the rollout's experts, `RoutingMode.REPLAY_IDS`) and the current policy's log-probs in the loss,
and in both cases the full-vocabulary entropies of the same distribution, from the same logits.

Conventions (those of `espo.sampler`, so a rollout's arrays line up without shifting):
  * Inputs are `Rollout.training_inputs()`: left-padded prompt then completion, [B, T].
  * Outputs are ALIGNED with `tokens`, [B, T]: logps[b, t] = log softmax(z_{b,t-1} / temp)
    [tokens[b, t]] with z the logits, i.e. the log-probability of token t given the tokens
    before it; entropies[b, t] = -sum_v p_v log p_v of that same distribution. Position t is
    meaningful when tokens t-1 and t are both real (attention_mask True); elsewhere (t = 0,
    padding, the first real prompt token) both are 0. So `logps[:, Tp:]` lines up with
    `Rollout.logps` [B, Tg] and the router trace [B, L, Tp + Tg, K] lines up with `tokens`.
  * Everything in float32 (log_softmax of float32 logits). `temperature` scales the logits as
    the sampler did (temperature 0, greedy, means 1), so with the rollout's temperature and its
    router trace replayed, `old_logps` reproduces the sampler's log-probs up to float error.
  * Entropies are always detached (stop_gradient): no objective here differentiates them.

Which entropy each consumer uses (issue 7 #10) is `EntropyConfig`:
  * ESPO grouping, adaptive clip (docs/formulas.md §2.2, Eq. 6: entropy of pi_old): "old" (default)
    = recomputed in the old-log-prob forward (the trainer's parameters, bf16/f32, untempered
    unless the rollout was tempered), or "sampler" = the rollout's entropies (the FP8 rollout
    copy, temperature-scaled; cheaper, but another distribution).
  * RL-ZVP (arXiv 2509.21880 §3: H of pi_theta, detached): "current" (default) = the policy
    being optimised, from the same forward as the training log-probs (`token_logps` in the loss;
    pass them to `espo.advantages.token_advantages`), or "old" / "sampler" as above.
Memory: the head's float32 logits exist `model.logits_chunk` tokens at a time
(`espo.model.head`), recomputed in the backward; attention is blocked from two key blocks up
(`espo.model.attention`); `model.remat` rematerialises each layer: nothing of size T x V or
T x T is whole in memory on long rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from espo import advantages, batching, correction, errors, losses, packing, types
from espo.model import config as config_lib
from espo.model import head, transformer

RoutingMode = config_lib.RoutingMode
ESPO_ENTROPY_SOURCES = ("old", "sampler")
RL_ZVP_ENTROPY_SOURCES = ("current", "old", "sampler")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyConfig:
    """Which policy's token entropies ESPO and RL-ZVP use (see the module docstring)."""

    espo: str = "old"  # ESPO grouping / adaptive clip: "old" (pi_old recomputed) or "sampler"
    rl_zvp: str = "current"  # RL-ZVP: "current" (training forward), "old" or "sampler"

    def __post_init__(self) -> None:
        for name, valid in (("espo", ESPO_ENTROPY_SOURCES), ("rl_zvp", RL_ZVP_ENTROPY_SOURCES)):
            if getattr(self, name) not in valid:
                raise errors.InvalidValue("EntropyConfig", name, getattr(self, name), f"{valid}")


def select_entropies(
    source: str,
    *,
    old: Float[Array, "B T"] | None = None,
    sampler: Float[Array, "B T"] | None = None,
    current: Float[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """The entropies named by `source` ("old", "sampler" or "current"), detached."""
    options = {"old": old, "sampler": sampler, "current": current}
    if source not in options:
        raise errors.InvalidValue("entropy", "source", source, f"{tuple(options)}")
    if options[source] is None:
        raise ValueError(f"entropy source={source!r} was selected but its entropies were not given")
    return jax.lax.stop_gradient(jnp.asarray(options[source], jnp.float32))


class TokenLogps(NamedTuple):
    """What `token_logps` returns (unpacks as `logps, entropies, aux = ...`)."""

    logps: Float[Array, "B T"]  # aligned with tokens; 0 where not meaningful
    entropies: Float[Array, "B T"]  # detached; 0 where not meaningful
    aux: transformer.ModelAux  # router statistics of this forward (losses, replay checks)


def token_logps(
    model_cfg: config_lib.ModelConfig,
    params: dict,
    tokens: Int[Array, "B T"],
    attention_mask: Bool[Array, "B T"],
    *,
    routing: types.RouterTrace | None = None,
    routing_mode: RoutingMode = RoutingMode.FREE,
    temperature: float = 1.0,
    segment_ids: Int[Array, "B T"] | None = None,
    **forward_options,
) -> TokenLogps:
    """Per-token log-probs and entropies of `tokens` from one forward (module conventions).

    Jittable with `model_cfg`, `routing_mode`, `temperature` and `forward_options` static
    (e.g. `dispatch_impl`); differentiable in `params` through `logps` only. With
    `segment_ids` (packed rows, `espo.packing`) a token's context is its own segment: the first
    token of every segment gets 0, as the first token of an unpacked row.
    """
    if not isinstance(temperature, int | float) or temperature < 0:
        raise errors.InvalidValue("", "temperature", temperature, "a float >= 0 (0: greedy, as 1)")
    if tokens.ndim != 2 or jnp.shape(attention_mask) != tokens.shape:
        raise ValueError(
            f"tokens and attention_mask must both be [B, T]; got {tokens.shape} and "
            f"{jnp.shape(attention_mask)}"
        )
    out = transformer.forward(
        model_cfg,
        params,
        tokens,
        attention_mask=attention_mask,
        routing=routing,
        routing_mode=routing_mode,
        segment_ids=segment_ids,
        return_logits=False,
        **forward_options,
    )
    scale = 1.0 if temperature == 0 else 1.0 / temperature
    (B, T), D = tokens.shape, model_cfg.d_model
    taken, entropy = head.taken_logps(
        model_cfg,
        params,
        out.hidden[:, :-1].reshape(B * (T - 1), D),
        tokens[:, 1:].reshape(-1),
        scale=scale,
    )  # [B * (T - 1)] each: the logits in chunks of tokens, never [B, T, V] at once
    taken, entropy = taken.reshape(B, T - 1), entropy.reshape(B, T - 1)
    mask = jnp.asarray(attention_mask, bool)
    real = mask[:, 1:] & mask[:, :-1]  # [B, T-1] token t and its context's last token are real
    if segment_ids is not None:
        real &= segment_ids[:, 1:] == segment_ids[:, :-1]  # [B, T-1] and in one segment
    first = jnp.zeros((tokens.shape[0], 1), jnp.float32)  # [B, 1] position 0 has no context
    logps = jnp.concatenate([first, jnp.where(real, taken, 0.0)], axis=1)  # [B, T]
    entropies = jnp.concatenate([first, jnp.where(real, entropy, 0.0)], axis=1)  # [B, T]
    return TokenLogps(logps=logps, entropies=jax.lax.stop_gradient(entropies), aux=out.aux)


def old_logps(
    model_cfg: config_lib.ModelConfig,
    params: dict,
    tokens: Int[Array, "B T"],
    attention_mask: Bool[Array, "B T"],
    routing: types.RouterTrace,
    *,
    temperature: float = 1.0,
    **forward_options,
) -> TokenLogps:
    """pi_old's log-probs and entropies: `token_logps` with the rollout's experts replayed
    (`RoutingMode.REPLAY_IDS`) and no gradient. For a carried-over resample group (age > 0,
    see espo.zero_variance) this is the current policy replaying an older trace: only
    `train.old_logps="sampler"` takes the ratio against the policy that sampled it."""
    return token_logps(
        model_cfg,
        jax.lax.stop_gradient(params),
        tokens,
        attention_mask,
        routing=routing,
        routing_mode=RoutingMode.REPLAY_IDS,
        temperature=temperature,
        **forward_options,
    )


def completion(values: Float[Array, "B T"], *, prompt_length: int) -> Float[Array, "B Tg"]:
    """The completion part [B, T - Tp] of an aligned [B, Tp + Tg] array (Rollout.logps layout)."""
    return values[:, prompt_length:]


# ---- the jitted steps of the trainer ------------------------------------------------------------


@flax.struct.dataclass
class TrainState:
    """Everything the update changes (a pytree; the trainer donates it to `train_step`)."""

    step: Int[Array, " "]  # optimiser updates done
    params: dict
    opt_state: optax.OptState
    ref_params: dict | None = None  # the frozen reference policy (loss.kl_coef > 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """The static settings of `prepare` and `train_step` (hashable)."""

    model: config_lib.ModelConfig
    loss: losses.LossConfig
    advantage: advantages.AdvantageConfig
    entropy: EntropyConfig
    num_groups: int  # P, groups per batch (segments of the advantage)
    micro_batch_size: int  # rows per micro-batch of an unpacked step
    packing_budget: int | None = None  # train.max_tokens_per_micro_batch when train.packing
    router_replay: bool = True
    old_logps: str = "recompute"  # "recompute" | "sampler"
    temperature: float = 1.0  # the rollout's; logits are scaled as the sampler did
    # One update over the whole batch (one epoch, one mini-batch) with recomputed pi_old: pi_old
    # IS the policy of that update, so its log-probs and entropies are the update's own forward
    # (stop-gradient; the ratio is exactly 1, as TRL's num_iterations=1) and `prepare` runs no
    # pi_old pass; the mismatch metrics come from the update (`train_step`).
    fused_old_logps: bool = False
    # train.scan_layers. False: forwards and gradients on per-layer parameters
    # (`transformer.unstack_layers`, an unrolled loop over layers; the gradient is stacked back
    # once an update) instead of a scan over the [L, ...] layout. On XLA:CPU the scan's stacked
    # residuals (zero-filled [L, ...] buffers, a dynamic-update-slice per layer) cost ~15% of an
    # update (docs/performance.md); the price is a compile that grows with depth.
    scan_layers: bool = True
    # train.replay_counterfactual: `prepare` also computes pi_old under the other routing (free
    # when replaying, replayed when not) on the same rows, one forward more a step, and logs its
    # mismatch against the sampler (mismatch/counterfactual/*) beside the run's own, and the
    # free-routing forward's expert agreement with the rollout per MoE layer
    # (mismatch/free_agreement/layer_<l>): router replay's effect measured on paired batches.
    replay_counterfactual: bool = False


def _layer_params(sc: StepConfig, params: dict | None) -> dict | None:
    """`params` in the layout the step's forwards run on: per-layer subtrees unless
    `sc.scan_layers` (`transformer.unstack_layers`; None stays None)."""
    if sc.scan_layers or params is None:
        return params
    return transformer.unstack_layers(sc.model, params)


def _routing(sc: StepConfig, router: types.RouterTrace) -> dict:
    if not sc.router_replay:
        return dict(routing=None, routing_mode=RoutingMode.FREE)
    return dict(routing=router, routing_mode=RoutingMode.REPLAY_IDS)


class _Rows(NamedTuple):
    """The forward inputs of one micro-batch, padded rows [B, T] or packed rows [R, L]."""

    tokens: Int[Array, "B T"]
    attention_mask: Bool[Array, "B T"]
    loss_mask: Bool[Array, "B T"]
    router: types.RouterTrace  # [B, L, T, K]
    packed: dict  # segment_ids and positions of packed rows; empty for padded rows


def _padded_rows(mb: batching.TrainBatch) -> _Rows:
    return _Rows(mb.tokens, mb.attention_mask, mb.loss_mask, mb.router, {})


def _packed_rows(batch: batching.TrainBatch, lay: _Micro) -> _Rows:
    """Micro-batch `lay` of `batch`, packed on the device: the tokens, masks and router trace
    move to their segments (the trace like the tokens)."""
    real = lay.segment_ids > 0  # [R, L]
    take = functools.partial(packing.gather, rows=lay.src_rows, cols=lay.src_cols, real=real)
    router = types.RouterTrace(
        expert_ids=take(batch.router.expert_ids, axis=2, fill=-1),  # [R, L, T, K]
        expert_weights=jax.tree.map(
            lambda w: take(w, axis=2, fill=0), batch.router.expert_weights
        ),  # None: an RL batch replays ids only
    )
    packed = dict(segment_ids=lay.segment_ids, positions=lay.positions)
    return _Rows(take(batch.tokens), real, take(batch.loss_mask, fill=False), router, packed)


def _rows_logps(sc: StepConfig, params, rows: _Rows, **options) -> TokenLogps:
    """`token_logps` of one micro-batch's rows, replaying its trace when `router_replay`."""
    return token_logps(
        sc.model, params, rows.tokens, rows.attention_mask, **_routing(sc, rows.router),
        temperature=sc.temperature, **rows.packed, **options,
    )  # fmt: skip


def _unless_empty(pred, fn, *args):
    """fn(*args) if `pred`, else zeros of its outputs: an all-padding micro-batch (a rounded-up
    packed row) costs no forward (`lax.cond` runs one branch)."""
    zeros = lambda *a: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *a))
    return jax.lax.cond(pred, fn, zeros, *args)


def _expert_agreement(
    a: Int[Array, "B L T K"], b: Int[Array, "B L T K"], mask
) -> tuple[Float[Array, " L"], Int[Array, " L"]]:
    """(sum, count) per layer over masked (row, position) of |experts(a) & experts(b)| / K, at
    the positions b recorded (b's id >= 0; a dense layer has none)."""
    same = (a[..., :, None] == b[..., None, :]).any(-1).mean(-1)  # [B, L, T]
    m = mask[:, None, :] & (b[..., 0] >= 0)  # [B, L, T]: recorded MoE layers only
    return jnp.where(m, same, 0.0).sum((0, 2)), m.sum((0, 2))


class _Micro(NamedTuple):
    """Micro-batch m of a `packing.Layout`: its packed rows and its `packing.unpack` index."""

    src_rows: Int[Array, "R L"]
    src_cols: Int[Array, "R L"]
    segment_ids: Int[Array, "R L"]
    positions: Int[Array, "R L"]
    index: tuple[Array, Array, Array]  # [n, T] each: m's sequences' tokens only


def _micro(layout: packing.Layout, m) -> _Micro:
    """Micro-batch m (traced) of `layout`."""
    per_micro = (layout.src_rows, layout.src_cols, layout.segment_ids, layout.positions)
    return _Micro(*(x[m] for x in per_micro), index=layout.micro_index(m))


def prepare(
    sc: StepConfig,
    params: dict,
    ref_params: dict | None,
    batch,
    layout: packing.Layout = None,
):
    """pi_old (and reference) log-probs, entropies, advantages and train-infer mismatch.

    One pass over micro-batches with `lax.map`: `micro_batch_size` rows each, or with a
    `layout` (`train.packing`) packed rows of `packing_budget` tokens in all, unpacked to the
    batch's [N, T] (rows of padding only are skipped). pi_old replays the rollout's experts when
    `router_replay` (REPLAY_IDS), or routes freely; `old_logps="sampler"` takes the rollout's own
    log-probs instead. Mismatch metrics compare the sampler's log-probs with pi_old's on loss
    tokens: k3 KL(sampler || trainer), the fraction with |dlogp| > ln 2 and the sampler
    correction the loss will apply (`espo.correction`: is_weight_mean / max, is_clipped_frac,
    rs_masked_frac, rs_masked_seq_frac) over the whole batch, whatever its micro-batching; with
    `sc.fused_old_logps` there is no pi_old pass and the mismatch metrics come from the update
    instead. (The router agreement comes from the update's forward, `train_step`.)
    """
    params, ref_params = _layer_params(sc, params), _layer_params(sc, ref_params)

    def one(rows: _Rows):
        zeros = jnp.zeros(rows.tokens.shape, jnp.float32)  # [R, L]
        if sc.fused_old_logps:  # pi_old is the update's own forward (see StepConfig)
            logps, ents, unrecorded = zeros, zeros, jnp.zeros((), jnp.int32)
        else:
            old = _rows_logps(sc, params, rows, replay_missing="free")
            logps, ents = old.logps, old.entropies
            unrecorded = old.aux.num_unrecorded_routes.astype(jnp.int32)
        ref = zeros
        if ref_params is not None:
            ref = _rows_logps(sc, ref_params, rows, replay_missing="free").logps
        counter, agree = zeros, jnp.zeros((2, sc.model.num_layers), jnp.float32)
        if sc.replay_counterfactual:  # the other routing on the same rows (see StepConfig)
            other = dataclasses.replace(sc, router_replay=not sc.router_replay)
            cf = _rows_logps(other, params, rows, replay_missing="free")
            if sc.router_replay:  # the counterfactual is the free forward
                free = cf
            elif not sc.fused_old_logps:  # pi_old's forward here is the free one
                free = old
            else:  # pi_old's free forward is the update's: one here for its routes
                free = _rows_logps(sc, params, rows, replay_missing="free")
            agreeing, pairs = _expert_agreement(
                free.aux.router_ids, rows.router.expert_ids, rows.loss_mask
            )
            agree = jnp.stack([agreeing, pairs.astype(jnp.float32)])
            counter = cf.logps
        return (logps, ents, ref, counter), (unrecorded, agree)

    if layout is None:
        mbs = batching.split(batch, batch.num_rows // sc.micro_batch_size)
        per_token, (unrecorded, agree) = jax.lax.map(lambda mb: one(_padded_rows(mb)), mbs)
        logps, ents, ref, counter = batching.unsplit(per_token)
    else:  # packed micro-batches, then back to the batch's [N, T] layout
        micro = lambda m: _unless_empty(
            layout.segment_ids[m].any(), lambda m: one(_packed_rows(batch, _micro(layout, m))), m
        )
        per_token, (unrecorded, agree) = jax.lax.map(micro, jnp.arange(layout.num_micro_batches))
        index = (layout.rows, layout.cols, layout.valid)
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # [M, R, L] -> [M * R, L]
        logps, ents, ref, counter = (packing.unpack(flat(x), index) for x in per_token)  # [N, T]
    logps = jax.lax.stop_gradient(logps)
    if sc.old_logps == "sampler":
        logps = batch.sampler_logps
    adv = advantages.compute(
        batch.rewards,
        group_ids=batch.group_ids,
        num_groups=sc.num_groups,
        cfg=sc.advantage,
        valid=batch.valid,
        shaping=batch.shaping,
    )
    batch = batch.replace(
        old_logps=logps,
        old_entropies=ents,
        ref_logps=ref,
        advantages=adv.sequence_advantages,
        zvp_sign=adv.zvp_sign,
    )
    metrics = dict(adv.metrics)
    if not sc.fused_old_logps:
        metrics["mismatch/unrecorded_routes"] = unrecorded.sum().astype(jnp.float32)
        metrics.update(mismatch_metrics(sc, logps, batch.sampler_logps, batch.loss_mask))
    if sc.replay_counterfactual:
        cf = _log_ratio_metrics(counter, batch.sampler_logps, batch.loss_mask)
        metrics.update({f"mismatch/counterfactual/{k}": v for k, v in cf.items()})
        agreeing, pairs = agree.sum(0)  # [L] each; a dense layer has no pairs
        for layer in sc.model.moe_layers:
            metrics[f"mismatch/free_agreement/layer_{layer}"] = agreeing[layer] / jnp.maximum(
                pairs[layer], 1.0
            )
    return batch, metrics


def mismatch_metrics(sc: StepConfig, logps, sampler_logps, mask) -> dict:
    """Trainer (pi_old) against sampler log-probs on the loss tokens `mask`: k3 KL(sampler ||
    trainer), the fraction with |dlogp| > ln 2, mean |dlogp|, and the sampler correction the
    loss applies (`espo.correction`)."""
    fix = correction.correct(sc.loss, old_logps=logps, sampler_logps=sampler_logps, mask=mask)
    return {
        f"mismatch/{k}": v
        for k, v in {**_log_ratio_metrics(logps, sampler_logps, mask), **fix.metrics}.items()
    }


def _log_ratio_metrics(logps, sampler_logps, mask) -> dict:
    """k3_kl, extreme_token_frac and abs_dlogp_mean of trainer against sampler log-probs on
    the tokens `mask` (`mismatch_metrics` without the correction)."""
    n = jnp.maximum(mask.sum(), 1)
    clamp = losses.LOG_RATIO_CLAMP  # the losses' clamp on log ratios, also for the metrics
    d = jnp.where(mask, jnp.clip(logps - sampler_logps, -clamp, clamp), 0.0)  # trainer - sampler
    return {
        "k3_kl": jnp.where(mask, jnp.expm1(d) - d, 0.0).sum() / n,
        "extreme_token_frac": jnp.where(mask, jnp.abs(d) > jnp.log(2.0), False).sum() / n,
        "abs_dlogp_mean": jnp.where(mask, jnp.abs(d), 0.0).sum() / n,
    }


def _micro_loss(sc: StepConfig, params, mb, packed=None):
    """(numerator + denominator * router aux loss, (LossOutput, aux)) of one micro-batch.

    packed: None (`mb` is the micro-batch's rows), or a `_Micro`: `mb` is the whole mini-batch
    [n, T], the micro-batch is its packed rows `packed`, and the loss runs on the unpacked
    [n, T] layout with m's sequences as its only loss tokens. Every per-sequence quantity
    (seq-mean aggregations, GSPO / ESPO ratios and entropy groups, sequence IS weights) is
    then per segment by construction, and the other sequences, with no loss token, leave every
    denominator: summed over micro-batches, numerators and denominators are the full batch's.
    """
    rows = _padded_rows(mb) if packed is None else _packed_rows(mb, packed)
    tl = _rows_logps(sc, params, rows, replay_missing="free")
    # The router's own choices on this forward against the rollout's (free of charge: the
    # router logits are computed anyway; under replay, each layer on the replayed context).
    agree, num_agree = (
        x.sum()
        for x in _expert_agreement(tl.aux.router_ids, rows.router.expert_ids, rows.loss_mask)
    )
    if packed is None:
        loss_mask = mb.loss_mask
    else:
        index = packed.index
        tl = tl._replace(logps=packing.unpack(tl.logps, index))
        tl = tl._replace(entropies=packing.unpack(tl.entropies, index))
        loss_mask = mb.loss_mask & index[2]  # [n, T]
    old_logps, old_entropies = mb.old_logps, mb.old_entropies
    if sc.fused_old_logps:  # pi_old is this forward's policy: its values, no gradient
        old_logps, old_entropies = jax.lax.stop_gradient((tl.logps, tl.entropies))
    pick = lambda source: select_entropies(
        source, old=old_entropies, sampler=mb.sampler_entropies, current=tl.entropies
    )
    adv = advantages.token_advantages(
        mb.advantages,
        mb.zvp_sign,
        entropies=pick(sc.entropy.rl_zvp),
        mask=loss_mask,
        alpha=sc.advantage.rl_zvp_alpha,
    )  # [B, T]
    out = losses.compute_loss(
        sc.loss,
        logps=tl.logps,
        old_logps=old_logps,
        advantages=adv,
        mask=loss_mask,
        # ESPO groups by them; every loss reports entropy and gradient use per entropy group.
        entropies=pick(sc.entropy.espo),
        ref_logps=mb.ref_logps if sc.loss.kl_coef > 0 else None,
        finished=mb.finished,
        sampler_logps=mb.sampler_logps,
    )
    extra = {"num_agreeing": agree, "num_agreement_pairs": num_agree.astype(jnp.float32)}
    if sc.fused_old_logps:  # what `prepare` measures otherwise (token means: _combine weighs them)
        extra.update(mismatch_metrics(sc, old_logps, mb.sampler_logps, loss_mask))
        extra["num_unrecorded_routes"] = tl.aux.num_unrecorded_routes.astype(jnp.float32)
        extra["num_mismatch_tokens"] = loss_mask.astype(jnp.float32).sum()  # before rejection
    out = out.replace(metrics={**out.metrics, **extra})
    # The router's aux loss weighted by this micro-batch's share of the denominator, so the
    # accumulated objective is (sum num + sum den * aux) / sum den: exact over micro-batches.
    return out.numerator + out.denominator * tl.aux.total, (out, tl.aux)


def _combine(metrics: dict, weights: Array) -> dict:
    """Per-micro-batch metrics [M] -> one value: counts summed, maxima (`*_max`) the largest,
    the rest weighted by tokens."""
    total = jnp.maximum(weights.sum(), 1.0)
    one = lambda k, v: (
        v.sum() if k.startswith("num_") else v.max() if k.endswith("_max")
        else (v * weights).sum() / total
    )  # fmt: skip
    return {k: one(k, v) for k, v in metrics.items()}


def train_step(sc: StepConfig, optimizer: optax.GradientTransformation, state: TrainState, mini):
    """One optimiser update on a mini-batch: exact micro-batch accumulation.

    `mini` is [M, micro, ...] (`batching.minibatches`), or a `batching.PackedMiniBatch` (the
    mini-batch [n, ...] and its `packing.Layout` of M packed rows, one per micro-batch; rows of
    padding only are skipped). The gradient is sum_m grad(numerator_m + den_m * aux_m) /
    sum_m den_m: the same as one forward over the whole mini-batch (test_trainer checks it),
    whatever M is. (The router aux loss is a mean per micro-batch: packed and padded
    micro-batches group the tokens differently, so only that term differs between them.)
    """
    grad_fn = jax.grad(functools.partial(_micro_loss, sc), has_aux=True)

    def metrics_of(grads, out_aux):
        out, aux = out_aux
        metrics = dict(out.metrics, numerator=out.numerator, denominator=out.denominator)
        metrics["router_aux_loss"] = aux.total
        # Which expert-parallel path the MoE layers took (summed: layers x micro-batches).
        metrics["num_moe_all_to_all"], metrics["num_moe_all_gather"] = aux.expert_parallel
        return grads, metrics

    def body(acc, mb):
        grads, metrics = metrics_of(*grad_fn(params, mb))
        return jax.tree.map(jnp.add, acc, grads), metrics

    def packed_body(acc, m):
        lay = _micro(mini.layout, m)
        grads, metrics = _unless_empty(
            lay.segment_ids.any(),
            lambda lay: metrics_of(*grad_fn(params, mini.batch, lay)),
            lay,
        )
        return jax.tree.map(jnp.add, acc, grads), metrics

    params = _layer_params(sc, state.params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    if isinstance(mini, batching.PackedMiniBatch):
        m = jnp.arange(mini.layout.num_micro_batches)
        grads, per_micro = jax.lax.scan(packed_body, zeros, m)
    else:
        grads, per_micro = jax.lax.scan(body, zeros, mini)
    if not sc.scan_layers:
        grads = transformer.stack_layers(sc.model, grads)
    den = per_micro["denominator"].sum()
    # The mean gradient in each parameter's dtype (the accumulator's): the optimiser state keeps
    # the dtypes `init` gave it. With bf16 params a float32 mean (den is float32) turned Adam's
    # moments float32 after the first update: twice their memory, a second compile, and no
    # aliasing of the donated state (found by experiments/aot.py).
    grads = jax.tree.map(lambda g: (g / jnp.maximum(den, 1.0)).astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    skip = ("numerator", "denominator", "num_unrecorded_routes", "num_mismatch_tokens")
    skip += ("num_agreeing", "num_agreement_pairs")
    is_loss = lambda k: not k.startswith("mismatch/") and k not in skip
    metrics = {
        f"loss/{k}": v
        for k, v in _combine(per_micro, per_micro["num_tokens"]).items()
        if is_loss(k)
    }
    if sc.fused_old_logps:  # over the loss tokens before rejection, as `prepare` measures them
        # (the correction's own means are weighted by those tokens too: exact for token means)
        mismatch = {k: v for k, v in per_micro.items() if k.startswith("mismatch/")}
        metrics.update(_combine(mismatch, per_micro["num_mismatch_tokens"]))
        metrics["mismatch/unrecorded_routes"] = per_micro["num_unrecorded_routes"].sum()
    # Over (row, MoE layer, loss position) of every micro-batch, as one forward would.
    pairs = jnp.maximum(per_micro["num_agreement_pairs"].sum(), 1.0)
    metrics["mismatch/router_agreement"] = per_micro["num_agreeing"].sum() / pairs
    metrics["loss/loss"] = per_micro["numerator"].sum() / jnp.maximum(den, 1.0)
    metrics["optim/grad_norm"] = optax.global_norm(grads)
    metrics["optim/update_norm"] = optax.global_norm(updates)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new, metrics


SCHEDULES = ("cosine", "constant")  # OptimizerConfig.schedule
OLD_LOGPS = ("recompute", "sampler")  # TrainConfig.old_logps


def schedule_rules(cfg) -> dict[str, tuple[bool, str]]:
    """`errors.check` rules of a config's learning_rate and warmup_steps (the RL optimiser's and
    the warm start's)."""
    return {
        "learning_rate": (errors.is_real(cfg.learning_rate) and cfg.learning_rate > 0, "> 0"),
        "warmup_steps": (errors.is_int(cfg.warmup_steps) and cfg.warmup_steps >= 0, ">= 0"),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """optax AdamW with linear warmup then cosine (or constant), global-norm clipped."""

    learning_rate: float
    warmup_steps: int = 0
    schedule: str = "cosine"
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    def __post_init__(self):
        errors.check(
            self,
            {
                **schedule_rules(self),
                "schedule": (self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
                "end_lr_ratio": (
                    errors.is_real(self.end_lr_ratio) and 0 <= self.end_lr_ratio <= 1,
                    "[0, 1]",
                ),
                "weight_decay": (
                    errors.is_real(self.weight_decay) and self.weight_decay >= 0,
                    ">= 0",
                ),
                "b1": (errors.is_real(self.b1) and 0 <= self.b1 < 1, "[0, 1)"),
                "b2": (errors.is_real(self.b2) and 0 <= self.b2 < 1, "[0, 1)"),
                "eps": (errors.is_real(self.eps) and self.eps > 0, "> 0"),
                "max_grad_norm": (
                    errors.is_real(self.max_grad_norm) and self.max_grad_norm >= 0,
                    ">= 0",
                ),
            },
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The RL loop: batch sizes, epochs, router replay and where pi_old comes from."""

    steps: int
    prompts_per_step: int
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # rows per optimiser update; 0 = the whole batch
    micro_batch_size: int = 64  # rows per forward / backward
    packing: bool = False  # packed updates: micro-batches of max_tokens_per_micro_batch tokens
    max_tokens_per_micro_batch: int = 4096  # token budget of a packed micro-batch (train.packing)
    router_replay: bool = True
    old_logps: str = "recompute"
    espo_entropy: str = "old"
    rl_zvp_entropy: str = "current"
    scan_layers: bool = True  # False: the update differentiates an unrolled loop over layers
    replay_counterfactual: bool = False  # also pi_old under the other routing (a diagnostic)
    log_every: int = 1

    def __post_init__(self):
        errors.check(
            self,
            {
                "steps": (errors.is_int(self.steps) and self.steps >= 0, "an int >= 0"),
                "prompts_per_step": (
                    errors.is_int(self.prompts_per_step) and self.prompts_per_step >= 1,
                    "an int >= 1",
                ),
                "ppo_epochs": (
                    errors.is_int(self.ppo_epochs) and self.ppo_epochs >= 1,
                    "an int >= 1",
                ),
                "mini_batch_size": (
                    errors.is_int(self.mini_batch_size) and self.mini_batch_size >= 0,
                    "an int >= 0 (0: the whole batch)",
                ),
                "micro_batch_size": (
                    errors.is_int(self.micro_batch_size) and self.micro_batch_size >= 1,
                    "an int >= 1",
                ),
                "packing": (isinstance(self.packing, bool), "True or False"),
                "max_tokens_per_micro_batch": (
                    errors.is_int(self.max_tokens_per_micro_batch)
                    and self.max_tokens_per_micro_batch >= 1,
                    "an int >= 1",
                ),
                "router_replay": (isinstance(self.router_replay, bool), "True or False"),
                "scan_layers": (isinstance(self.scan_layers, bool), "True or False"),
                "replay_counterfactual": (
                    isinstance(self.replay_counterfactual, bool),
                    "True or False",
                ),
                "old_logps": (self.old_logps in OLD_LOGPS, f"one of {OLD_LOGPS}"),
                "log_every": (errors.is_int(self.log_every) and self.log_every >= 1, "an int >= 1"),
            },
        )

    def batch_rows(self, max_group_size: int) -> tuple[int, int, int]:
        """(rows, mini-batch rows, micro-batch rows) of the fixed-shape optimiser batch."""
        rows = self.prompts_per_step * max_group_size
        mini = self.mini_batch_size or rows
        micro = min(self.micro_batch_size, mini)
        rows = -(-rows // mini) * mini  # pad the batch up to whole mini-batches
        if mini % micro:
            raise errors.InvalidValue(
                "TrainConfig", "micro_batch_size", self.micro_batch_size,
                f"a divisor of the mini-batch ({mini} rows)",
            )  # fmt: skip
        return rows, mini, micro


# Cached: the same settings give the same transformation object, so a jitted step built on it
# (`trainer._jit`) is found again by a later run in the same process.
@functools.cache
def make_optimizer(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    end_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then cosine decay to end_lr_ratio (or constant), clipped."""
    warmup = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
    rest = max(total_steps - warmup_steps, 1)
    if schedule == "cosine":
        after = optax.cosine_decay_schedule(learning_rate, rest, alpha=end_lr_ratio)
    else:
        after = optax.constant_schedule(learning_rate)
    lr = optax.join_schedules([warmup, after], [warmup_steps]) if warmup_steps else after
    chain = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
    chain.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*chain), lr
