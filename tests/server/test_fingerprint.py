"""``system_fingerprint``: on every chat and completion response and stream chunk, stable for a running server,
changed by the settings that decide the outputs."""

from __future__ import annotations

import json
import re

import pytest

from server.serving import system_fingerprint
from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, sse_events, token_steps

FORMAT = re.compile(r"^lookahead-server-[0-9A-Za-z.+]+-[0-9a-f]{8}$")


@pytest.fixture
def scripted(tokenizer):
    return ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one", " two"])))


async def fingerprints(client) -> list[str]:
    """The fingerprint of every chat and completion response and chunk, streamed and not."""
    found = []
    for path, body in (("/v1/chat/completions", chat_body("Hi", max_tokens=2)),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        found.append((await client.post(path, json=body)).json()["system_fingerprint"])
        stream = await client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(event) for event in sse_events(stream.text)[:-1]]
        assert len(chunks) >= 3
        found.extend(chunk["system_fingerprint"] for chunk in chunks)
    return found


async def test_every_response_and_chunk_carries_the_same_fingerprint(scripted):
    config = make_config()
    async with running_app(config, scripted) as (_, client):
        found = await fingerprints(client)
    assert set(found) == {system_fingerprint(config)} and FORMAT.match(found[0]), found[0]


def test_the_fingerprint_follows_the_decoding_settings():
    base = system_fingerprint(make_config())
    assert base == system_fingerprint(make_config(port=1234, max_queue=3))  # serving settings: same outputs
    for changed in ({"lookahead": {"window_size": 3}}, {"lookahead": {"enabled": False}}, {"quantize": "int8"},
                    {"model": "other"}):
        assert system_fingerprint(make_config(**changed)) != base, changed
