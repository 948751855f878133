"""What one sequence brings to a forward: its step's tokens, their positions, which of them see which, the rows
whose logits it reads, and the cache its keys and values go to.

Contract: ``Slice`` is plain data, made by a decode's plan (``decoding.step.steps``, ``decoding.step.stream``) and read
by every forward that runs it: the packed eager forward (``decoding.forward.packed``), the fused CPU step
(``decoding.forward.fused``) and the static step (``decoding.forward.static``). It imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decoding.forward.kv_cache import SlotCache


@dataclass(frozen=True)
class Slice:
    """One sequence's part of a packed forward.

    - ``tokens``: the step's input token ids (``t`` of them).
    - ``positions`` ``[t]``: their absolute position ids.
    - ``visible`` ``[t, t]`` bool, or None for causal: which step tokens each step token attends to (every
      step token also sees the whole cache).
    - ``logit_rows`` ``[r]``: the step rows whose logits are returned (may be empty).
    - ``cache``: the sequence's cache; the forward appends ``t`` slots to it.
    - ``parents`` (``t`` ints, or None for causal): each step token's parent (-1: none), when ``visible`` is
      each token and its ancestors, as in every lookahead step; a static step (``decoding.forward.static``) builds
      the mask from them on the device instead of copying ``visible``.
    - ``host_positions`` / ``host_rows`` (optional): ``positions`` and ``logit_rows`` as Python ints, for a
      static step to write without reading the tensors back; given them, ``positions`` / ``logit_rows`` may be
      None (made when an eager forward needs them).
    - ``visibility`` (optional): makes ``visible`` when an eager forward needs it (``visible`` then None), so a
      static step never builds the ``[t, t]`` mask on the host.
    - ``top_k``: the top ids per read row its finisher wants beside the argmax (a static step reads them in the
      same copy, ``decoding.forward.choice.RowIds``; 0: none).
    """

    tokens: list[int]
    positions: torch.Tensor | None
    visible: torch.Tensor | None
    logit_rows: torch.Tensor | None
    cache: SlotCache
    parents: tuple[int, ...] | None = None
    host_positions: Sequence[int] | None = None
    host_rows: Sequence[int] | None = None
    visibility: Callable[[], torch.Tensor] | None = None
    top_k: int = 0

    @property
    def row_count(self) -> int:
        """How many logits rows the slice reads."""
        return len(self.host_rows) if self.logit_rows is None else len(self.logit_rows)

    def position_tensor(self) -> torch.Tensor:
        """``positions``, made from ``host_positions`` when not given."""
        return self.positions if self.positions is not None else torch.tensor(self.host_positions, dtype=torch.long)

    def row_tensor(self) -> torch.Tensor:
        """``logit_rows``, made from ``host_rows`` when not given."""
        return self.logit_rows if self.logit_rows is not None else torch.tensor(self.host_rows, dtype=torch.long)

    def visible_mask(self) -> torch.Tensor | None:
        """``visible``, made by ``visibility`` when not given (None: causal)."""
        return self.visible if self.visible is not None or self.visibility is None else self.visibility()
