"""The static step's shapes and its one input buffer: what a step varies, as data, checked on the host.

Contract: a ``Bucket`` is a static step's shape (``sequences`` x ``tokens`` input tokens attending over
``attended`` cache slots); one that cannot hold its tokens cannot be built. Its input buffer is int64: the fields
``TOKEN_FIELDS`` (``sequences * tokens`` ints each: token ids, positions, each token's parent in the step, the rows
to read) then ``SEQUENCE_FIELDS`` (``sequences`` ints each: each sequence's cache length and pool row; a token's
keys/values go to its sequence's row at slot length + its index, derived on the device).
``step_values(slices, bucket, scratch_row)`` lays a step's slices out as those ints (padding sequences on the
pool's ``scratch_row``), and ``check_slices`` raises ``StaticInputError`` naming the bucket, field and value unless
every one lies in the range its kernels can index (``input_bounds``; ``check_inputs`` checks a whole buffer), so a
device-side assert (which poisons a CUDA context) never happens. The check reads each slice's own ints (``min``
and ``max`` of each, a few passes), never a tensor.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.forward.slices import Slice
from decoding.forward.static_forward import SEQUENCE_FIELDS, TOKEN_FIELDS


class StaticInputError(ValueError):
    """A static step's inputs index outside its bucket, the KV pool or the vocabulary (the message names which)."""


@dataclass(frozen=True, order=True)
class Bucket:
    """A static step's shape: ``sequences`` x ``tokens`` input tokens, attending over ``attended`` cache slots.

    A bucket whose tokens do not fit its attended slots cannot be built: its keys/values would be written past
    the slots it attends over.

    >>> Bucket(1, 96, 64)
    Traceback (most recent call last):
    ...
    ValueError: Bucket(sequences=1, tokens=96, attended=64) cannot hold its tokens: 96 tokens > 64 attended slots
    """

    sequences: int
    tokens: int
    attended: int

    def __post_init__(self) -> None:
        if min(self.sequences, self.tokens) < 1:
            raise ValueError(f"{self} has no tokens")
        if self.tokens > self.attended:
            raise ValueError(f"{self} cannot hold its tokens: {self.tokens} tokens > {self.attended} attended slots")

    @property
    def input_size(self) -> int:
        """Ints in the step's input buffer."""
        return len(TOKEN_FIELDS) * self.sequences * self.tokens + len(SEQUENCE_FIELDS) * self.sequences


@functools.lru_cache(maxsize=1024)
def _ranges(bucket: Bucket, pool_rows: int, vocab: int) -> dict[str, tuple[int, int]]:
    """Each field's range ``[low, high)`` (``input_bounds``), a parent's high being its sequence's token count (it
    must also come before its token). Cached: read only."""
    return {
        "token_ids": (0, vocab), "positions": (0, 2**62), "parents": (-1, bucket.tokens),
        "read_rows": (0, bucket.sequences * bucket.tokens), "lengths": (0, bucket.attended - bucket.tokens + 1),
        "rows": (0, pool_rows),
    }


def input_bounds(bucket: Bucket, pool_rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``: for each int of ``bucket``'s input buffer (module contract), the range ``[low, high)`` the
    kernels that use it can index: token ids below ``vocab``; rows read within the step's tokens; pool rows
    (written and read) below ``pool_rows``; each token's parent -1 or an earlier token of its sequence; cache
    lengths that leave room for the step's tokens below the attended length (its tokens' write slots)."""
    count, sequences = bucket.sequences * bucket.tokens, bucket.sequences
    ranges = _ranges(bucket, pool_rows, vocab)
    low, high = [], []
    for name in (*TOKEN_FIELDS, *SEQUENCE_FIELDS):
        size = count if name in TOKEN_FIELDS else sequences
        low.append(torch.full((size,), ranges[name][0]))
        high.append(torch.arange(bucket.tokens).repeat(sequences) if name == "parents"
                    else torch.full((size,), ranges[name][1]))
    return torch.cat(low), torch.cat(high)


def check_inputs(values: torch.Tensor, bucket: Bucket, bounds: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise ``StaticInputError``, naming ``bucket``, the field and the value, unless every int of the host input
    buffer ``values`` lies in its range (``bounds``: ``input_bounds(bucket, ...)``). Three small ops when all is
    well; a step that passes cannot index out of range on the device.

    >>> bucket = Bucket(1, 2, 64)
    >>> bounds = input_bounds(bucket, pool_rows=3, vocab=10)
    >>> check_inputs(torch.tensor([5, 6, 0, 1, -1, 0, 0, 1, 62, 0]), bucket, bounds)
    >>> check_inputs(torch.tensor([5, 6, 0, 1, -1, 0, 0, 1, 63, 0]), bucket, bounds)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decoding.forward.static_inputs.StaticInputError: Bucket(sequences=1, tokens=2, attended=64): lengths[0] holds ...
    """
    low, high = bounds
    outside = torch.logical_or(values < low, values >= high)
    if not outside.any():
        return
    index = int(outside.nonzero()[0])
    count = bucket.sequences * bucket.tokens
    field = index // count if index < len(TOKEN_FIELDS) * count else len(TOKEN_FIELDS) + (
        index - len(TOKEN_FIELDS) * count) // bucket.sequences
    offset = index % count if field < len(TOKEN_FIELDS) else (index - len(TOKEN_FIELDS) * count) % bucket.sequences
    name = (*TOKEN_FIELDS, *SEQUENCE_FIELDS)[field]
    raise StaticInputError(f"{bucket}: {name}[{offset}] holds {int(values[index])}, outside "
                           f"[{int(low[index])}, {int(high[index])})")


def step_values(slices: Sequence[Slice], bucket: Bucket, scratch_row: int) -> list[int]:
    """The input buffer's ints for ``slices`` in ``bucket`` (module contract), field after field; a sequence past
    the slices is padding (``scratch_row``, nothing cached), a token past a slice's is padding too (parent -1, id 0,
    any position). A slice without ``host_positions`` / ``host_rows`` has its tensors read instead."""
    tokens = bucket.tokens
    ids: list[int] = []
    positions: list[int] = []
    parents: list[int] = []
    read_rows: list[int] = []
    lengths: list[int] = []
    rows: list[int] = []
    for index in range(bucket.sequences):
        slice_ = slices[index] if index < len(slices) else None
        base = index * tokens
        if slice_ is None:
            real, length, row, read = 0, 0, scratch_row, ()
        else:
            real, length, row = len(slice_.tokens), slice_.cache.length, slice_.cache.pool_row
            ids += slice_.tokens
            positions += slice_.host_positions if slice_.host_positions is not None else slice_.positions.tolist()
            parents += slice_.parents if slice_.parents is not None else range(-1, real - 1)
            read = slice_.host_rows if slice_.host_rows is not None else slice_.logit_rows.tolist()
        pad = tokens - real
        ids += [0] * pad
        positions += [length + real] * pad  # padding: past the sequence, any finite value
        parents += [-1] * pad
        read_rows += [base + r for r in read] if base else read
        read_rows += [base] * (tokens - len(read))
        lengths.append(length)
        rows.append(row)
    return ids + positions + parents + read_rows + lengths + rows


def check_slices(values: list[int], bucket: Bucket, pool_rows: int, vocab: int) -> None:
    """Raise ``StaticInputError`` (as ``check_inputs`` would, naming the field) unless every int of ``values``
    (``step_values``' for ``bucket``) lies in its range (``input_bounds``). A few ``min``/``max`` passes over the
    ints, no tensor.

    >>> bucket = Bucket(1, 2, 64)
    >>> check_slices([5, 6, 0, 1, -1, 0, 0, 1, 62, 0], bucket, pool_rows=3, vocab=10)
    >>> check_slices([5, 6, 0, 1, -1, 1, 0, 1, 62, 0], bucket, pool_rows=3, vocab=10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decoding.forward.static_inputs.StaticInputError: Bucket(sequences=1, tokens=2, attended=64): parents[1] holds 1, ...
    """
    count, sequences = bucket.sequences * bucket.tokens, bucket.sequences
    ranges = _ranges(bucket, pool_rows, vocab)
    fields = [values[start : start + count] for start in range(0, len(TOKEN_FIELDS) * count, count)]
    start = len(TOKEN_FIELDS) * count
    fields += [values[start + field * sequences : start + (field + 1) * sequences]
               for field in range(len(SEQUENCE_FIELDS))]
    inside = len(values) == bucket.input_size and not any(map(
        operator.ge, fields[2], itertools.cycle(range(bucket.tokens))))  # a parent before its token
    for name, field in zip((*TOKEN_FIELDS, *SEQUENCE_FIELDS), fields, strict=True):
        low, high = ranges[name]
        inside = inside and min(field) >= low and (name == "positions" or max(field) < high)
    if not inside:
        check_inputs(torch.tensor(values), bucket, input_bounds(bucket, pool_rows, vocab))
        raise StaticInputError(f"{bucket}: {len(values)} input ints for {bucket.input_size}")
