"""Hugging Face interop: load / save Qwen3-MoE and Mixtral safetensors checkpoints.

One table (`_layer_specs`) maps every espo parameter to its Hugging Face tensor name(s) and the
layout change between them; loading and saving both read it, so the two directions cannot drift.
Loading reads tensor by tensor into preallocated stacked arrays (no second full copy); every
missing, unexpected or mis-shaped tensor raises `CheckpointError` naming the file and the key.
Expert weights are read as written on disk by transformers (per-expert `experts.{e}.*` tensors;
the fused `experts.gate_up_proj` / `experts.down_proj` layout is accepted too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import save_file

from espo import errors
from espo.model import config as config_lib
from espo.model import transformer

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
SUPPORTED_ARCHITECTURES = (QWEN3_MOE, MIXTRAL)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


CheckpointError = errors.CheckpointError  # a file that is not the architecture it claims


# ---- config ---------------------------------------------------------------------------------


def config_from_hf(hf: dict, *, source: str = "config.json") -> tuple[config_lib.ModelConfig, str]:
    """(ModelConfig, architecture) from a Hugging Face config dict."""
    archs = hf.get("architectures") or []
    arch = (
        archs[0]
        if archs
        else {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}.get(hf.get("model_type"))
    )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            source, "architectures", archs or hf.get("model_type"), f"{SUPPORTED_ARCHITECTURES}"
        )

    def get(*keys, default=None, required=True):
        for key in keys:
            if hf.get(key) is not None:
                return hf[key]
        if required and default is None:
            raise CheckpointError(source, keys[0], valid=f"present (also tried {keys[1:]})")
        return default

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(source, "rope_type", rope_type, "default")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(source, "hidden_act", hf["hidden_act"], "silu")
    if hf.get("attention_bias"):
        raise CheckpointError(source, "attention_bias", True, "false")
    num_layers = get("num_hidden_layers")
    num_heads = get("num_attention_heads")
    d_model = get("hidden_size")
    kw = dict(
        vocab_size=get("vocab_size"),
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads", default=num_heads),
        head_dim=get("head_dim", default=d_model // num_heads),
        num_experts=get("num_experts", "num_local_experts"),
        top_k=get("num_experts_per_tok"),
        rms_eps=float(get("rms_norm_eps", default=1e-6)),
        rope_theta=float(rope.get("rope_theta") or get("rope_theta", default=10000.0)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
    )
    if arch == QWEN3_MOE:
        step = hf.get("decoder_sparse_step") or 1
        only = set(hf.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        kw.update(
            moe_ffn_dim=get("moe_intermediate_size"),
            dense_layers=dense,
            dense_ffn_dim=get("intermediate_size") if dense else 0,
            qk_norm=True,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            sliding_window=window,
        )
    else:
        kw.update(
            moe_ffn_dim=get("intermediate_size"),
            qk_norm=False,
            norm_topk_prob=True,  # Mixtral always renormalises its top-k gates
            sliding_window=hf.get("sliding_window"),
        )
    try:
        return config_lib.ModelConfig(**kw), arch
    except errors.InvalidValue as e:
        raise e.moved(source, CheckpointError) from e


def config_to_hf(cfg: config_lib.ModelConfig, arch: str) -> dict:
    """The Hugging Face config dict for `cfg` as `arch`."""
    common = {
        "architectures": [arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts_per_tok": cfg.top_k,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "torch_dtype": cfg.param_dtype,
        "max_position_embeddings": 32768,
    }
    if arch == QWEN3_MOE:
        return common | {
            "model_type": "qwen3_moe",
            "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.moe_ffn_dim,
            "intermediate_size": cfg.dense_ffn_dim or cfg.moe_ffn_dim,
            "mlp_only_layers": list(cfg.dense_layers),
            "decoder_sparse_step": 1,
            "norm_topk_prob": cfg.norm_topk_prob,
            "attention_bias": False,
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window,
        }
    return common | {
        "model_type": "mixtral",
        "num_local_experts": cfg.num_experts,
        "intermediate_size": cfg.moe_ffn_dim,
        "sliding_window": cfg.sliding_window,
    }


def _check_exportable(cfg: config_lib.ModelConfig, arch: str):
    """Raises InvalidValue for the first ModelConfig field the `arch` format cannot express."""
    mixtral = arch == MIXTRAL
    errors.check(
        cfg,
        {
            "shared_expert_ffn_dim": (not cfg.shared_expert_ffn_dim, "0 (neither format has one)"),
            "qk_norm": (
                cfg.qk_norm != mixtral,
                f"{not mixtral} for {arch} (Qwen3-MoE always normalises q and k, Mixtral never)",
            ),
            "norm_topk_prob": (cfg.norm_topk_prob or not mixtral, "True (Mixtral renormalises)"),
            "dense_layers": (not cfg.dense_layers or not mixtral, "() for Mixtral"),
        },
        where=f"ModelConfig (saved as {arch})",
    )


# ---- the parameter table --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One espo leaf (per layer, optionally per expert) and its Hugging Face tensor."""

    path: tuple[str, ...]  # path inside the block (or the top-level tree when not per-layer)
    hf_name: str  # with {layer} and {expert} placeholders
    to_espo: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    per_expert: bool = False


def _identity(a):
    return a


def _transpose(a):
    return np.ascontiguousarray(a.T)


def _layer_specs(cfg: config_lib.ModelConfig, arch: str, is_moe: bool) -> list[_Spec]:
    D, H, N, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads_in = lambda n: lambda a: np.ascontiguousarray(a.T.reshape(D, n, Dh))
    heads_out = lambda a: np.ascontiguousarray(a.reshape(D, -1).T)
    attn = "model.layers.{layer}.self_attn."
    specs = [
        _Spec(("input_norm", "scale"), "model.layers.{layer}.input_layernorm.weight",
              _identity, _identity),
        _Spec(("post_attn_norm", "scale"), "model.layers.{layer}.post_attention_layernorm.weight",
              _identity, _identity),
        _Spec(("attn", "q_proj"), attn + "q_proj.weight", heads_in(H), heads_out),
        _Spec(("attn", "k_proj"), attn + "k_proj.weight", heads_in(N), heads_out),
        _Spec(("attn", "v_proj"), attn + "v_proj.weight", heads_in(N), heads_out),
        _Spec(("attn", "o_proj"), attn + "o_proj.weight",
              lambda a: np.ascontiguousarray(a.T.reshape(H, Dh, D)),
              lambda a: np.ascontiguousarray(a.reshape(H * Dh, D).T)),
    ]  # fmt: skip
    if cfg.qk_norm:
        specs += [
            _Spec(("attn", "q_norm", "scale"), attn + "q_norm.weight", _identity, _identity),
            _Spec(("attn", "k_norm", "scale"), attn + "k_norm.weight", _identity, _identity),
        ]
    if not is_moe:
        mlp = "model.layers.{layer}.mlp."
        return specs + [
            _Spec(("mlp", name), mlp + f"{name}.weight", _transpose, _transpose)
            for name in ("gate_proj", "up_proj", "down_proj")
        ]
    if arch == MIXTRAL:
        moe, names = "model.layers.{layer}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, names = "model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj")
    specs.append(_Spec(("moe", "router"), moe + "gate.weight", _transpose, _transpose))
    for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), names, strict=True):
        specs.append(
            _Spec(("moe", ours), moe + "experts.{expert}." + theirs + ".weight",
                  _transpose, _transpose, per_expert=True)
        )  # fmt: skip
    return specs


def _top_specs(cfg: config_lib.ModelConfig) -> list[_Spec]:
    specs = [
        _Spec(("embed",), "model.embed_tokens.weight", _identity, _identity),
        _Spec(("final_norm", "scale"), "model.norm.weight", _identity, _identity),
    ]
    if not cfg.tie_embeddings:
        specs.append(_Spec(("lm_head",), "lm_head.weight", _transpose, _transpose))
    return specs


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---- loading --------------------------------------------------------------------------------


def _read_json(file: pathlib.Path) -> dict:
    """The JSON object in `file`; CheckpointError naming the file when it is not JSON."""
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(str(file), "contents", valid=f"JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(str(file), "contents", type(value).__name__, "a JSON object")
    return value


def _open_safetensors(file: pathlib.Path):
    """`safe_open(file)`; a truncated or corrupt file raises CheckpointError naming it."""
    try:
        return safe_open(file, framework="np")
    except (safetensors.SafetensorError, OSError) as e:
        raise CheckpointError(str(file), "contents", valid=f"a safetensors file ({e})") from e


class _TensorFiles:
    """Name -> file index over one or many safetensors files; reads one tensor at a time."""

    def __init__(self, path: pathlib.Path):
        index_file = path / "model.safetensors.index.json"
        if index_file.exists():
            weight_map = _read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(str(index_file), "weight_map", weight_map, "an object")
            self.where = {k: path / f for k, f in weight_map.items()}
            self.source = str(index_file)
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    str(path), "*.safetensors", valid="present (or model.safetensors.index.json)"
                )
            self.where = {}
            for f in files:
                with _open_safetensors(f) as handle:
                    self.where.update(dict.fromkeys(handle.keys(), f))
            self.source = str(path)
        self.used: set[str] = set()

    def __contains__(self, name):
        return name in self.where

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(self.source, name, valid=f"a tensor of shape {shape}")
        file = self.where[name]
        with _open_safetensors(file) as handle:
            try:
                tensor = handle.get_tensor(name)
            except safetensors.SafetensorError as e:
                raise CheckpointError(str(file), name, valid=f"a readable tensor ({e})") from e
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                str(file), f"{name}.shape", tuple(tensor.shape), f"{tuple(shape)}"
            )
        self.used.add(name)
        return tensor


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype: config_lib.DTypeLike | None = None
) -> tuple[config_lib.ModelConfig, dict]:
    """(ModelConfig, params) from a local Hugging Face checkpoint directory.

    Args:
      path: a directory holding `config.json` and `*.safetensors` (optionally sharded with
        `model.safetensors.index.json`).
      dtype: parameter (and compute) dtype in any spelling `config.dtype_name` accepts
        ("bfloat16", jnp.bfloat16, np.float32, jnp.dtype("float32")); default: the checkpoint's
        own when it is float32 or bfloat16, else float32.
    """
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(str(path), "config.json", valid="present (a Hugging Face dir)")
    hf = _read_json(config_file)
    cfg, arch = config_from_hf(hf, source=str(config_file))
    disk_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    if dtype is None:  # not `dtype or ...`: np.dtype objects are falsy
        param_dtype = disk_dtype if disk_dtype in ("float32", "bfloat16") else "float32"
    else:
        param_dtype = config_lib.dtype_name(dtype, field="load_hf_checkpoint(dtype)")
    cfg = cfg.replace(param_dtype=param_dtype, dtype=param_dtype)
    np_dtype = np.dtype(jnp.dtype(param_dtype))
    files = _TensorFiles(path)
    shapes = transformer.param_shapes(cfg)
    params: dict = {}

    for spec in _top_specs(cfg):
        want = _get(shapes, spec.path).shape
        hf_shape = spec.to_hf(np.empty(want, np.int8)).shape
        _set(params, spec.path, spec.to_espo(files.read(spec.hf_name, hf_shape)).astype(np_dtype))

    for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
        run = transformer.run_name(r)
        for spec in _layer_specs(cfg, arch, is_moe):
            want = _get(shapes[run], spec.path).shape  # [n, (E,) ...]
            out = np.empty(want, np_dtype)
            item_shape = want[2:] if spec.per_expert else want[1:]
            hf_shape = spec.to_hf(np.empty(item_shape, np.int8)).shape
            for j in range(length):
                layer = start + j
                if spec.per_expert:
                    fused = _read_fused_experts(files, spec, layer, cfg, arch)
                    for e in range(cfg.num_experts):
                        name = spec.hf_name.format(layer=layer, expert=e)
                        hf_tensor = fused[e] if fused is not None else files.read(name, hf_shape)
                        out[j, e] = spec.to_espo(hf_tensor)
                else:
                    out[j] = spec.to_espo(files.read(spec.hf_name.format(layer=layer), hf_shape))
            _set(params, (run, *spec.path), out)

    unexpected = sorted(
        k for k in set(files.where) - files.used if not k.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        more = " ..." if len(unexpected) > 8 else ""
        raise CheckpointError(
            files.source, "tensors", f"{unexpected[:8]}{more}",
            f"only those of {arch} with {cfg.num_layers} layers and {cfg.num_experts} experts",
        )  # fmt: skip
    return cfg, jax.tree.map(jnp.asarray, params)


def _read_fused_experts(files, spec, layer, cfg, arch):
    """[E, out, in] Hugging Face tensors from the fused in-memory layout, if that is on disk."""
    if arch != QWEN3_MOE:
        return None
    prefix = f"model.layers.{layer}.mlp.experts."
    E, D, F = cfg.num_experts, cfg.d_model, cfg.moe_ffn_dim
    if spec.path[-1] == "down_proj" and prefix + "down_proj" in files:
        return files.read(prefix + "down_proj", (E, D, F))
    if prefix + "gate_up_proj" in files and spec.path[-1] in ("gate_proj", "up_proj"):
        gate_up = files.read(prefix + "gate_up_proj", (E, 2 * F, D))
        return gate_up[:, :F] if spec.path[-1] == "gate_proj" else gate_up[:, F:]
    return None


# ---- saving ---------------------------------------------------------------------------------


def save_hf_checkpoint(
    cfg: config_lib.ModelConfig,
    params: dict,
    path: str | os.PathLike,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = 4 << 30,
) -> pathlib.Path:
    """Write `params` as a Hugging Face checkpoint directory that transformers loads.

    The architecture defaults to Qwen3-MoE when `cfg.qk_norm`, else Mixtral. Tensors are written
    with per-expert names, in shards of at most `max_shard_bytes` (with an index when sharded).
    An existing non-empty directory is never overwritten.
    """
    arch = architecture or (QWEN3_MOE if cfg.qk_norm else MIXTRAL)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise errors.InvalidValue("", "architecture", arch, f"{SUPPORTED_ARCHITECTURES}")
    _check_exportable(cfg, arch)
    path = pathlib.Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path}: exists and is not empty; refusing to overwrite it")
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for spec in _top_specs(cfg):
        tensors[spec.hf_name] = spec.to_hf(np.asarray(_get(params, spec.path)))
    for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
        block = params[transformer.run_name(r)]
        for spec in _layer_specs(cfg, arch, is_moe):
            stacked = np.asarray(_get(block, spec.path))
            for j in range(length):
                if spec.per_expert:
                    for e in range(cfg.num_experts):
                        name = spec.hf_name.format(layer=start + j, expert=e)
                        tensors[name] = spec.to_hf(stacked[j, e])
                else:
                    tensors[spec.hf_name.format(layer=start + j)] = spec.to_hf(stacked[j])
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        if current and size + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = np.ascontiguousarray(tensor)
        size += tensor.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.nbytes for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, arch), indent=2))
    return path
