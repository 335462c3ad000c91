"""Shared test fixtures: tiny random Hugging Face MoE checkpoints, a fake sampling model,
reward functions for spawned workers, `load_script` (experiment scripts by path) and
`jaxpr_equations` (every equation of a traced program, for structure tests).

Importing this module needs only espo; building Hugging Face models needs the `test` extras
(torch, transformers), imported lazily. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from espo import errors


def make_hf_checkpoint(
    path: str | pathlib.Path,
    *,
    architecture: str = "Qwen3MoeForCausalLM",
    seed: int = 0,
    init_std: float = 0.2,
    **overrides,
) -> pathlib.Path:
    """Save a random tiny Qwen3-MoE or Mixtral model created by transformers to `path`.

    `init_std` is large enough (vs Hugging Face's 0.02) that logits and router decisions are far
    from degenerate, so parity checks are sensitive.
    """
    import torch
    import transformers

    from espo.model import hf

    common = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )
    if architecture == hf.QWEN3_MOE:
        kw = common | dict(num_experts=6, moe_intermediate_size=16, intermediate_size=24)
        config_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    elif architecture == hf.MIXTRAL:
        kw = common | dict(num_local_experts=6, intermediate_size=16, sliding_window=None)
        config_cls, model_cls = transformers.MixtralConfig, transformers.MixtralForCausalLM
    else:
        raise ValueError(f"architecture={architecture!r}; valid: {hf.SUPPORTED_ARCHITECTURES}")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(kw | overrides))).eval()
    path = pathlib.Path(path)
    model.save_pretrained(path)
    return path


def hf_forward(path, tokens: np.ndarray, *, attention_mask=None, position_ids=None):
    """(float32 logits [B, T, V], top-k expert ids per layer {layer: [B*T, K]}) from transformers.

    The expert ids are what transformers' own router modules return, captured with hooks.
    """
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    picked: dict[int, np.ndarray] = {}

    def hook(layer):
        def fn(_module, _inputs, outputs):
            picked[layer] = outputs[2].numpy()  # (router_logits, router_scores, router_indices)

        return fn

    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        gate = getattr(block, "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):
            gate.register_forward_hook(hook(i))
    as_t = lambda a: None if a is None else torch.as_tensor(np.asarray(a))
    with torch.no_grad():
        out = model(
            input_ids=as_t(tokens),
            attention_mask=as_t(attention_mask),
            position_ids=as_t(position_ids),
        )
    return out.logits.float().numpy(), picked


# ---- losses --------------------------------------------------------------------------------


@functools.cache
def num_den_grad(cfg):
    """jit((batch) -> (numerator, denominator, d numerator / d logps)) of
    `espo.losses.compute_loss` under the `LossConfig` cfg, compiled once per cfg."""
    from espo import losses

    @jax.jit
    def f(batch):
        def num(logps):
            out = losses.compute_loss(cfg, **{**batch, "logps": logps})
            return out.numerator, out.denominator

        (n, d), g = jax.value_and_grad(num, has_aux=True)(batch["logps"])
        return n, d, g

    return f


# ---- train batches -----------------------------------------------------------------------------


@functools.cache
def _jit_on_config(fn):
    """`fn(cfg, ...)` jitted with its config static (one jit object per function)."""
    return jax.jit(fn, static_argnums=0)


def random_train_batch(
    cfg, *, num_rows: int, prompt_length: int, generation_length: int, seed: int = 0,
    lengths: tuple[np.ndarray, np.ndarray] | None = None,
):  # fmt: skip
    """(a non-degenerate `espo.batching.TrainBatch`, the params it was traced with): ragged
    left-padded prompts and right-padded completions (`lengths` = (prompt, completion) per row,
    random >= 1 by default), the router trace of a forward, row 1 with a failed reward (no loss
    token), sampler / old log-probs at +-N(0, 0.1) of the current ones, groups of 4 rows."""
    from espo import batching, train_step, types
    from espo import model as model_lib

    N, TP, TG = num_rows, prompt_length, generation_length
    rng = np.random.default_rng(seed)
    # Jitted (one compile per config, then ~0 s): op by op, init and the two forwards took ~4 s
    # a batch on 2 CPU cores, in each of the many tests that build one.
    init, forward, token_logps = map(
        _jit_on_config, (model_lib.init, model_lib.forward, train_step.token_logps)
    )
    params = init(cfg, jax.random.key(seed))
    tokens = rng.integers(2, cfg.vocab_size, (N, TP + TG)).astype(np.int32)
    plen, clen = lengths or (rng.integers(1, TP + 1, N), rng.integers(1, TG + 1, N))
    plen, clen = np.asarray(plen)[:, None], np.asarray(clen)[:, None]
    pos = np.arange(TP + TG)
    attn = ((pos >= TP - plen) & (pos < TP)) | ((pos >= TP) & (pos < TP + clen))
    loss_mask = (pos >= TP) & (pos < TP + clen)
    valid = np.ones(N, bool)
    valid[1] = False  # a failed reward: no loss token, so micro-batch denominators differ
    loss_mask &= valid[:, None]
    out = forward(cfg, params, jnp.asarray(tokens), attention_mask=jnp.asarray(attn))
    ids = np.where(attn[:, None, :, None], np.asarray(out.router.expert_ids), -1)
    logps = np.asarray(token_logps(cfg, params, tokens, attn).logps)
    noise = rng.normal(0, 0.1, logps.shape).astype(np.float32)
    on_loss = lambda x: np.where(loss_mask, x, 0.0).astype(np.float32)
    batch = batching.TrainBatch(
        tokens=tokens,
        attention_mask=attn,
        loss_mask=loss_mask,
        router=types.RouterTrace(
            expert_ids=ids.astype(np.int32), expert_weights=np.zeros(ids.shape, np.float32)
        ),
        sampler_logps=on_loss(logps + noise),
        sampler_entropies=on_loss(rng.uniform(0, 2, logps.shape)),
        finished=rng.random(N) < 0.7,
        group_ids=np.repeat(np.arange(N // 4), 4).astype(np.int32),
        rewards=rng.integers(0, 2, N).astype(np.float32),
        shaping=rng.uniform(-0.2, 0, N).astype(np.float32),
        valid=valid,
        old_logps=on_loss(logps - noise),
        old_entropies=on_loss(rng.uniform(0, 2, logps.shape)),
        ref_logps=np.zeros(logps.shape, np.float32),
        advantages=rng.normal(0, 1, N).astype(np.float32),
        zvp_sign=np.resize(np.array([0, 0, 1, 1, 0, -1, 0, 0], np.int32), N),
    )
    return batch, params


def sgd_update(sc, params, mini):
    """`espo.train_step.train_step` (jitted) with SGD at learning rate 1 from step 0: the new
    params are params - gradient. Returns (new TrainState, metrics)."""
    import optax

    from espo import train_step

    state = train_step.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optax.sgd(1.0).init(params)
    )
    return _sgd_step(sc)(state, mini)


@functools.cache
def _sgd_step(sc):
    """One jit per step config: tests repeat configs, and a new jit object traces the step again
    (seconds) even when XLA's cache holds its program."""
    import optax

    from espo import train_step

    return jax.jit(functools.partial(train_step.train_step, sc, optax.sgd(1.0)))


# ---- reward functions for the reward-pool tests (importable by spawned worker processes) ------


def length_reward(prompt: str, completion: str, meta) -> float:
    """len(completion) / 10, after sleeping meta.get("sleep", 0) seconds."""
    time.sleep(float(meta.get("sleep", 0.0)))
    return len(completion) / 10.0


def prompt_parity_reward(prompt: str, completion: str, meta) -> float:
    """The parity of the sum of the prompt's character codes: a reward known before sampling
    (pass rates exactly 0 or 1)."""
    return float(sum(map(ord, prompt)) % 2)


def misbehaving_reward(prompt: str, completion: str, meta) -> float:
    """Hangs, crashes the process, raises or returns garbage, as `completion` asks."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(3)
    if completion == "raise":
        raise RuntimeError("reward function failed")
    if completion == "garbage":
        return "not a number"  # type: ignore[return-value]
    if completion == "nan":
        return float("nan")
    return 1.0


# ---- a fake model for the sampler and the rollout ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class CountingModel:
    """A `SamplingModel` whose next token after t is (t + 1) % vocab (near-certain by default).

    The next-token logits after token t are `sharpness + spread * (t % 3)` at (t + 1) % vocab and
    0 elsewhere. With the default sharpness 30 the next token is near-certain (log-probs and
    entropies ~1e-12): completion lengths are known in advance (from a last prompt token t, a
    stop id s comes after (s - t) % vocab tokens). A small sharpness gives a real distribution
    (sharpness 0: uniform; sharpness 1, spread 1: p(peak) = 0.28 / 0.51 / 0.74 for vocab 8, so
    log-probs, entropies and their positions can all be told apart). The "expert" of a token is
    token % 3 (`NUM_EXPERTS` = 3), so every position of a router trace can be checked.
    `step_delay_s` makes each forward take that long (a host callback), standing in for a model
    whose decode is slow.

    Its KV cache has the real layout (`espo.model.layers.KVCache`: k, v a [B, N, S, head_dim]
    buffer a layer, here N = 1 head of width 2) and holds each cached token's id in k[l][..., 0],
    so a cache written in the wrong slots or rows shows; its `aux` is a real `ModelAux` of zeros.
    """

    NUM_EXPERTS = 3  # the "expert" of token t is t % 3
    HEAD_DIM = 2

    vocab: int = 8
    num_layers: int = 1
    top_k: int = 1
    step_delay_s: float = 0.0
    sharpness: float = 30.0  # logit of the next token (others 0)
    spread: float = 0.0  # added to the next token's logit per unit of token % 3

    def logits(self, tokens):
        """Next-token logits [B, T, V] after each token of `tokens` [B, T] (see the docstring)."""
        peak = self.sharpness + self.spread * (tokens % 3)  # [B, T]
        return peak[..., None] * jax.nn.one_hot((tokens + 1) % self.vocab, self.vocab)

    def init_cache(self, *, batch, max_length):
        from espo.model import layers

        shape = (batch, 1, max_length, self.HEAD_DIM)  # [B, N, S, Dh] a layer
        return layers.KVCache(
            k=tuple(jnp.zeros(shape, jnp.float32) for _ in range(self.num_layers)),
            v=tuple(jnp.zeros(shape, jnp.float32) for _ in range(self.num_layers)),
            kv_positions=jnp.full((batch, max_length), -1, jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    def forward(self, params, tokens, *, attention_mask=None, cache=None):
        from espo import types
        from espo.model import layers, transformer

        del params
        B, T = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), bool)
        logits = self.logits(tokens)  # [B, T, V]
        if self.step_delay_s:
            delay = self.step_delay_s

            def wait(x):
                time.sleep(delay)
                return np.zeros_like(x)

            logits = logits + jax.pure_callback(
                wait, jax.ShapeDtypeStruct(logits.shape, logits.dtype), logits
            )
        if cache is not None:
            positions = jnp.where(attention_mask, 0, -1).astype(jnp.int32)  # [B, T]
            kv = jnp.broadcast_to(
                tokens.astype(jnp.float32)[:, None, :, None], (B, 1, T, self.HEAD_DIM)
            )  # [B, N, T, Dh]: each token's id, at its slots
            write = lambda c: jax.lax.dynamic_update_slice(c, kv, (0, 0, cache.index, 0))
            cache = layers.KVCache(
                k=tuple(map(write, cache.k)),
                v=tuple(map(write, cache.v)),
                kv_positions=jax.lax.dynamic_update_slice(
                    cache.kv_positions, positions, (0, cache.index)
                ),
                index=cache.index + T,
            )
        ids = (tokens % 3)[:, None, :, None].astype(jnp.int32)  # [B, 1, T, 1]
        ids = jnp.broadcast_to(ids, (B, self.num_layers, T, self.top_k))  # [B, L, T, K]
        router = types.RouterTrace(expert_ids=ids, expert_weights=jnp.ones(ids.shape))
        aux = transformer.ModelAux(
            load_balancing_loss=jnp.zeros((), jnp.float32),
            z_loss=jnp.zeros((), jnp.float32),
            expert_load=jnp.zeros((self.num_layers, self.NUM_EXPERTS), jnp.float32),
            total=jnp.zeros((), jnp.float32),
            num_unrecorded_routes=jnp.zeros((), jnp.int32),
            expert_parallel=jnp.zeros((2,), jnp.int32),
        )
        return transformer.ModelOutput(logits=logits, cache=cache, router=router, aux=aux)


def draw_without_pixels(path: pathlib.Path, title, axes_spec, series) -> None:
    """A stand-in for `espo.plots._draw` in tests that read no picture: every panel's series is
    still looked up (and its steps and values checked to pair up), and the panel's file is
    written empty."""
    for _, keys in axes_spec:
        for key in keys:
            steps, values = series[key]
            assert len(steps) == len(values), key
    path.write_bytes(b"")


def jaxpr_equations(jaxpr):
    """(equation, the jaxpr holding it) for every equation of `jaxpr` and, depth first, of its
    sub-jaxprs (jit calls, loop bodies, conds, custom_vjp functions)."""
    for eqn in jaxpr.eqns:
        yield eqn, jaxpr
        for p in eqn.params.values():
            for j in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(j, "jaxpr", j)  # a ClosedJaxpr's Jaxpr, or the Jaxpr itself
                if hasattr(inner, "eqns"):
                    yield from jaxpr_equations(inner)


def emulated_devices_env(count: int) -> dict[str, str]:
    """This process's environment for a subprocess that emulates `count` CPU devices: the
    device-count flag added to the XLA_FLAGS already set (the tests' compile options kept), and
    the CPU platform (on a GPU machine JAX would otherwise take its one GPU)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")


def load_script(path: str | os.PathLike, *, name: str | None = None):
    """The Python file at `path` as a module (experiment scripts and configs are not in a
    package; pytest runs with --import-mode=importlib). Registered in `sys.modules` under
    `name` (default "espo_script_<file stem>", which shadows no real module), so its
    dataclasses can resolve their module by name."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_script: no file at {path}")
    name = name or f"espo_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load_slowly(seconds: float):
    time.sleep(seconds)
    return length_reward


class SlowLoadingReward:
    """Pickles to a reward function whose loading (in the worker) takes `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        return (_load_slowly, (self.seconds,))


class UnloadableReward:
    """Pickles to something that kills the worker process while it is being loaded."""

    def __reduce__(self):
        return (os._exit, (5,))


class FromSource:
    """A reward fn a spawned worker builds by executing `source` (which defines `reward`).

    The tests run with --import-mode=importlib, so functions defined in a test module cannot be
    unpickled in a spawned worker; `eval` is a builtin, so this pickles to (eval, source).
    """

    def __init__(self, source: str):
        self.source = source

    def __reduce__(self):
        return (eval, (f"(lambda ns: (exec({self.source!r}, ns), ns['reward'])[1])({{}})",))


@contextlib.contextmanager
def raises_invalid(field: str, *, where: str | None = None, kind: type = errors.InvalidValue):
    """`pytest.raises(kind)` that checks the error's field (and owner), not its wording."""
    import pytest  # only tests call this

    with pytest.raises(kind) as info:
        yield info
    got = info.value
    assert got.field == field, f"field {got.field!r}, expected {field!r}: {got}"
    assert where is None or got.where == where, f"where {got.where!r}, expected {where!r}: {got}"


class CountingSafetensors:
    """A safetensors file handle (`safe_open(...)`) that adds the bytes of every tensor or block
    it returns to `n[0]`: how much of a checkpoint a loader reads (`espo.model.hf`'s
    `_open_safetensors` wrapped with it: tests/model/test_hf.py, experiments/bench_load.py)."""

    def __init__(self, handle, n: list):
        self.handle, self.n = handle, n

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def _count(self, array):
        self.n[0] += array.nbytes
        return array

    def get_tensor(self, name):
        return self._count(self.handle.get_tensor(name))

    def get_slice(self, name):
        inner = self.handle.get_slice(name)
        return type("Slice", (), {
            "get_shape": lambda _: inner.get_shape(),
            "__getitem__": lambda _, index: self._count(inner[index]),
        })()  # fmt: skip
