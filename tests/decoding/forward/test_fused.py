"""The fused CPU step (decoding.forward.fused): the eager forward's logits and cache to float tolerance, each row's
result the same bits whatever else the step holds, and lookahead == greedy through it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from decoding.forward import fused, packed
from decoding.forward.kv_cache import CacheOverflowError, new_cache
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from decoding.weights import native
from decoding.weights.linears import pack_float32
from tests.conftest import tiny_llama, tiny_qwen2

needs_kernel = pytest.mark.skipif(native.fused_ops() is None, reason="needs the native library (AVX2, a compiler)")
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)


def packed_model(make_model=tiny_llama, seed: int = 0) -> torch.nn.Module:
    return pack_float32(make_model(seed))


def step(model, use_fused: bool, monkeypatch, prompt_length: int = 5):
    """A prefill of ``prompt_length`` tokens, then a two-slice forward (a 7-token prefill and a 4-token tree step
    over the first cache); the logits of both forwards and the caches."""
    if not use_fused:
        monkeypatch.setattr(packed.fused, "plan_for", lambda model: None)
    first, second = new_cache(model, 64), new_cache(model, 64)
    prompt = [(3 * index + 1) % 60 for index in range(prompt_length)]
    with torch.no_grad():
        warm = forward_packed(model, [Slice(prompt, torch.arange(prompt_length), None, torch.tensor([0, 2]), second)])
        positions = torch.tensor([0, 1, 1, 2]) + prompt_length
        logits = forward_packed(model, [
            Slice([5, 6, 7, 8, 9, 10, 11], torch.arange(7), None, torch.tensor([2, 6]), first),
            Slice([12, 13, 14, 15], positions, TREE, torch.arange(4), second),
        ])
    monkeypatch.undo()
    return warm + logits, [first, second]


@needs_kernel
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("prompt_length", [5, 40], ids=["short-prefill", "long-prefill"])
def test_the_fused_step_equals_the_eager_step_to_float_tolerance(make_model, prompt_length, monkeypatch):
    model = packed_model(make_model)
    assert fused.plan_for(model) is not None
    expected_logits, expected_caches = step(model, False, monkeypatch, prompt_length)
    logits, caches = step(model, True, monkeypatch, prompt_length)
    for got, expected in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for cache, expected in zip(caches, expected_caches, strict=True):
        assert cache.length == expected.length
        for layer, expected_layer in zip(cache.layers, expected.layers, strict=True):
            torch.testing.assert_close(layer.keys, expected_layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.values, expected_layer.values, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_row_is_the_same_bits_alone_and_inside_a_tree_step(pool):
    """Token 14 sees the cache and token 12 in the tree step; stepped alone after 12 it sees the same keys."""
    model = packed_model()
    prompt = [3, 9, 4, 1, 7]
    tree_cache, chain_cache = new_cache(model, 32), new_cache(model, 32)
    with torch.no_grad():
        for cache in (tree_cache, chain_cache):
            forward_packed(model, [Slice(prompt, torch.arange(5), None, torch.tensor([4]), cache)])
        tree = forward_packed(
            model, [Slice([12, 13, 14, 15], torch.tensor([5, 6, 6, 7]), TREE, torch.arange(4), tree_cache)]
        )[0]
        first = forward_packed(model, [Slice([12], torch.tensor([5]), None, torch.tensor([0]), chain_cache)])[0]
        third = forward_packed(model, [Slice([14], torch.tensor([6]), None, torch.tensor([0]), chain_cache)])[0]
    assert torch.equal(tree[0], first[0]) and torch.equal(tree[2], third[0])
    for tree_layer, chain_layer in zip(tree_cache.layers, chain_cache.layers, strict=True):
        assert torch.equal(tree_layer.keys[:, :, 5], chain_layer.keys[:, :, 5])  # token 12's keys
        assert torch.equal(tree_layer.keys[:, :, 7], chain_layer.keys[:, :, 6])  # token 14's keys


@needs_kernel
def test_a_batched_row_is_the_same_bits_as_alone(pool):
    model = packed_model()
    alone_cache, shared_cache, other_cache = (new_cache(model, 32) for _ in range(3))
    with torch.no_grad():
        alone = forward_packed(model, [Slice([3, 9, 4], torch.arange(3), None, torch.arange(3), alone_cache)])[0]
        shared = forward_packed(model, [
            Slice([8, 8, 1, 2, 5], torch.arange(5), None, torch.arange(5), other_cache),
            Slice([3, 9, 4], torch.arange(3), None, torch.arange(3), shared_cache),
        ])[1]
    assert torch.equal(alone, shared)


@needs_kernel
@pytest.mark.parametrize(
    "config",
    [LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=16, recycled=2), LookaheadConfig(2, 4, 4),
     LookaheadConfig(7, 5, 7), LookaheadConfig(3, 3, 2, copy_length=8, window_chains=True)],
    ids=["cpu-preset", "2-4-4", "7-5-7", "3-3-2-chains"],
)
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_lookahead_equals_greedy_through_the_fused_step(make_model, config):
    model = packed_model(make_model, seed=3)
    assert fused.plan_for(model) is not None
    stop = StopCriteria(max_tokens=40)
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7, 9, 8, 7, 9, 8, 7], [30, 11, 4]):
        greedy = [token for result in generate_autoregressive(model, prompt, stop) for token in result.token_ids]
        ahead = [token for result in generate_lookahead(model, prompt, stop, lookahead=config)
                 for token in result.token_ids]
        assert ahead == greedy, prompt


@needs_kernel
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_every_thread_count_gives_the_bits_of_one_thread(make_model, pool, monkeypatch):
    # Every native call split (norms, rotary, attention's units, products, activation) over 2 or 3 threads: the
    # logits and caches of a prefill and a tree step are those of one thread, bit for bit.
    model = packed_model(make_model)
    native.set_threads(1)
    expected_logits, expected_caches = step(model, True, monkeypatch)
    native.set_threads(pool)
    logits, caches = step(model, True, monkeypatch)
    assert all(torch.equal(got, expected) for got, expected in zip(logits, expected_logits, strict=True))
    for cache, expected in zip(caches, expected_caches, strict=True):
        for layer, expected_layer in zip(cache.layers, expected.layers, strict=True):
            assert torch.equal(layer.keys, expected_layer.keys) and torch.equal(layer.values, expected_layer.values)


@needs_kernel
def test_lookahead_equals_greedy_at_every_thread_count(pool):
    model = packed_model(tiny_llama, seed=3)
    stop, config = StopCriteria(max_tokens=40), LookaheadConfig(2, 4, 4, copy_length=8)
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3], [30, 11, 4]):
        greedy = [token for result in generate_autoregressive(model, prompt, stop) for token in result.token_ids]
        ahead = [token for result in generate_lookahead(model, prompt, stop, lookahead=config)
                 for token in result.token_ids]
        assert ahead == greedy, prompt


def decode_step(model, native_step: bool):
    """Two sequences prefilled, then one decode forward of a 4-token tree over the first and a one-token step over
    the second: the forward's logits and both caches, through the native whole step or call by call."""
    plan = fused.plan_for(model)
    saved = plan.step_layers
    plan.step_layers = saved if native_step else None
    try:
        first, second = new_cache(model, 32), new_cache(model, 32)
        with torch.no_grad():
            forward_packed(model, [Slice([3, 9, 4, 1, 7], torch.arange(5), None, torch.tensor([4]), first),
                                   Slice([2, 8], torch.arange(2), None, torch.tensor([1]), second)])
            logits = forward_packed(model, [
                Slice([12, 13, 14, 15], torch.tensor([5, 6, 6, 7]), TREE, torch.arange(4), first),
                Slice([30], torch.tensor([2]), None, torch.tensor([0]), second),
            ])
    finally:
        plan.step_layers = saved
    return logits, [first, second]


def assert_same_bits(got, expected) -> None:
    (logits, caches), (expected_logits, expected_caches) = got, expected
    assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits, strict=True))
    for cache, expected_cache in zip(caches, expected_caches, strict=True):
        assert cache.length == expected_cache.length
        for layer, expected_layer in zip(cache.layers, expected_cache.layers, strict=True):
            assert torch.equal(layer.keys, expected_layer.keys) and torch.equal(layer.values, expected_layer.values)


@needs_kernel
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-with-biases"])
def test_a_decode_step_in_one_native_call_is_the_bits_of_the_call_by_call_step(make_model, pool):
    model = make_model(0)
    torch.manual_seed(1)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.data.normal_(0, 0.5)  # transformers initialises biases to zero: give them weight
    model = pack_float32(model)
    assert fused.plan_for(model).step_layers is not None
    assert_same_bits(decode_step(model, native_step=True), decode_step(model, native_step=False))


@needs_kernel
def test_a_gguf_model_steps_in_one_native_call_with_the_same_bits(tmp_path, pool):
    from decoding.weights.gguf_model import build_gguf_model
    from tests.decoding.weights.test_gguf_model import LAYOUTS, write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    config, _ = write_tiny_gguf(path, LAYOUTS["mixed"])  # Q4_1, Q8_0 and de-quantized float32 products
    model = build_gguf_model(path, config, native.panel_gemm())
    assert fused.plan_for(model).step_layers is not None
    assert_same_bits(decode_step(model, native_step=True), decode_step(model, native_step=False))


@needs_kernel
def test_a_prompt_is_the_same_bits_however_it_is_chunked():
    # Prompt chunks attend natively as decode steps do: a 40-token prompt in one chunk, in chunks of 25 + 15 (a later
    # chunk over a filled cache, as after the prefix cache) and 39 + 1 gives its last row the same logits and every
    # layer the same keys and values, so a repeated greedy request starts from the same bits.
    model = packed_model()
    prompt = [(7 * index + 3) % 60 for index in range(40)]
    results = []
    with torch.no_grad():
        for cuts in ([40], [25, 15], [39, 1]):
            cache, start, logits = new_cache(model, 64), 0, None
            for size in cuts:
                tokens = prompt[start : start + size]
                logits = forward_packed(model, [Slice(tokens, torch.arange(start, start + size), None,
                                                      torch.tensor([size - 1]), cache)])[0]
                start += size
            results.append((logits, cache))
    (first, first_cache), *others = results
    for logits, cache in others:
        assert torch.equal(logits, first)
        for layer, expected in zip(cache.layers, first_cache.layers, strict=True):
            assert torch.equal(layer.keys, expected.keys) and torch.equal(layer.values, expected.values)


@needs_kernel
def test_an_overflowing_step_writes_nothing():
    model = packed_model()
    cache = new_cache(model, 6)
    with torch.no_grad():
        forward_packed(model, [Slice([1, 2, 3, 4], torch.arange(4), None, torch.tensor([3]), cache)])
        with pytest.raises(CacheOverflowError):
            forward_packed(model, [Slice([5, 6, 7], torch.arange(3) + 4, None, torch.tensor([2]), cache)])
    assert cache.length == 4


def test_models_it_cannot_step_get_no_plan():
    assert fused.plan_for(tiny_llama()) is None  # torch's nn.Linear: no native products to fuse around
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert fused.plan_for(gpt2) is None
