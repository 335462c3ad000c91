"""Prefill + `lax.while_loop` decode with the KV cache: tokens, log-probs, entropies, routing.

`sample` pads prompts (left) to a prompt bucket and the generation budget to a generation bucket,
then runs one jitted function per (model, batch, prompt bucket, generation bucket, G, decoding
settings), so a whole run compiles a bounded number of times (`compile_count()`).

Conventions (what the trainer relies on):
  * Rows are B*G, the G samples of one prompt adjacent (row = prompt * G + sample).
  * A row finishes when it emits ANY of `SamplingParams.stop_ids` (a model may have several:
    Qwen3 stops at <|im_end|> and <|endoftext|>), or when it has generated `max_new_tokens`.
  * `logps[i, t]` is the log-probability of the sampled token under the temperature-scaled
    distribution softmax(logits / temperature), *before* top-p / top-k truncation (the policy's
    own probability, as the trainer recomputes it with `espo.train_step.token_logps`);
    `entropies[i, t]` is the full-vocabulary entropy of that same distribution. With
    temperature == 0 (greedy) both use temperature 1.
  * `mask[i, t]` is True for the sampled tokens, the stop token included; `lengths =
    mask.sum(-1)`. Tokens after the stop are `pad_id`.
  * `router` covers [prompt bucket + generation bucket] positions in the layout of
    `training_inputs`: left-padded prompt, then the completion. Position p holds the experts that
    routed the token *at* p (prefill for prompt tokens, the decode step that consumed the token
    for completion tokens); padding holds -1. A training forward over `training_inputs` with
    `RoutingMode.REPLAY_IDS` therefore uses exactly the rollout's experts.
  * The sampler sees the model only through the `SamplingModel` protocol (`forward` and
    `init_cache`), so a fake model tests it exactly; `espo.model.Model` is the real one (a bare
    `ModelConfig` is wrapped in it). Params may be float or FP8-quantized
    (`espo.quant.quantize_fp8`) transparently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from espo import errors, scheduling, sharding, types
from espo.model import config as config_lib
from espo.model import handle, layers, transformer

DEFAULT_BUCKETS = scheduling.LengthBuckets(
    prompt_buckets=scheduling.geometric_buckets(min_size=16, max_size=8192),
    generation_buckets=scheduling.geometric_buckets(min_size=16, max_size=32768),
)

SampleOutput = types.SampleOutput  # what `sample` and `sample_chunk` return


_is_int = errors.is_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How completions are sampled (names as in vLLM / verl rollout configs).

    `stop_ids` is a non-empty tuple of distinct token ids >= 0 (a list is accepted and stored as
    a tuple); a row finishes at the first of them it emits. An id outside the vocabulary is
    allowed and never fires (`stop_ids=(vocab_size,)` generates exactly max_new_tokens).
    `pad_id` may be one of the stop ids (Qwen3's pad token is its <|endoftext|> stop token):
    completions are delimited by `lengths` / `mask`, never by looking for padding.
    """

    max_new_tokens: int  # hard cap on completion length (the only truncation)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept
    top_k: int = 0  # 0 = no top-k truncation
    stop_ids: tuple[int, ...]  # a row finishes when it emits any of these
    pad_id: int  # padding token (prompts' left padding, completions after the stop)

    def __post_init__(self):
        stop = self.stop_ids
        if isinstance(stop, list | tuple) and all(_is_int(i) for i in stop):
            object.__setattr__(self, "stop_ids", tuple(int(i) for i in stop))
        checks = {
            "max_new_tokens": (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, ">= 1"),
            "temperature": (
                isinstance(self.temperature, numbers.Real) and self.temperature >= 0,
                "a float >= 0 (0: greedy)",
            ),
            "top_p": (isinstance(self.top_p, numbers.Real) and 0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (_is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0: no top-k)"),
            "stop_ids": (
                isinstance(self.stop_ids, tuple)
                and len(self.stop_ids) >= 1
                and all(_is_int(i) and i >= 0 for i in self.stop_ids)
                and len(set(self.stop_ids)) == len(self.stop_ids),
                "a non-empty tuple of distinct token ids >= 0, e.g. (eos_id,)",
            ),
            "pad_id": (_is_int(self.pad_id) and self.pad_id >= 0, "a token id >= 0"),
        }
        errors.check(self, checks)
        object.__setattr__(self, "pad_id", int(self.pad_id))


class SamplingModel(Protocol):
    """What the sampler needs of a model. Implementations must be hashable (jit static)."""

    num_layers: int
    top_k: int

    def forward(self, params, tokens, *, attention_mask, cache) -> transformer.ModelOutput: ...

    def init_cache(self, *, batch: int, max_length: int) -> layers.KVCache: ...


def sampling_model(model: handle.Model | SamplingModel | config_lib.ModelConfig) -> SamplingModel:
    """`model` as a `SamplingModel`: a `ModelConfig` becomes `espo.model.Model(cfg)`; anything
    else must have the protocol's attributes (checked here, not deep inside a trace)."""
    if isinstance(model, config_lib.ModelConfig):
        return handle.Model(model)
    missing = [a for a in ("num_layers", "top_k", "forward", "init_cache") if not hasattr(model, a)]
    if missing:
        raise TypeError(
            f"model={model!r} is not a SamplingModel (missing {missing}): pass an "
            "espo.model.Model, a ModelConfig, or an object with num_layers, top_k, "
            "forward(params, tokens, *, attention_mask, cache) and init_cache(*, batch, max_length)"
        )
    return model


def trace_id_dtype(model: SamplingModel) -> np.dtype:
    """The dtype of the sampler's recorded expert ids: `types.expert_id_dtype` of the model's
    `num_experts`, int32 for a model without that attribute."""
    return types.expert_id_dtype(getattr(model, "num_experts", 2**31))


@flax.struct.dataclass
class _State:
    """The decode loop's carry; rows (R) sharded along the mesh's data axes (`shard_rows`)."""

    step: Int[Array, " "]
    cache: layers.KVCache
    logits: Float[Array, "R V"]  # next-token logits
    key: jax.Array
    tokens: Int[Array, "R Tg"]
    logps: Float[Array, "R Tg"]
    entropies: Float[Array, "R Tg"]
    done: Bool[Array, " R"]
    lengths: Int[Array, " R"]
    ids: Int[Array, "R L Tg K"]  # `types.expert_id_dtype`
    weights: Float[Array, "R L Tg K"] | None  # None unless `trace_weights`


def _shard_rows(s: _State) -> _State:
    """Each data shard of the context mesh decodes its own rows (and keeps their KV cache)."""
    rows = sharding.constrain_rows
    cache = s.cache.replace(
        k=tuple(map(rows, s.cache.k)),
        v=tuple(map(rows, s.cache.v)),
        kv_positions=rows(s.cache.kv_positions),
    )
    return s.replace(
        cache=cache, logits=rows(s.logits), tokens=rows(s.tokens), logps=rows(s.logps),
        entropies=rows(s.entropies), done=rows(s.done), lengths=rows(s.lengths),
        ids=rows(s.ids), weights=None if s.weights is None else rows(s.weights),
    )  # fmt: skip


def _log_probs(logits, temperature):
    """Temperature-scaled log-probs and entropy (temperature 0 -> the untempered ones)."""
    scale = 1.0 if temperature == 0 else 1.0 / temperature
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) * scale, axis=-1)  # [R, V]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [R]
    return logp, entropy


def _truncate(logp, *, top_p: float, top_k: int):
    """Mask (to -inf) tokens outside the top-k and outside the top-p nucleus."""
    if top_k > 0:
        kth = jax.lax.top_k(logp, top_k)[0][:, -1:]  # [R, 1]
        logp = jnp.where(logp < kth, -jnp.inf, logp)
    if top_p < 1.0:
        sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]  # [R, V], descending
        probs = jnp.exp(sorted_logp)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # [R, V]
        keep = mass_before < top_p * jnp.sum(probs, axis=-1, keepdims=True)
        cutoff = jnp.min(jnp.where(keep, sorted_logp, jnp.inf), axis=-1, keepdims=True)
        logp = jnp.where(logp < cutoff, -jnp.inf, logp)
    return logp


def choose_tokens(logits, key, *, temperature: float, top_p: float, top_k: int):
    """(tokens [R], logps [R], entropies [R]) for one decode step (see module conventions)."""
    logp, entropy = _log_probs(logits, temperature)
    if temperature == 0:
        token = jnp.argmax(logp, axis=-1)
    else:
        # Inverse-CDF sampling: one uniform per row instead of a Gumbel per vocabulary entry
        # (the PRNG dominates a CPU decode step otherwise).
        probs = jnp.exp(_truncate(logp, top_p=top_p, top_k=top_k))  # [R, V], 0 outside
        cdf = jnp.cumsum(probs, axis=-1)  # [R, V]
        u = jax.random.uniform(key, (logits.shape[0], 1)) * cdf[:, -1:]  # [R, 1]
        token = jnp.sum(cdf <= u, axis=-1)  # first index whose cdf exceeds u
        # Float rounding can land past the last kept token: step back to the largest kept one.
        last_kept = logits.shape[-1] - 1 - jnp.argmax(probs[:, ::-1] > 0, axis=-1)
        token = jnp.minimum(token, last_kept)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], entropy


def _is_stop(token: Int[Array, " R"], stop_ids: tuple[int, ...]) -> Bool[Array, " R"]:
    """Whether each token is one of the stop ids (a few static comparisons)."""
    return functools.reduce(jnp.logical_or, [token == i for i in stop_ids])


@flax.struct.dataclass
class Prefix:
    """Completions already generated for each row (a continuation chunk), right-padded."""

    tokens: Int[Array, "R Tg"]
    lengths: Int[Array, " R"]
    logps: Float[Array, "R Tg"]
    entropies: Float[Array, "R Tg"]


_traces = [0]  # how many times jax.jit has traced `_sample_chunk` (see compile_count)


def compile_count() -> int:
    """How many sampling programs have been compiled so far (one per distinct model, shapes and
    decoding settings): `_sample_chunk` counts its own traces, one per new signature, each then
    compiled (or read from the persistent compilation cache) when it runs; a trace that is never
    run (`jax.make_jaxpr`, `.lower`) counts too. It only grows. Not the jitted
    function's `_cache_size()`: that is its share of jax.jit's global C++ dispatch cache (8192
    entries, LRU), which a long process fills, and then it reads 0 however much was compiled."""
    return _traces[0]


def sample_chunk(
    model: handle.Model | SamplingModel | config_lib.ModelConfig,
    params,
    prompts: Int[Array, "B Tp"],
    prompt_mask: Bool[Array, "B Tp"],
    key: jax.Array,
    budget: Int[Array, " "],
    prefix: Prefix | None = None,
    *,
    num_samples: int,
    gen_len: int,
    sampling: SamplingParams,
    steps_per_check: int = 1,
    trace_weights: bool = True,
) -> SampleOutput:
    """One compiled chunk: left-padded prompts [B, Tp] -> B*G rows of at most `budget` tokens.

    `sampling` gives the decoding settings (temperature, top-p, top-k, stop and pad ids); its
    `max_new_tokens` is not used here: `budget` (a traced scalar, so budgets share a compile)
    caps this chunk, and `gen_len` (static) is the buffer length.

    With a `prefix` (num_samples must be 1) each row continues its already generated tokens:
    the prefill covers prompt + prefix and generation resumes at the row's prefix length; the
    output holds prefix + new tokens, and the trace of the prefix positions comes from that
    prefill. A row stops at a stop id or when its total generated length reaches `budget`.

    `steps_per_check` decode steps run between two checks of the loop's condition (vLLM's
    multi-step scheduling): on a GPU every check is a device-to-host copy the next step waits
    for. The steps past the last live row are masked (every write keeps the row's value), so
    the output is the same for any value; `num_steps` counts the steps run, rounded up to a
    multiple of it. It is taken down to a divisor of `gen_len` (the cache has no slot past it).

    The router trace holds ids in `types.expert_id_dtype` of the model's `num_experts` (int32
    for a model without that attribute), and the gate weights only with `trace_weights`: an RL
    rollout replays ids alone, and at Qwen3-235B's 8k tokens a chunk's float32 weights are
    23.5 GiB that the host and every device would carry for nothing.
    """
    if prefix is not None and num_samples != 1:
        raise ValueError(f"a prefix (continuation) needs num_samples=1, got {num_samples}")
    model = sampling_model(model)
    if hasattr(model, "decode_params"):  # e.g. per-layer weights on CPU, split outside the jit
        params = model.decode_params(params)
    return _sample_chunk(
        model, params, prompts, prompt_mask, key, budget, prefix,
        num_samples=num_samples, gen_len=gen_len, temperature=float(sampling.temperature),
        top_p=float(sampling.top_p), top_k=int(sampling.top_k), stop_ids=sampling.stop_ids,
        pad_id=sampling.pad_id, steps_per_check=math.gcd(int(steps_per_check), gen_len),
        trace_weights=bool(trace_weights),
    )  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "model", "num_samples", "gen_len", "temperature", "top_p", "top_k", "stop_ids", "pad_id",
        "steps_per_check", "trace_weights",
    ),
)  # fmt: skip
def _sample_chunk(
    model: SamplingModel,
    params,
    prompts: Int[Array, "B Tp"],
    prompt_mask: Bool[Array, "B Tp"],
    key: jax.Array,
    budget: Int[Array, " "],
    prefix: Prefix | None,
    *,
    num_samples: int,
    gen_len: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_ids: tuple[int, ...],
    pad_id: int,
    steps_per_check: int = 1,
    trace_weights: bool = True,
) -> SampleOutput:
    """`sample_chunk` with the decoding settings as hashable statics (one compile per value)."""
    _traces[0] += 1  # runs while tracing only
    B, Tp = prompts.shape
    G, R, L, K = num_samples, prompts.shape[0] * num_samples, model.num_layers, model.top_k
    rep = lambda a: jnp.repeat(a, G, axis=0)
    steps = jnp.arange(gen_len)
    id_dtype = trace_id_dtype(model)

    if prefix is None:
        inputs, input_mask, cache_len = prompts, prompt_mask, Tp + gen_len
        start = jnp.zeros((R,), jnp.int32)
    else:
        start = prefix.lengths.astype(jnp.int32)
        inputs = jnp.concatenate([prompts, prefix.tokens], axis=1)  # [R, Tp + Tg]
        input_mask = jnp.concatenate([prompt_mask, steps[None] < start[:, None]], axis=1)
        cache_len = Tp + 2 * gen_len
    inputs, input_mask = sharding.constrain_rows(inputs), sharding.constrain_rows(input_mask)
    cache = model.init_cache(batch=B, max_length=cache_len)
    pre = model.forward(params, inputs, attention_mask=input_mask, cache=cache)
    last = Tp - 1 + (0 if prefix is None else start)  # each row's last real input position
    logits = jnp.take_along_axis(pre.logits, jnp.broadcast_to(last, (B,))[:, None, None], 1)
    # Share the prefill across the G samples of each prompt: repeat rows, prompt-major.
    cache = pre.cache.repeat(G)
    real = input_mask[:, None, :, None]  # [B, 1, Tp(+Tg), 1]
    trace_ids = rep(jnp.where(real, pre.router.expert_ids, -1).astype(id_dtype))  # [R, L, T, K]
    trace_w = rep(jnp.where(real, pre.router.expert_weights, 0.0)) if trace_weights else None
    if prefix is None:
        tokens = jnp.full((R, gen_len), pad_id, jnp.int32)
        logps = entropies = jnp.zeros((R, gen_len), jnp.float32)
        gen_ids = jnp.full((R, L, gen_len, K), -1, id_dtype)
        gen_w = jnp.zeros((R, L, gen_len, K), jnp.float32) if trace_weights else None
    else:
        in_prefix = steps[None] < start[:, None]  # [R, Tg]
        tokens = jnp.where(in_prefix, prefix.tokens, pad_id).astype(jnp.int32)
        logps = jnp.where(in_prefix, prefix.logps, 0.0)
        entropies = jnp.where(in_prefix, prefix.entropies, 0.0)
        gen_ids = trace_ids[:, :, Tp:]
        gen_w = None if trace_w is None else trace_w[:, :, Tp:]
    prompt_trace = types.RouterTrace(
        expert_ids=trace_ids[:, :, :Tp],
        expert_weights=None if trace_w is None else trace_w[:, :, :Tp],
    )
    rows = jnp.arange(R)

    def step(s: _State) -> _State:
        key, sub = jax.random.split(s.key)
        token, logp, entropy = choose_tokens(
            s.logits, sub, temperature=temperature, top_p=top_p, top_k=top_k
        )
        live = ~s.done & (s.lengths < budget)  # rows still generating take this step
        token = jnp.where(live, token, pad_id)
        out = model.forward(params, token[:, None], attention_mask=live[:, None], cache=s.cache)
        at = jnp.minimum(s.lengths, gen_len - 1)  # each row writes at its own length
        live_lk = live[:, None, None]
        # This step's routing [R, L, K] at each live row's position of a trace buffer.
        trace = lambda buf, new: buf.at[rows, :, at].set(jnp.where(live_lk, new, buf[rows, :, at]))
        return _shard_rows(
            _State(
                step=s.step + 1,
                cache=out.cache,
                logits=out.logits[:, -1],
                key=key,
                tokens=s.tokens.at[rows, at].set(jnp.where(live, token, s.tokens[rows, at])),
                logps=s.logps.at[rows, at].set(jnp.where(live, logp, s.logps[rows, at])),
                entropies=s.entropies.at[rows, at].set(
                    jnp.where(live, entropy, s.entropies[rows, at])
                ),
                done=s.done | (live & _is_stop(token, stop_ids)),
                lengths=s.lengths + live.astype(jnp.int32),
                ids=trace(s.ids, out.router.expert_ids[:, :, 0].astype(id_dtype)),
                weights=None
                if s.weights is None
                else trace(s.weights, out.router.expert_weights[:, :, 0]),
            )
        )

    def body(s: _State) -> _State:
        if steps_per_check == 1:
            return step(s)
        # A loop of known trip count: XLA:GPU runs it without reading a condition back.
        return jax.lax.fori_loop(0, steps_per_check, lambda _, s: step(s), s)

    def cond(s: _State):
        return jnp.any(~s.done & (s.lengths < budget)) & (s.step < gen_len)

    state = _State(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=rep(logits[:, 0]),
        key=key,
        tokens=tokens,
        logps=logps,
        entropies=entropies,
        done=jnp.zeros((R,), bool),
        lengths=start,
        ids=gen_ids,
        weights=gen_w,
    )
    state = jax.lax.while_loop(cond, body, _shard_rows(state))
    # Replicated on the context mesh, if any: the host reads every row (in every process).
    return sharding.replicate(
        SampleOutput(
            prompt_tokens=rep(prompts),
            prompt_mask=rep(prompt_mask),
            tokens=state.tokens,
            mask=steps[None] < state.lengths[:, None],
            lengths=state.lengths,
            finished=state.done,
            num_steps=state.step,
            logps=state.logps,
            entropies=state.entropies,
            router=prompt_trace.concat_time(
                types.RouterTrace(expert_ids=state.ids, expert_weights=state.weights)
            ),
        )
    )


def left_pad(
    prompt_tokens, prompt_lengths: Sequence[int], *, width: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-aligned (left-padded) [B, width] prompts and their mask.

    `prompt_tokens` is a [B, T] array or a list of B token sequences (ragged is fine); row i
    contributes its first `prompt_lengths[i]` tokens.
    """
    B = len(prompt_tokens)
    out = np.full((B, width), pad_id, np.int32)
    mask = np.zeros((B, width), bool)
    for i, (row, n) in enumerate(zip(prompt_tokens, prompt_lengths, strict=True)):
        n = int(n)
        if n > 0:
            out[i, width - n :] = np.asarray(row[:n])
            mask[i, width - n :] = True
    return out, mask


def sample(
    model: handle.Model | SamplingModel | config_lib.ModelConfig,
    params,
    prompt_tokens: Int[np.ndarray, "B T"],
    prompt_lengths: Int[np.ndarray, " B"],
    *,
    key: jax.Array,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_ids: tuple[int, ...],
    pad_id: int,
    buckets: scheduling.LengthBuckets = DEFAULT_BUCKETS,
    steps_per_check: int = 1,
    trace_weights: bool = True,
) -> SampleOutput:
    """`num_samples` completions of each prompt (rows prompt-major), stopping at any stop id.

    Args:
      model: an `espo.model.Model`, any `SamplingModel`, or a `ModelConfig` (wrapped in Model).
      prompt_tokens: [B, T] right-padded (or unpadded) prompts; `prompt_lengths` [B] real lengths.
      max_new_tokens: the generation budget; rounded up to a generation bucket for the buffer
        shape, but no sequence generates more than `max_new_tokens` tokens.
      temperature / top_p / top_k / stop_ids / pad_id: sampling settings (temperature 0 =
        greedy), validated as `SamplingParams`.
      buckets: the prompt and generation lengths compiled for.
      steps_per_check: decode steps between checks of the loop's condition (`sample_chunk`).
      trace_weights: record the router's gate weights as well as its ids (`sample_chunk`).
    """
    sp = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_ids=stop_ids, pad_id=pad_id,
    )  # fmt: skip
    if not _is_int(num_samples) or num_samples < 1:
        raise errors.InvalidValue("", "num_samples", num_samples, "an int >= 1")
    lengths = np.asarray(prompt_lengths)
    if lengths.min() < 1:
        raise ValueError(f"prompt_lengths must be >= 1, got min {lengths.min()}")
    buckets.check_max_new_tokens(sp.max_new_tokens)
    width = buckets.prompt_bucket(int(lengths.max()))
    gen_len = buckets.generation_bucket(sp.max_new_tokens)
    prompts, mask = left_pad(prompt_tokens, lengths, width=width, pad_id=sp.pad_id)
    return sample_chunk(
        sampling_model(model), params, jnp.asarray(prompts), jnp.asarray(mask), key,
        jnp.asarray(sp.max_new_tokens, jnp.int32), num_samples=num_samples, gen_len=gen_len,
        sampling=sp, steps_per_check=steps_per_check, trace_weights=trace_weights,
    )  # fmt: skip
