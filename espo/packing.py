"""Sequence packing for the update: whole sequences laid end to end in rows of a token budget.

Two layouts of the same sequences:
- unpacked [N, T] (`espo.batching.TrainBatch`): sequence n's real tokens, prompt then completion,
  are the contiguous columns [start_n, start_n + len_n) of row n;
- packed [R, L], L = the token budget (`train.max_tokens_per_micro_batch`): sequence n occupies
  columns [offset_n, offset_n + len_n) of row `row_n`. `segment_ids` number the sequences of a
  row 1, 2, ... in placement order, 0 on the padding at the end of a row; `positions` restart at
  0 in every segment (RoPE), -1 on padding.
`plan` places sequences first-fit decreasing on the host (numpy, deterministic: ties keep batch
order). `pack` moves any per-token host array (tokens, masks, the router trace along its time
axis) into the packed layout, so the trace is packed exactly like the tokens. `unpack` is the
jittable way back for what a packed forward computes (log-probs, entropies): a gather whose
gradient scatters back to the packed positions. The losses then run on the unpacked layout, so
every per-sequence quantity (seq-mean aggregations, GSPO / ESPO ratios, ESPO's entropy groups,
sequence IS weights) is per segment by construction: a segment never shares a row of the loss.
Invariant: unpack(pack(x)) == x on every real token, and 0 elsewhere.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Packing:
    """Where every sequence of an unpacked [N, T] batch lives in the packed [R, L] batch."""

    row: np.ndarray  # int32 [N] packed row of sequence n; -1 for a sequence with no token
    offset: np.ndarray  # int32 [N] its first column in that row
    start: np.ndarray  # int32 [N] its first column in the unpacked row
    length: np.ndarray  # int32 [N] its real tokens
    num_rows: int  # R
    budget: int  # L

    @property
    def segment_ids(self) -> Int[np.ndarray, "R L"]:
        """1, 2, ... per sequence of a row in placement (offset) order; 0 on padding."""
        out = np.zeros((self.num_rows, self.budget), np.int32)
        order = np.lexsort((self.offset, self.row))
        count = np.zeros(self.num_rows, np.int32)
        for n in order:
            if self.row[n] >= 0:
                count[self.row[n]] += 1
                out[self.row[n], self.offset[n] : self.offset[n] + self.length[n]] = count[
                    self.row[n]
                ]
        return out

    @property
    def positions(self) -> Int[np.ndarray, "R L"]:
        """0, 1, ... within each segment (RoPE restarts per sequence); -1 on padding."""
        out = np.full((self.num_rows, self.budget), -1, np.int32)
        for n in np.flatnonzero(self.row >= 0):
            out[self.row[n], self.offset[n] : self.offset[n] + self.length[n]] = np.arange(
                self.length[n]
            )
        return out

    def pack(self, x: np.ndarray, *, axis: int = 1, fill=0) -> np.ndarray:
        """[N, ..., T (at `axis`), ...] -> [R, ..., L, ...]: each sequence's tokens moved to its
        segment, `fill` elsewhere (e.g. -1 for expert ids)."""
        x = np.asarray(x)
        shape = list(x.shape)
        shape[0], shape[axis] = self.num_rows, self.budget
        out = np.full(shape, fill, x.dtype)
        for n in np.flatnonzero(self.row >= 0):
            src = [n] + [slice(None)] * (x.ndim - 1)
            dst = [self.row[n]] + [slice(None)] * (x.ndim - 1)
            src[axis] = slice(self.start[n], self.start[n] + self.length[n])
            dst[axis] = slice(self.offset[n], self.offset[n] + self.length[n])
            out[tuple(dst)] = x[tuple(src)]
        return out

    def unpack_index(self, num_columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cols, valid), each [N, T]: unpacked (n, t) reads packed (rows, cols) if valid."""
        t = np.arange(num_columns)[None, :]  # [1, T]
        inside = (t >= self.start[:, None]) & (t < (self.start + self.length)[:, None])
        valid = inside & (self.row >= 0)[:, None]  # [N, T]
        rows = np.where(valid, self.row[:, None], 0).astype(np.int32)
        cols = np.where(valid, self.offset[:, None] + t - self.start[:, None], 0).astype(np.int32)
        return rows, cols, valid


def plan(
    attention_mask: Bool[np.ndarray, "N T"], *, budget: int, num_rows: int | None = None
) -> Packing:
    """First-fit decreasing placement of the real tokens of each row of `attention_mask`.

    Each row's real tokens must be contiguous (a left-padded prompt then its completion). A
    sequence longer than `budget` is an error naming it; `num_rows` fixes R (an error if the
    sequences do not fit), else R is the number of rows first-fit decreasing needs (at least 1).
    """
    mask = np.asarray(attention_mask, bool)
    if mask.ndim != 2:
        raise ValueError(f"attention_mask must be [N, T], got shape {mask.shape}")
    if not (isinstance(budget, int) and budget >= 1):
        raise ValueError(f"budget={budget!r} is invalid: an int >= 1")
    length = mask.sum(-1).astype(np.int32)  # [N]
    start = np.where(length > 0, mask.argmax(-1), 0).astype(np.int32)  # [N]
    t = np.arange(mask.shape[1])[None, :]
    contiguous = (t >= start[:, None]) & (t < (start + length)[:, None])
    if (bad := np.flatnonzero((contiguous != mask).any(-1))).size:
        raise ValueError(f"sequence {bad[0]} is not contiguous in attention_mask: cannot pack it")
    if (long := np.flatnonzero(length > budget)).size:
        n = long[0]
        raise ValueError(
            f"sequence {n} has {length[n]} tokens, more than the packing budget "
            f"train.max_tokens_per_micro_batch={budget}"
        )
    row = np.full(length.shape, -1, np.int32)
    offset = np.zeros(length.shape, np.int32)
    used: list[int] = []  # tokens placed per packed row
    for n in sorted(np.flatnonzero(length > 0), key=lambda n: (-length[n], n)):
        r = next((r for r, u in enumerate(used) if u + length[n] <= budget), len(used))
        if r == len(used):
            used.append(0)
        row[n], offset[n] = r, used[r]
        used[r] += length[n]
    if num_rows is not None and len(used) > num_rows:
        raise ValueError(
            f"{int(length.sum())} tokens in {int((length > 0).sum())} sequences need "
            f"{len(used)} packed rows of {budget}, more than num_rows={num_rows}"
        )
    r_total = max(len(used), 1) if num_rows is None else num_rows  # >= 1 row: fixed-rank arrays
    return Packing(
        row=row, offset=offset, start=start, length=length, num_rows=r_total, budget=budget
    )


def unpack(
    packed: Float[Array, "R L"], index: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> Float[Array, "N T"]:
    """The unpacked [N, T] view of a packed per-token array (0 off the real tokens); jittable,
    and the gradient of the result scatters back to the packed positions."""
    rows, cols, valid = index
    return jnp.where(valid, packed[rows, cols], jnp.zeros((), packed.dtype))  # [N, T]
