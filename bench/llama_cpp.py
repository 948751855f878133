"""llama.cpp as a benchmark method: the same GGUF file, the same prompt ids, greedy, through ``llama-cpp-python``.

Contract: ``llama_cpp_runner(gguf_path, threads)`` returns a ``bench.measure`` runner that decodes a prompt's
token ids greedily with llama.cpp (``llama_cpp.Llama``: one context of ``context`` tokens, ``threads`` threads for
decoding and prefill alike, temperature 0, no repetition penalty) and ignores the model it is handed. It stops at
``max_tokens`` or a stop token (stripped, as ours are). ``Decoded.steps`` counts llama.cpp's forward passes: the
prompt's batches of ``n_batch`` tokens plus one per generated token that was fed back. Each decode starts from an
empty KV cache (``Llama.reset``), so the prompt's prefill is timed like ours. ``available()`` says whether the
optional extra is installed (``pip install -e '.[llama-cpp]'``, a source build of llama.cpp: a few minutes);
``make test`` does not need it. On a VM that exposes AMX but does not let a process use it (the 2-core Xeon here),
llama.cpp's native build crashes in its first forward; build it without AMX:
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
-DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install -e '.[llama-cpp]'``.

llama.cpp computes with its own quantized arithmetic (it quantizes activations to 8 bits for the dot products),
so its greedy text can differ from ours after a few dozen tokens; the report's "identical to greedy" column says
so per prompt. The comparison that matters here is tokens per second on one thread.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from decoding.params import StopCriteria

DEFAULT_CONTEXT = 4096
DEFAULT_BATCH = 512


def available() -> bool:
    """Whether ``llama-cpp-python`` is importable here."""
    return importlib.util.find_spec("llama_cpp") is not None


@functools.cache
def _load(gguf_path: str, threads: int, context: int) -> Any:
    """One ``llama_cpp.Llama`` per (file, threads, context) per process: loading maps the file once."""
    from llama_cpp import Llama

    llama = Llama(
        model_path=gguf_path, n_ctx=context, n_batch=DEFAULT_BATCH, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )
    atexit.register(llama.close)  # freed before the interpreter tears down the bindings it frees through
    return llama


def llama_cpp_runner(
    gguf_path: Path, threads: int = 1, context: int = DEFAULT_CONTEXT
) -> Callable[[PreTrainedModel, Sequence[int], StopCriteria], Any]:
    """A runner (``bench.records.Runner``) that decodes with llama.cpp on ``gguf_path``; raises ``RuntimeError``
    when ``llama-cpp-python`` is not installed."""
    if not available():
        raise RuntimeError("the llama_cpp method needs llama-cpp-python: pip install -e '.[llama-cpp]'")

    def run(_model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria) -> Any:
        from bench.records import Decoded

        llama = _load(str(gguf_path), threads, context)
        llama.reset()
        tokens: list[int] = []
        fed_back = 0
        if stop.max_tokens > 0:
            for token in llama.generate(
                list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
            ):
                if token in stop.stop_token_ids:
                    break
                tokens.append(token)
                if len(tokens) >= stop.max_tokens:
                    break
                fed_back += 1
        steps = math.ceil(len(prompt_ids) / DEFAULT_BATCH) + fed_back
        return Decoded(tokens, steps)

    return run
