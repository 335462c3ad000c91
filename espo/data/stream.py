"""`PromptStream`: the deterministic, checkpointable stream of training Examples.

This module owns the order in which training prompts are drawn: a grain pipeline
`MapDataset.source(source).shuffle(seed).repeat()` (a fresh permutation every epoch, reseeded by
grain from `seed` and the epoch), read through a grain iterator without worker threads or
prefetch, so the iterator's state is exactly the number of examples consumed.

Invariants: the same (source, seed) gives the same sequence in every run and process;
`load_state_dict(state_dict())` on a fresh stream continues exactly where the state was taken;
every draw, accepted or rejected, consumes one example; `take` never loops forever.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import grain

from espo import errors
from espo.data import examples as examples_lib

_STATE_VERSION = 1


class PromptStream:
    """Training Examples in a shuffled, endlessly repeated order; see the module docstring."""

    def __init__(self, source: Sequence[examples_lib.Example], *, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise errors.InvalidValue("PromptStream", "seed", seed, "an int >= 0")
        if len(source) == 0:
            name = getattr(source, "name", type(source).__name__)
            raise ValueError(f"PromptStream: source {name!r} is empty; valid: >= 1 example")
        self._source = source
        self._seed = seed
        dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat()
        # No threads, no prefetch: nothing is read ahead, so state = examples consumed.
        read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iterator = iter(dataset.to_iter_dataset(read_options))
        self._num_draws = 0
        self._num_rejected = 0

    def take(
        self,
        n: int,
        *,
        accept: Callable[[examples_lib.Example], bool] | None = None,
        max_draws: int | None = None,
    ) -> list[examples_lib.Example]:
        """The next `n` examples for which `accept(e)` is true (all when `accept` is None).

        Rejected examples are consumed and counted in `data/rejected`. Stops after `max_draws`
        draws (default 100 * n) and then returns fewer than `n`.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise errors.InvalidValue("PromptStream.take", "n", n, "an int >= 0")
        if max_draws is None:
            max_draws = 100 * n
        if isinstance(max_draws, bool) or not isinstance(max_draws, int) or max_draws < 0:
            raise ValueError(
                f"PromptStream.take: max_draws={max_draws!r} is invalid; valid: an int >= 0"
            )
        out: list[examples_lib.Example] = []
        draws = 0
        while len(out) < n and draws < max_draws:
            example = next(self._iterator)
            draws += 1
            self._num_draws += 1
            if accept is None or accept(example):
                out.append(example)
            else:
                self._num_rejected += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: grain's iterator state, the counters and what they index."""
        return {
            "version": _STATE_VERSION,
            "iterator": copy.deepcopy(self._iterator.get_state()),
            "num_draws": self._num_draws,
            "num_rejected": self._num_rejected,
            "seed": self._seed,
            "source_len": len(self._source),
            "source_name": getattr(self._source, "name", ""),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` (from `state_dict`) was taken.

        Raises when the state was taken on a different source (name or length) or seed: the
        positions it holds would index another order.
        """
        missing = [
            k
            for k in ("version", "iterator", "num_draws", "num_rejected", "seed", "source_len")
            if k not in state
        ]
        if missing:
            raise ValueError(f"PromptStream.load_state_dict: the state has no {missing}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"PromptStream.load_state_dict: state version {state['version']!r}; "
                f"valid: {_STATE_VERSION}"
            )
        mine = {
            "seed": self._seed,
            "source_len": len(self._source),
            "source_name": getattr(self._source, "name", ""),
        }
        theirs = {k: state.get(k, "") for k in mine}
        if mine != theirs:
            diff = ", ".join(
                f"{k}: state {theirs[k]!r} vs stream {mine[k]!r}"
                for k in mine
                if mine[k] != theirs[k]
            )
            raise ValueError(
                f"PromptStream.load_state_dict: the state was taken on another stream ({diff})"
            )
        self._iterator.set_state(copy.deepcopy(state["iterator"]))
        self._num_draws = int(state["num_draws"])
        self._num_rejected = int(state["num_rejected"])

    def metrics(self) -> dict[str, float]:
        """Epochs drawn (fractional), examples rejected by `accept`, malformed records skipped."""
        return {
            "data/epochs": self._num_draws / len(self._source),
            "data/rejected": float(self._num_rejected),
            "data/skipped_records": float(getattr(self._source, "num_skipped", 0)),
        }
