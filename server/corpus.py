"""``POST /v1/memory/corpus`` and ``GET /v1/memory`` (extensions): text added to the server-wide n-gram memory while
serving (SGLang's ``add_external_corpus``, in OpenAI's style), and what the memory holds.

Contract: ``add`` answers 400 ``memory_disabled`` when the server has no shared memory (``lookahead.memory_tokens``
0); otherwise it tokenizes the request's documents off the event loop (``tokenize``: without special tokens; 400
naming ``documents`` when they come to more than ``lookahead.max_corpus_tokens`` tokens, ``documents[i]`` for a text
that tokenizes to nothing), cuts each into the memory's documents (``decoding.corpus_documents``) and adds them on
the worker thread, which owns the memory (``Worker.call``: between two steps, one memory document per call, so a
large corpus never holds decoding up for more than one document's add). Each document added is counted
(``Metrics.corpus_added``); the answer (``CorpusAdded``) says what was added and the memory's usage after. The
memory's own bound holds (the oldest documents are evicted), and ``--memory-file`` writes what was added at
shutdown with the rest. ``usage`` reads the memory on the worker thread (``MemoryInfo``; ``enabled`` false without
one). Both answer 503 while the server is not ready or once its worker has stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from decoding import MemoryUsage, corpus_documents
from server.errors import BadRequestError, ServiceUnavailableError
from server.jobs import EngineLike
from server.protocol import CorpusAdded, CorpusRequest, MemoryInfo
from server.text import TextCodec
from server.worker import WorkerStopped

if TYPE_CHECKING:
    from server.runtime import Runtime

Result = TypeVar("Result")
DISABLED = MemoryInfo(enabled=False, tokens=0, documents=0, capacity=0)


def tokenize(codec: TextCodec, request: CorpusRequest, max_tokens: int) -> list[list[int]]:
    """The memory documents of ``request.documents``, in order (module contract: 400 beyond ``max_tokens`` in all,
    or for a text without tokens). Blocks on the tokenizer: call it off the event loop."""
    documents: list[list[int]] = []
    total = 0
    for index, text in enumerate(request.documents):
        tokens = codec.encode_text(text, add_special_tokens=False)
        if not tokens:
            raise BadRequestError("A document must hold text that tokenizes to at least one token.",
                                  param=f"documents[{index}]")
        total += len(tokens)
        if total > max_tokens:
            raise BadRequestError(f"The documents come to more than {max_tokens} tokens, the most one call may add "
                                  "(lookahead.max_corpus_tokens): send them in several calls.", param="documents")
        documents.extend(corpus_documents(tokens))
    return documents


def memory_info(usage: MemoryUsage | None) -> MemoryInfo:
    """The answer's view of the memory's usage (``DISABLED`` for none)."""
    if usage is None:
        return DISABLED
    return MemoryInfo(enabled=True, tokens=usage.tokens, documents=usage.documents, capacity=usage.capacity)


def disabled_error() -> BadRequestError:
    """The 400 for a corpus sent to a server without a shared memory."""
    return BadRequestError("The server has no n-gram memory (lookahead.memory_tokens is 0): start it with "
                           "--memory-tokens N to add a corpus.", code="memory_disabled")


async def on_worker(runtime: Runtime, function: Callable[[EngineLike], Result]) -> Result:
    """``function(engine)``'s result, run on the worker thread between two steps (503 once the worker stopped)."""
    try:
        return await asyncio.wrap_future(runtime.worker.call(function))
    except WorkerStopped as error:
        raise ServiceUnavailableError("The server is shutting down; retry on another instance.",
                                      reason="draining") from error


async def add(runtime: Runtime, request: CorpusRequest) -> dict[str, Any]:
    """``POST /v1/memory/corpus`` (module contract)."""
    loaded = runtime.require_loaded()
    limit = runtime.config.lookahead.max_corpus_tokens
    if runtime.config.lookahead.memory_tokens == 0:
        raise disabled_error()
    documents = await asyncio.to_thread(tokenize, loaded.codec, request, limit)  # never empty: each text has tokens
    usage: MemoryUsage | None = None
    for document in documents:
        usage = await on_worker(runtime, lambda engine, document=document: engine.add_documents([document]))
        if usage is None:
            raise disabled_error()
        runtime.metrics.corpus_added(1, len(document))
    tokens = sum(len(document) for document in documents)
    return CorpusAdded(documents=len(documents), tokens=tokens, memory=memory_info(usage)).model_dump()


async def usage(runtime: Runtime) -> dict[str, Any]:
    """``GET /v1/memory`` (module contract)."""
    runtime.require_loaded()
    return memory_info(await on_worker(runtime, lambda engine: engine.memory_usage())).model_dump()
