"""Hugging Face interop: load / save Qwen3-MoE and Mixtral safetensors checkpoints.

One table (`_layer_specs`) maps every espo parameter to its Hugging Face tensor name(s) and the
layout change between them (a transpose, attention heads split out of a dimension); loading and
saving both read it, so the two directions cannot drift. Every tensor is checked against the
files' headers before any is read: a missing, unexpected or mis-shaped tensor raises
`CheckpointError` naming the file and the key. Loading reads blocks (`safe_open(...).get_slice`)
one HF tensor at a time into the stacked [L, (E,) ...] leaves; with target shardings each device's
block is read through the layout change (a device's slice of an espo leaf is a slice of each HF
tensor it covers), so a process reads its share of the checkpoint, never the whole. Saving
writes one shard file at a time, converting only that file's tensors. Expert weights are read
as written on disk by transformers (per-expert `experts.{e}.*` tensors; the fused
`experts.gate_up_proj` / `experts.down_proj` layout is accepted too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable
from typing import NamedTuple

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
    """One espo leaf (per layer, optionally per expert) and its Hugging Face tensor.

    The espo item (one layer's, or one expert's, part of the leaf) is the HF tensor, transposed
    when `transpose`, with axis `split` of that cut into (-1, `inner`) (attention heads). `read`
    maps a slice of the item back to the block of the HF tensor that holds it, so a loader reads
    only what a device needs."""

    path: tuple[str, ...]  # path inside the block (or the top-level tree when not per-layer)
    hf_name: str  # with {layer} and {expert} placeholders
    transpose: bool = False
    split: int | None = None  # axis of the (transposed) HF tensor cut into (heads, inner)
    inner: int = 1
    per_expert: bool = False

    def _merged_shape(self, item_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The item's shape with the split axes merged: the HF tensor's, transposed or not."""
        shape = list(item_shape)
        if self.split is not None:
            a = self.split
            shape[a : a + 2] = [shape[a] * shape[a + 1]]
        return tuple(shape)

    def hf_shape(self, item_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = self._merged_shape(item_shape)
        return shape[::-1] if self.transpose else shape

    def read(self, index: tuple[slice, ...], read_hf: Callable) -> np.ndarray:
        """item[index] (`index`: one slice per item axis, int start and stop, step 1), from
        `read_hf(hf_index)`, which returns that block of the HF tensor. A split axis is read in
        whole heads and cut afterwards (`espo.sharding` never splits head_dim)."""
        merged = list(index)
        if self.split is not None:
            heads = index[self.split]
            merged[self.split : self.split + 2] = [
                slice(heads.start * self.inner, heads.stop * self.inner)
            ]
        block = read_hf(tuple(reversed(merged)) if self.transpose else tuple(merged))
        if self.transpose:
            block = block.T
        if self.split is not None:
            a = self.split
            block = block.reshape(*block.shape[:a], -1, self.inner, *block.shape[a + 1 :])
            block = block[(slice(None),) * (a + 1) + (index[a + 1],)]
        return block  # a view: the caller copies it into its block of the leaf

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        """The HF tensor of the whole espo item `a`."""
        a = a.reshape(self._merged_shape(a.shape))
        return np.ascontiguousarray(a.T if self.transpose else a)


def _layer_specs(cfg: config_lib.ModelConfig, arch: str, is_moe: bool) -> list[_Spec]:
    Dh = cfg.head_dim
    # q/k/v: [n * Dh, D] on disk -> [D, n, Dh]; o: [D, H * Dh] -> [H, Dh, D].
    heads_in = dict(transpose=True, split=1, inner=Dh)
    attn = "model.layers.{layer}.self_attn."
    specs = [
        _Spec(("input_norm", "scale"), "model.layers.{layer}.input_layernorm.weight"),
        _Spec(("post_attn_norm", "scale"), "model.layers.{layer}.post_attention_layernorm.weight"),
        _Spec(("attn", "q_proj"), attn + "q_proj.weight", **heads_in),
        _Spec(("attn", "k_proj"), attn + "k_proj.weight", **heads_in),
        _Spec(("attn", "v_proj"), attn + "v_proj.weight", **heads_in),
        _Spec(("attn", "o_proj"), attn + "o_proj.weight", transpose=True, split=0, inner=Dh),
    ]
    if cfg.qk_norm:
        specs += [
            _Spec(("attn", "q_norm", "scale"), attn + "q_norm.weight"),
            _Spec(("attn", "k_norm", "scale"), attn + "k_norm.weight"),
        ]
    if not is_moe:
        mlp = "model.layers.{layer}.mlp."
        return specs + [
            _Spec(("mlp", name), mlp + f"{name}.weight", transpose=True)
            for name in ("gate_proj", "up_proj", "down_proj")
        ]
    if arch == MIXTRAL:
        moe, names = "model.layers.{layer}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, names = "model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj")
    specs.append(_Spec(("moe", "router"), moe + "gate.weight", transpose=True))
    for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), names, strict=True):
        name = moe + "experts.{expert}." + theirs + ".weight"
        specs.append(_Spec(("moe", ours), name, transpose=True, per_expert=True))
    return specs


def _top_specs(cfg: config_lib.ModelConfig) -> list[_Spec]:
    specs = [
        _Spec(("embed",), "model.embed_tokens.weight"),
        _Spec(("final_norm", "scale"), "model.norm.weight"),
    ]
    if not cfg.tie_embeddings:
        specs.append(_Spec(("lm_head",), "lm_head.weight", transpose=True))
    return specs


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _full_index(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` (slices, as `jax.make_array_from_callback` passes them; missing trailing axes
    whole) with int start and stop."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index {index} of an array of shape {shape}: steps must be 1")
        out.append(slice(start, stop))
    return tuple(out)


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
    """Name -> file index over one or many safetensors files; reads blocks of tensors
    (`get_slice`: only the bytes of the block are copied out of the file)."""

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
        self._handles: dict[pathlib.Path, object] | None = None  # while `opened`
        self._stack: contextlib.ExitStack | None = None

    def __contains__(self, name):
        return name in self.where

    @contextlib.contextmanager
    def opened(self):
        """Inside the block each file is opened once, not once per read; closed after it (the
        loader opens one block per parameter, so no handle or file mapping outlives it)."""
        if self._handles is not None:
            yield
            return
        self._handles = {}
        try:
            with contextlib.ExitStack() as stack:
                self._stack = stack
                yield
        finally:
            self._handles = self._stack = None

    def _handle(self, file: pathlib.Path):
        if self._handles is None:
            raise RuntimeError("_TensorFiles: read outside `opened()`")
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open_safetensors(file))
        return self._handles[file]

    def _slice(self, name: str):
        file = self.where[name]
        try:
            return self._handle(file).get_slice(name)
        except safetensors.SafetensorError as e:
            raise CheckpointError(str(file), name, valid=f"a readable tensor ({e})") from e

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """`name` is in the checkpoint with this shape (read from the file's header only)."""
        if name not in self.where:
            raise CheckpointError(self.source, name, valid=f"a tensor of shape {shape}")
        got = tuple(self._slice(name).get_shape())
        if got != tuple(shape):
            raise CheckpointError(str(self.where[name]), f"{name}.shape", got, f"{tuple(shape)}")
        self.used.add(name)

    def read(self, name: str, index: tuple) -> np.ndarray:
        """tensor[index] of a `check`ed tensor."""
        try:
            return self._slice(name)[index]
        except safetensors.SafetensorError as e:
            file = str(self.where[name])
            raise CheckpointError(file, name, valid=f"a readable tensor ({e})") from e


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one espo item's HF tensor is: `name[*at, offset + i, ...]` is its row i (a tensor of
    its own: at () and offset 0; one expert of a fused tensor: at (e,), offset its part's)."""

    name: str
    at: tuple[int, ...] = ()
    offset: int = 0

    def index(self, hf_index: tuple[slice, ...]) -> tuple:
        first, *rest = hf_index
        return (*self.at, slice(first.start + self.offset, first.stop + self.offset), *rest)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One espo parameter and the sources of its items: one `_Source` for a top-level leaf,
    else one per layer of the run (a tuple of one per expert for expert weights)."""

    path: tuple[str, ...]  # in the params tree
    spec: _Spec
    shape: tuple[int, ...]  # [(n, (E,)) ...]
    sources: _Source | tuple

    def read(self, files: _TensorFiles, index: tuple[slice, ...], dtype) -> np.ndarray:
        """self[index] as a host array of `dtype`, reading from `files` only the blocks of the
        HF tensors it covers, one item (a layer's, an expert's) at a time: the peak is the
        result plus one HF block."""
        index = _normalize(index, self.shape)
        out = np.empty(tuple(s.stop - s.start for s in index), dtype)
        spec = self.spec

        def item(source, where):
            out[where] = spec.read(
                index[len(where) :], lambda i: files.read(source.name, source.index(i))
            )

        with files.opened():
            if isinstance(self.sources, _Source):
                item(self.sources, ())
                return out
            layers = index[0]
            for j in range(layers.start, layers.stop):
                if not spec.per_expert:
                    item(self.sources[j], (j - layers.start,))
                    continue
                for e in range(index[1].start, index[1].stop):
                    item(self.sources[j][e], (j - layers.start, e - index[1].start))
        return out


def _plan(cfg: config_lib.ModelConfig, arch: str, files: _TensorFiles, shapes: dict) -> list:
    """Every `_Leaf` of `cfg`'s params, each tensor they read checked first (present, of its
    shape: a missing or mis-shaped one raises CheckpointError before anything is read)."""
    leaves = []
    for spec in _top_specs(cfg):
        shape = _get(shapes, spec.path).shape
        files.check(spec.hf_name, spec.hf_shape(shape))
        leaves.append(_Leaf(spec.path, spec, shape, _Source(spec.hf_name)))
    for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
        run = transformer.run_name(r)
        for spec in _layer_specs(cfg, arch, is_moe):
            shape = _get(shapes[run], spec.path).shape  # [n, (E,) ...]
            hf_shape = spec.hf_shape(shape[2:] if spec.per_expert else shape[1:])
            sources = []
            for layer in range(start, start + length):
                if not spec.per_expert:
                    sources.append(_Source(spec.hf_name.format(layer=layer)))
                    files.check(sources[-1].name, hf_shape)
                    continue
                fused = _fused_expert_sources(files, spec, layer, cfg, arch)
                if fused is None:
                    names = [spec.hf_name.format(layer=layer, expert=e) for e in range(shape[1])]
                    for name in names:
                        files.check(name, hf_shape)
                    fused = tuple(map(_Source, names))
                sources.append(fused)
            leaves.append(_Leaf((run, *spec.path), spec, shape, tuple(sources)))
    return leaves


def _fused_expert_sources(files, spec, layer, cfg, arch) -> tuple[_Source, ...] | None:
    """Per expert, where its [out, in] HF tensor is in the fused in-memory layout
    (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]), if that is on disk."""
    if arch != QWEN3_MOE:
        return None
    prefix = f"model.layers.{layer}.mlp.experts."
    E, D, F = cfg.num_experts, cfg.d_model, cfg.moe_ffn_dim
    if spec.path[-1] == "down_proj" and prefix + "down_proj" in files:
        files.check(prefix + "down_proj", (E, D, F))
        return tuple(_Source(prefix + "down_proj", (e,)) for e in range(E))
    if prefix + "gate_up_proj" in files and spec.path[-1] in ("gate_proj", "up_proj"):
        files.check(prefix + "gate_up_proj", (E, 2 * F, D))
        offset = 0 if spec.path[-1] == "gate_proj" else F
        return tuple(_Source(prefix + "gate_up_proj", (e,), offset) for e in range(E))
    return None


def _load_leaf(files: _TensorFiles, leaf: _Leaf, dtype, sharding) -> jax.Array:
    """The whole leaf (`sharding` None), or a `jax.make_array_from_callback` array whose
    callback reads only each addressable device's block; devices that hold the same block
    (replicated axes) share one read."""
    if sharding is None:
        return jnp.asarray(leaf.read(files, _full_index(leaf.shape), dtype))
    blocks: dict[tuple, np.ndarray] = {}

    def block(index):
        index = _normalize(index, leaf.shape)
        key = tuple((s.start, s.stop) for s in index)
        if key not in blocks:
            blocks[key] = leaf.read(files, index, dtype)
        return blocks[key]

    with files.opened():
        return jax.make_array_from_callback(leaf.shape, sharding, block)


@dataclasses.dataclass(frozen=True)
class _Checkpoint:
    """An opened checkpoint: its config and the leaves to read, every tensor checked."""

    cfg: config_lib.ModelConfig
    files: _TensorFiles
    shapes: dict  # transformer.param_shapes(cfg)
    leaves: list[_Leaf]
    dtype: np.dtype  # of the params


def _open_checkpoint(path: pathlib.Path, dtype) -> _Checkpoint:
    """config.json read, every tensor checked (present, of its shape, none unexpected) from the
    files' headers; no tensor data read."""
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
    files = _TensorFiles(path)
    shapes = transformer.param_shapes(cfg)
    with files.opened():
        leaves = _plan(cfg, arch, files, shapes)
    unexpected = sorted(
        k for k in set(files.where) - files.used if not k.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        more = " ..." if len(unexpected) > 8 else ""
        raise CheckpointError(
            files.source, "tensors", f"{unexpected[:8]}{more}",
            f"only those of {arch} with {cfg.num_layers} layers and {cfg.num_experts} experts",
        )  # fmt: skip
    return _Checkpoint(cfg, files, shapes, leaves, np.dtype(jnp.dtype(param_dtype)))


Shardings = dict | Callable[[config_lib.ModelConfig], dict]


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: config_lib.DTypeLike | None = None,
    shardings: Shardings | None = None,
) -> tuple[config_lib.ModelConfig, dict]:
    """(ModelConfig, params) from a local Hugging Face checkpoint directory.

    Args:
      path: a directory holding `config.json` and `*.safetensors` (optionally sharded with
        `model.safetensors.index.json`).
      dtype: parameter (and compute) dtype in any spelling `config.dtype_name` accepts
        ("bfloat16", jnp.bfloat16, np.float32, jnp.dtype("float32")); default: the checkpoint's
        own when it is float32 or bfloat16, else float32.
      shardings: where to put the params: a tree of `jax.sharding.Sharding` with the structure
        of `transformer.param_shapes(cfg)`, or a function of the loaded ModelConfig returning
        one (the caller knows the config only once config.json is read), e.g.
        `lambda cfg: sharding.param_shardings(mesh, transformer.param_shapes(cfg))`. Each
        parameter is then built with `jax.make_array_from_callback`, and each process reads
        only the blocks its devices hold (safetensors' lazy `get_slice`), one HF tensor at a
        time: its peak host memory is about its devices' share of the largest parameter plus
        one tensor, not the checkpoint. None (the default): every parameter whole on the
        default device. The values are the same bits either way.

    Every tensor is checked (present, of its shape) from the files' headers before any is read;
    a missing, mis-shaped or unexpected tensor raises CheckpointError naming the file and key.
    """
    ckpt = _open_checkpoint(pathlib.Path(path), dtype)
    if callable(shardings):
        shardings = shardings(ckpt.cfg)
    if shardings is not None and jax.tree.structure(shardings) != jax.tree.structure(ckpt.shapes):
        raise errors.InvalidValue(
            "load_hf_checkpoint", "shardings", type(shardings).__name__,
            "a tree of jax.sharding.Sharding with the structure of transformer.param_shapes(cfg)",
        )  # fmt: skip
    params: dict = {}
    for leaf in ckpt.leaves:
        sharding = None if shardings is None else _get(shardings, leaf.path)
        _set(params, leaf.path, _load_leaf(ckpt.files, leaf, ckpt.dtype, sharding))
    return ckpt.cfg, params


# ---- saving ---------------------------------------------------------------------------------


class _Tensor(NamedTuple):
    """One HF tensor of an export: item [layer, expert] of the espo leaf at `path`."""

    name: str
    spec: _Spec
    path: tuple[str, ...]
    layer: int | None  # index into the stacked leaf; None for a top-level leaf
    expert: int | None
    nbytes: int


def _export_tensors(cfg, arch, params) -> list[_Tensor]:
    """Every HF tensor of `params`, in the order the files list them; nothing converted."""
    out = []
    for spec in _top_specs(cfg):
        leaf = _get(params, spec.path)
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        out.append(_Tensor(spec.hf_name, spec, spec.path, None, None, nbytes))
    for r, (is_moe, start, length) in enumerate(cfg.layer_runs()):
        run = transformer.run_name(r)
        for spec in _layer_specs(cfg, arch, is_moe):
            leaf = _get(params[run], spec.path)
            lead = 2 if spec.per_expert else 1
            nbytes = math.prod(leaf.shape[lead:]) * np.dtype(leaf.dtype).itemsize
            for j in range(length):
                for e in range(cfg.num_experts) if spec.per_expert else (None,):
                    name = spec.hf_name.format(layer=start + j, expert=e)
                    out.append(_Tensor(name, spec, (run, *spec.path), j, e, nbytes))
    return out


def _host_slice(leaf, layer: int | None) -> np.ndarray:
    """leaf[layer] (the whole leaf for None) as a host array. Of a `jax.Array` of this process,
    copied from one device of each distinct block (a replicated leaf from one device, never one
    gather per device); of one spread over processes, `np.asarray` (which refuses it)."""
    if not isinstance(leaf, jax.Array) or not leaf.is_fully_addressable:
        return np.asarray(leaf if layer is None else leaf[layer])
    out = np.empty(leaf.shape if layer is None else leaf.shape[1:], leaf.dtype)
    done = set()
    for shard in leaf.addressable_shards:
        index = _normalize(shard.index, leaf.shape)
        key = tuple((s.start, s.stop) for s in index)
        if key in done or (layer is not None and not index[0].start <= layer < index[0].stop):
            continue
        done.add(key)
        if layer is None:
            out[index] = np.asarray(shard.data)
        else:  # the layer's rows of this block alone leave the device
            out[index[1:]] = np.asarray(shard.data[layer - index[0].start])
    return out


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

    One shard file at a time: only its tensors are converted, and a stacked leaf is brought to
    the host one layer slice at a time (of a sharded `jax.Array` of this process, from one
    device of each distinct block), so the peak host memory is about one shard (twice:
    safetensors' numpy `save_file` copies each tensor to bytes) plus one layer of one leaf, not
    the model. Params sharded over several processes must be gathered first
    (`espo.trainer._finish` does).
    """
    arch = architecture or (QWEN3_MOE if cfg.qk_norm else MIXTRAL)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise errors.InvalidValue("", "architecture", arch, f"{SUPPORTED_ARCHITECTURES}")
    _check_exportable(cfg, arch)
    path = pathlib.Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path}: exists and is not empty; refusing to overwrite it")
    path.mkdir(parents=True, exist_ok=True)
    tensors = _export_tensors(cfg, arch, params)
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    held: dict = {}  # the one (leaf, layer) slice on the host, reused by its experts

    def convert(t: _Tensor) -> np.ndarray:
        key = (t.path, t.layer)
        if key not in held:
            held.clear()  # the previous slice goes before the next is gathered
            held[key] = _host_slice(_get(params, t.path), t.layer)
        item = held[key] if t.expert is None else held[key][t.expert]
        return np.ascontiguousarray(t.spec.to_hf(item))

    if len(shards) == 1:
        fnames = ["model.safetensors"]
    else:
        fnames = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(fnames, shards, strict=True):
        contents = {t.name: convert(t) for t in shard}
        save_file(contents, path / fname, metadata={"format": "pt"})
        del contents  # before the next shard's tensors exist
        weight_map.update(dict.fromkeys((t.name for t in shard), fname))
    held.clear()
    if len(shards) > 1:
        total = sum(t.nbytes for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, arch), indent=2))
    return path
