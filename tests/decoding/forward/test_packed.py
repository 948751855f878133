"""The packed forward's attention: folding grouped query heads into the query length changes nothing."""

from __future__ import annotations

import pytest
import torch

from decoding.forward.kv_cache import SlotCache
from decoding.forward.packed import _folded_attention, _mask, query_group
from decoding.forward.slices import Slice
from tests.conftest import tiny_llama


@pytest.mark.parametrize("group, count, past", [(3, 1, 17), (3, 9, 40), (2, 30, 0), (1, 5, 8)])
def test_folded_attention_equals_grouped_attention(group, count, past):
    torch.manual_seed(group * 100 + count)
    kv_heads, dim = 3, 16
    query = torch.randn(1, kv_heads * group, count, dim)
    keys, values = torch.randn(2, 1, kv_heads, past + count, dim).unbind(0)
    visible = torch.rand(count, count) < 0.5
    visible |= torch.eye(count, dtype=torch.bool)
    mask = torch.zeros(1, 1, count, past + count)
    mask[0, 0, :, past:].masked_fill_(~visible, torch.finfo(mask.dtype).min)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True
    )
    folded = _folded_attention(query, keys, values, mask.repeat(1, 1, group, 1), group, 0.25)
    torch.testing.assert_close(folded, expected, rtol=1e-5, atol=1e-6)


def test_query_group_reads_the_head_counts():
    assert query_group(tiny_llama()) == 2


def test_a_grouped_mask_repeats_the_slice_rows_per_group():
    visible = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    slice_ = Slice([1, 2, 3], torch.arange(3), visible, torch.arange(3), SlotCache(1, 16))
    single = _mask(slice_, 5, torch.float32, torch.device("cpu"))
    grouped = _mask(slice_, 5, torch.float32, torch.device("cpu"), group=3)
    assert single.shape == (1, 1, 3, 8) and grouped.shape == (1, 1, 9, 8)
    assert torch.equal(grouped, single.repeat(1, 1, 3, 1))
    assert torch.equal(single[0, 0, :, 5:] == 0, visible)
