"""Shared fixtures: tiny seeded random models of two architectures, and the real default model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 64
TINY_SIZES = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# One intra-op thread: on this 2-core machine a second OpenMP thread competing with the server under test (or
# anything else) makes forwards erratic; one thread is the stable setting (see shared/docs/cpu-notes.md).
torch.set_num_threads(1)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer LLaMA with a 64-token vocabulary, random but seeded weights, in eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_SIZES)).eval()


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (attention biases, different rotary base) with a 64-token vocabulary."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_SIZES, use_sliding_window=False)).eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request):
    """Each tiny architecture in turn."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]()


@pytest.fixture(scope="session")
def real_model():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per session on the CPU in float32."""
    from decoding.weights.loading import load_model

    return load_model(device="cpu", dtype="float32")
