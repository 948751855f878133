"""Several choices per request and echo: completions' prompt lists (strings, token ids), ``n`` for chat and
completions (indices, usage, seeds, streams), ``best_of``, ``echo`` with and without logprobs (``max_tokens``
0 included), and how ``n`` meets admission and disconnects. The real default model where text matters; the
scripted decoder where timing does."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict

import pytest
import torch

from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, asgi_post, chat_body, running_app, sse_events, token_steps

TOLERANCE = 1e-4
PROMPTS = ["The capital of France is", "def add(a, b):"]
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


async def complete(client, **fields) -> dict:
    response = await client.post("/v1/completions", json=fields)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(body: str) -> tuple[list[dict], str]:
    """A stream's JSON chunks and its last event."""
    events = sse_events(body)
    return [json.loads(event) for event in events[:-1]], events[-1]


@pytest.mark.real_model
async def test_prompt_list_with_n_numbers_choices_and_sums_usage(client, tokenizer):
    data = await complete(client, prompt=PROMPTS, n=2, **GREEDY)
    choices = data["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    texts = [choice["text"] for choice in choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: n identical choices
    alone = await complete(client, prompt=PROMPTS[1], **GREEDY)
    assert alone["choices"][0]["text"] == texts[2]
    prompt_tokens = sum(len(tokenizer.encode(prompt)) for prompt in PROMPTS)  # each prompt counted once
    usage = data["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 4 * 4
    assert usage["total_tokens"] == prompt_tokens + 16
    assert data["decoding"]["steps"] >= 4  # the choices' steps summed
    ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    by_ids = await complete(client, prompt=ids, n=2, **GREEDY)
    assert [choice["text"] for choice in by_ids["choices"]] == texts
    assert {**by_ids["usage"], "prompt_tokens_details": None} == {**usage, "prompt_tokens_details": None}
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompts again: KV reused
    single = await complete(client, prompt=ids[1], **GREEDY)  # one list of token ids is one prompt
    assert [choice["text"] for choice in single["choices"]] == [texts[2]]


@pytest.mark.real_model
async def test_seeded_choices_are_reproducible_and_use_seed_plus_index(client):
    """n choices decode side by side; a seed decides the text whatever the batch, so choice j is the request with
    seed + j alone."""
    sampled = {"prompt": PROMPTS[0], "temperature": 1.0, "max_tokens": 6, "seed": 41}
    first = await complete(client, **sampled, n=3)
    texts = [choice["text"] for choice in first["choices"]]
    assert len(set(texts)) > 1
    third = await complete(client, **{**sampled, "seed": 43})  # choice j decodes with seed + j, alone or not
    assert third["choices"][0]["text"] == texts[2]


@pytest.mark.real_model
async def test_stream_with_prompts_and_n_indexes_every_chunk(client):
    body = {"prompt": PROMPTS, "n": 2, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    whole = await complete(client, **{**body, "stream": False})
    chunks, last = streamed((await client.post("/v1/completions", json=body)).text)
    assert last == "[DONE]"
    *choice_chunks, usage_chunk = chunks
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in choice_chunks:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert dict(finishes) == {index: ["length"] for index in range(4)}  # one finish chunk per choice
    assert [texts[index] for index in range(4)] == [choice["text"] for choice in whole["choices"]]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {  # the same prompts again: their KV is reused
        **whole["usage"], "prompt_tokens_details": usage_chunk["usage"]["prompt_tokens_details"]}


@pytest.mark.real_model
async def test_chat_n_streams_a_role_and_a_finish_chunk_per_choice(client):
    body = chat_body("Name a color.", n=2, **GREEDY)
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    assert [choice["index"] for choice in whole["choices"]] == [0, 1]
    assert whole["choices"][0]["message"] == whole["choices"][1]["message"]
    chunks, _ = streamed((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
    roles = [chunk["choices"][0]["index"] for chunk in chunks if "role" in chunk["choices"][0]["delta"]]
    finishes = [chunk["choices"][0]["index"] for chunk in chunks if chunk["choices"][0]["finish_reason"]]
    assert roles == [0, 1] and sorted(finishes) == [0, 1]
    content = defaultdict(str)
    for chunk in chunks:
        content[chunk["choices"][0]["index"]] += chunk["choices"][0]["delta"].get("content", "")
    assert [content[0], content[1]] == [choice["message"]["content"] for choice in whole["choices"]]


@pytest.mark.real_model
async def test_best_of_equal_to_n_is_accepted(client):
    data = await complete(client, prompt=PROMPTS[0], n=2, best_of=2, temperature=0, max_tokens=1)
    assert len(data["choices"]) == 2


@pytest.mark.real_model
async def test_echo_prepends_the_prompt_text(client):
    plain = await complete(client, prompt=PROMPTS, **GREEDY)
    echoed = await complete(client, prompt=PROMPTS, echo=True, **GREEDY)
    for prompt, mine, reference in zip(PROMPTS, echoed["choices"], plain["choices"], strict=True):
        assert mine["text"] == prompt + reference["text"] and mine["logprobs"] is None
    only = await complete(client, prompt=PROMPTS[0], echo=True, max_tokens=0)
    [choice] = only["choices"]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0


@torch.inference_mode()
def reference_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """log_softmax of one plain forward over the prompt: token i read at row i - 1."""
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.mark.real_model
async def test_echo_logprobs_with_max_tokens_zero_are_the_prompts(client, real_model, tokenizer):
    """lm-evaluation-harness' loglikelihood request: the prompt's tokens and logprobs, nothing generated."""
    ids = tokenizer.encode(PROMPTS[1])
    data = await complete(client, prompt=[ids], echo=True, logprobs=1, max_tokens=0, temperature=0)
    [choice] = data["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(logprobs["tokens"]) == len(ids) and "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(reference_prompt_logprobs(real_model.model, ids),
                                                           abs=TOLERANCE)
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    body = {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}
    chunks, last = streamed((await client.post("/v1/completions", json=body)).text)
    assert last == "[DONE]" and [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, "length"]
    assert chunks[0]["choices"][0]["text"] == choice["text"]
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == logprobs["tokens"]


@pytest.mark.real_model
async def test_echo_logprobs_stream_puts_the_prompt_in_each_choices_first_chunk(client):
    body = {"prompt": PROMPTS, "n": 2, "echo": True, "logprobs": 2, **GREEDY}
    whole = await complete(client, **body)
    plain = await complete(client, **{**body, "echo": False})
    for index, (mine, reference) in enumerate(zip(whole["choices"], plain["choices"], strict=True)):
        completion_part = len(reference["logprobs"]["tokens"])
        assert mine["text"] == PROMPTS[index // 2] + reference["text"]
        assert mine["logprobs"]["tokens"][-completion_part:] == reference["logprobs"]["tokens"]
        assert mine["logprobs"]["token_logprobs"][-completion_part:] == pytest.approx(
            reference["logprobs"]["token_logprobs"], abs=TOLERANCE)
        assert mine["logprobs"]["token_logprobs"][0] is None
    chunks, _ = streamed((await client.post("/v1/completions", json={**body, "stream": True})).text)
    seen: dict[int, dict] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        first = seen.setdefault(choice["index"], choice)
        if choice is first:
            assert choice["text"].startswith(PROMPTS[choice["index"] // 2])
            assert choice["logprobs"]["token_logprobs"][0] is None
        elif choice["logprobs"] is not None:
            assert None not in choice["logprobs"]["token_logprobs"]
    joined = defaultdict(list)
    for chunk in chunks:
        if chunk["choices"][0]["logprobs"] is not None:
            joined[chunk["choices"][0]["index"]] += chunk["choices"][0]["logprobs"]["text_offset"]
    assert [joined[index] for index in range(4)] == [c["logprobs"]["text_offset"] for c in whole["choices"]]


WORDS = [" one", " two", " three", " four", " five", " six"]


def scripted(tokenizer, gate: threading.Event | None = None, delay: float = 0.0) -> ScriptedDecoder:
    return ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, WORDS * 4), gate=gate, delay=delay))


async def test_n_takes_n_places_and_over_capacity_is_refused(tokenizer):
    gate = threading.Event()
    config = make_config(max_running=1, max_queue=2)
    async with running_app(config, scripted(tokenizer, gate)) as (app, client):
        body = {"prompt": "alpha", "max_tokens": 3}
        response = await client.post("/v1/completions", json={**body, "n": 4})  # 4 > 1 + 2 ever
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        first = asyncio.create_task(client.post("/v1/completions", json={**body, "n": 2}))
        await asyncio.sleep(0.2)
        assert app.state.runtime.worker.running + app.state.runtime.worker.waiting == 2
        full = await client.post("/v1/completions", json={**body, "n": 2})  # 2 + 2 > 3: all or none
        assert full.status_code == 429
        assert app.state.runtime.worker.running + app.state.runtime.worker.waiting == 2
        gate.set()
        data = (await first).json()
        assert [choice["index"] for choice in data["choices"]] == [0, 1]


async def test_a_disconnect_cancels_every_choice(tokenizer):
    decoder = scripted(tokenizer, delay=0.02)
    async with running_app(make_config(), decoder) as (app, _):
        disconnect = asyncio.Event()
        body = {"prompt": ["alpha", "bravo"], "n": 2, "max_tokens": 100, "stream": True}

        def on_send(message):
            if message["type"] == "http.response.body" and message.get("body", b"").count(b"data:") and \
                    not disconnect.is_set():
                disconnect.set()

        await asgi_post(app, "/v1/completions", body, disconnect, on_send)
        runtime = app.state.runtime
        deadline = asyncio.get_running_loop().time() + 10
        while runtime.worker.busy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert not runtime.worker.busy
    assert sorted(decoder.closed) == ["alpha", "alpha", "bravo", "bravo"]
    assert len(decoder.step_log) < 4 * 24  # they stopped early


@pytest.mark.real_model
async def test_each_sampled_choice_keeps_its_own_grammar(client):
    """n choices of a structured-output request each follow the schema (each stream has its own constraint)."""
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"], "additionalProperties": False}
    body = chat_body("Name a color as JSON.", n=2, temperature=1.0, seed=5, max_tokens=20,
                     response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert set(json.loads(choice["message"]["content"])) == {"color"}
