"""Lookahead decoding for transformers causal LMs: pure torch, no HTTP, no asyncio.

The engine knows nothing about tokenization: token ids in, token ids out.

The package is four rooms, subpackages each mapped by its own docstring, tied together by a few top-level modules.
Imports between rooms point one way, up this list (a room imports the rooms listed before it, never one after;
``tests/test_layering.py`` holds it):

- ``decoding.weights``: a model loaded (the default model fetched once, GGUF weights kept quantized, int8) and the
  native kernels its products run on (``csrc/``).
- ``decoding.forward``: how one step's forward runs on a device: the KV cache, the slices, and the static, fused,
  compiled, lean and public forwards (its docstring gives which runs when); each row's greedy ids.
- ``decoding.proposers``: where a lookahead step's guesses come from: the Jacobi window and its n-gram pool, the
  context's copies, the shared n-gram memory, the prediction, recycled and runner-up tokens, a grammar's forced
  tokens.
- ``decoding.step``: one decode (``DecodeStream``, ``decoding.step.stream``) and what its steps are made of: drafts,
  the token tree, verification, sampling, logits adjustments, logprobs; the prefix cache.

Top-level modules below every room (any room may import them; they import no room): ``params`` (what a request asks,
as plain data: ``SamplingParams``, ``StopCriteria``, ``LookaheadConfig``, ``Grammar``; no torch) and ``errors`` (the
typed exceptions), which the server reads, and ``grammar`` (a request's grammar compiled into the ``Constraint`` that
proposers and steps obey). Above every room: ``batch`` (``BatchEngine``, the engine: the continuous batch of decodes,
its step in two halves, ``launch`` and ``complete``, and ``start_forward``, where the static step or the eager forward
is chosen), ``batch_policy`` (``BatchPolicy``: how one forward spends its tokens, ``allocate``), ``payoff`` (the
engine's payoff guard: a decode whose verifying steps do not pay takes plain steps a while), ``calibration`` (the
step-cost curve measured through ``forward_batch``) and ``decoder`` (``Decoder``, the facade the server uses).

The names below are imported lazily (PEP 562), so ``decoding.params`` and ``decoding.errors``, which the
server's configuration reads, can be imported without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchEngine": "decoding.batch",
    "BatchPolicy": "decoding.batch_policy",
    "step_batch": "decoding.batch",
    "Decoder": "decoding.decoder",
    "configure_threads": "decoding.decoder",
    "native_steps": "decoding.decoder",
    "release_free_memory": "decoding.decoder",
    "DecodeStream": "decoding.step.stream",
    "Step": "decoding.step.stream",
    "StepCounts": "decoding.step.stream",
    "StepStats": "decoding.step.stream",
    "generate_autoregressive": "decoding.step.stream",
    "generate_lookahead": "decoding.step.stream",
    "ContextLengthError": "decoding.errors",
    "GrammarError": "decoding.errors",
    "DecodingError": "decoding.errors",
    "EmptyPromptError": "decoding.errors",
    "InvalidParameterError": "decoding.errors",
    "ModelLoadError": "decoding.errors",
    "TokenLogprob": "decoding.step.logprobs",
    "MemoryUsage": "decoding.proposers.ngram_memory",
    "NGramMemory": "decoding.proposers.ngram_memory",
    "corpus_documents": "decoding.proposers.ngram_memory",
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
