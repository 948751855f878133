"""int8 quantization: rows stay independent bit for bit, and lookahead == greedy on a quantized model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.errors import InvalidParameterError
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from decoding.weights.linears import FusedLinear, KernelLinear, _replace_below, kernel_linear
from decoding.weights.quantize import Int8Kernel, quantize_int8
from tests.conftest import TINY_SIZES, tiny_llama, tiny_qwen2
from tests.decoding.weights.test_linears import PROMPTS, real_prompt_ids, tokens_of

CONFIGS = [LookaheadConfig(1, 5, 3), LookaheadConfig(2, 4, 4), LookaheadConfig(7, 5, 7), LookaheadConfig(3, 3, 0)]


def rows_of_varied_scale(count: int, features: int, seed: int = 0) -> torch.Tensor:
    """``count`` random rows whose magnitudes span four decades, one of them all zeros."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, features, generator=generator) * torch.logspace(-2, 2, count)[:, None]
    rows[count // 2] = 0.0
    return rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3, 8, 17, 64])
def test_int8_linear_rows_are_independent_bit_for_bit(bias, count):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias)
    quantized = kernel_linear(linear, Int8Kernel)
    rows = rows_of_varied_scale(count, 96)
    together = quantized(rows.unsqueeze(0))  # [1, count, 80]
    alone = torch.cat([quantized(rows[i : i + 1]) for i in range(count)])
    assert together.shape == (1, count, 80)
    assert torch.equal(together[0], alone)


def test_int8_linear_is_close_to_float32():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    rows = torch.randn(16, 256) * 3
    expected, got = linear(rows), kernel_linear(linear, Int8Kernel)(rows)
    relative = ((got - expected).norm(dim=1) / expected.norm(dim=1)).max().item()
    assert relative < 0.02


def test_fused_projections_equal_separate_ones_in_any_call_order():
    torch.manual_seed(0)
    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(32, 32, bias=True), nn.Linear(32, 16), nn.Linear(32, 16)
    separate = {name: kernel_linear(getattr(block, name), Int8Kernel) for name in ("q_proj", "k_proj", "v_proj")}
    quantize_block = copy.deepcopy(block)
    _replace_below(quantize_block, Int8Kernel)
    assert all(isinstance(getattr(quantize_block, name), FusedLinear) for name in separate)
    first, second = torch.randn(1, 5, 32), torch.randn(1, 3, 32)
    for x, order in [(first, ("k_proj", "q_proj", "v_proj")), (second, ("v_proj", "k_proj", "q_proj"))]:
        for name in order:
            assert torch.equal(getattr(quantize_block, name)(x), separate[name](x)), name
    assert quantize_block.q_proj._fused.output is None  # released once every member took its slice
    assert torch.equal(quantize_block.k_proj(first), separate["k_proj"](first))
    assert torch.equal(quantize_block.k_proj(second), separate["k_proj"](second))


def test_quantize_replaces_every_linear_and_keeps_the_tied_embedding():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_SIZES, tie_word_embeddings=True)).eval()
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        expected = model(ids).logits
        assert quantize_int8(model) is model
        got = model(ids).logits
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model.get_output_embeddings(), KernelLinear)
    assert isinstance(model.get_output_embeddings().kernel, Int8Kernel)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert ((got - expected).norm() / expected.norm()).item() < 0.05


def test_quantize_refuses_a_non_float32_model():
    with pytest.raises(InvalidParameterError, match="float32 CPU model"):
        quantize_int8(tiny_llama().to(torch.bfloat16))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized_tiny_model(request):
    """Each tiny architecture, quantized (built fresh: the shared tiny models stay float32)."""
    return quantize_int8({"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.window_size}-{c.ngram_size}-{c.guess_set_size}")
def test_lookahead_equals_greedy_on_a_quantized_tiny_model(quantized_tiny_model, config):
    stop = StopCriteria(max_tokens=40)
    for prompt in PROMPTS:
        expected = tokens_of(generate_autoregressive(quantized_tiny_model, prompt, stop))
        assert tokens_of(generate_lookahead(quantized_tiny_model, prompt, stop, lookahead=config)) == expected


@pytest.mark.real_model
@pytest.mark.slow
def test_lookahead_equals_greedy_on_the_quantized_real_model(real_model):
    model = quantize_int8(copy.deepcopy(real_model.model))  # the session's float32 model stays as it is
    tokenizer = real_model.tokenizer
    stop = StopCriteria(max_tokens=40, stop_token_ids=frozenset({tokenizer.eos_token_id}))
    for ids in real_prompt_ids(tokenizer):
        expected = tokens_of(generate_autoregressive(model, ids, stop))
        for config in (LookaheadConfig(2, 4, 4), LookaheadConfig(7, 5, 7)):
            assert tokens_of(generate_lookahead(model, ids, stop, lookahead=config)) == expected, config
