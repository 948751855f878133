"""The static step's attention as one kernel a layer: rotary on the queries and the step's keys, the step's keys and
values written into the KV pool, and attention over the pool row's prefix and the step's token tree.

Contract: two custom ops for a step of ``B`` sequences x ``T`` tokens (``n = B * T``, token-major).
``tree_reach(parents)`` (``torch.ops.lookahead.tree_reach``), once a step: ``parents`` ``[B, T]`` int64, each step
token's parent (an earlier token of its sequence's step) or -1, gives ``reach`` ``[B, T, T]`` uint8, 1 where step
token ``j`` is token ``i`` or one of its ancestors. ``tree_attention(states, rotation, cache, reach, lengths, rows,
heads, scaling)`` (``torch.ops.lookahead.tree_attention``), once a layer:

- ``states`` ``[n, (heads + 2 kv) * d]``: the fused q/k/v projection, not rotated;
- ``rotation`` ``[n, 2, d]``: each token's cos (index 0) and sin (1), the rotary's scaling folded in;
- ``cache`` ``[rows, 2 kv, L, d]``: one layer's pool view (key heads, then value heads), **written**: token ``t`` of
  sequence ``b`` puts its rotated keys and its values at ``cache[rows[b], :, lengths[b] + t]`` (every ``t < T``:
  padding tokens too, into slots past the real ones, as ``decoding.forward.static`` lays them);
- ``reach``: ``tree_reach``'s;
- ``lengths``, ``rows`` ``[B]`` int64: each sequence's cached length and pool row.

It returns ``[n, heads * d]``, the model's head order: each query head's softmax-weighted values over the slots
its token sees, the first ``lengths[b]`` slots of its row and the step tokens it reaches (grouped heads share a key
head: query head ``h`` reads key head ``h // (heads / kv)``), scores scaled by ``scaling``. A padding token (parent
-1) gets a finite row nobody reads.

Two implementations behind each op. On CUDA, where Triton is installed, one Triton kernel each
(``decoding.forward.tree_triton``). The reach is a walk up the parents per row (one launch a step, where the
closure by squarings took ``2 log2 T``). The attention: a program per block of query rows of one sequence and key
head (a row is a ``(token, group head)`` pair, so a key block is loaded once for the group); the step's own keys are
rotated from ``states`` by whoever reads them and written by the program that owns the token, so no program waits on
another. Elsewhere (the CPU, which rehearses CUDA's code path) the same arithmetic runs in torch ops
(``reference_reach``, ``reference``). Either way the compiled step sees one library call a layer where it saw five
kernels (the rotation, the key/value write, the two gathers, attention), and one a step for the mask's closure:
``bench.kernels`` counts what a GPU launches. ``eligible(head_dim)``: the head sizes the kernel takes (a power of
two, at least 16: ``tl.dot``'s smallest side). The kernels agree with the references to float tolerance (a row's
sums run in another order; the reach exactly); the CPU suite runs them through Triton's interpreter against the
references (``tests/decoding/forward/tree_triton_check.py``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ancestors", "eligible", "mask_from_reach", "reference", "squarings", "triton_available", "tree_attention"]

MIN_HEAD_DIM = 16  # tl.dot's smallest side

log = logging.getLogger(__name__)


def eligible(head_dim: int) -> bool:
    """Whether the kernel takes heads of ``head_dim`` (a power of two, at least ``MIN_HEAD_DIM``).

    >>> [eligible(size) for size in (8, 16, 64, 96, 128)]
    [False, True, True, False, True]
    """
    return head_dim >= MIN_HEAD_DIM and head_dim & (head_dim - 1) == 0


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the GPU image has it; the CPU suite installs it for its interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def squarings(tokens: int) -> int:
    """How many squarings ``ancestors`` needs for a step of ``tokens`` tokens: a chain's longest path is
    ``tokens - 1`` links, and each squaring doubles the links a path may take.

    >>> [squarings(tokens) for tokens in (1, 2, 3, 8, 9, 512)]
    [0, 1, 1, 3, 3, 9]
    """
    return math.ceil(math.log2(tokens - 1)) if tokens > 2 else tokens - 1


def ancestors(parents: torch.Tensor, dtype: torch.dtype, depth: int | None = None) -> torch.Tensor:
    """``[B, T, T]`` 0/1: entry ``[b, i, j]`` is 1 when step token ``j`` is ``i`` or an ancestor of ``i``
    (``parents[b, i]``: i's parent, -1 for none). Pointer doubling by squaring: ``depth`` products, at least
    ``squarings(T)`` (its default; more change nothing), so that a forward traced with T symbolic needs no T."""
    count = parents.shape[1]
    columns = torch.arange(count, device=parents.device)
    linked = (parents.unsqueeze(-1) == columns) | torch.eye(count, dtype=torch.bool, device=parents.device)
    reach = linked.to(dtype)
    for _ in range(squarings(count) if depth is None else depth):
        reach = torch.bmm(reach, reach).clamp_max_(1)
    return reach


def mask_from_reach(reach: torch.Tensor, lengths: torch.Tensor, attended: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[B, 1, T, attended]`` mask of ``reach`` ``[B, T, T]``: cache slot s is seen by every token when
    ``s < length``, and by token i when ``s = length + j`` for j in ``reach[b, i]``; every other slot is masked."""
    count = reach.shape[1]
    relative = torch.arange(attended, device=reach.device) - lengths.unsqueeze(1)  # [B, L]: slot - length
    in_step = reach.gather(2, relative.clamp(0, count - 1).unsqueeze(1).expand(-1, count, -1))  # [B, T, L]
    prefix = relative < 0
    step = (relative < count) & ~prefix
    seen = in_step * step.unsqueeze(1) + prefix.unsqueeze(1)
    return ((seen - 1) * torch.finfo(dtype).max).unsqueeze(1)


def _rotate(heads: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary on ``heads`` ``[n, h, d]`` with ``rotation`` ``[n, 2, d]`` (cos, sin), rotate-half convention."""
    half = heads.shape[-1] // 2
    turned = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    return heads * rotation[:, :1] + turned * rotation[:, 1:]


def reference_reach(parents: torch.Tensor) -> torch.Tensor:
    """``tree_reach`` in torch ops (the ancestor closure by squarings), on any device."""
    return (ancestors(parents, torch.float32) > 0).to(torch.uint8)


def reference(
    states: torch.Tensor, rotation: torch.Tensor, cache: torch.Tensor, reach: torch.Tensor, lengths: torch.Tensor,
    rows: torch.Tensor, heads: int, scaling: float,
) -> torch.Tensor:
    """The op in torch ops, on any device (module contract)."""
    sequences, tokens = reach.shape[0], reach.shape[1]
    count, kv_heads, dim = states.shape[0], cache.shape[1] // 2, cache.shape[3]
    split = states.view(count, heads + 2 * kv_heads, dim)
    rotated = _rotate(split[:, : heads + kv_heads], rotation)
    query = rotated[:, :heads]
    new = torch.cat((rotated[:, heads:], split[:, heads + kv_heads :]), dim=1)  # [n, 2 kv, d]
    write_rows = rows.unsqueeze(1).expand(sequences, tokens).reshape(count, 1)
    write_slots = (lengths.unsqueeze(1) + torch.arange(tokens, device=lengths.device)).view(count, 1)
    columns = torch.arange(2 * kv_heads, device=cache.device)
    cache.index_put_((write_rows, columns, write_slots), new)
    keys, values = cache.index_select(0, rows).split(kv_heads, dim=1)  # [B, kv, L, d]
    mask = mask_from_reach(reach.to(states.dtype), lengths, cache.shape[2], states.dtype)
    query = query.view(sequences, tokens, heads, dim).transpose(1, 2)  # [B, heads, T, d]
    output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                            enable_gqa=kv_heads != heads)
    return output.transpose(1, 2).reshape(count, heads * dim)


@torch.library.custom_op("lookahead::tree_reach", mutates_args=())
def tree_reach(parents: torch.Tensor) -> torch.Tensor:
    """The step's ``reach`` (module contract) from its ``parents``: one Triton kernel where ``tree_attention`` runs
    its own, else ``reference_reach``."""
    return _kernel_or_reference(parents, launch_reach, reference_reach, parents)


@tree_reach.register_fake
def _(parents):
    return parents.new_empty((parents.shape[0], parents.shape[1], parents.shape[1]), dtype=torch.uint8)


@torch.library.custom_op("lookahead::tree_attention", mutates_args=("cache",))
def tree_attention(
    states: torch.Tensor, rotation: torch.Tensor, cache: torch.Tensor, reach: torch.Tensor, lengths: torch.Tensor,
    rows: torch.Tensor, heads: int, scaling: float,
) -> torch.Tensor:
    """The op (module contract): the Triton kernel on CUDA where Triton is installed (and on the CPU under Triton's
    interpreter, ``TRITON_INTERPRET=1``: how the CPU suite runs it), else ``reference``."""
    return _kernel_or_reference(states, launch, reference, states, rotation, cache, reach, lengths, rows, heads,
                                scaling)


@tree_attention.register_fake
def _(states, rotation, cache, reach, lengths, rows, heads, scaling):
    return states.new_empty((states.shape[0], heads * cache.shape[3]))


def _kernel_or_reference(tensor: torch.Tensor, kernel: Callable, fallback: Callable, *args: object) -> torch.Tensor:
    """``kernel(*args)`` where the kernels run (CUDA with Triton, or Triton's interpreter), else ``fallback(*args)``.
    Should a kernel raise (a Triton that cannot compile it for this device), the failure is logged and the
    references serve from then on; the warm-up runs before each capture meet such a failure, never the capture."""
    global _kernel_failed
    if not _kernel_failed and triton_available() and (tensor.device.type == "cuda" or _interpreting()):
        try:
            return kernel(*args)
        except Exception:  # a kernel that does not compile here: the references serve from now on
            log.exception("the tree attention kernel failed; its reference in torch ops runs from now on")
            _kernel_failed = True
    return fallback(*args)


_kernel_failed = False  # set when a kernel raised once (logged): every later call runs the references


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter here (``TRITON_INTERPRET=1``), which takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch_reach(parents: torch.Tensor, block_rows: int = 16, block_keys: int = 64) -> torch.Tensor:
    """Run ``tree_reach``'s Triton kernel (a walk up the parents per row; ``parents`` made contiguous)."""
    from decoding.forward.tree_triton import reach_kernel

    parents = parents.contiguous()
    sequences, tokens = parents.shape
    reach = torch.empty((sequences, tokens, tokens), dtype=torch.uint8, device=parents.device)
    reach_kernel[(math.ceil(tokens / block_rows), sequences)](parents, reach, tokens, BLOCK_R=block_rows,
                                                               BLOCK_N=block_keys)
    return reach


def launch(
    states: torch.Tensor, rotation: torch.Tensor, cache: torch.Tensor, reach: torch.Tensor, lengths: torch.Tensor,
    rows: torch.Tensor, heads: int, scaling: float, block_keys: int = 64,
) -> torch.Tensor:
    """Run the Triton kernel (module contract); on a CPU tensor only under ``TRITON_INTERPRET=1``. ``cache``'s last
    dimension must be contiguous (the other inputs are made so). Sums in float32 whatever the dtype; the output has
    ``states``' dtype."""
    sequences, tokens = reach.shape[0], reach.shape[1]
    kv_heads, dim = cache.shape[1] // 2, cache.shape[3]
    group = heads // kv_heads
    if not eligible(dim) or cache.stride(3) != 1:
        raise ValueError(f"the tree attention kernel takes power-of-two heads of 16 or more over a cache whose last "
                         f"dimension is contiguous, got heads of {dim}, stride {cache.stride(3)}")
    query_rows = tokens * group
    block_rows = 16 if query_rows <= 16 else 32 if query_rows <= 32 else 64
    states, rotation, reach, lengths, rows = (tensor.contiguous() for tensor in (states, rotation, reach, lengths,
                                                                                rows))
    output = states.new_empty((states.shape[0], heads * dim))
    grid = (math.ceil(query_rows / block_rows), sequences * kv_heads)
    from decoding.forward.tree_triton import attention_kernel

    attention_kernel[grid](
        states, rotation, cache, reach, lengths, rows, output,
        states.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), tokens, scaling * math.log2(math.e),
        HEADS=heads, KV=kv_heads, GROUP=group, D=dim, BLOCK_R=block_rows, BLOCK_N=block_keys,
    )
    return output
