"""espo's entry point: `python experiments/run.py --config configs/<name>.py[:variant]`.

Config fields are overridden from the command line (`--config.model.num_layers=8`). Until the RL
trainer lands this runs the model demo: build (or load) the MoE, decode greedily with the KV cache
while recording the router trace, then show what router replay buys after a policy update.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, logging
from ml_collections import config_flags

from espo import model

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Run configuration.")


def build_model(model_cfg, *, seed: int):
    """(ModelConfig, params) from the `model` config section."""
    fields = model_cfg.to_dict()
    hf_path = fields.pop("hf_path")
    if hf_path:
        return model.load_hf_checkpoint(hf_path)
    cfg = model.ModelConfig(**fields)
    return cfg, model.init(cfg, jax.random.key(seed))


def greedy_decode(cfg, params, prompts, *, new_tokens):
    """Prefill + cached greedy decode; returns all tokens [B, T] and the rollout's RouterTrace."""
    step = jax.jit(functools.partial(model.forward, cfg))
    B, T0 = prompts.shape
    out = step(params, prompts, cache=model.init_cache(cfg, batch=B, max_length=T0 + new_tokens))
    tokens, traces = [prompts], [out.router]
    for _ in range(new_tokens):
        nxt = jnp.argmax(out.logits[:, -1:], axis=-1).astype(jnp.int32)  # [B, 1]
        tokens.append(nxt)
        out = step(params, nxt, cache=out.cache)
        traces.append(out.router)
    trace = functools.reduce(lambda a, b: a.concat_time(b), traces)
    return jnp.concatenate(tokens, axis=1), trace.slice_time(0, T0 + new_tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "mode"))
def token_logps(cfg, params, tokens, trace=None, mode=model.RoutingMode.FREE):
    out = model.forward(cfg, params, tokens[:, :-1], routing=trace, routing_mode=mode)
    logps = jax.nn.log_softmax(out.logits, axis=-1)
    return jnp.take_along_axis(logps, tokens[:, 1:, None], axis=-1)[..., 0], out.router


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    t0 = time.perf_counter()
    cfg, params = build_model(config.model, seed=config.seed)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    runs = ", ".join(f"{'moe' if m else 'dense'}[{s}:{s + n}]" for m, s, n in cfg.layer_runs())
    print(
        f"model: {num_params / 1e6:.2f}M params; layers {runs}; E={cfg.num_experts} K={cfg.top_k}"
    )

    key = jax.random.key(config.seed + 1)
    prompts = jax.random.randint(
        key, (config.demo.batch, config.demo.prompt_length), 0, cfg.vocab_size, jnp.int32
    )
    tokens, rollout_trace = greedy_decode(cfg, params, prompts, new_tokens=config.demo.new_tokens)
    ids = np.asarray(rollout_trace.expert_ids)  # [B, L, T, K]
    print(f"decoded {tokens.shape[0]}x{config.demo.new_tokens} tokens; trace {ids.shape} [B,L,T,K]")
    print("expert load per MoE layer (share of assignments, E experts):")
    for layer in cfg.moe_layers:
        load = (
            np.bincount(ids[:, layer].reshape(-1), minlength=cfg.num_experts) / ids[:, layer].size
        )
        bar = " ".join(f"{x:.2f}" for x in load)
        print(f"  layer {layer:2d}: {bar}   max/mean={load.max() * cfg.num_experts:.2f}")

    # Router replay: a training forward on the rollout's tokens, after a small policy update,
    # with free routing vs the rollout's experts replayed. Trace positions are aligned with the
    # tokens, so the forward over tokens[:, :-1] replays trace[:, :, :-1].
    rollout_logps, _ = token_logps(cfg, params, tokens)
    noise_keys = jax.random.split(jax.random.key(config.seed + 2), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    scale = config.demo.update_scale
    updated = treedef.unflatten(
        [
            w + scale * jnp.std(w) * jax.random.normal(k, w.shape, w.dtype)
            for w, k in zip(leaves, noise_keys, strict=True)
        ]
    )
    replay_trace = rollout_trace.slice_time(0, tokens.shape[1] - 1)
    free_logps, free_trace = token_logps(cfg, updated, tokens)
    replay_logps, _ = token_logps(cfg, updated, tokens, replay_trace, model.RoutingMode.REPLAY_IDS)
    moe = np.array(cfg.moe_layers)
    changed = np.mean(
        np.sort(np.asarray(free_trace.expert_ids)[:, moe], -1)
        != np.sort(np.asarray(replay_trace.expert_ids)[:, moe], -1)
    )
    print(f"after a {scale:g}-relative update: {100 * changed:.1f}% of expert choices change")
    free_gap = float(jnp.mean(jnp.abs(free_logps - rollout_logps)))
    replay_gap = float(jnp.mean(jnp.abs(replay_logps - rollout_logps)))
    print(f"  mean |logp_train - logp_rollout|  free: {free_gap:.2e}   replayed: {replay_gap:.2e}")
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    app.run(main)
