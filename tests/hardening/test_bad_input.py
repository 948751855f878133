"""Hand-written hostile inputs the fuzzer does not reach, against the live server: oversized bodies, deep
nesting, non-standard numbers, non-UTF-8 bytes, thousands of stop strings, a 1 MB message, Unicode edge cases.

Every case must end in a 200 or a clean 4xx in OpenAI's envelope, never a 5xx, and the keep-alive connection must
stay usable: all cases go through one ``httpx.Client`` and each is followed by a small request that must succeed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.hardening.live import MODEL, assert_envelope, chat_body, completion_body, sse_data, stream_text

pytestmark = pytest.mark.real_model
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMIT = 1 << 20  # the live server's max_request_bytes (the default)
ZWJ_FAMILY = "\U0001F469\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"
RTL = "\u202eשלום עולם\u202c مرحبا بالعالم \u200f"
ZALGO = "Z\u0351\u0308\u0361\u0334a\u0337\u0303\u0313l\u0358g\u0489o"


@pytest.fixture(scope="module")
def client(live) -> Iterator[httpx.Client]:
    """One keep-alive connection for the whole module (a server that drops it after an error fails here)."""
    with httpx.Client(base_url=live.base_url, timeout=120, limits=httpx.Limits(max_connections=1)) as http:
        yield http


def post_raw(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


def still_serving(client: httpx.Client) -> None:
    """A tiny request on the same connection succeeds."""
    response = client.post(COMPLETIONS, json=completion_body("Hi", max_tokens=1))
    assert response.status_code == 200, response.text


def check_bad(client: httpx.Client, path: str, body: bytes, status: int = 400, param: str | None = None,
              code: str | None = None) -> dict:
    response = post_raw(client, path, body)
    error = assert_envelope(response, status)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    still_serving(client)
    return error


def test_body_over_the_limit_is_413(client):
    body = json.dumps(chat_body("x" * (LIMIT + 10))).encode()
    check_bad(client, CHAT, body, 413, code="request_too_large")


def test_chunked_body_over_the_limit_is_413_without_reading_it_all(client):
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64):  # 4 MiB in all, sent without Content-Length
            yield b"a" * 65536
        yield b'"}'

    response = client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert_envelope(response, 413)
    still_serving(client)


def test_one_megabyte_message_is_a_context_error(client):
    content = "word " * 200_000  # 1,000,000 bytes: under the body limit, far over the context
    error = check_bad(client, CHAT, json.dumps(chat_body(content)).encode(), 400, code="context_length_exceeded")
    assert error["param"] in ("messages", "max_tokens")
    check_bad(client, CHAT, json.dumps(chat_body(content * 2)).encode(), 413)  # 2 MB: over the body limit


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deep_nesting_is_400(client, depth):
    arrays = b'{"prompt": "Hi", "deep": ' + b"[" * depth + b"]" * depth + b"}"
    check_bad(client, COMPLETIONS, arrays)
    objects = b'{"prompt": "Hi", "deep": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    check_bad(client, COMPLETIONS, objects)


def test_moderate_nesting_in_an_unknown_field_is_ignored(client):
    body = b'{"prompt": "Hi", "max_tokens": 1, "deep": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert post_raw(client, COMPLETIONS, body).status_code == 200


def test_nesting_in_a_known_field_is_400(client):
    check_bad(client, COMPLETIONS, b'{"prompt": "Hi", "stop": [[[["x"]]]]}', param="stop[0]")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "max_tokens", "unknown"])
def test_non_standard_numbers_are_400(client, literal, field):
    check_bad(client, COMPLETIONS, f'{{"prompt": "Hi", "{field}": {literal}}}'.encode())


def test_overflowing_numbers_are_400(client):
    check_bad(client, COMPLETIONS, b'{"prompt": "Hi", "temperature": 1e400}', param="temperature")
    check_bad(client, COMPLETIONS, b'{"prompt": "Hi", "seed": 1' + b"0" * 100 + b"}", param="seed")
    check_bad(client, COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 30 + b"}", param="max_tokens")
    check_bad(client, COMPLETIONS, b'{"prompt": "Hi", "lookahead": {"window_size": 1' + b"0" * 30 + b"}}",
              param="lookahead.window_size")
    check_bad(client, COMPLETIONS, b'{"prompt": "Hi", "seed": ' + b"7" * 10_000 + b"}")  # over Python's int limit


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff\xfe"}',  # invalid start bytes
    '{"prompt": "café"}'.encode("latin-1"),
    b'{"prompt": "\xc0\xaf"}',  # overlong encoding of "/"
    b'{"prompt": "\xed\xa0\x80"}',  # a UTF-16 surrogate encoded as UTF-8
    b'{"prompt": "\xe2\x82"}',  # truncated sequence
    '{"prompt": "Hi"}'.encode("utf-16"),
    '{"prompt": "Hi"}'.encode("utf-32"),
], ids=["ff-fe", "latin-1", "overlong", "encoded-surrogate", "truncated", "utf-16", "utf-32"])
def test_non_utf8_bytes_are_400(client, raw):
    check_bad(client, COMPLETIONS, raw)


def test_utf8_byte_order_mark_is_tolerated(client):
    response = post_raw(client, COMPLETIONS, b"\xef\xbb\xbf" + json.dumps(completion_body("Hi", max_tokens=1)).encode())
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("count", [17, 10_000])
def test_too_many_stop_strings_are_400(client, count):
    stops = [f"stop{index}" for index in range(count)]
    error = check_bad(client, CHAT, json.dumps(chat_body("Hi", stop=stops)).encode(), param="stop")
    assert "16" in error["message"]


def test_four_long_stop_strings_are_fine(client):
    stops = ["x" * 10_000, ZWJ_FAMILY, RTL, "\u200d"]
    response = client.post(CHAT, json=chat_body("Say hello.", stop=stops))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


SURROGATES = [
    ("prompt", '{"prompt": "ok \\ud800 ok"}', "prompt"),
    ("low", '{"prompt": "\\udfff"}', "prompt"),
    ("prompt-list", '{"prompt": ["\\ud83d"]}', "prompt[0]"),
    ("stop", '{"prompt": "Hi", "stop": ["\\ud800"]}', "stop[0]"),
    ("model", '{"prompt": "Hi", "model": "\\ud800"}', "model"),
    ("unknown-key", '{"prompt": "Hi", "\\ud800": 1}', "\\ud800"),  # echoed escaped, never raw
]


@pytest.mark.parametrize("where, body, param", SURROGATES, ids=[case[0] for case in SURROGATES])
def test_lone_surrogates_are_400(client, where, body, param):
    error = check_bad(client, COMPLETIONS, body.encode(), param=param)
    assert "surrogate" in error["message"]


def test_lone_surrogate_in_a_chat_message_names_it(client):
    body = b'{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text", ' \
           b'"text": "\\udbff"}]}]}'
    check_bad(client, CHAT, body, param="messages[1].content[0].text")


UNICODE_TEXTS = {
    "zwj": f"Describe this family: {ZWJ_FAMILY} \U0001F3F3\ufe0f\u200d\U0001F308 \U0001F44D\U0001F3FD",
    "rtl": f"Translate: {RTL}",
    "combining": f"What is {ZALGO}?",
    "controls": "Tab\there, NUL\u0000, BOM\ufeff, noncharacters \ufffe\uffff, private \ue000",
    "escaped pair": "Smile \U0001F600",
}


@pytest.mark.parametrize("name", list(UNICODE_TEXTS))
def test_unicode_edge_cases_are_served(client, name):
    text = UNICODE_TEXTS[name]
    chat = client.post(CHAT, json=chat_body(text, max_tokens=3, stop=[ZWJ_FAMILY, "\u200f"]))
    assert chat.status_code == 200, chat.text
    plain = client.post(COMPLETIONS, json=completion_body(text, max_tokens=3, stop=["\u202e"]))
    assert plain.status_code == 200, plain.text
    streamed = client.post(COMPLETIONS, json=completion_body(text, max_tokens=3, stop=["\u202e"], stream=True))
    events = sse_data(streamed.text)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert stream_text(events) == plain.json()["choices"][0]["text"]


def test_escaped_surrogate_pairs_are_the_character(client):
    escaped = b'{"prompt": "Smile \\ud83d\\ude00", "max_tokens": 4, "temperature": 0}'
    literal = json.dumps(completion_body("Smile \U0001F600", max_tokens=4), ensure_ascii=False).encode()
    first, second = post_raw(client, COMPLETIONS, escaped), post_raw(client, COMPLETIONS, literal)
    assert first.status_code == second.status_code == 200
    assert first.json()["usage"] == second.json()["usage"]
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


@pytest.mark.parametrize("body", [
    {"model": MODEL, "prompt": "Hi", "temperature": 5e-324, "max_tokens": 2},
    {"model": MODEL, "prompt": "Hi", "temperature": 1, "top_p": 5e-324, "max_tokens": 2},
    {"model": MODEL, "prompt": "Hi", "temperature": 1, "top_k": 2**64, "max_tokens": 2},
    {"model": MODEL, "prompt": "Hi", "seed": -(2**63), "temperature": 1, "max_tokens": 2},
    {"model": MODEL, "prompt": "Hi", "seed": 2**63 - 1, "temperature": 1, "max_tokens": 2},
])
def test_extreme_valid_sampling_settings_are_served(client, body):
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
