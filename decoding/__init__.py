"""Lookahead decoding for transformers causal LMs: pure torch, no HTTP, no asyncio.

The engine knows nothing about tokenization: token ids in, token ids out.
"""

from decoding.batch import BatchEngine, BatchPolicy, step_batch
from decoding.decoder import Decoder, configure_threads
from decoding.engine import DecodeStream, Step, StepCounts, StepStats, generate_autoregressive, generate_lookahead
from decoding.errors import ContextLengthError, DecodingError, EmptyPromptError, InvalidParameterError, ModelLoadError
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria

__all__ = [
    "BatchEngine",
    "BatchPolicy",
    "DecodeStream",
    "ContextLengthError",
    "Decoder",
    "DecodingError",
    "EmptyPromptError",
    "InvalidParameterError",
    "LookaheadConfig",
    "ModelLoadError",
    "SamplingParams",
    "Step",
    "StepCounts",
    "StepStats",
    "StopCriteria",
    "configure_threads",
    "step_batch",
    "generate_autoregressive",
    "generate_lookahead",
]
