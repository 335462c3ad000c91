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

For the update the packing runs on the device: `layout` plans a batch on the host (numpy ints
only: `Layout`, micro-batches of R packed rows as long as the batch's rows, R * L tokens within
the budget, the number of micro-batches rounded up to a power of two so a run compiles a bounded
set of shapes) and `gather` moves device arrays (tokens, the router trace) into the packed rows
inside the jitted step. (Rows of the whole budget would give every token an attention span of
the budget: on CPU, with no segment-skipping attention kernel, slower than padding.)
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from espo import errors


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

    def pack_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, cols), each [R, L]: packed (r, l) reads unpacked (rows, cols) where its
        segment id is > 0 (0, 0 on padding): the index of `gather`."""
        rows, cols = np.zeros((2, self.num_rows, self.budget), np.int32)
        for n in np.flatnonzero(self.row >= 0):
            seg = slice(self.offset[n], self.offset[n] + self.length[n])
            rows[self.row[n], seg] = n
            cols[self.row[n], seg] = np.arange(self.start[n], self.start[n] + self.length[n])
        return rows, cols

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
        raise errors.InvalidValue("", "budget", budget, "an int >= 1")
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


def gather(
    x: Array, *, rows: Int[Array, "R L"], cols: Int[Array, "R L"], real: Bool[Array, "R L"],
    axis: int = 1, fill=0,
) -> Array:  # fmt: skip
    """Jittable `Packing.pack`: [N, ..., T (at `axis`), ...] -> [R, ..., L, ...], reading
    unpacked (rows, cols) (`Packing.pack_index`) where `real`, `fill` elsewhere."""
    taken = jnp.moveaxis(x, axis, 1)[rows, cols]  # [R, L, ...]
    real = real.reshape(real.shape + (1,) * (taken.ndim - 2))
    return jnp.moveaxis(jnp.where(real, taken, jnp.asarray(fill, x.dtype)), 1, axis)


def bucket(num_rows: int, *, max_rows: int) -> int:
    """`num_rows` rounded up to a power of two, at most `max_rows` (>= num_rows): the packed
    shapes of a run are then at most log2(max_rows) + 1 (no recompile after warm-up)."""
    return min(1 << max(num_rows - 1, 0).bit_length(), max(max_rows, num_rows))


@flax.struct.dataclass
class Layout:
    """An unpacked batch [N, T] as M micro-batches of R packed rows of L tokens each (R * L <=
    the token budget; M a `bucket`, trailing micro-batches may be all padding). Host numpy ints,
    small: the jitted step packs the device arrays itself (`gather`) and unpacks what the
    forward computes."""

    src_rows: Int[Array, "M R L"]  # unpacked row of each packed token (0 on padding)
    src_cols: Int[Array, "M R L"]  # its unpacked column
    segment_ids: Int[Array, "M R L"]  # 1, 2, ... per sequence of the row, 0 on padding
    positions: Int[Array, "M R L"]  # restarting per segment, -1 on padding
    rows: Int[Array, "N T"]  # packed row of each unpacked token, counted over micro-batches
    cols: Int[Array, "N T"]  # its packed column
    valid: Bool[Array, "N T"]  # a real token (attention_mask)

    @property
    def num_micro_batches(self) -> int:
        return self.segment_ids.shape[0]

    @property
    def rows_per_micro_batch(self) -> int:
        return self.segment_ids.shape[1]

    def micro_index(self, m) -> tuple[Array, Array, Array]:
        """The `unpack` index of micro-batch m's packed rows ([R, L]) into the [N, T] layout:
        m's sequences' tokens only (jittable in m)."""
        r = self.rows_per_micro_batch
        return self.rows % r, self.cols, self.valid & (self.rows // r == m)


def layout(attention_mask: Bool[np.ndarray, "N T"], *, budget: int) -> Layout:
    """First-fit-decreasing `plan` of `attention_mask` into rows of L = min(T, budget) tokens,
    R = budget // L rows per micro-batch, the micro-batch count rounded up by `bucket`.

    Rows as long as the batch's (not one row of the whole budget) keep each token's attention
    span at most T, as in the padded update, while a micro-batch still holds `budget` tokens.
    Errors as `plan`'s (a sequence longer than the budget names it and the budget).
    """
    mask = np.asarray(attention_mask, bool)
    n, t = mask.shape
    row_length = min(t, budget)
    per_micro = budget // row_length  # R
    first = plan(mask, budget=row_length)
    num_micro = bucket(-(-first.num_rows // per_micro), max_rows=-(-n // per_micro))
    p = dataclasses.replace(first, num_rows=num_micro * per_micro)  # padding rows added
    src_rows, src_cols = p.pack_index()
    rows, cols, valid = p.unpack_index(t)
    micro = lambda x: x.reshape(num_micro, per_micro, row_length)  # [M * R, L] -> [M, R, L]
    return Layout(
        src_rows=micro(src_rows),
        src_cols=micro(src_cols),
        segment_ids=micro(p.segment_ids),
        positions=micro(p.positions),
        rows=rows,
        cols=cols,
        valid=valid,
    )
