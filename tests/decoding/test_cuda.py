"""The CUDA path keeps the CPU path's guarantees: lookahead == greedy, batching changes nothing, exact KV fix-up.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
``pytest tests/decoding/test_cuda.py``. Exactness is asserted in float32. In bfloat16 a multi-token step and
a one-token step round differently, so a near-tie between two tokens can break the other way; the benchmark's
``identical`` column reports how often that happens on the real model (docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from decoding.batch import BatchPolicy
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from server.config import decoder_lookahead
from server.config_layers import load_config
from tests.conftest import tiny_llama, tiny_qwen2
from tests.decoding.forward.test_lean import assert_lean_step_equals_the_public_forward
from tests.decoding.test_batch import CONFIGS as BATCH_CONFIGS
from tests.decoding.test_batch import PROMPTS, make_stream, run_batch, tokens_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
CONFIGS = [
    LookaheadConfig(2, 3, 2),
    LookaheadConfig(4, 4, 4),
    LookaheadConfig(7, 5, 7),
    LookaheadConfig(15, 5, 15),
    LookaheadConfig(1, 5, 3, lazy_window=True, break_even=0.5),
]
# What the server runs on a GPU (as server.app resolves it): the window, the pool's token tree and the copy steps
# in one tree mask.
CUDA_PRESET = decoder_lookahead(load_config(device_preset="cuda").lookahead)
REAL_MESSAGES = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def cuda_tiny(request):
    """Each tiny architecture on the GPU, in float32."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]().to(CUDA)


@pytest.fixture(scope="module")
def cuda_real():
    """The default model on the GPU in float32 (converted into the cache on first use)."""
    from decoding.weights.loading import load_model

    return load_model(device="cuda", dtype="float32")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.window_size}-{c.ngram_size}-{c.guess_set_size}")
def test_lookahead_equals_greedy_on_cuda(cuda_tiny, config):
    stop = StopCriteria(48)
    for prompt in PROMPTS:
        expected = tokens_of(generate_autoregressive(cuda_tiny, prompt, stop))
        assert tokens_of(generate_lookahead(cuda_tiny, prompt, stop, lookahead=config)) == expected


def test_batched_streams_equal_each_stream_alone_on_cuda(cuda_tiny):
    alone = [tokens_of(make_stream(cuda_tiny, p, c)) for p, c in zip(PROMPTS, BATCH_CONFIGS, strict=True)]
    streams = [make_stream(cuda_tiny, p, c) for p, c in zip(PROMPTS, BATCH_CONFIGS, strict=True)]
    assert run_batch(streams, BatchPolicy(max_step_tokens=64, prefill_chunk=4), join_at={1: 3, 3: 5}) == alone


def test_lean_step_equals_the_public_forward_on_cuda(cuda_tiny, monkeypatch):
    logits = assert_lean_step_equals_the_public_forward(cuda_tiny, monkeypatch)
    assert all(got.device.type == "cuda" for got in logits)


def test_kv_fixup_on_cuda_matches_a_fresh_forward(cuda_tiny):
    """After every step the GPU cache equals the KV of one plain forward over the committed tokens."""
    stream = generate_lookahead(cuda_tiny, PROMPTS[0], StopCriteria(40), lookahead=LookaheadConfig(4, 4, 4))
    multi_token_steps = 0
    with torch.inference_mode():
        for step in stream:
            multi_token_steps += step.stats.committed > 1
            tokens = stream.sequence.tokens[:-1]
            reference = DynamicCache()
            cuda_tiny(input_ids=torch.tensor([tokens], device=CUDA), past_key_values=reference, use_cache=True)
            for layer, (keys, values, _) in zip(stream.sequence.cache.layers, reference, strict=True):
                assert layer.keys.device.type == "cuda"
                torch.testing.assert_close(layer.keys, keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(layer.values, values, rtol=1e-4, atol=1e-5)
    assert multi_token_steps > 0


@pytest.mark.real_model
@pytest.mark.parametrize(
    "config", [CONFIGS[2], CONFIGS[3], CUDA_PRESET], ids=["7-5-7", "15-5-15", "cuda-preset"]
)
def test_real_model_lookahead_equals_greedy_on_cuda(cuda_real, config):
    from decoding.decoder import Decoder

    decoder = Decoder(cuda_real)
    stop = StopCriteria(64, decoder.eos_token_ids())
    accepted = 0
    for text in REAL_MESSAGES:
        encoded = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        expected = tokens_of(decoder.decode(ids, stop))
        steps = list(decoder.decode(ids, stop, lookahead=config))
        assert tokens_of(steps) == expected, text
        accepted += sum(step.stats.accepted for step in steps)
    assert accepted > 0


# ---------------------------------------------------------------- the static step and its CUDA graphs


@pytest.fixture
def no_tf32():
    """float32 products in full float32 (TF32 off), so that a multi-token step rounds as a one-token step."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def graphed(model, mode="graphs", sequences=4, capacity=1024):
    from decoding.forward.kv_cache import KVPool
    from decoding.forward.static import StaticStep

    return StaticStep(model, KVPool(model, sequences, capacity, scratch_tokens=256), mode)


def static_decode(model, runner, prompts, configs, sampling=None, max_tokens=40):
    from decoding.batch import BatchEngine
    from decoding.params import SamplingParams
    from tests.decoding.forward.test_static import decode

    return decode(BatchEngine(model, static=runner), prompts, configs, max_tokens, sampling or SamplingParams())


def test_a_graph_replay_equals_the_eager_static_step_bit_for_bit(cuda_tiny, no_tf32):
    from decoding.forward.slices import Slice
    from decoding.proposers.window import step_layout

    layout = step_layout(4, 3, (-1, 0, 1, -1))
    results = []
    for mode in ("eager", "graphs"):
        runner = graphed(cuda_tiny, mode)
        cache = runner.pool.acquire(128)
        with torch.inference_mode():
            runner.run([Slice(PROMPTS[0], torch.arange(len(PROMPTS[0])), None, torch.arange(1), cache)])
            tokens = [(7 * index) % 60 for index in range(layout.num_tokens)]
            step = Slice(tokens, layout.offsets + len(PROMPTS[0]), layout.visible, layout.logit_rows, cache,
                         layout.parents)
            logits, argmax = runner.run([step])
            results.append((logits[0].clone(), argmax))
        assert runner.replays == (2 if mode == "graphs" else 0)
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


def config_id(config: LookaheadConfig) -> str:
    return f"{config.window_size}-{config.ngram_size}-{config.guess_set_size}"


@pytest.mark.parametrize("config", [*CONFIGS, CUDA_PRESET], ids=config_id)
def test_lookahead_equals_greedy_through_cuda_graphs(cuda_tiny, config, no_tf32):
    runner = graphed(cuda_tiny)
    greedy = static_decode(cuda_tiny, runner, PROMPTS, [None] * len(PROMPTS))
    assert greedy == [tokens_of(generate_autoregressive(cuda_tiny, p, StopCriteria(40))) for p in PROMPTS]
    assert static_decode(cuda_tiny, runner, PROMPTS, [config] * len(PROMPTS)) == greedy
    assert runner.replays > 0 and runner.captures == len(runner._buckets)


@pytest.mark.real_model
def test_real_model_at_the_cuda_preset_through_cuda_graphs(cuda_real, no_tf32):
    from decoding.decoder import Decoder
    from tests.decoding.forward.test_static import drain

    decoder = Decoder(cuda_real)
    stop = StopCriteria(64, decoder.eos_token_ids())
    policy = BatchPolicy(static_step="graphs", static_sequences=4)
    engine = decoder.batch_engine(policy)
    assert engine.static is not None and engine.static.mode == "graphs"
    for text in REAL_MESSAGES:
        encoded = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        expected = tokens_of(decoder.decode(ids, stop))
        for config in (None, CUDA_PRESET):
            engine.add(text, ids, stop, lookahead=config)
            assert drain(engine)[text] == expected, (text, config)
    assert engine.static.replays > 0


@pytest.mark.parametrize("config", [CONFIGS[1], CUDA_PRESET], ids=config_id)
def test_a_seed_gives_the_same_tokens_on_cuda_alone_batched_and_through_graphs(cuda_tiny, config, no_tf32):
    """Per-position sampling on the device: the noise is computed where the logits are, every row a step may read
    at once; lookahead, a batch and the captured static step commit the plain loop's sampled tokens."""
    from dataclasses import replace

    from decoding.params import SamplingParams

    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    seeded = [replace(sampling, seed=seed) for seed in range(len(PROMPTS))]
    stop = StopCriteria(40)
    expected = [tokens_of(generate_autoregressive(cuda_tiny, p, stop, s)) for p, s in zip(PROMPTS, seeded, strict=True)]
    alone = [tokens_of(generate_lookahead(cuda_tiny, p, stop, s, config)) for p, s in zip(PROMPTS, seeded, strict=True)]
    assert alone == expected
    streams = [make_stream(cuda_tiny, p, config, s) for p, s in zip(PROMPTS, seeded, strict=True)]
    assert run_batch(streams, BatchPolicy(max_step_tokens=256, prefill_chunk=4), join_at={1: 3}) == expected
    runner = graphed(cuda_tiny)
    assert static_decode(cuda_tiny, runner, PROMPTS, [config] * len(PROMPTS), seeded) == expected


def test_the_tree_attention_kernel_on_cuda(no_tf32):
    """The static step's attention kernels (Triton, compiled for this GPU) against their references over a grid of
    shapes and every token bucket in the default model's head layout, then greedy decodes through captured graphs
    with them in every layer (heads of 16: the tiny models' 8 are too narrow): lookahead == greedy == the eager
    loop."""
    from tests.decoding.forward.tree_triton_check import bucket_mismatches, decode_mismatches, mismatches

    assert mismatches(CUDA) == []
    assert bucket_mismatches(CUDA) == []
    assert decode_mismatches(CUDA) == []
