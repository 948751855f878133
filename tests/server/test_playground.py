"""The playground page and the ``stream_steps`` extension, in-process against the real default model.

Covers: ``GET /`` serves the page with its controls, the static assets are served (and reach nothing outside the
server), the ``step`` objects appear only when asked for and add up to the usage numbers, and a stream without
the flag is exactly the standard one.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, sse_events, token_steps

pytestmark = pytest.mark.real_model
REPEAT = "List the days of the week, twice."
STEPPED = {"temperature": 0, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
CONTROLS = ("model", "api-key", "lookahead-enabled", "window-size", "ngram-size", "guess-set-size", "compare",
            "temperature", "max-tokens", "message")


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


def chunks_of(body: str) -> list[dict]:
    """The JSON chunks of an SSE body (``[DONE]`` checked and dropped)."""
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def normalized(body: str) -> str:
    """An SSE body with its response id and creation time blanked and its keep-alive comments (``: ping``, sent when a
    stream pauses, as one may on a loaded machine) dropped, to compare two streams byte for byte."""
    body = "".join(line for line in body.splitlines(keepends=True) if not line.startswith(":"))
    return re.sub(r'"created":\d+', '"created":0', re.sub(r'"id":"[^"]+"', '"id":""', body))


async def test_root_serves_the_page_with_its_controls(client):
    response = await client.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    for control in CONTROLS:
        assert f'id="{control}"' in page, control
        assert f'for="{control}"' in page, f"{control} has no label"
    for button in ("send", "stop", "new-chat"):
        assert f'id="{button}"' in page
    assert 'src="static/app.js"' in page and 'href="static/style.css"' in page
    assert 'class="legend"' in page and 'role="log"' in page


async def test_static_assets_are_served_and_reach_nothing_outside(client):
    script = await client.get("/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "stream_steps" in script.text and "AbortController" in script.text and "include_usage" in script.text
    style = await client.get("/static/style.css")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    page = (await client.get("/")).text
    for text in (page, script.text, style.text):
        assert not re.search(r"https?://|//cdn|@import", text)
    missing = await client.get("/static/nothing.js")
    assert missing.status_code == 404 and "error" in missing.json()


async def test_page_is_public_while_the_api_needs_the_key(decoder):
    async with running_app(make_config(api_key="secret"), decoder) as (_, client):
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/static/app.js")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401
        authorized = await client.get("/v1/models", headers={"Authorization": "Bearer secret"})
        assert authorized.status_code == 200


async def test_steps_add_up_to_usage_and_show_multi_token_steps(client):
    response = await client.post("/v1/chat/completions", json=chat_body(REPEAT, **STEPPED, stream_steps=True))
    chunks = chunks_of(response.text)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    finish = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    usage_chunk = chunks[-1]
    assert content and all(set(c["step"]) == {"tokens", "accepted", "offered"} for c in content)
    assert "step" in finish and "step" not in chunks[0] and "step" not in usage_chunk
    steps = [c["step"] for c in [*content, finish]]
    decoding = usage_chunk["decoding"]
    assert sum(s["tokens"] for s in steps) == usage_chunk["usage"]["completion_tokens"]
    assert sum(s["accepted"] for s in steps) == decoding["accepted_tokens"]
    assert sum(s["offered"] for s in steps) == decoding["offered_tokens"]
    assert sum(1 for s in steps if s["tokens"]) <= decoding["steps"]
    assert all(0 <= s["accepted"] <= s["tokens"] for s in steps)
    assert any(s["tokens"] > 1 for s in steps), "a repeated list should give at least one multi-token step"


async def test_steps_of_the_plain_decoder_are_single_tokens(client):
    body = chat_body("Say hello.", **STEPPED, stream_steps=True, lookahead={"enabled": False})
    chunks = chunks_of((await client.post("/v1/chat/completions", json=body)).text)
    steps = [c["step"] for c in chunks if "step" in c]
    assert chunks[-1]["decoding"]["method"] == "autoregressive" and chunks[-1]["decoding"]["offered_tokens"] == 0
    assert all(s["tokens"] == 1 and s["accepted"] == 0 for s in steps[:-1])
    assert sum(s["tokens"] for s in steps) == chunks[-1]["usage"]["completion_tokens"]


async def test_steps_add_up_after_a_stop_string_and_on_completions(client):
    chat = chat_body(REPEAT, **STEPPED, stream_steps=True, stop=["Tuesday"])
    chunks = chunks_of((await client.post("/v1/chat/completions", json=chat)).text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "Monday" in text and "Tuesday" not in text and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert sum(c["step"]["tokens"] for c in chunks if "step" in c) == chunks[-1]["usage"]["completion_tokens"]
    completion = {"prompt": "Monday, Tuesday, Wednesday, Monday, Tuesday,", **STEPPED, "stream_steps": True}
    chunks = chunks_of((await client.post("/v1/completions", json=completion)).text)
    assert all("step" in c for c in chunks[:-1]) and "step" not in chunks[-1]
    assert sum(c["step"]["tokens"] for c in chunks[:-1]) == chunks[-1]["usage"]["completion_tokens"]


async def test_standard_stream_is_unchanged_without_the_flag(client):
    # out of the shared n-gram memory: the first stream's completion would give the second bigger steps; out of
    # the prefix cache: the second would report the first one's prompt as cached tokens
    body = chat_body("Name a fruit.", **STEPPED, lookahead={"shared_memory": False}, cache_prompt=False)
    plain = await client.post("/v1/chat/completions", json=body)
    off = await client.post("/v1/chat/completions", json={**body, "stream_steps": False})
    assert normalized(plain.text) == normalized(off.text)
    for chunk in chunks_of(plain.text):
        expected = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
        assert set(chunk) == (expected | {"decoding"} if not chunk["choices"] else expected)
    whole = await client.post("/v1/chat/completions", json={**body, "stream": False, "stream_steps": True})
    assert "step" not in whole.json()
    bad = await client.post("/v1/chat/completions", json={**body, "stream_steps": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_steps"


async def test_tokens_without_text_count_on_the_finish_chunk(tokenizer):
    """A last step that is only EOS (no text) is reported by the finish chunk's step."""
    steps = [*token_steps(tokenizer, ["Hello", " there"]), [tokenizer.eos_token_id]]
    decoder = ScriptedDecoder(tokenizer, lambda _: Script(steps, finish_reason="stop"))
    async with running_app(make_config(), decoder) as (_, client):
        body = chat_body("Hi", stream=True, stream_steps=True, stream_options={"include_usage": True})
        chunks = chunks_of((await client.post("/v1/chat/completions", json=body)).text)
    finish = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert finish["step"]["tokens"] == 1
    assert sum(c["step"]["tokens"] for c in chunks if "step" in c) == chunks[-1]["usage"]["completion_tokens"]
