"""Checkpoints of a training run: one orbax step holds the device state and the host state.

Owns `WORKDIR/checkpoints` (an orbax `CheckpointManager`, one directory per saved step):
- `state`: a pytree of arrays (params, optimizer state, step, RNG key data as uint32...),
  written with `StandardSave` and restored into the shapes, dtypes and shardings of an abstract
  pytree (`jax.eval_shape` output or `jax.ShapeDtypeStruct`s).
- `host`: a JSON-serialisable dict (data iterator state, curriculum, pass-rate history, length
  predictor, model config...), written with `JsonSave`. JSON turns tuples into lists. Host
  numpy arrays (the resample buffer's rows) go in through `arrays_to_json`, which stores each
  one exactly (dtype, shape, raw bytes in base64; zero-size arrays too, which orbax's array
  handlers refuse), and come back with `arrays_from_json`. A bare ndarray is an error.

Invariants:
- Both items of a step are written into `<step>.orbax-checkpoint-tmp*/`, which orbax renames
  to `<step>/` only after everything is written; `save` returns after that rename. A process
  killed at any moment (SIGKILL included) therefore leaves the previous complete checkpoint or
  the new complete one, never a half-written step that `latest_step` would pick; the next
  `Checkpointer` on the directory deletes unfinished temporary directories. (Durability across
  a power loss is the file system's business: nothing here calls fsync.)
- Old steps are deleted only after the new one is complete; the `keep` newest stay. (A kill
  while orbax deletes an old step can leave that older step half deleted; the newest is whole.)
- A restore whose abstract state does not match the saved one (a leaf's path, shape or dtype)
  raises `CheckpointMismatchError`; orbax would otherwise cast dtypes silently.
- `check_model_config` compares the model config saved in `host` with the current one before
  anything is built from the checkpoint.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import operator
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from espo import errors

CHECKPOINTS_DIR = "checkpoints"  # WORKDIR/checkpoints


class CheckpointMismatchError(errors.CheckpointError):
    """The checkpoint on disk does not fit the current run (model config, shapes or dtypes)."""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidValue("Checkpointer", name, value, "an int >= 1")
    return value


def _json_path_error(value: Any, path: str) -> str | None:
    """The path of the first value `json.dumps` cannot write, or None when all of it can."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path} has the non-string key {k!r}"
            err = _json_path_error(v, f"{path}[{k!r}]")
            if err:
                return err
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            err = _json_path_error(v, f"{path}[{i}]")
            if err:
                return err
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return None
    return f"{path} is a {type(value).__name__} ({value!r:.80}), which JSON cannot hold"


_ARRAY_KEY = "__ndarray__"


def arrays_to_json(tree: Any) -> Any:
    """`tree` (dicts, lists, tuples, JSON scalars, numpy arrays) with every numpy array replaced
    by {"__ndarray__": {"dtype", "shape", "base64"}}: exact, bit for bit (NaN included)."""
    if isinstance(tree, np.ndarray):
        if tree.dtype.hasobject:
            raise TypeError(f"arrays_to_json: an object array ({tree.dtype}) has no raw bytes")
        data = base64.b64encode(np.ascontiguousarray(tree).tobytes()).decode("ascii")
        return {_ARRAY_KEY: dict(dtype=tree.dtype.str, shape=list(tree.shape), base64=data)}
    if isinstance(tree, Mapping):
        return {k: arrays_to_json(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [arrays_to_json(v) for v in tree]
    return tree


def arrays_from_json(tree: Any) -> Any:
    """The inverse of `arrays_to_json` (tuples come back as lists, as JSON gives them)."""
    if isinstance(tree, Mapping):
        if tree.keys() == {_ARRAY_KEY}:
            a = tree[_ARRAY_KEY]
            flat = np.frombuffer(base64.b64decode(a["base64"]), np.dtype(a["dtype"]))
            return flat.reshape(a["shape"]).copy()  # writeable, owns its memory
        return {k: arrays_from_json(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [arrays_from_json(v) for v in tree]
    return tree


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_name(path: tuple) -> str:
    """The '.'-joined name orbax gives a leaf (`opt.0.mu.w`)."""
    return ".".join(_key_name(k) for k in path)


def _describe(shape: Any, dtype: Any) -> str:
    return f"{jax.numpy.dtype(dtype).name}{list(shape)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 25
    keep: int = 2

    def __post_init__(self):
        errors.check(
            self,
            {
                "every_steps": (errors.is_int(self.every_steps) and self.every_steps >= 1, ">= 1"),
                "keep": (errors.is_int(self.keep) and self.keep >= 1, ">= 1"),
            },
        )


class Checkpointer:
    """Saves and restores (state, host) pairs in `directory`, every `every_steps`, keeping `keep`.

    Saving is synchronous: when `save` returns the step is complete on disk.
    """

    def __init__(
        self, directory: str | os.PathLike, *, every_steps: int, keep: int, read_only: bool = False
    ):
        self.every_steps = _positive_int("every_steps", every_steps)
        self.keep = _positive_int("keep", keep)
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else self.keep,
            save_interval_steps=0 if read_only else 1,
            create=not read_only,
            # a save cut short by a kill leaves a tmp dir; another run's directory is not ours
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=False,
            read_only=read_only,
        )
        # Handlers named up front: restore_host / item_metadata then need no handler registry
        # (orbax warns "Item ... could not be restored" without them).
        handlers = dict(state=ocp.StandardCheckpointHandler(), host=ocp.JsonCheckpointHandler())
        verbosity = logging.get_verbosity()
        if read_only:  # orbax warns that a read-only directory is read only
            logging.set_verbosity(logging.ERROR)
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers
            )
        finally:
            logging.set_verbosity(verbosity)
        # orbax removes unfinished saves in the background and waits for that only before its
        # next save; wait now, so the directory is settled once the constructor returns.
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()

    # -- queries ----------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete step on disk, ascending."""
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """Whether `step` is a checkpoint step (a multiple of `every_steps`)."""
        return step % self.every_steps == 0

    # -- save / restore ---------------------------------------------------------------------------
    def save(self, step: int, *, state: Any, host: dict, force: bool = False) -> bool:
        """Writes `state` and `host` as step `step`; returns whether a checkpoint was written.

        Without `force` only steps where `should_save` holds are written. A step that is already
        on disk is not written again (False). A step older than the newest one is an error.
        """
        if isinstance(step, bool) or not hasattr(step, "__index__") or operator.index(step) < 0:
            raise errors.InvalidValue("Checkpointer.save", "step", step, "an int >= 0")
        step = operator.index(step)
        if not (force or self.should_save(step)):
            return False
        if not isinstance(host, Mapping):
            raise TypeError(f"checkpoint host state must be a dict, got {type(host).__name__}")
        err = _json_path_error(host, "host")
        if err:
            raise TypeError(f"checkpoint host state is not JSON-serialisable: {err}")
        steps = self.all_steps()
        if step in steps:
            return False
        if steps and step < steps[-1]:
            raise ValueError(
                f"cannot save step {step}: {self.directory} already holds the newer step "
                f"{steps[-1]} (steps {steps}); use another workdir to branch a run"
            )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(dict(host))
        )
        saved = self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        if not saved:
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")
        return True

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps}"
            )
        return step

    def restore_host(self, step: int | None = None) -> dict:
        """Only the host dict of `step` (default: the newest), e.g. to check the model config."""
        step = self._resolve(step)
        out = self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
        return dict(out.host)

    def _check_abstract(self, step: int, abstract_state: Any) -> None:
        saved = self._manager.item_metadata(step)["state"]
        tree = getattr(saved, "tree", saved)
        is_meta = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
        on_disk = {m.name: m for m in jax.tree.leaves(tree, is_leaf=is_meta) if is_meta(m)}
        problems = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
            name = _leaf_name(path)
            meta = on_disk.get(name)
            if meta is None or not is_meta(leaf):
                continue  # structure differences are reported by orbax below
            if tuple(meta.shape) != tuple(leaf.shape) or meta.dtype != leaf.dtype:
                problems.append(
                    f"{name}: checkpoint {_describe(meta.shape, meta.dtype)}, "
                    f"expected {_describe(leaf.shape, leaf.dtype)}"
                )
        if problems:
            raise CheckpointMismatchError(
                str(self.directory), f"step {step}",
                valid=f"the state this run builds ({len(problems)} leaves differ: "
                + "; ".join(problems) + ")",
            )  # fmt: skip

    def restore(self, step: int | None = None, *, abstract_state: Any) -> tuple[Any, dict]:
        """(state, host) of `step` (default: the newest), state shaped like `abstract_state`."""
        step = self._resolve(step)
        self._check_abstract(step, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), host=ocp.args.JsonRestore()
        )
        try:
            out = self._manager.restore(step, args=args)
        except ValueError as e:  # orbax: structure or shape mismatch
            raise CheckpointMismatchError(
                str(self.directory), f"step {step}",
                valid=f"the state this run builds ({' '.join(str(e).split())})",
            ) from e  # fmt: skip
        return out.state, dict(out.host)

    def restore_params(self, step: int | None = None) -> tuple[Any, dict]:
        """(params, host) of `step` (default: the newest), whatever the rest of the state holds.

        Every array is read as saved, onto this process's first device (the optimizer state is
        read and dropped: orbax restores a tree whole).
        """
        step = self._resolve(step)
        saved = self._manager.item_metadata(step)["state"]
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        is_meta = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device),
            getattr(saved, "tree", saved),
            is_leaf=is_meta,
        )
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target), host=ocp.args.JsonRestore()
        )
        out = self._manager.restore(step, args=args)
        return out.state["params"], dict(out.host)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def flatten_config(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {"section.field": value} (what check_model_config compares)."""
    out = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten_config(v, f"{name}."))
        else:
            out[name] = v
    return out


_ABSENT = object()


def check_model_config(saved: dict, current: dict, defaults: dict | None = None) -> None:
    """Raises CheckpointMismatchError naming every model-config field that differs.

    `saved` comes back from the checkpoint's JSON and `current` from the run's config; both are
    compared in their JSON form (tuples == lists, other objects by `str`), nested dicts field by
    field (`moe.top_k`). A field the checkpoint lacks (added to the config since it was
    written) matches when the run's value is its value in `defaults`.
    """
    as_json = lambda c: json.loads(json.dumps(c, default=str))  # dtypes etc. by their str
    saved_flat, current_flat = flatten_config(as_json(saved)), flatten_config(as_json(current))
    default_flat = flatten_config(as_json(defaults or {}))
    show = lambda v: "<absent>" if v is _ABSENT else json.dumps(v)
    lines = []
    for name in sorted(saved_flat.keys() | current_flat.keys()):
        a, b = saved_flat.get(name, _ABSENT), current_flat.get(name, _ABSENT)
        if a is _ABSENT and b is not _ABSENT and default_flat.get(name, _ABSENT) == b:
            continue  # a field newer than the checkpoint, at its default
        if a is _ABSENT or b is _ABSENT or a != b:
            lines.append(f"{name}: checkpoint {show(a)}, config {show(b)}")
    if lines:
        raise CheckpointMismatchError(
            "model config", lines[0].split(":")[0],
            valid=f"equal to the checkpoint's; {len(lines)} fields differ: " + "; ".join(lines)
            + ". Resume with the checkpoint's model config, or start a fresh run in another "
            "workdir (--workdir)",
        )  # fmt: skip
