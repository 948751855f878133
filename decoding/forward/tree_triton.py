"""The Triton kernels of ``decoding.forward.tree_attention`` (its module contract; imported only where the ops run
them: on CUDA, or on the CPU under ``TRITON_INTERPRET=1``).

``attention_kernel``: one program per block of ``BLOCK_R`` query rows of one sequence and one key head. A query
row is a ``(token, group head)`` pair, token-major, so the group's heads share each key block the program loads. The
program

1. rotates its rows' queries (rotate-half convention, ``rotation``'s cos and sin) and scales them by ``scale``
   (the attention's scaling times log2(e): the softmax runs in base 2);
2. writes the rotated keys and the values of the tokens whose first query row is its own (each token once) into
   the pool at ``length + t`` of its sequence's row;
3. attends: an online softmax over the row's ``length`` cached slots, then over the step's tokens, whose keys it
   rotates from ``states`` itself (never from the pool: another program may still be writing them), each step
   token seen where ``reach`` says so (an ancestor is an earlier token, so the step's tokens after the program's
   last are never read).

``reach_kernel`` builds ``reach`` once a step (``tree_reach``).

Sums run in float32 with IEEE products (no TF32), in slot order within each block.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotated(base, tok, column, live, cos, sin, d, partner, sign):
    """Rows ``tok`` (offsets) of ``base`` at ``column`` + ``d``, rotated (rotate-half convention)."""
    x = tl.load(base + tok[:, None] + column[:, None] + d[None, :], mask=live[:, None], other=0.0)
    turned = tl.load(base + tok[:, None] + column[:, None] + partner[None, :], mask=live[:, None], other=0.0)
    return x.to(tl.float32) * cos.to(tl.float32) + sign[None, :] * turned.to(tl.float32) * sin.to(tl.float32)


@triton.jit
def _cos_sin(rotation, tok, live, d, D: tl.constexpr):
    """Rows ``tok`` of ``rotation`` ``[n, 2, D]``: their cos and their sin."""
    cos = tl.load(rotation + tok[:, None] * 2 * D + d[None, :], mask=live[:, None], other=0.0)
    sin = tl.load(rotation + tok[:, None] * 2 * D + D + d[None, :], mask=live[:, None], other=0.0)
    return cos, sin


@triton.jit
def _online(q, k, v, visible, top, total, acc):
    """One key block of the online softmax (base 2): scores ``q @ k^T`` where ``visible``, folded into the running
    maximum ``top``, sum ``total`` and weighted values ``acc``; a row that sees nothing yet keeps zeros."""
    scores = tl.where(visible, tl.dot(q, tl.trans(k), input_precision="ieee"), float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, 1))
    safe = tl.where(new_top == float("-inf"), 0.0, new_top)
    p = tl.exp2(scores - safe[:, None])
    alpha = tl.exp2(top - safe)
    return new_top, total * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")


@triton.jit
def reach_kernel(parents, reach, T, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``reach[b, i, j]`` = 1 where step token ``j`` is ``i`` or an ancestor of ``i``, else 0, for a block of rows
    ``i`` of sequence ``b``: the rows zeroed, then each walks up its parents (an ancestor is an earlier token: at
    most ``T`` hops)."""
    b = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i < T
    rows = reach + b * T * T + i.to(tl.int64) * T
    for start in range(0, T, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        tl.store(rows[:, None] + j[None, :], tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.uint8),
                 mask=live[:, None] & (j < T)[None, :])
    tl.debug_barrier()  # the zeros land before the walk's ones
    current = tl.where(live, i, -1).to(tl.int64)
    hops = 0
    while (tl.max(current, 0) >= 0) & (hops <= T):
        tl.store(rows + current, tl.full([BLOCK_R], 1, dtype=tl.uint8), mask=current >= 0)
        current = tl.load(parents + b * T + current, mask=current >= 0, other=-1)
        hops += 1


@triton.jit
def attention_kernel(states, rotation, cache, reach, lengths, rows, out, s_tok, c_row, c_head, c_slot, T, scale,
           HEADS: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
           BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    block = tl.program_id(0)
    b = tl.program_id(1) // KV
    kvh = tl.program_id(1) % KV
    length = tl.load(lengths + b)
    row = tl.load(rows + b)
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    # This program's query rows: (token t, group head g) pairs, token-major.
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r // GROUP
    live = t < T
    tok = b * T + t
    cos, sin = _cos_sin(rotation, tok, live, d, D)
    q = _rotated(states, tok * s_tok, (kvh * GROUP + r % GROUP) * D, live, cos, sin, d, partner, sign) * scale
    # The step's keys and values of the tokens whose first query row is here go into the pool.
    first = (block * BLOCK_R + GROUP - 1) // GROUP
    w = first + tl.arange(0, BLOCK_R)
    owned = (w * GROUP < block * BLOCK_R + BLOCK_R) & (w < T)
    wtok = b * T + w
    wcos, wsin = _cos_sin(rotation, wtok, owned, d, D)
    kcol = tl.zeros([BLOCK_R], dtype=tl.int32) + (HEADS + kvh) * D
    key = _rotated(states, wtok * s_tok, kcol, owned, wcos, wsin, d, partner, sign)
    value = tl.load(states + wtok[:, None] * s_tok + (HEADS + KV + kvh) * D + d[None, :], mask=owned[:, None],
                    other=0.0)
    keys = cache + row * c_row + kvh * c_head
    values = cache + row * c_row + (KV + kvh) * c_head
    slot = (length + w)[:, None] * c_slot + d[None, :]
    tl.store(keys + slot, key, mask=owned[:, None])
    tl.store(values + slot, value, mask=owned[:, None])
    # Online softmax (base 2), first over the row's prefix in the pool, then over the step's own tokens.
    top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    for start in range(0, length, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        valid = s < length
        k = tl.load(keys + s[:, None] * c_slot + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(values + s[:, None] * c_slot + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        top, total, acc = _online(q, k, v, valid[None, :], top, total, acc)
    last = tl.minimum(T, (block * BLOCK_R + BLOCK_R - 1) // GROUP + 1)  # past the program's last token
    for start in range(0, last, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jvalid = j < T
        jtok = b * T + j
        jcos, jsin = _cos_sin(rotation, jtok, jvalid, d, D)
        jcol = tl.zeros([BLOCK_N], dtype=tl.int32) + (HEADS + kvh) * D
        k = _rotated(states, jtok * s_tok, jcol, jvalid, jcos, jsin, d, partner, sign)
        v = tl.load(states + jtok[:, None] * s_tok + (HEADS + KV + kvh) * D + d[None, :], mask=jvalid[:, None],
                    other=0.0).to(tl.float32)
        seen = tl.load(reach + b * T * T + t[:, None] * T + j[None, :], mask=live[:, None] & jvalid[None, :],
                       other=0)
        top, total, acc = _online(q, k, v, seen != 0, top, total, acc)
    total = tl.where(total == 0.0, 1.0, total)
    result = acc / total[:, None]
    columns = (kvh * GROUP + r % GROUP) * D
    tl.store(out + tok[:, None] * (HEADS * D) + columns[:, None] + d[None, :], result, mask=live[:, None])
