"""The native attention of the fused CPU step (``csrc/fused_ops.cpp: fused_attention``): torch's attention to float
tolerance for every grouping of query heads (runs of three, two and one) and head width (chunks of four and fewer),
its keys and values stored in the cache, and a row's output the same bits alone as inside a causal or tree step, at
any thread count."""

from __future__ import annotations

import pytest
import torch

from decoding.weights import native

OPS = native.fused_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="needs the native library (AVX2, a compiler)")
SCALE = 0.3
# (query heads, kv heads): groups of 3 (the default model's 9/3), 1, 4 (3 + 1), 5 (3 + 2), 7 (3 + 3 + 1)
HEADS = [(9, 3), (4, 4), (8, 2), (10, 2), (7, 1)]


def attend(qkv: torch.Tensor, heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor, past: int,
           visible: torch.Tensor | None = None) -> torch.Tensor:
    """One native call: ``qkv`` [count, (heads + 2 kv_heads) dim]'s rows stored at slots past.. of ``keys`` and
    ``values`` ([kv_heads, capacity, dim], written in place) and attended; the output [count, heads * dim]."""
    count, dim = qkv.shape[0], keys.shape[2]
    out = torch.full((count, heads * dim), float("nan"))
    mask = None if visible is None else visible.to(torch.uint8).contiguous()
    OPS.attention(qkv.data_ptr(), count, qkv.shape[1], heads, kv_heads, dim, keys.data_ptr(), values.data_ptr(),
                  keys.shape[1] * dim, past, None if mask is None else mask.data_ptr(), SCALE, out.data_ptr())
    return out


def reference(qkv: torch.Tensor, heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor, past: int,
              visible: torch.Tensor | None) -> torch.Tensor:
    """The same attention in float64 torch: the cache's first ``past`` slots then the step's own keys as
    ``visible`` (causal when None) shows them."""
    count, dim = qkv.shape[0], keys.shape[2]
    split = qkv.double().view(count, heads + 2 * kv_heads, dim)
    query, key, value = split[:, :heads], split[:, heads:heads + kv_heads], split[:, heads + kv_heads:]
    all_keys = torch.cat([keys[:, :past].double(), key.transpose(0, 1)], dim=1)  # [kv_heads, past + count, dim]
    all_values = torch.cat([values[:, :past].double(), value.transpose(0, 1)], dim=1)
    own = torch.ones(count, count).tril().bool() if visible is None else visible
    mask = torch.cat([torch.ones(count, past, dtype=torch.bool), own], dim=1)
    group = heads // kv_heads
    scores = torch.einsum("thd,hsd->ths", query, all_keys.repeat_interleave(group, 0)) * SCALE
    weights = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("ths,hsd->thd", weights, all_values.repeat_interleave(group, 0)).reshape(count, -1).float()


def inputs(heads: int, kv_heads: int, dim: int, count: int, past: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(count, (heads + 2 * kv_heads) * dim, generator=generator)
    keys = torch.randn(kv_heads, past + count + 2, dim, generator=generator)
    values = torch.randn(kv_heads, past + count + 2, dim, generator=generator)
    return qkv, keys, values


def tree(count: int, seed: int) -> torch.Tensor:
    """A random visibility with every row seeing itself (rows may see later rows: the kernel takes any mask)."""
    visible = torch.rand(count, count, generator=torch.Generator().manual_seed(seed)) < 0.4
    return visible | torch.eye(count, dtype=torch.bool)


@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}q-{k}kv" for h, k in HEADS])
@pytest.mark.parametrize("dim", [8, 24, 64, 72, 128])
@pytest.mark.parametrize(("count", "past", "masked"), [(1, 0, False), (1, 70, False), (6, 5, True), (20, 0, False),
                                                        (17, 130, True)])
def test_the_native_attention_is_torchs_to_float_tolerance(heads, dim, count, past, masked):
    qkv, keys, values = inputs(*heads, dim, count, past)
    visible = tree(count, dim + count) if masked else None
    expected = reference(qkv, *heads, keys, values, past, visible)
    stored_keys, stored_values = keys.clone(), values.clone()
    got = attend(qkv, *heads, stored_keys, stored_values, past, visible)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    split = qkv.view(count, heads[0] + 2 * heads[1], dim)
    assert torch.equal(stored_keys[:, past:past + count], split[:, heads[0]:heads[0] + heads[1]].transpose(0, 1))
    assert torch.equal(stored_values[:, past:past + count], split[:, heads[0] + heads[1]:].transpose(0, 1))
    assert torch.equal(stored_keys[:, :past], keys[:, :past])  # the cached slots are left as they were


@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}q-{k}kv" for h, k in HEADS])
@pytest.mark.parametrize("dim", [24, 64])
def test_a_row_is_the_same_bits_alone_as_inside_a_causal_step(heads, dim, pool):
    """A 40-row causal step over 67 cached slots (a range of units crosses blocks of keys and of units) against the
    same rows stepped one at a time: each one-row call sees exactly the keys its row saw."""
    count, past = 40, 67
    qkv, keys, values = inputs(*heads, dim, count, past, seed=dim)
    together = attend(qkv, *heads, keys.clone(), values.clone(), past)
    alone_keys, alone_values = keys.clone(), values.clone()
    alone = torch.cat([attend(qkv[t:t + 1], *heads, alone_keys, alone_values, past + t) for t in range(count)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("heads", [(9, 3), (10, 2)], ids=["9q-3kv", "10q-2kv"])
def test_a_tree_row_is_the_same_bits_as_the_chain_it_sees(heads, pool):
    """Row 3 of a tree that sees rows 0 and 2 (and the cache) gets the bits of a chain of those three rows."""
    dim, past = 64, 33
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    qkv, keys, values = inputs(*heads, dim, 4, past, seed=5)
    in_tree = attend(qkv, *heads, keys.clone(), values.clone(), past, visible)
    chain = attend(qkv[[0, 2, 3]], *heads, keys.clone(), values.clone(), past)
    assert torch.equal(in_tree[[0, 2, 3]], chain)
