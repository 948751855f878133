"""The lean step (decoding.forward.lean) gives the model's public forward's logits and cache, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from decoding.forward import lean, packed
from decoding.forward.kv_cache import SlotCache, new_cache
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.weights.linears import pack_float32
from tests.conftest import tiny_llama, tiny_qwen2
from tests.decoding.weights.test_linears import real_prompt_ids


def test_supports_the_llama_family_and_nothing_else():
    assert lean.supports(tiny_llama()) and lean.supports(tiny_qwen2())
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert not lean.supports(gpt2)


def two_slice_step(model: torch.nn.Module, use_lean: bool, monkeypatch) -> tuple[list[torch.Tensor], list[SlotCache]]:
    """One packed forward over a prefill (empty cache) and a masked 4-token step (5 cached tokens), after a
    one-token step on the second cache; returns the logits of both forwards and the caches."""
    monkeypatch.setattr(packed.lean, "supports", lambda model: use_lean)
    monkeypatch.setattr(packed.fused, "plan_for", lambda model: None)  # the lean step itself, not the fused one
    first, second = new_cache(model, 32), new_cache(model, 32)
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        warm = forward_packed(model, [Slice([3, 9, 4, 1, 7], torch.arange(5), None, torch.arange(5), second)])
        logits = forward_packed(
            model,
            [
                Slice([5, 6, 7, 8, 9, 10, 11], torch.arange(7), None, torch.tensor([2, 6]), first),
                Slice([12, 13, 14, 15], torch.tensor([5, 6, 6, 7]), visible, torch.arange(4), second),
            ],
        )
    return warm + logits, [first, second]


def assert_lean_step_equals_the_public_forward(model: torch.nn.Module, monkeypatch) -> list[torch.Tensor]:
    """Run ``two_slice_step`` both ways; assert the logits and caches are identical; return the lean logits."""
    expected_logits, expected_caches = two_slice_step(model, False, monkeypatch)
    logits, caches = two_slice_step(model, True, monkeypatch)
    assert len(logits) == len(expected_logits) == 3
    for got, expected in zip(logits, expected_logits, strict=True):
        assert torch.equal(got, expected)
    for cache, expected in zip(caches, expected_caches, strict=True):
        assert cache.length == expected.length
        for layer, expected_layer in zip(cache.layers, expected.layers, strict=True):
            assert torch.equal(layer.keys, expected_layer.keys) and torch.equal(layer.values, expected_layer.values)
    return logits


@pytest.mark.parametrize("layout", ["torch", "packed"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_lean_step_equals_the_public_forward_bit_for_bit(make_model, layout, monkeypatch):
    model = make_model()
    if layout == "packed":
        pack_float32(model)
    assert_lean_step_equals_the_public_forward(model, monkeypatch)


@pytest.mark.real_model
@pytest.mark.slow
def test_lean_step_equals_the_public_forward_on_the_packed_real_model(real_model, monkeypatch):
    model = pack_float32(copy.deepcopy(real_model.model))
    ids = real_prompt_ids(real_model.tokenizer)[1]
    results = []
    for use_lean in (False, True):
        monkeypatch.setattr(packed.lean, "supports", lambda model, use_lean=use_lean: use_lean)
        monkeypatch.setattr(packed.fused, "plan_for", lambda model: None)
        cache = new_cache(model, len(ids) + 8)
        with torch.no_grad():
            prefill = forward_packed(
                model, [Slice(ids, torch.arange(len(ids)), None, torch.tensor([len(ids) - 1]), cache)]
            )
            step = forward_packed(model, [Slice([1, 2, 3], torch.arange(3) + len(ids), None, torch.arange(3), cache)])
        results.append(prefill + step)
    assert all(torch.equal(got, expected) for got, expected in zip(results[1], results[0], strict=True))


def test_a_model_without_a_model_type_goes_through_its_public_forward():
    from tests.decoding.stubs import cycle_model

    model = cycle_model()
    assert not lean.supports(model)
    forward_packed(model, [Slice([1, 2], torch.arange(2), None, torch.arange(2), new_cache(model, 8))])
    assert model.forward_calls == 1
