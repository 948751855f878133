"""The fused static step: ``static_forward`` compiled by inductor, a handful of compiles for every bucket.

Contract: ``FusedForwards(weights, top_k, backend)`` hands out, per ``Bucket``, a call of ``static_forward``
compiled with ``torch.compile`` (inductor by default): each layer runs as a few fused kernels around its library
calls (the products, attention) instead of ~21 ATen ops. ``call(bucket, caches, inputs, outputs)`` returns a
zero-argument callable running the bucket (``caches``: the layers' pool views cut to the bucket's attended length;
``inputs``: its int64 input buffer; ``outputs``: its views ``[B * T, vocab]`` and ``[B, 1 + top_k, T]`` of the
shared output buffers), and ``compiles`` counts the compiles so far.

One compile serves a whole class of buckets: the attended length is symbolic in every class, and so are the
sequences and the step's tokens wherever they are not 1 (a size of 1 is specialized by torch's tracer, so one
sequence and many, one token and many, are separate classes). The tokens' classes are those of
``static_forward``'s ancestor closure: its squarings are a Python count, so each class runs the count its longest
step needs (``TOKEN_CLASSES``: T = 1, up to 8, up to 64, up to 512); a squaring past the closure changes nothing.
So at most eight compiles cover every bucket; a server compiles the one-sequence classes at start, and inductor's
on-disk cache (``$TORCHINDUCTOR_CACHE_DIR``: the image sets it to the cache volume's ``/cache/inductor``; else
inductor's ``/tmp``) keeps them between starts. Outputs are the eager forward's to the last
bits of float arithmetic (inductor reorders reductions); greedy ids hold as they do eagerly.
"""

from __future__ import annotations

import bisect
import functools
import types
from collections.abc import Callable, Sequence

import torch
import torch._dynamo

from decoding.forward.static_forward import StaticWeights, static_forward
from decoding.forward.static_inputs import Bucket
from decoding.forward.tree_attention import squarings

__all__ = ["TOKEN_CLASSES", "FusedForwards", "token_class"]

TOKEN_CLASSES = (1, 8, 64, 512)  # the longest step of each class of token counts


def token_class(tokens: int) -> int:
    """The longest step of ``tokens``' class (``TOKEN_CLASSES``); a step longer than the last has none.

    >>> [token_class(tokens) for tokens in (1, 2, 8, 9, 384)]
    [1, 8, 8, 64, 512]
    """
    at = bisect.bisect_left(TOKEN_CLASSES, tokens)
    if at == len(TOKEN_CLASSES):
        raise ValueError(f"a step of {tokens} tokens is longer than the fused step's classes ({TOKEN_CLASSES[-1]})")
    return TOKEN_CLASSES[at]


def _fused_step(
    weights: StaticWeights, caches: Sequence[torch.Tensor], inputs: torch.Tensor, logits: torch.Tensor,
    ids: torch.Tensor, top_k: int, depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``static_forward`` with its sequences and tokens read off ``ids`` ``[B, 1 + top_k, T]`` (sizes a trace can
    hold symbolic, where ints are fixed), its ancestor closure ``depth`` squarings deep."""
    return static_forward(weights, caches, inputs, ids.shape[0], ids.shape[2], out=(logits, ids), top_k=top_k,
                          depth=depth)


def _fresh_step() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A copy of ``_fused_step`` with a code object of its own: one per class, so that each keeps its own graph in
    torch's cache rather than recompiling over another's."""
    return types.FunctionType(_fused_step.__code__.replace(), _fused_step.__globals__, _fused_step.__name__)


class FusedForwards:
    """The compiled forwards of one static step, one per class of buckets (module contract)."""

    def __init__(self, weights: StaticWeights, top_k: int, backend: str | Callable = "inductor") -> None:
        self.weights, self.top_k, self.backend = weights, top_k, backend
        self._functions: dict[tuple[bool, int], Callable] = {}

    @property
    def compiles(self) -> int:
        """Classes compiled (or being compiled) so far."""
        return len(self._functions)

    def call(
        self, bucket: Bucket, caches: Sequence[torch.Tensor], inputs: torch.Tensor,
        outputs: tuple[torch.Tensor, torch.Tensor],
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """``bucket``'s compiled forward over ``caches``, ``inputs`` and ``outputs`` (module contract), its class
        compiled on its first run."""
        many, longest = bucket.sequences > 1, token_class(bucket.tokens)
        function = self._functions.get((many, longest))
        if function is None:
            function = torch.compile(_fresh_step(), fullgraph=True, dynamic=False, backend=self.backend)
            self._functions[many, longest] = function
        logits, ids = outputs
        _mark(caches, inputs, logits, ids, many, longest > 1)
        return functools.partial(function, self.weights, caches, inputs, logits, ids, self.top_k,
                                 squarings(longest))


def _mark(
    caches: Sequence[torch.Tensor], inputs: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, many: bool,
    steps: bool,
) -> None:
    """Mark the sizes a class holds symbolic: the attended length always, the sequences when ``many``, the step's
    tokens when ``steps`` (and the buffers whose sizes follow from them). A size marked so must not be 1."""
    for cache in caches:
        torch._dynamo.mark_dynamic(cache, 2)
    if many:
        torch._dynamo.mark_dynamic(ids, 0)
    if steps:
        torch._dynamo.mark_dynamic(ids, 2)
    if many or steps:
        torch._dynamo.mark_dynamic(inputs, 0)
        torch._dynamo.mark_dynamic(logits, 0)
