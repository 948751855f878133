"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes): the ids a completion or chat
decodes from, text back, the tokenizer's special tokens, 400s naming the field, and the API key like ``/v1/*``."""

from __future__ import annotations

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, token_steps

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def scripted(tokenizer):
    return ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one"])), context_length=4096)


@pytest.fixture
async def client(scripted):
    async with running_app(make_config(), scripted) as (_, client):
        yield client


async def test_tokenize_a_prompt_as_a_completion_would(client, tokenizer):
    data = (await client.post("/tokenize", json={"prompt": "The capital of France"})).json()
    assert data == {"tokens": tokenizer.encode("The capital of France"), "count": len(data["tokens"]),
                    "max_model_len": 4096}
    bare = (await client.post("/tokenize", json={"prompt": "x", "add_special_tokens": False})).json()
    assert bare["tokens"] == tokenizer.encode("x", add_special_tokens=False)


async def test_tokenize_messages_counts_what_a_chat_completion_sends(client):
    data = (await client.post("/tokenize", json={"model": "SmolLM2-135M-Instruct", "messages": MESSAGES})).json()
    chat = (await client.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=1))).json()
    assert data["count"] == len(data["tokens"]) == chat["usage"]["prompt_tokens"]
    bare = (await client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})).json()
    assert bare["count"] < data["count"] and data["tokens"][: bare["count"]] == bare["tokens"]


async def test_detokenize_round_trips(client, tokenizer):
    ids = tokenizer.encode("Lookahead decoding, token by token.", add_special_tokens=False)
    response = await client.post("/detokenize", json={"tokens": ids})
    assert response.status_code == 200 and response.json() == {"prompt": "Lookahead decoding, token by token."}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": ["1"]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special": True}, "skip_special"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_token": True}, "add_special_token"),
    ("/tokenize", {"messages": []}, "messages"),
])
async def test_bad_bodies_are_400_naming_the_field(client, path, body, param):
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_unknown_model_is_404(client):
    response = await client.post("/tokenize", json={"model": "gpt-4o", "prompt": "a"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


async def test_the_api_key_guards_them(scripted):
    async with running_app(make_config(api_key="k"), scripted) as (_, client):
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert (await client.post(path, json=body)).status_code == 401
            response = await client.post(path, json=body, headers={"authorization": "Bearer k"})
            assert response.status_code == 200, path
        assert (await client.get("/tokenizer_info")).status_code == 401
        assert (await client.get("/tokenizer_info", headers={"authorization": "Bearer k"})).status_code == 200


async def test_tokenizer_info_names_the_special_tokens_and_the_template(client, tokenizer):
    info = (await client.get("/tokenizer_info")).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["model_max_length"] == 4096
