"""Lookahead decoding for transformers causal LMs: pure torch, no HTTP, no asyncio.

The engine knows nothing about tokenization: token ids in, token ids out.

The names below are imported lazily (PEP 562), so ``decoding.params`` and ``decoding.errors``, which the
server's configuration reads, can be imported without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchEngine": "decoding.batch",
    "BatchPolicy": "decoding.batch",
    "step_batch": "decoding.batch",
    "Decoder": "decoding.decoder",
    "configure_threads": "decoding.decoder",
    "release_free_memory": "decoding.decoder",
    "DecodeStream": "decoding.engine",
    "Step": "decoding.engine",
    "StepCounts": "decoding.engine",
    "StepStats": "decoding.engine",
    "generate_autoregressive": "decoding.engine",
    "generate_lookahead": "decoding.engine",
    "ContextLengthError": "decoding.errors",
    "GrammarError": "decoding.errors",
    "DecodingError": "decoding.errors",
    "EmptyPromptError": "decoding.errors",
    "InvalidParameterError": "decoding.errors",
    "ModelLoadError": "decoding.errors",
    "TokenLogprob": "decoding.logprobs",
    "MemoryUsage": "decoding.memory",
    "NGramMemory": "decoding.memory",
    "corpus_documents": "decoding.memory",
    "ANY_JSON_OBJECT": "decoding.params",
    "Grammar": "decoding.params",
    "LookaheadConfig": "decoding.params",
    "LLAMA_CPP_NUMBERS": "decoding.params",
    "NumberBounds": "decoding.params",
    "SamplingParams": "decoding.params",
    "StopCriteria": "decoding.params",
    "draw_seed": "decoding.params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decoding' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
