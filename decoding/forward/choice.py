"""Each row's most likely token ids: the greedy choice, and the top-k a proposer recycles.

Contract: ``top_ids(scores, k)`` returns, for each row of ``scores`` ``[rows, vocab]``, the indices of its ``k``
highest scores, highest first, the lower index first among equal scores; ``greedy_ids(scores)`` is ``k = 1``
flattened: torch's ``argmax`` (the first maximum). Every greedy choice of a decode goes through ``greedy_ids``,
so the plain loop and lookahead choose by one rule. A float32 CPU tensor is read by the native kernel
(``csrc/fused_ops.cpp``: one pass, ~10 us a row of 49,152 where torch's ``argmax`` took ~150 us and ``topk(2)``
~200 us on the 2-core Xeon); anything else by torch. NaN scores: never chosen by the native kernel, chosen by
torch's ``argmax``; logits with NaN are a broken model either way.

``RowIds`` is what a forward that chose on the device hands back (``decoding.forward.static``): the rows' argmax ids
(the list itself) and, when it read them in the same copy, their top ids (``top(k)``), so that a step's greedy choices
and the top-k a proposer recycles come from one device-to-host read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from decoding.weights import native

MAX_NATIVE_K = 64


def top_ids(scores: torch.Tensor, k: int) -> list[list[int]]:
    """The ``k`` (1..vocab) best token ids of each row of ``scores`` ``[rows, vocab]``, best first."""
    ops = native.fused_ops()
    if ops is None or scores.device.type != "cpu" or scores.dtype != torch.float32 or k > MAX_NATIVE_K:
        if k == 1:
            return [[index] for index in scores.argmax(dim=-1).tolist()]
        return scores.topk(k, dim=-1).indices.tolist()
    rows = scores.contiguous()
    out = torch.empty((rows.shape[0], k), dtype=torch.int64)
    ops.top_tokens(rows.data_ptr(), rows.shape[0], rows.shape[1], k, out.data_ptr())
    return out.tolist()


def greedy_ids(scores: torch.Tensor) -> list[int]:
    """Each row's argmax (the first maximum) of ``scores`` ``[rows, vocab]``."""
    return [ids[0] for ids in top_ids(scores, 1)]


def greedy_id(scores: torch.Tensor) -> int:
    """The argmax of one row ``[vocab]``."""
    return greedy_ids(scores.reshape(1, -1))[0]


class RowIds(list):
    """Each logits row's argmax id (the list itself), as read off the device, and ``columns``: ``columns[j][r]`` is
    row r's (j+1)-th best id (``decoding.forward.static_forward.row_ids``' layout), as many as were read.

    >>> ids = RowIds([7, 3], [[7, 3], [5, 1]])
    >>> ids == [7, 3], ids.top(2), ids.top(3)
    (True, [(7, 5), (3, 1)], None)
    """

    def __init__(self, argmax: Iterable[int], columns: Sequence[Sequence[int]] = ()) -> None:
        super().__init__(argmax)
        self.columns = columns

    def top(self, k: int) -> list[tuple[int, ...]] | None:
        """Each row's ``k`` best ids, best first; None when fewer than ``k`` were read (read them off the logits)."""
        if k > len(self.columns):
            return None
        return list(zip(*self.columns[:k], strict=True))
