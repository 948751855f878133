"""The quantized panel kernel: GGUF's Q4_0 / Q4_1 / Q8_0 blocks repacked once, the product equal to a float32
product of the rows rounded to 8 bits (``rounded``, llama.cpp's activations) with gguf's own de-quantized weight to
float tolerance on either entry (and within llama.cpp's error of the unrounded product), each row's result the same
bits alone or among 1..128 rows (and past 128, where rows are taken 128 at a time), a broken row (an infinity, a
NaN) giving NaN where it reaches, and the embedding rows read from the same panels equal to gguf's de-quantized rows
bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from decoding.weights import native
from decoding.weights.quant_panels import (
    FORMATS,
    PanelEmbedding,
    QuantizedWeight,
    QuantKernel,
    dequantize,
    pack,
    rounded,
    unpack,
)

gguf = pytest.importorskip("gguf")

needs_kernel = pytest.mark.skipif(
    not (native.supported_cpu() and native.compiler()), reason="needs an AVX2 x86-64 CPU and a C++ compiler"
)
FORMAT_NAMES = sorted(FORMATS)


def quantized(name: str, rows: int, columns: int, seed: int = 0) -> QuantizedWeight:
    """A random weight [rows, columns] quantized by gguf into ``name``'s blocks."""
    weight = np.random.default_rng(seed).standard_normal((rows, columns), dtype=np.float32)
    raw = gguf.quantize(weight, gguf.GGMLQuantizationType[name])
    return QuantizedWeight(FORMATS[name], torch.from_numpy(raw), columns)


def gguf_weight(weight: QuantizedWeight) -> torch.Tensor:
    """gguf's own de-quantization of ``weight`` (float32 [rows, columns])."""
    raw = weight.raw.numpy()
    return torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[weight.format.name]).copy())


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_dequantize_equals_gguf_bit_for_bit(name):
    weight = quantized(name, 24, 96)
    assert torch.equal(dequantize(weight), gguf_weight(weight))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_packing_keeps_every_quant_and_scale(name):
    weight = quantized(name, 32, 64)
    panels = pack(weight, 16)
    fmt = weight.format
    assert panels.shape == (2, 2, fmt.block_bytes(16)) and panels.dtype == torch.uint8
    quants, scales = unpack(weight)
    assert quants.shape == (32, 64) and scales.shape == (2 * 16, 2, fmt.scales)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(quantized(name, 24, 64), 16)


@needs_kernel
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("shape", [(48, 64), (576, 96), (96, 1536), (3072, 576)])
def test_the_product_equals_a_float32_product_of_the_rounded_rows_with_gguf_weights(gemm, name, shape):
    weight = quantized(name, *shape)
    kernel = QuantKernel(weight, gemm)
    reference = gguf_weight(weight)
    torch.manual_seed(0)
    for count in (1, 2, 3, 4, 5, 8, 9, 17, 40):
        rows = torch.randn(count, shape[1]) * torch.rand(count, 1) * 10
        got, expected = kernel(rows), rounded(rows) @ reference.t()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5 * float(expected.abs().max()))
        # The rounding's own error (half a step of max |x| / 127 per value): under 1% of the product, root mean
        # square, as llama.cpp's 8-bit activations give.
        exact = rows @ reference.t()
        assert (got - exact).pow(2).mean().sqrt() <= 0.01 * exact.pow(2).mean().sqrt()


def test_rounding_keeps_each_block_within_half_a_step_and_marks_broken_blocks():
    torch.manual_seed(5)
    rows = torch.randn(3, 96) * torch.tensor([[1e-3], [1.0], [1e3]])
    rows[1, 40:64] = 0.0
    got = rounded(rows)
    step = rows.reshape(3, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((got - rows).reshape(3, 3, 32).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(rounded(torch.zeros(2, 32)), torch.zeros(2, 32))
    broken = rows.clone()
    broken[0, 3], broken[2, 70] = float("inf"), float("nan")
    got = rounded(broken)
    assert got[0, :32].isnan().all() and got[2, 64:].isnan().all()
    assert torch.equal(got[0, 32:], rounded(rows)[0, 32:]) and torch.equal(got[1], rounded(rows)[1])


@needs_kernel
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_a_broken_row_gives_nan_where_it_reaches_and_leaves_the_others(gemm, name):
    kernel = QuantKernel(quantized(name, 48, 96), gemm)
    torch.manual_seed(6)
    rows = torch.randn(3, 96)
    broken = rows.clone()
    broken[1, 50] = float("nan")
    got = kernel(broken)
    assert got[1].isnan().all()
    assert torch.equal(got[[0, 2]], kernel(rows)[[0, 2]])


@needs_kernel
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("shape", [(48, 224), (400, 160)])
def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(gemm, name, shape):
    # 1-8 rows (1-12 on the AVX-512 entry) run as one tile over all of K; more run in bands of blocks and groups of
    # rows with a remainder; past 128 the rows are taken 128 at a time. (400 columns: panels of 8 on AVX2, of 16 on
    # AVX-512; 224 / 160 columns: 7 / 5 blocks, a partial band block.)
    kernel = QuantKernel(quantized(name, *shape), gemm)
    torch.manual_seed(1)
    rows = torch.randn(140, shape[1])
    alone = torch.cat([kernel(rows[i : i + 1]) for i in range(len(rows))])
    for count in [*range(2, 41), 63, 64, 65, 100, 127, 128, 129, 140]:
        assert torch.equal(kernel(rows[:count]), alone[:count]), count
    assert torch.equal(kernel(rows[60:90]), alone[60:90])


@needs_kernel
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_a_row_gives_the_same_bits_at_any_thread_count(gemm, pool, name):
    # Every call split over 1, 2 and 3 threads (ranges of whole tiles, remainders at the end): each row batched
    # equals the row alone on one thread, for 1-12 rows (one tile over K), bands and past 128 rows.
    kernel = QuantKernel(quantized(name, 400, 224), gemm)
    torch.manual_seed(4)
    rows = torch.randn(140, 224)
    native.set_threads(1)
    alone = torch.cat([kernel(rows[i : i + 1]) for i in range(len(rows))])
    native.set_threads(pool)
    for count in [*range(1, 20), 33, 128, 129, 140]:
        assert torch.equal(kernel(rows[:count]), alone[:count]), count


@needs_kernel
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_both_entries_give_the_same_bits(name):
    if not native.wide_cpu():
        pytest.skip("this CPU has no AVX-512")
    wide = native.panel_gemm()
    narrow = native.PanelGemm(ctypes.CDLL(str(native.library_path())), wide=False)
    weight = quantized(name, 96, 320)
    torch.manual_seed(2)
    rows = torch.randn(30, 320)
    for count in (1, 2, 3, 4, 7, 8, 13, 30):
        assert torch.equal(QuantKernel(weight, wide)(rows[:count]), QuantKernel(weight, narrow)(rows[:count]))


@needs_kernel
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("wide", [True, False], ids=["wide-entry", "avx2-entry"])
def test_embedding_rows_come_from_the_same_panels_bit_for_bit(name, wide):
    """Rows of either entry's panels (16 columns, Q8_0 stored + 128; 8 columns) de-quantize to gguf's bits."""
    if wide and not native.wide_cpu():
        pytest.skip("this CPU has no AVX-512")
    gemm = native.PanelGemm(ctypes.CDLL(str(native.library_path())), wide=wide)
    weight = quantized(name, 64, 96)
    kernel = QuantKernel(weight, gemm)
    assert kernel.lanes == (16 if wide else 8)
    embedding = PanelEmbedding(kernel)
    ids = torch.tensor([[0, 5, 17, 63], [63, 8, 9, 16]])
    got = embedding(ids)
    assert got.shape == (2, 4, 96) and got.dtype == torch.float32
    assert torch.equal(got, gguf_weight(weight)[ids])
    assert torch.equal(embedding(torch.tensor([9])), gguf_weight(weight)[[9]])


@needs_kernel
def test_an_embedding_id_outside_the_vocabulary_is_refused(gemm):
    embedding = PanelEmbedding(QuantKernel(quantized("Q8_0", 32, 64), gemm))
    for bad in (32, -1):
        with pytest.raises(IndexError, match=r"\[0, 32\)"):
            embedding(torch.tensor([0, bad]))


@needs_kernel
def test_bias_is_added_and_a_wrong_width_is_refused(gemm):
    weight = quantized("Q8_0", 32, 64)
    bias = torch.randn(32)
    kernel = QuantKernel(weight, gemm, bias)
    rows = torch.randn(3, 64)
    torch.testing.assert_close(kernel(rows), rounded(rows) @ gguf_weight(weight).t() + bias, rtol=1e-4, atol=2e-4)
    with pytest.raises(ValueError, match="features"):
        kernel(torch.randn(3, 32))


def test_only_weights_of_one_format_stack():
    first, second = quantized("Q4_1", 16, 64), quantized("Q4_1", 8, 64, seed=1)
    both = QuantizedWeight.stacked([first, second])
    assert both.rows == 24 and torch.equal(dequantize(both)[16:], dequantize(second))
    with pytest.raises(ValueError, match="one format"):
        QuantizedWeight.stacked([first, quantized("Q8_0", 16, 64)])
