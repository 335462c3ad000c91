"""The programs of one RL step at a config's real shapes, compiled and measured for a target
(`experiments/aot.py`'s subprocess: one mesh, one process, nothing run unless asked).

`programs` builds each function the trainer jits with the trainer's shardings and donation
(the update's micro-step, pi_old's forward, one rollout chunk) from shape structs; `measure`
compiles them for a TPU topology, emulated CPU devices or this machine's own, and returns each
one's per-device memory by kind, FLOPs, collective bytes and roofline time. aot.py's docstring
says what is counted and how far each number can be trusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from unittest import mock

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 2**30
PROGRAMS = ("update", "old", "rollout", "eval")
DECODING = {"rollout": "chunk_rows", "eval": "eval_rows"}  # programs that decode: their rows


def settings_of(config: str, overrides: tuple[str, ...] = ()):
    """The Settings of `path[:variant]` with `overrides` ("train.ppo_epochs=2": a JSON value, or
    a string) and its model's architecture (a checkpoint's path ignored: the shape is the
    config's)."""
    from espo import config as config_lib
    from espo import testing

    path, _, variant = config.partition(":")
    cfg = testing.load_script(ROOT / path if not os.path.isabs(path) else path).get_config(variant)
    for item in overrides:
        key, eq, text = item.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            node = node.get(name) if hasattr(node, "get") else None
        if not eq or node is None or leaf not in node:
            raise SystemExit(f"--set {item!r}: not a key=value of {config}'s config")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node[leaf] = value
    cfg.model.hf_path = ""  # the architecture from the config's model fields
    s = config_lib.Settings.from_config(cfg)
    return s, s.model


def shapes_of(s, model_cfg, devices: int, rows_per_device: int = 0) -> dict:
    """T, rows per micro-batch and per chunk, rows per RL step (module docstring)."""
    curr = s.curriculum
    T = s.max_prompt_length + curr.max_new_tokens
    if not rows_per_device:
        if s.train.packing:
            rows_per_device = max(1, s.train.max_tokens_per_micro_batch // T)
        else:
            rows_per_device = max(1, s.train.micro_batch_size // devices)
    G = max(max(st.group_size for st in curr.stages), s.zve.max_group_size)
    num_rows, mini_rows, _ = s.train.batch_rows(G)
    G_first = curr.stages[0].group_size
    prompts = max(s.rollout.max_chunk_size // G_first, 1)  # a chunk's prompts, on every device
    chunk = math.ceil(prompts / devices) * devices * G_first
    # The eval's larger sampler call (`evaluate._run_pass`): the sampled pass (eval.samples a
    # prompt) or the greedy one (1)
    e = s.eval
    sampled = (min(e.batch_size // e.samples, e.sampled_prompts) * e.samples, e.samples)
    eval_rows, eval_G = max(sampled, (min(e.batch_size, e.num_prompts), 1))
    return dict(
        T=T, Tp=s.max_prompt_length, Tg=curr.max_new_tokens, micro_rows=rows_per_device * devices,
        rows_per_device=rows_per_device, step_rows=num_rows, updates=num_rows // mini_rows,
        epochs=s.train.ppo_epochs, G=G_first, chunk_rows=chunk, eval_rows=eval_rows,
        eval_G=eval_G,
    )  # fmt: skip


def abstract_batch(model_cfg, lead: tuple[int, ...], T: int):
    """A `batching.TrainBatch` of shape structs [*lead, T] (the trainer's fields and dtypes)."""
    import jax
    import jax.numpy as jnp

    from espo import batching, types

    S = lambda *shape, dt=jnp.float32: jax.ShapeDtypeStruct((*lead, *shape), dt)  # noqa: E731
    trace = (model_cfg.num_layers, T, model_cfg.top_k)
    return batching.TrainBatch(
        tokens=S(T, dt=jnp.int32), attention_mask=S(T, dt=bool), loss_mask=S(T, dt=bool),
        router=types.RouterTrace(  # ids only, as the rollout records them
            expert_ids=S(*trace, dt=types.expert_id_dtype(model_cfg.num_experts)),
            expert_weights=None,
        ),
        sampler_logps=S(T), sampler_entropies=S(T), finished=S(dt=bool),
        group_ids=S(dt=jnp.int32), rewards=S(), shaping=S(), valid=S(dt=bool),
        old_logps=S(T), old_entropies=S(T), ref_logps=S(T), advantages=S(),
        zvp_sign=S(dt=jnp.int32),
    )  # fmt: skip


def mesh_over(devices, sizes: dict):
    """espo's mesh ("data", "fsdp", "expert") over `devices` with `sizes`."""
    import jax
    import numpy as np

    from espo import sharding

    dims = tuple(int(sizes.get(a, 1)) for a in sharding.AXES)
    if math.prod(dims) != len(devices):
        raise ValueError(f"mesh {sizes} is not the {len(devices)} devices of the target")
    auto = (jax.sharding.AxisType.Auto,) * len(dims)
    return jax.sharding.Mesh(np.array(devices).reshape(dims), sharding.AXES, axis_types=auto)


def place(tree, shardings):
    """Shape structs of `tree` carrying `shardings` (a tree or one sharding)."""
    import jax

    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    put = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)  # noqa: E731
    return jax.tree.map(put, tree, shardings)


def per_device_bytes(tree) -> float:
    """The bytes one device holds of placed shape structs (the largest shard; whole if unplaced)."""
    import jax

    shard = lambda a: a.shape if a.sharding is None else a.sharding.shard_shape(a.shape)  # noqa: E731
    return float(sum(math.prod(shard(a)) * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def programs(s, model_cfg, mesh, shp: dict, *, for_flops: bool = False) -> dict:
    """name -> (jitted fn, placed args, {kind: per-device bytes of its args}, resident bytes).

    `for_flops`: the model as XLA computes it (attention "blocked"), for `roofline.jaxpr_dots`."""
    import jax
    import jax.numpy as jnp

    from espo import sampler, sharding, train_step, trainer
    from espo.model import handle, transformer

    if for_flops and model_cfg.attention_impl in ("splash", "triton"):  # the kernels' XLA twin
        model_cfg = model_cfg.replace(attention_impl="blocked")
    T, R = shp["T"], shp["micro_rows"]
    # As the trainer: one update over the whole batch takes pi_old from that update's forward.
    one_update = s.train.ppo_epochs == 1 and shp["updates"] == 1
    sc = trainer.step_config(s, model_cfg, micro_batch_size=R, one_update=one_update)
    optimizer, _ = train_step.make_optimizer(total_steps=1000, **dataclasses.asdict(s.optimizer))
    params = transformer.param_shapes(model_cfg)

    def make_state(p):
        return train_step.TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p)
        )

    abstract = jax.eval_shape(make_state, params)
    state_sh = sharding.state_shardings(mesh, optimizer, abstract)
    state = place(abstract, state_sh)
    rows = sharding.batch_sharding(mesh)
    sizes = dict(params=per_device_bytes(state.params), opt_state=per_device_bytes(state.opt_state))
    out = {}

    def update(state, mini):
        return train_step.train_step(sc, optimizer, state, mini)

    mini = place(abstract_batch(model_cfg, (1, R), T), sharding.batch_sharding(mesh, leading=1))
    out["update"] = (  # as the trainer: the state returned where it came from, so donated
        jax.jit(update, donate_argnums=(0,), out_shardings=(state_sh, sharding.replicated(mesh))),
        (state, mini),
        dict(sizes, inputs=per_device_bytes(mini)),
        0.0,
    )

    def old(params, batch):
        return train_step.prepare(sc, params, None, batch)

    batch = place(abstract_batch(model_cfg, (R,), T), rows)
    used = 0.0 if one_update else sizes["params"]  # fused: no pi_old forward, no params read
    out["old"] = (
        jax.jit(old),
        (state.params, batch),
        dict(params=used, opt_state=0.0, inputs=per_device_bytes(batch)),
        sizes["params"] - used + sizes["opt_state"],
    )

    # The rollout: the trainer's once-a-step conversion (FP8 with rollout.fp8, the rollout's
    # layout with rollout.param_layout), the decode layout, placed as XLA places them; then one
    # chunk of `sampler._sample_chunk`.
    model = handle.Model(trainer.sampler_model_config(s, model_cfg))
    for_rollout = trainer._rollout_params(s, mesh, params, dtype=model.cfg.dtype)

    def decode_layout(to_decode):
        """The weights `to_decode(params)` gives a sampler, placed as the compiler places them
        (a short compile; unplaced when only counting FLOPs)."""
        shapes = jax.eval_shape(to_decode, params)
        if for_flops:
            return shapes
        with jax.set_mesh(mesh):
            prep = jax.jit(to_decode).trace(state.params).lower().compile()
        return place(shapes, prep.output_shardings)

    rep = sharding.replicated(mesh)

    def prompt_structs(B: int):
        """[B, Tp] prompts and their mask, rows over the batch axes where they divide."""
        where = rows if B % sharding.batch_shards(mesh) == 0 else rep
        return tuple(jax.ShapeDtypeStruct((B, shp["Tp"]), dt, sharding=where)
                     for dt in (jnp.int32, bool))  # fmt: skip

    dparams = decode_layout(lambda p: model.decode_params(for_rollout(p)))
    G = shp["G"]
    prompts, mask = prompt_structs(shp["chunk_rows"] // G)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    budget = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)

    def decode(model, G, name: str):
        def chunk(dparams, prompts, mask, key, budget):
            return sampler._sample_chunk(
                model, dparams, prompts, mask, key, budget, None, num_samples=G,
                gen_len=shp["Tg"], temperature=1.0, top_p=1.0, top_k=0,
                stop_ids=(model_cfg.vocab_size,), pad_id=0, steps_per_check=1,
                trace_weights=False,
            )  # fmt: skip  # an id no row samples: every decode step runs (the longest chunk)

        chunk.__name__ = chunk.__qualname__ = name  # its HLO module: jit_<name> (the TPU dump)
        return chunk

    # The training state stays on the device while it decodes, or (rollout.offload_state) waits
    # in host memory, all but params the sampler reads as they are: copied out and back a step.
    state_b = sizes["params"] + sizes["opt_state"]
    kept = state_b
    if s.rollout.offload_state:
        kept = 0.0 if trainer.rollout_converts(s) else sizes["params"]
    out["rollout"] = (
        jax.jit(decode(model, G, "rollout")),
        (dparams, prompts, mask, key, budget),
        dict(params=per_device_bytes(dparams), opt_state=0.0,
             inputs=per_device_bytes((prompts, mask, key, budget)), offloaded=state_b - kept),
        kept,
    )  # fmt: skip

    # The held-out eval (at the start, every eval.every_steps and the end; `trainer._evaluate`):
    # the training model and params in the decode layout (a per-layer copy the sampler makes
    # each call), its larger pass's call; the state resident (with rollout.offload_state the
    # optimiser's moments wait in host memory).
    tmodel = handle.Model(model_cfg)
    eparams = decode_layout(tmodel.decode_params)
    ev_prompts, ev_mask = prompt_structs(shp["eval_rows"] // shp["eval_G"])
    moved = sizes["opt_state"] if s.rollout.offload_state else 0.0
    out["eval"] = (
        jax.jit(decode(tmodel, shp["eval_G"], "eval")),
        (eparams, ev_prompts, ev_mask, key, budget),
        dict(params=per_device_bytes(eparams), opt_state=0.0,
             inputs=per_device_bytes((ev_prompts, ev_mask, key, budget)), offloaded=moved),
        state_b - moved,
    )  # fmt: skip
    return out


def model_flops_per_token(cfg, context: float) -> dict:
    """Model FLOPs of one token's forward (the MFU convention: 2 x active matmul params +
    attention's 4 x layers x heads x head_dim x context), and the active parameter count."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    moe = cfg.top_k * 3 * cfg.d_model * cfg.moe_ffn_dim + cfg.d_model * cfg.num_experts
    moe += 3 * cfg.d_model * cfg.shared_expert_ffn_dim
    dense = 3 * cfg.d_model * cfg.dense_ffn_dim
    active = cfg.num_layers * attn + len(cfg.moe_layers) * moe + len(cfg.dense_layers) * dense
    active += cfg.d_model * cfg.vocab_size  # the head (the embedding is a lookup)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return dict(active_params=active, forward=2 * active + attention)


# ---- one mesh's programs compiled (a subprocess: its own XLA flags and device count) -------------
def _decode_loop(closed_jaxpr):
    """The body of the rollout's decode `while` (the largest while loop in the program)."""
    from jax.extend import core as jex_core

    best = None

    def walk(jaxpr):
        nonlocal best
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                body = eqn.params["body_jaxpr"]
                if best is None or len(body.jaxpr.eqns) > len(best.jaxpr.eqns):
                    best = body
            for v in eqn.params.values():
                for sub in v if isinstance(v, tuple | list) else (v,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return best


def _timed(compiled, args, repeats: int = 3) -> float:
    """Median seconds of `compiled` on random inputs of `args`' shapes and placements (normal
    floats, small non-negative ints, a decode budget of its whole buffer)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def make(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            x = rng.standard_normal(a.shape).astype(np.float32) * 0.02
        elif a.dtype == jnp.bool_:
            x = np.ones(a.shape, bool)
        else:
            x = rng.integers(0, 4, a.shape) if a.shape else np.full((), 2**30)
        return jax.device_put(jnp.asarray(x, a.dtype), a.sharding)

    times = []
    for _ in range(repeats):
        inputs = jax.tree.map(make, args)  # fresh: the update donates its state
        t = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


PROGRESS = "aot progress: "  # the compiling subprocess's stderr lines that `run_point` reads


def progress(text: str) -> None:
    """One line of where the compiling subprocess is (read back on a timeout)."""
    print(PROGRESS + text, file=sys.stderr, flush=True)


def measure(point: dict) -> dict:
    """Compile `point`'s programs on its mesh; per program its per-device memory, matmul work
    and collectives (module docstring)."""
    import bench_memory

    bench_memory._rss_watchdog(point["max_rss_gb"])
    dump = tempfile.mkdtemp(prefix="aot_") if point.get("tpu") else ""
    flags = os.environ.get("XLA_FLAGS", "")
    if point.get("gpus") and not point.get("local"):
        flags += f" --xla_force_host_platform_device_count={point['gpus']}"
    if dump:
        flags += f" --xla_dump_to={dump}"
    os.environ["XLA_FLAGS"] = flags
    import jax
    import roofline

    from espo.model import experts, layers

    blocked = layers.blocked_decode

    if not point.get("local"):  # --local: this machine's accelerator compiles (a real GPU)
        jax.config.update("jax_platforms", "cpu")
    backend = contextlib.nullcontext()
    if point.get("tpu"):
        import bench_moe

        devices = bench_moe.tpu_topology(point["tpu"]).devices
        backend = bench_moe._as_tpu()
    else:
        devices = jax.devices()[: point["gpus"]]
    chip = roofline.Chip(**point["chip"])
    mesh = mesh_over(devices, point["mesh"])
    s, cfg = settings_of(point["config"], tuple(point.get("set", ())))
    if point.get("layers"):  # a slice of the model's depth (`mesh_result`'s extrapolation)
        cfg = cfg.replace(num_layers=point["layers"])
    shp = shapes_of(s, cfg, len(devices), point["rows_per_device"])
    with backend:
        progs = programs(s, cfg, mesh, shp)
    # The work is counted on one device (the global shapes, no expert-parallel shard_map:
    # its all-gather fallback, the larger branch of a cond, would count every gathered row
    # against every local expert) and split evenly over the devices by the roofline.
    one = mesh_over(devices[:1], {})
    flop_progs = programs(s, cfg, one, shp, for_flops=True)
    out = dict(shapes=shp, devices=len(devices), programs={})
    for name in point["programs"]:
        fn, args, sizes, resident = progs[name]
        row = dict(sizes, resident=resident)
        t0 = time.perf_counter()
        progress(f"{name}: compiling")
        with backend, jax.set_mesh(mesh):
            lowered = fn.trace(*args).lower()
        try:
            compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001
            if not (point.get("tpu") and "RESOURCE_EXHAUSTED" in str(e)):
                raise
            compiled, row["refused"] = None, str(e).split("\n")[0][:200]  # the chip's HBM check
        row["compile_s"] = time.perf_counter() - t0
        progress(f"{name}: compiled in {row['compile_s']:.0f} s")
        if point.get("run") and compiled is not None:  # --run: timed here (no stop id exists:
            row["measured_s"] = _timed(compiled, args)  # the decode runs its whole budget)
            progress(f"{name}: ran in {row['measured_s']:.3g} s")
        if point.get("tpu"):  # the buffer assignment the chip's check adds up
            got = bench_memory.allocation_sizes(dump, module=f"jit_{name}")
            args_b, out_b, temp_b, alias_b = (
                got["args_gib"] * GiB, got["out_gib"] * GiB, got["temp_gib"] * GiB, 0.0,
            )  # fmt: skip
        else:
            mem = compiled.memory_analysis()
            args_b, out_b = mem.argument_size_in_bytes, mem.output_size_in_bytes
            temp_b, alias_b = mem.temp_size_in_bytes, mem.alias_size_in_bytes
        # The inputs XLA keeps (jit drops unused ones: the update reads no ref_logps)
        row["placed_inputs"], row["inputs"] = row["inputs"], args_b - sizes["params"]
        row["inputs"] -= sizes["opt_state"]
        row.update(
            xla_args=args_b, temporaries=temp_b, outputs=out_b - alias_b,
            total=args_b + temp_b + out_b - alias_b + resident,
        )  # fmt: skip
        # The rollout's one loop of unknown trip count is its decode loop: Tg steps.
        trips = shp["Tg"] if name in DECODING else 1
        text = compiled.as_text() if compiled else ""
        row["collectives"] = roofline.hlo_collectives(text, unknown_trip=trips) if text else {}
        ffn, fargs, *_ = flop_progs[name]
        # Counted as the dropless grouped matmul every accelerator path computes (CPU's default,
        # "capacity", multiplies padding too).
        # A TPU's decode step attends over the whole cache ("blocked" over its slots), not the
        # CPU's loop over the filled blocks (`layers.blocked_decode`); a GPU's Triton kernel
        # visits only the filled ones, but its products sit inside a Pallas call that the count
        # does not see, so a GPU is counted over the whole cache too (an upper bound).
        decode_loop = blocked if chip.name == "cpu" else (lambda *a: False)
        with (
            jax.set_mesh(one),
            mock.patch.object(experts, "default_impl", lambda *a, **k: "ragged"),
            mock.patch.object(layers, "blocked_decode", decode_loop),
        ):
            jaxpr = ffn.trace(*fargs).jaxpr
        dots = roofline.jaxpr_dots(jaxpr)
        row["flops"] = roofline.total_flops(dots)
        row["matmul_s"] = roofline.roofline_seconds(dots, chip, devices=len(devices))
        row["opaque"] = sum(1 for d in dots if "opaque" in d.where)
        row["unknown_loops"] = sum(1 for d in dots if d.where.count(roofline.UNKNOWN_WHILE))
        if name in DECODING:  # the decode loop's body: one decode step
            step = roofline.jaxpr_dots(_decode_loop(jaxpr))
            row["decode_flops"] = roofline.total_flops(step)
            row["decode_matmul_s"] = roofline.roofline_seconds(step, chip, devices=len(devices))
            row["unknown_loops"] -= len(step)
        out["programs"][name] = row
        if dump:  # the next program's dump only
            for f in pathlib.Path(dump).glob("*"):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    if dump:
        shutil.rmtree(dump, ignore_errors=True)
    return out
