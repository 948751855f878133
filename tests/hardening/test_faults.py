"""Injected faults, in-process with the real model: a generation that raises inside the worker fails only its
own request (a 500 envelope, or an error event mid-stream), concurrent requests and the next one are unaffected
(same greedy text as alone), the failed step generators are closed, and the counters stay consistent. An
exception that escapes every handler is one 500 envelope, not an exception thrown at the ASGI server (which
would log it twice and drop the client's keep-alive connection).

The faults come from wrappers around the real decoder and tokenizer that misbehave on a marker prompt only:
the decoder's real ``BatchEngine`` opens a failing ``DecodeStream`` for those prompts. Nothing in the server
knows about them.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Sequence
from typing import Any

import pytest

from decoding import BatchEngine, BatchPolicy, DecodeStream
from server.config import ServerConfig
from tests.hardening.live import assert_envelope, sse_data, stream_text
from tests.server.helpers import running_app, scrape

pytestmark = pytest.mark.real_model
MARKER = "FAULT-INJECTED"
FAIL_AT_STEP = 3
PROMPT = "The capital of France is"


class InjectedFault(RuntimeError):
    """The fault a test injects."""


class FailingStream(DecodeStream):
    """A real decode whose step ``FAIL_AT_STEP`` raises inside the batched step; records when it is closed."""

    def __init__(self, closed: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed_log = closed
        self.steps = 0

    def finish(self, logits: Any, argmax: Any = None) -> Any:
        if self.steps == FAIL_AT_STEP:
            raise InjectedFault("injected fault")
        self.steps += 1
        return super().finish(logits, argmax)

    def close(self) -> None:
        super().close()
        self.closed_log.append("closed")


class FaultyDecoder:
    """The real decoder, except that prompts holding ``MARKER`` fail at step ``FAIL_AT_STEP``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.closed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_engine(self, policy: Any = None, memory_tokens: int = 0, memory_file: Any = None,
                     memory_corpus: Any = ()) -> BatchEngine:
        """A memory-less engine whose streams fail on ``MARKER`` (memory settings are ignored: faults only)."""
        return BatchEngine(self.inner.loaded.model, policy or BatchPolicy(), open_stream=self._open)

    def _open(self, model: Any, prompt_ids: Sequence[int], *args: Any, **kwargs: Any) -> DecodeStream:
        """The engine's stream, with what the engine adds by keyword (a prefix-cache hit, a grammar, ...)."""
        if MARKER in self.inner.tokenizer.decode(list(prompt_ids)):
            return FailingStream(self.closed, model, prompt_ids, *args, **kwargs)
        return DecodeStream(model, prompt_ids, *args, **kwargs)


class FaultyTokenizer:
    """The real tokenizer, except that encoding a text holding ``MARKER`` raises (outside any typed handler)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __deepcopy__(self, memo: dict) -> FaultyTokenizer:
        return FaultyTokenizer(copy.deepcopy(self.inner, memo))

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        if MARKER in text:
            raise InjectedFault("tokenizer fault")
        return self.inner.encode(text, *args, **kwargs)


@pytest.fixture(scope="module")
def real_decoder(real_model):
    from decoding import Decoder

    return Decoder(real_model)


def body(prompt: str, stream: bool = False) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}


async def test_a_failing_generation_fails_only_its_own_request(real_decoder):
    decoder = FaultyDecoder(real_decoder)
    async with running_app(ServerConfig(warmup=False), decoder) as (app, client):
        alone = (await client.post("/v1/completions", json=body(PROMPT))).json()["choices"][0]["text"]
        bad, bad_stream, good, good_stream = await asyncio.gather(
            client.post("/v1/completions", json=body(f"{MARKER} {PROMPT}")),
            client.post("/v1/completions", json=body(f"{MARKER} {PROMPT}", stream=True)),
            client.post("/v1/completions", json=body(PROMPT)),
            client.post("/v1/completions", json=body(PROMPT, stream=True)),
        )
        error = assert_envelope(bad, 500)
        assert (error["type"], error["code"]) == ("server_error", "internal_error")
        assert "injected" not in error["message"]  # internals stay in the log

        events = sse_data(bad_stream.text)
        assert bad_stream.status_code == 200 and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["type"] == "server_error"
        assert stream_text(events[:-1])  # the text before the fault was delivered

        assert good.json()["choices"][0]["text"] == alone
        assert stream_text(sse_data(good_stream.text)) == alone
        after = await client.post("/v1/completions", json=body(PROMPT))
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == alone
        samples = scrape(app)
    assert decoder.closed == ["closed", "closed"]  # both failed decodes closed (their caches freed)
    assert samples['lookahead_requests_total{finish_reason="error"}'] == 2
    assert samples['lookahead_requests_total{finish_reason="length"}'] + samples[
        'lookahead_requests_total{finish_reason="stop"}'] == 4
    assert samples["lookahead_requests_running"] == 0 and samples["lookahead_requests_waiting"] == 0


async def test_an_unexpected_exception_is_one_500_envelope(real_decoder):
    """``raise_app_exceptions=True``: an exception re-raised to the ASGI server would fail this test."""
    decoder = FaultyDecoder(real_decoder)
    decoder.tokenizer = FaultyTokenizer(real_decoder.tokenizer)
    async with running_app(ServerConfig(warmup=False), decoder, raise_app_exceptions=True) as (app, client):
        response = await client.post("/v1/completions", json=body(f"{MARKER} x"))
        error = assert_envelope(response, 500)
        assert error["code"] == "internal_error" and "tokenizer" not in error["message"]
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": MARKER}]})
        assert_envelope(chat, 500)
        assert (await client.post("/v1/completions", json=body(PROMPT))).status_code == 200
