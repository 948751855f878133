"""``POST /v1/memory/corpus`` and ``GET /v1/memory``: text added to the shared n-gram memory while serving, on the
worker thread, bounded, counted, behind the key, kept by ``--memory-file``, and then used by greedy decodes."""

from __future__ import annotations

import pytest

from decoding.proposers.ngram_memory import CORPUS_DOCUMENT_TOKENS, NGramMemory, load_memory
from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, running_app, scrape, token_steps

CODE = "def add(a, b):\n    return a + b\n"
PROSE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
def scripted(tokenizer):
    return ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one"])))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


async def test_documents_enter_the_memory_on_the_worker_thread_and_are_counted(tokenizer, scripted):
    config = make_config(lookahead={"memory_tokens": 1000})
    async with running_app(config, scripted) as (app, client):
        empty = (await client.get("/v1/memory")).json()
        response = await client.post("/v1/memory/corpus", json={"documents": [CODE, PROSE]})
        after = (await client.get("/v1/memory")).json()
        snapshot = app.state.runtime.engine.memory.snapshot()
        metrics = scrape(app)
    documents = [encode(tokenizer, CODE), encode(tokenizer, PROSE)]
    tokens = sum(map(len, documents))
    assert empty == {"object": "memory", "enabled": True, "tokens": 0, "documents": 0, "capacity": 1000}
    assert response.status_code == 200, response.text
    memory = {"object": "memory", "enabled": True, "tokens": tokens, "documents": 2, "capacity": 1000}
    assert response.json() == {"object": "memory.corpus", "documents": 2, "tokens": tokens, "memory": memory}
    assert after == memory and snapshot == documents
    assert scripted.memory_added_on == ["decode-worker", "decode-worker"]  # one call per document, on the worker
    assert metrics["lookahead_corpus_documents_total"] == 2
    assert metrics["lookahead_corpus_tokens_total"] == tokens


async def test_a_long_text_enters_as_documents_of_bounded_length(tokenizer, scripted):
    text = " w1" * (CORPUS_DOCUMENT_TOKENS // 2 + 100)  # two tokens each
    tokens = encode(tokenizer, text)
    assert CORPUS_DOCUMENT_TOKENS < len(tokens) < 2 * CORPUS_DOCUMENT_TOKENS
    async with running_app(make_config(lookahead={"memory_tokens": 20_000}), scripted) as (app, client):
        data = (await client.post("/v1/memory/corpus", json={"documents": [text]})).json()
        snapshot = app.state.runtime.engine.memory.snapshot()
    assert (data["documents"], data["tokens"]) == (2, len(tokens))
    assert snapshot == [tokens[:CORPUS_DOCUMENT_TOKENS], tokens[CORPUS_DOCUMENT_TOKENS:]]


async def test_the_memory_bound_holds(tokenizer, scripted):
    """A text longer than the memory keeps its tail; a later one evicts the oldest documents whole."""
    long_text = " ".join(f"w{i}" for i in range(120))
    async with running_app(make_config(lookahead={"memory_tokens": 50}), scripted) as (app, client):
        first = (await client.post("/v1/memory/corpus", json={"documents": [long_text]})).json()
        second = (await client.post("/v1/memory/corpus", json={"documents": [PROSE]})).json()
        snapshot = app.state.runtime.engine.memory.snapshot()
    assert first["tokens"] == len(encode(tokenizer, long_text)) > 50
    assert first["memory"] == {"object": "memory", "enabled": True, "tokens": 50, "documents": 1, "capacity": 50}
    assert second["memory"]["tokens"] <= 50 and snapshot == [encode(tokenizer, PROSE)]  # the long one evicted


@pytest.mark.parametrize("body, param", [
    ({}, "documents"),
    ({"documents": []}, "documents"),
    ({"documents": "one text"}, "documents"),
    ({"documents": [CODE, ""]}, "documents[1]"),
    ({"documents": [7]}, "documents[0]"),
    ({"documents": [CODE], "text": "x"}, "text"),
    ({"text": CODE}, "documents"),
])
async def test_bad_bodies_get_a_400_naming_the_field_and_add_nothing(scripted, body, param):
    async with running_app(make_config(lookahead={"memory_tokens": 1000}), scripted) as (_, client):
        response = await client.post("/v1/memory/corpus", json=body)
        memory = (await client.get("/v1/memory")).json()
        served = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert memory["tokens"] == 0 and served.status_code == 200  # nothing added, the server keeps serving


async def test_more_tokens_than_a_call_may_add_is_a_400_and_adds_nothing(tokenizer, scripted):
    config = make_config(lookahead={"memory_tokens": 1000, "max_corpus_tokens": 16})
    async with running_app(config, scripted) as (app, client):
        fits = await client.post("/v1/memory/corpus", json={"documents": [CODE]})
        refused = await client.post("/v1/memory/corpus", json={"documents": [PROSE, CODE]})
        memory = (await client.get("/v1/memory")).json()
        metrics = scrape(app)
    assert len(encode(tokenizer, CODE)) <= 16 < len(encode(tokenizer, PROSE)) + len(encode(tokenizer, CODE))
    assert fits.status_code == 200 and refused.status_code == 400
    assert refused.json()["error"]["param"] == "documents" and "16 tokens" in refused.json()["error"]["message"]
    assert memory["tokens"] == len(encode(tokenizer, CODE))  # the refused call added nothing
    assert metrics['lookahead_requests_rejected_total{reason="invalid_request"}'] == 1


async def test_a_body_over_the_request_limit_is_a_413(scripted):
    config = make_config(lookahead={"memory_tokens": 1000}, max_request_bytes=1024)
    async with running_app(config, scripted) as (_, client):
        response = await client.post("/v1/memory/corpus", json={"documents": ["x" * 2000]})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


async def test_without_a_memory_the_corpus_is_refused_and_the_memory_reported_off(scripted):
    async with running_app(make_config(lookahead={"memory_tokens": 0}), scripted) as (_, client):
        response = await client.post("/v1/memory/corpus", json={"documents": [CODE]})
        memory = (await client.get("/v1/memory")).json()
    assert response.status_code == 400 and response.json()["error"]["code"] == "memory_disabled"
    assert memory == {"object": "memory", "enabled": False, "tokens": 0, "documents": 0, "capacity": 0}
    assert scripted.memory_added_on == []


async def test_the_endpoints_need_the_key_when_keys_are_on(scripted):
    config = make_config(api_key="k", lookahead={"memory_tokens": 1000})
    body = {"documents": [CODE]}
    async with running_app(config, scripted) as (_, client):
        without = await client.post("/v1/memory/corpus", json=body)
        wrong = await client.post("/v1/memory/corpus", json=body, headers={"authorization": "Bearer x"})
        read = await client.get("/v1/memory")
        keyed = await client.post("/v1/memory/corpus", json=body, headers={"authorization": "Bearer k"})
    assert (without.status_code, wrong.status_code, read.status_code, keyed.status_code) == (401, 401, 401, 200)
    assert without.json()["error"]["code"] == "invalid_api_key"
    assert scripted.memory_added_on == ["decode-worker"]  # only the keyed call reached the memory


async def test_before_the_model_is_ready_the_endpoints_answer_503(tokenizer, scripted):
    from tests.server.helpers import gated_loader

    release, load = gated_loader(scripted)
    async with running_app(make_config(), load_decoder=load, wait_ready=False) as (_, client):
        response = await client.post("/v1/memory/corpus", json={"documents": [CODE]})
        memory = await client.get("/v1/memory")
        release.set()
    assert response.status_code == memory.status_code == 503


async def test_a_corpus_feeds_greedy_decodes_and_a_memory_file_keeps_it(decoder, tmp_path):
    """The real model: a greedy completion's own text, loaded as a corpus, is what the memory then offers (its
    guesses accepted, the text unchanged); a restart with the memory file starts with the corpus."""
    path = str(tmp_path / "memory.json.gz")
    config = make_config(lookahead={"memory_tokens": 5000, "memory_file": path})
    prompt = "def fibonacci(n):"
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 32}
    async with running_app(config, decoder) as (app, client):
        alone = (await client.post("/v1/completions", json={**body, "lookahead": {"shared_memory": False}})).json()
        text = alone["choices"][0]["text"]
        added = (await client.post("/v1/memory/corpus", json={"documents": [prompt + text]})).json()
        assert added["memory"]["tokens"] == added["tokens"]  # the opted-out completion added nothing: only the corpus
        fed = (await client.post("/v1/completions", json=body)).json()
        metrics = scrape(app)
    assert fed["choices"][0]["text"] == text  # guesses only: the greedy text is the same
    assert fed["decoding"]["sources"]["memory"]["accepted_tokens"] > 0
    assert alone["decoding"]["sources"].get("memory", {"accepted_tokens": 0})["accepted_tokens"] == 0
    assert metrics["lookahead_memory_accepted_tokens_total"] > 0
    saved = NGramMemory(5000)
    assert load_memory(saved, path, decoder.vocabulary_id) == 2  # the corpus, then the fed completion
    assert saved.snapshot()[0] == encode(decoder.tokenizer, prompt + text)
    async with running_app(config, decoder) as (app, client):
        memory = (await client.get("/v1/memory")).json()
        snapshot = app.state.runtime.engine.memory.snapshot()
    assert memory["documents"] == 2 and snapshot == saved.snapshot()
