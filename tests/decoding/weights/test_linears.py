"""Linear layers run by CPU kernels: the packed float32 layout equals nn.Linear, and lookahead == greedy on it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.decoder import Decoder, check_linear_options, prepare_linears
from decoding.errors import InvalidParameterError
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from decoding.weights.linears import (
    FusedLinear,
    KernelLinear,
    PackedFloat32,
    _replace_below,
    kernel_linear,
    pack_float32,
    shared_kernel,
)
from decoding.weights.quantize import Int8Kernel
from tests.conftest import TINY_SIZES, tiny_llama, tiny_qwen2

PROMPTS = [
    [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
    [42],
]
CONFIGS = [
    LookaheadConfig(1, 5, 3),
    LookaheadConfig(2, 4, 4),
    LookaheadConfig(7, 5, 7),
    LookaheadConfig(1, 5, 3, lazy_window=True, copy_length=8),
]


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3, 8, 17])
def test_packed_float32_equals_nn_linear_to_rounding(bias, count):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias)
    rows = torch.randn(2, count, 96)
    expected, got = linear(rows), kernel_linear(linear, PackedFloat32)(rows)
    assert got.shape == (2, count, 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_float32_rows_of_a_multi_row_step_are_independent_bit_for_bit():
    # Lookahead steps verify several rows at once; each must not depend on which others share its step.
    torch.manual_seed(0)
    kernel = PackedFloat32(torch.randn(80, 96), torch.randn(80))
    rows = torch.randn(16, 96)
    together = kernel(rows)
    pairs = torch.cat([kernel(rows[i : i + 2]) for i in range(0, 16, 2)])
    assert torch.equal(together, pairs)
    assert torch.equal(kernel(rows[3:11]), together[3:11])


def test_fused_packed_projections_equal_separate_ones_in_any_call_order():
    torch.manual_seed(0)
    block = nn.Module()
    block.gate_proj, block.up_proj = nn.Linear(32, 48), nn.Linear(32, 48, bias=True)
    separate = {name: kernel_linear(getattr(block, name), PackedFloat32) for name in ("gate_proj", "up_proj")}
    packed = copy.deepcopy(block)
    _replace_below(packed, PackedFloat32)
    assert all(isinstance(getattr(packed, name), FusedLinear) for name in separate)
    for x, order in [(torch.randn(1, 1, 32), ("up_proj", "gate_proj")), (torch.randn(1, 6, 32), separate)]:
        for name in order:
            torch.testing.assert_close(getattr(packed, name)(x), separate[name](x), rtol=1e-6, atol=1e-6)
    assert packed.gate_proj._fused.output is None  # released once both members took their slice


def test_shared_kernel_is_the_fused_groups_kernel_only_for_the_whole_group_in_order():
    attention = pack_float32(tiny_llama()).model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    kernel = shared_kernel(projections)
    rows = torch.randn(3, TINY_SIZES["hidden_size"])
    assert torch.equal(kernel(rows), torch.cat([projection(rows) for projection in projections], dim=-1))
    assert shared_kernel(projections[:2]) is None  # not the whole group
    assert shared_kernel((attention.k_proj, attention.q_proj, attention.v_proj)) is None  # out of order
    assert shared_kernel((attention.o_proj,)) is None and shared_kernel(()) is None
    assert shared_kernel((tiny_llama().model.layers[0].self_attn.q_proj,)) is None  # nn.Linear


def test_pack_float32_replaces_every_linear_and_keeps_the_tied_embedding():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_SIZES, tie_word_embeddings=True)).eval()
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        expected = model(ids).logits
        assert pack_float32(model) is model
        got = model(ids).logits
        last = model(ids[:, -1:]).logits  # the one-row path
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert isinstance(model.get_output_embeddings(), KernelLinear)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert last.shape == (1, 1, TINY_SIZES["vocab_size"])


def test_pack_float32_refuses_a_non_float32_model():
    with pytest.raises(InvalidParameterError, match="float32 CPU model"):
        pack_float32(tiny_llama().to(torch.bfloat16))


@pytest.mark.parametrize(
    ("quantize", "layout", "expected", "kernel"),
    [
        ("none", "auto", "packed", PackedFloat32),
        ("none", "packed", "packed", PackedFloat32),
        ("none", "torch", "torch", None),
        ("int8", "auto", "int8", Int8Kernel),
        ("int8", "torch", "int8", Int8Kernel),
    ],
)
def test_prepare_linears_applies_what_it_reports(quantize, layout, expected, kernel):
    model = tiny_llama()
    assert prepare_linears(model, quantize, layout) == expected
    head = model.get_output_embeddings()
    if kernel is None:
        assert isinstance(head, nn.Linear)
    else:
        assert isinstance(head.kernel, kernel)


def test_prepare_linears_leaves_a_bfloat16_model_alone_on_auto_and_refuses_packed():
    model = tiny_llama().to(torch.bfloat16)
    assert prepare_linears(model, "none", "auto") == "torch"
    with pytest.raises(InvalidParameterError, match="float32 CPU model"):
        prepare_linears(model, "none", "packed")


@pytest.mark.parametrize(
    ("quantize", "layout", "parameter"),
    [("int8", "packed", "weight_layout"), ("int4", "auto", "quantize"), ("none", "blocked", "weight_layout")],
)
def test_bad_linear_options_are_refused_before_any_loading(quantize, layout, parameter):
    with pytest.raises(InvalidParameterError) as caught:
        check_linear_options(quantize, layout)
    assert caught.value.param == parameter
    with pytest.raises(InvalidParameterError):
        Decoder.load("/nonexistent/model", quantize=quantize, weight_layout=layout)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def packed_tiny_model(request):
    """Each tiny architecture with packed float32 linears (built fresh: the shared tiny models stay as they are)."""
    return pack_float32({"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]())


def config_id(config: LookaheadConfig) -> str:
    return f"{config.window_size}-{config.ngram_size}-{config.guess_set_size}-copy{config.copy_length}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_lookahead_equals_greedy_on_a_packed_tiny_model(packed_tiny_model, config):
    stop = StopCriteria(max_tokens=40)
    for prompt in PROMPTS:
        expected = tokens_of(generate_autoregressive(packed_tiny_model, prompt, stop))
        assert tokens_of(generate_lookahead(packed_tiny_model, prompt, stop, lookahead=config)) == expected


REAL_PROMPTS = [
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "List three tips for writing clear emails.",
]


def real_prompt_ids(tokenizer) -> list[list[int]]:
    """Token ids of ``REAL_PROMPTS``: the code as a raw continuation, the question through the chat template."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": REAL_PROMPTS[1]}], add_generation_prompt=True, tokenize=False
    )
    return [tokenizer(REAL_PROMPTS[0]).input_ids, tokenizer(chat, add_special_tokens=False).input_ids]


@pytest.mark.real_model
@pytest.mark.slow
def test_packed_real_model_decodes_as_nn_linear_does_and_lookahead_equals_greedy(real_model):
    model = pack_float32(copy.deepcopy(real_model.model))  # the session's model keeps nn.Linear
    tokenizer = real_model.tokenizer
    stop = StopCriteria(max_tokens=48, stop_token_ids=frozenset({tokenizer.eos_token_id}))
    for ids in real_prompt_ids(tokenizer):
        expected = tokens_of(generate_autoregressive(real_model.model, ids, stop))
        assert tokens_of(generate_autoregressive(model, ids, stop)) == expected
        for config in (LookaheadConfig(1, 5, 3, lazy_window=True, copy_length=16), LookaheadConfig(7, 5, 7)):
            assert tokens_of(generate_lookahead(model, ids, stop, lookahead=config)) == expected, config
