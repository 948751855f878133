"""Each row's best token ids (decoding.forward.choice): torch's argmax and topk, by the native kernel where it runs."""

from __future__ import annotations

import pytest
import torch

from decoding.forward.choice import greedy_id, greedy_ids, top_ids
from decoding.weights import native

needs_kernel = pytest.mark.skipif(native.fused_ops() is None, reason="needs the native library (AVX2, a compiler)")


@needs_kernel
@pytest.mark.parametrize("width", [1, 7, 8, 13, 64, 49152])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_top_ids_equal_torch_on_distinct_scores(width, k):
    generator = torch.Generator().manual_seed(width * 10 + k)
    scores = torch.randn((6, width), generator=generator)
    k = min(k, width)
    assert top_ids(scores, k) == scores.topk(k, dim=-1).indices.tolist()
    assert greedy_ids(scores) == scores.argmax(dim=-1).tolist()


@needs_kernel
def test_ties_go_to_the_lower_index_as_argmax_does():
    scores = torch.zeros((3, 40))
    scores[0, [9, 3, 30]] = 2.0
    scores[1] = float("-inf")
    scores[2, 17:] = 5.0
    assert greedy_ids(scores) == scores.argmax(dim=-1).tolist() == [3, 0, 17]
    assert top_ids(scores, 3) == [[3, 9, 30], [0, 1, 2], [17, 18, 19]]


@needs_kernel
def test_a_strided_row_and_one_row_read_as_torch_does():
    scores = torch.randn((8, 50)).t()  # not contiguous
    assert greedy_ids(scores) == scores.argmax(dim=-1).tolist()
    assert greedy_id(scores[3]) == int(scores[3].argmax())


def test_what_the_kernel_does_not_take_goes_to_torch():
    scores = torch.randn((2, 300), dtype=torch.float64)
    assert greedy_ids(scores) == scores.argmax(dim=-1).tolist()
    wide = torch.randn((2, 300))
    assert top_ids(wide, 80) == wide.topk(80, dim=-1).indices.tolist()
