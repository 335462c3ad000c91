"""Sharded == single-device, run by tests/test_sharding.py in a subprocess with 8 emulated CPU
devices (XLA_FLAGS must be set before jax is imported, so not in the pytest process).

For each mesh (data, fsdp, expert) in MESHES: the forward (free routing and REPLAY_IDS), the
sampler (rows decoded per data shard; in the training layout and in the rollout's own,
`sharding.ROLLOUT_RULES`), the old log-probs of `prepare`, and one SGD train step
(loss, gradient norm, new params), with the parameters placed by `sharding.param_shardings`
and the batch along (data, fsdp), equal the single-device results within 1e-5 (float32); each
device holds E / expert experts and D / fsdp of the model dimension, and with an expert axis
the MoE blocks run expert-parallel (`experts.expert_parallel_dispatch`: a shard_map over the
context mesh, a psum over "expert").
Prints one line per mesh (those given as "d,f,e" arguments, else MESHES); exits non-zero on a
mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from espo import advantages, batching, losses, sampler, sharding, testing, train_step
from espo import model as model_lib

MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4)]
CFG = model_lib.ModelConfig(
    vocab_size=64, d_model=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
    num_experts=8, top_k=2, moe_ffn_dim=16, dense_layers=(0,), dense_ffn_dim=24,
    shared_expert_ffn_dim=8, qk_norm=True, aux_loss_coef=0.01, z_loss_coef=0.001,
    moe_chunk=4,  # rows of 10 tokens: the MoE blocks dispatch 3 chunks of every row's tokens
)  # fmt: skip
N, TP, TG = 16, 4, 6
TOL = dict(atol=1e-5, rtol=1e-5)


def step_config(micro_batch_size: int) -> train_step.StepConfig:
    return train_step.StepConfig(
        model=CFG,
        loss=losses.LossConfig(vocab_size=CFG.vocab_size, name="espo", kl_coef=0.05),
        advantage=advantages.AdvantageConfig(rl_zvp=True),
        entropy=train_step.EntropyConfig(),
        num_groups=N // 4,
        micro_batch_size=micro_batch_size,
        router_replay=True,
    )


def run(params, batch, mesh=None):
    """Forward (free, replay), prepare and one SGD step, on `mesh` (None: one device)."""
    sc = step_config(micro_batch_size=N // 2)
    opt = optax.sgd(1.0)
    mini = batching.split(batch, 2)
    if mesh is not None:
        shard = sharding.param_shardings(mesh, params)
        params = jax.device_put(params, shard)
        batch = sharding.put_batch(batch, mesh)
        mini = sharding.put_batch(mini, mesh, leading=1)
    fwd = jax.jit(model_lib.forward, static_argnums=0, static_argnames="routing_mode")
    # Traced once: its jaxpr is also what `main` searches for the expert-parallel exchange.
    traced = fwd.trace(CFG, params, batch.tokens, attention_mask=batch.attention_mask)
    free = traced.lower().compile()(params, batch.tokens, attention_mask=batch.attention_mask)
    replay = fwd(
        CFG, params, batch.tokens, attention_mask=batch.attention_mask, routing=batch.router,
        routing_mode=model_lib.RoutingMode.REPLAY_IDS,
    )  # fmt: skip
    ref = jax.tree.map(lambda p: p * 1.01, params)
    prepared, _ = jax.jit(functools.partial(train_step.prepare, sc))(params, ref, batch, None)
    state = train_step.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params)
    )
    new, metrics = jax.jit(functools.partial(train_step.train_step, sc, opt))(state, mini)
    # The sampler: 4 prompts x 2 samples, each data shard decoding its rows (threefry random
    # bits do not depend on the sharding, so the tokens are the same).
    prompts, prompt_mask = batch.tokens[:4, :TP], batch.attention_mask[:4, :TP]
    sample = lambda p, cfg=CFG: sampler.sample_chunk(
        model_lib.Model(cfg), p, prompts, prompt_mask, jax.random.key(7), jnp.int32(TG),
        num_samples=2, gen_len=TG,
        sampling=sampler.SamplingParams(max_new_tokens=TG, stop_ids=(CFG.vocab_size,), pad_id=0),
    )  # fmt: skip
    sampled = sample(params)
    # The rollout's own layouts (rollout.param_layout): experts over "expert" ("experts") or
    # over every axis ("experts_all", the model's expert_axes with them), the rest
    # replicated; each decodes the same rows.
    # One device has no layout: every layout's reference is the sampler above (a second
    # compile with other expert_axes would only decode the same rows again).
    in_layout = {}
    for layout, axes in sharding.EXPERT_AXES.items():
        got = sampled
        if mesh is not None:
            rules = sharding.rollout_rules(layout)
            laid = jax.device_put(params, sharding.param_shardings(mesh, params, rules))
            got = sample(laid, dataclasses.replace(CFG, expert_axes=axes))
        in_layout[layout] = (got.tokens, got.logps, got.router.expert_ids)
    out = dict(
        sampled=(sampled.tokens, sampled.logps, sampled.entropies, sampled.router.expert_ids),
        sampled_rollout_layouts=in_layout,
        free=(free.logits, free.router.expert_ids, free.router.expert_weights, free.aux.total),
        replay=(replay.logits, replay.router.expert_weights),
        old_logps=prepared.old_logps,
        ref_logps=prepared.ref_logps,
        params=new.params,
        loss=metrics["loss/loss"],
        grad_norm=metrics["optim/grad_norm"],
    )
    return out, params, traced.jaxpr


def check_expert_parallel_paths(mesh, axes=("expert",)) -> None:
    """`experts.expert_parallel_dispatch` on `mesh` with the experts over `axes`, each path
    (all_to_all within its send capacity, a generous one and the default ~1.25x the mean, where
    a row's slot must be its rank within its destination's block; all_to_all past it so the
    all-gather path runs instead; tokens that do not split and are replicated): output and
    gradient equal the plain loop on one device, and the path reported is the one taken. Also:
    a send capacity that fits the fullest destination exactly stays all_to_all (one less falls
    back); mode "all_gather" with the impl asked for; the buffers sized from the tokens a
    device holds (`_check_buffer_sizes`); bfloat16 cases that keep bf16 in value and gradient
    (no float32 buffer sent or scattered back) and equal the float32 loop on the same rounded
    inputs to bf16's precision. Over more axes than "expert", the float32 cases only."""
    from espo.model import experts

    E, K = _EXPERTS, _TOP_K
    f32, bf16 = jnp.float32, jnp.bfloat16
    a2a, gather, auto = "all_to_all", "all_gather", "auto"
    cases = [  # (tokens, mode, send capacity, path taken: [all_to_all, all_gather], dtype, impl)
        (64, a2a, 64, [1, 0], f32, auto), (64, a2a, None, [1, 0], f32, auto),
        (64, a2a, 1, [0, 1], f32, auto), (36, a2a, None, [0, 1], f32, auto),
        (64, gather, None, [0, 1], f32, "ragged"),
        (64, a2a, "full", [1, 0], f32, auto), (64, a2a, "full - 1", [0, 1], f32, auto),
        (64, a2a, None, [1, 0], bf16, auto), (64, a2a, 1, [0, 1], bf16, auto),
    ]  # fmt: skip
    if axes != ("expert",):  # 8 tokens a device over 8 shards: the default capacity may
        cases = [c for c in cases if c[4] == f32]  # overflow; the path is then all_gather
        cases[1] = (64, a2a, None, "by capacity", f32, auto)
    for M, mode, cap, path, dtype, impl in cases:
        (x, ids, gate, wd), (want, dwant) = _moe_case(M, dtype)
        if isinstance(cap, str):  # the most any shard sends one destination: fits exactly
            cap = _most_sent(ids, mesh, E=E, axes=axes) - (cap == "full - 1")
        if path == "by capacity":  # all_to_all where the default send capacity holds
            n = math.prod(mesh.shape[a] for a in axes)
            default = experts.capacity_for(M // sharding.batch_shards(mesh) * K, n)
            path = [1, 0] if _most_sent(ids, mesh, E=E, axes=axes) <= default else [0, 1]
        ep = functools.partial(
            experts.expert_parallel_dispatch,
            ids=ids,
            mode=mode,
            send_capacity=cap,
            impl=impl,
            axes=axes,
        )
        with jax.set_mesh(mesh):
            placed = jax.device_put(wd, jax.sharding.NamedSharding(mesh, P(axes)))
            with warnings.catch_warnings():  # a float32 update scattered into bf16 (an error
                warnings.simplefilter("error", FutureWarning)  # in later JAX) fails here
                # Traced once: the program run is the one whose equations are checked below.
                traced = jax.jit(functools.partial(_value_and_grad, ep)).trace(x, gate, placed)
                (y, taken), dgot = traced.lower().compile()(x, gate, placed)
        what = f"expert-parallel {mode} M={M} send capacity {cap} {jnp.dtype(dtype).name} {impl}"
        what += f" over {axes}"
        got, expected = jax.tree.leaves((y, dgot)), jax.tree.leaves((want, dwant))
        for a, b in zip(got, expected, strict=True):  # the output, then d x, d gate, d w_*
            assert a.dtype == dtype, (what, a.dtype)
            bf16_tol = dict(rtol=0.03, atol=0.03 * float(jnp.abs(b).max()))
            tol = TOL if dtype == f32 else bf16_tol
            chex.assert_trees_all_close(a.astype(f32), b, **tol, custom_message=what)
        np.testing.assert_array_equal(  # int32 counts, as `aux.expert_parallel` declares
            np.asarray(taken), np.array(path, np.int32), err_msg=what, strict=True
        )
        if cap is None and dtype == f32:
            eqns = [eqn for eqn, _ in testing.jaxpr_equations(traced.jaxpr.jaxpr)]
            if impl == "ragged":  # the impl asked for runs on every device
                assert any(e.primitive.name.startswith("ragged_dot") for e in eqns), what
            else:
                _check_buffer_sizes(eqns, mesh, M=M, E=E, K=K, F=_FFN, axes=axes)


# The expert-parallel cases' E, D, F, K; D = 6 is no other dimension (8 tokens a shard, 12, 36, 64).
_EXPERTS, _WIDTH, _FFN, _TOP_K = 8, 6, 12, 2


@functools.cache
def _moe_case(M: int, dtype) -> tuple:
    """((x, ids, gate, expert weights) of M tokens in `dtype`, the plain loop's (output,
    gradient) on one device in float32 on those rounded inputs). Cached: the inputs depend on M
    and the dtype only, so every case and mesh of the same ones share one reference."""
    from espo.model import moe

    E, D, F, K = _EXPERTS, _WIDTH, _FFN, _TOP_K
    k = jax.random.split(jax.random.key(11), 6)
    w = [jax.random.normal(k[i], s) / 3 for i, s in enumerate([(E, D, F), (E, D, F), (E, F, D)])]
    x = jax.random.normal(k[3], (M, D)).astype(dtype)
    ids = jax.random.randint(k[4], (M, K), -1, E)  # -1: unrecorded, contributes nothing
    gate = jax.nn.softmax(jax.random.normal(k[5], (M, K))).astype(dtype)
    wd = [a.astype(dtype) for a in w]
    ref = functools.partial(_with_no_path, functools.partial(moe.moe_reference, ids=ids))
    f32 = lambda a: a.astype(jnp.float32)
    (want, _), dwant = _value_and_grad(ref, *jax.tree.map(f32, (x, gate, wd)))
    return (x, ids, gate, wd), (want, dwant)


def check_attention_kernels(mesh) -> None:
    """`attention.attend` with a Pallas kernel ("triton", "splash"; interpret mode here) under
    a context mesh: each device runs the kernel on its own rows (a shard_map over the batch
    axes; XLA cannot partition a Pallas call); value and gradient equal the kernel on one
    device. Rows the mesh does not split take the blocked form, equal to the dense one."""
    from espo.model import attention

    shards = sharding.batch_shards(mesh)
    N, G, Dh, T = 2, 2, 8, attention.KERNEL_BLOCK + 1  # one past a kernel block

    def loss(q, kk, vv, pos, impl):
        out = attention.attend(
            q, kk, vv, q_positions=pos, kv_positions=pos, impl=impl, own_keys=True
        )
        real = (pos >= 0)[:, None, :, None].repeat(G, 2).reshape(len(q), 1, T * G, 1)
        return jnp.sum(jnp.where(real, jnp.sin(out), 0.0)), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=4)
    inputs, wants = {}, {}  # the dense reference is the same for both kernels: computed once
    for impl in ("triton", "splash"):
        for B, via in ((shards, impl), (shards // 2, "dense")):
            if B not in inputs:
                k = jax.random.split(jax.random.key(5), 4)
                q = jax.random.normal(k[0], (B, N, T * G, Dh))
                kv = [jax.random.normal(k[i], (B, N, T, Dh)) for i in (1, 2)]
                pos = jnp.broadcast_to(jnp.arange(T) - 3, (B, T))  # 3 padding slots on the left
                inputs[B] = (q, *kv, jnp.where(pos < 0, -1, pos))
            if (B, via) not in wants:
                with jax.default_device(jax.devices()[0]):
                    wants[B, via] = grad(*inputs[B], via)
            want = wants[B, via]
            with jax.set_mesh(mesh):
                placed = inputs[B]
                if B % shards == 0:
                    placed = sharding.put_batch(placed, mesh)
                traced = grad.trace(*placed, impl)  # once: run, and its jaxpr checked
                got = traced.lower().compile()(*placed)
            what = f"attention {impl} under mesh {dict(mesh.shape)}, {B} rows"
            assert ("shard_map" in str(traced.jaxpr)) == (B % shards == 0), what
            (value, _), grads = got  # the outputs of padding queries differ: dense averages
            chex.assert_trees_all_close(
                (value, grads), (want[0][0], want[1]), atol=2e-5, rtol=2e-5, custom_message=what
            )


def check_decode_kernel(mesh) -> None:
    """`layers.decode_attention` on a GPU (the backend faked, `gpu_attention`'s Triton kernel
    in interpret mode) under a context mesh: each device runs the kernel on its own rows (a
    shard_map; XLA cannot partition a Pallas call, and would gather every row's cache onto
    every device), equal to the CPU's XLA block loop on one device. Rows the mesh does not
    split take that loop, which XLA partitions."""
    from unittest import mock

    from espo.model import gpu_attention, layers

    shards = sharding.batch_shards(mesh)
    N, G, S, Dh, filled = 2, 2, 2 * gpu_attention.BLOCK + 3, 16, gpu_attention.BLOCK + 1
    interpreted = functools.partial(gpu_attention.decode_attention, interpret=True)
    step = jax.jit(
        lambda q, k, v, mask, filled: layers.decode_attention(
            q, k, v, mask, filled=filled, dtype=jnp.float32
        )
    )
    for B in (shards, shards // 2):
        k = jax.random.split(jax.random.key(B), 3)
        q = jax.random.normal(k[0], (B, N, G, Dh))
        cache = [jax.random.normal(k[i], (B, N, S, Dh)) for i in (1, 2)]
        mask = jnp.broadcast_to(jnp.arange(S) < filled, (B, 1, S))
        inputs = (q, *cache, mask, jnp.int32(filled))
        with jax.default_device(jax.devices()[0]), mock.patch.object(layers, "DECODE_BLOCK", 32):
            want = step(*inputs)  # the CPU's block loop (blocks of 32: fewer than S's slots)
        with (
            jax.set_mesh(mesh),
            mock.patch.object(layers, "DECODE_BLOCK", 32),
            mock.patch.object(jax, "default_backend", lambda: "gpu"),
            mock.patch.object(gpu_attention, "decode_attention", interpreted),
        ):
            placed = (
                (*sharding.put_batch(inputs[:4], mesh), inputs[4]) if B % shards == 0 else inputs
            )
            traced = step.trace(*placed)
            got = traced.lower().compile()(*placed)
        what = f"decode kernel under mesh {dict(mesh.shape)}, {B} rows"
        jaxpr = str(traced.jaxpr)
        assert ("shard_map" in jaxpr) == ("pallas_call" in jaxpr) == (B % shards == 0), what
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5, custom_message=what)


def _most_sent(ids, mesh, *, E, axes) -> int:
    """The most (token, expert) assignments one batch shard of `ids` sends one expert shard."""
    n = math.prod(mesh.shape[a] for a in axes)
    blocks = np.asarray(ids).reshape(sharding.batch_shards(mesh), -1)  # [i m, (i + 1) m)
    dest = np.where(blocks >= 0, blocks // (E // n), n)  # n: unrecorded, sent nowhere
    return max(np.bincount(row, minlength=n + 1)[:n].max() for row in dest)


def _check_buffer_sizes(eqns, mesh, *, M, E, K, F, axes) -> None:
    """Buffers sized from the tokens a device holds (m = M / shards when they split, all M when
    replicated): each `all_to_all` sends `capacity_for(m K, n)` rows per destination, and the
    local experts' batched matmul is [E / n, capacity_for(m K, E / n), F]. (Any capacity gives
    the same values; a buffer sized from all M tokens would send 8x the rows.)"""
    from espo.model import experts

    n, shards = math.prod(mesh.shape[a] for a in axes), sharding.batch_shards(mesh)
    split = M % shards == 0
    m = M // shards if split else M
    sent = {v.aval.shape[0] for e in eqns if e.primitive.name == "all_to_all" for v in e.invars}
    assert sent == ({n * experts.capacity_for(m * K, n)} if split else set()), (M, sent)
    local = (E // n, experts.capacity_for(m * K, E // n), F)
    assert any(v.aval.shape == local for e in eqns for v in e.outvars), (M, local)


def _with_no_path(fn, *args, **kwargs):
    return fn(*args, **kwargs), None


def _value_and_grad(fn, x, gate, w):
    """((output, path), gradient of sum(sin(output)) wrt x, the gate weights and the experts)."""

    def loss(x, gate, w):
        y, path = fn(x, weights=gate, w_gate=w[0], w_up=w[1], w_down=w[2])
        return jnp.sum(jnp.sin(y).astype(jnp.float32)), (y, path)

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, gate, w)
    return out, grads


def main(meshes=MESHES) -> int:
    assert jax.device_count() == 8, f"{jax.device_count()} devices: set XLA_FLAGS"
    batch, params = testing.random_train_batch(
        CFG, num_rows=N, prompt_length=TP, generation_length=TG, seed=3
    )
    with jax.default_device(jax.devices()[0]):
        single, _, _ = run(params, batch)
    single = jax.device_get(single)
    assert float(single["grad_norm"]) > 1e-3
    for data, fsdp, expert in meshes:
        mesh = sharding.make_mesh(data=data, fsdp=fsdp, expert=expert)
        with jax.set_mesh(mesh):  # the context mesh: MoE blocks split the experts over it
            got, placed, jaxpr = run(params, batch, mesh)
        # Real expert parallelism: a shard_map exchanging the tokens with an all-to-all.
        jaxpr = str(jaxpr)
        assert ("shard_map" in jaxpr and "all_to_all" in jaxpr) == (expert > 1), mesh
        up = placed["blocks_1"]["moe"]["up_proj"]  # [L, E, D, F]
        local = up.addressable_shards[0].data.shape
        assert local[1:3] == (CFG.num_experts // expert, CFG.d_model // fsdp), (local, mesh)
        assert len({s.device for s in up.addressable_shards}) == 8
        for layout, n in (("experts", expert), ("experts_all", 8)):
            rules = sharding.rollout_rules(layout)
            rollout_up = jax.device_put(placed, sharding.param_shardings(mesh, placed, rules))
            got_local = rollout_up["blocks_1"]["moe"]["up_proj"].addressable_shards[0].data.shape
            assert got_local[1:3] == (CFG.num_experts // n, CFG.d_model), (got_local, mesh)
        for key, want in single.items():
            chex.assert_trees_all_close(jax.device_get(got[key]), want, **TOL, custom_message=key)
        np.testing.assert_array_equal(got["free"][1], single["free"][1])  # expert ids
        if expert > 1:
            check_expert_parallel_paths(mesh)
        if fsdp > 1 and expert > 1:  # the rollout's "experts_all": over every axis
            check_expert_parallel_paths(mesh, sharding.BATCH_AXES)
        check_attention_kernels(mesh)
        check_decode_kernel(mesh)
        print(f"mesh {(data, fsdp, expert)}: equal to one device")
    return 0


if __name__ == "__main__":
    # Meshes "d,f,e" on the command line (default: all of MESHES).
    sys.exit(main([tuple(map(int, m.split(","))) for m in sys.argv[1:]] or MESHES))
