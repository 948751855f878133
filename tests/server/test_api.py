"""The HTTP API against the real default model, in-process: response shapes, streams, stop strings, metrics."""

from __future__ import annotations

import json

import pytest

from server.config import LookaheadSettings
from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, scrape, sse_events, token_steps

pytestmark = pytest.mark.real_model
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture
async def client(decoder):
    async with running_app(make_config(), decoder) as (_, client):
        yield client


async def test_chat_completion_shape(client):
    response = await client.post("/v1/chat/completions", json=chat_body("Say hello.", **GREEDY))
    assert response.status_code == 200
    data = response.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert isinstance(data["created"], int) and data["model"] == "SmolLM2-135M-Instruct"
    [choice] = data["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 12
    decoding = data["decoding"]
    assert decoding["method"] == "lookahead"
    defaults = LookaheadSettings()  # make_config's: the field defaults
    assert (decoding["window_size"], decoding["ngram_size"], decoding["guess_set_size"]) == (
        defaults.window_size, defaults.ngram_size, defaults.guess_set_size
    )
    assert 1 <= decoding["steps"] <= usage["completion_tokens"]
    assert decoding["tokens_per_step"] == pytest.approx(usage["completion_tokens"] / decoding["steps"], abs=1e-3)
    assert 0 <= decoding["accepted_tokens"] <= usage["completion_tokens"]
    for name, source in decoding["sources"].items():  # per candidate source; they overlap, so each is bounded only
        assert name in ("pool", "copy", "memory", "prediction") or name.isidentifier()
        assert 0 <= source["accepted_tokens"] <= min(source["offered_tokens"], decoding["accepted_tokens"])


async def test_lookahead_off_is_autoregressive_and_gives_the_same_greedy_text(client):
    body = chat_body("Name three colors.", **GREEDY)
    lookahead = (await client.post("/v1/chat/completions", json=body)).json()
    plain = (await client.post("/v1/chat/completions", json={**body, "lookahead": {"enabled": False}})).json()
    assert plain["decoding"]["method"] == "autoregressive"
    assert plain["decoding"]["window_size"] is None
    assert plain["decoding"]["steps"] == plain["usage"]["completion_tokens"]
    assert plain["decoding"]["sources"] == {}
    assert plain["choices"][0]["message"]["content"] == lookahead["choices"][0]["message"]["content"]


async def test_request_lookahead_values_are_used(client):
    body = chat_body("Count to five.", **GREEDY, lookahead={"window_size": 3, "ngram_size": 3, "guess_set_size": 2})
    data = (await client.post("/v1/chat/completions", json=body)).json()
    decoding = data["decoding"]
    assert (decoding["window_size"], decoding["ngram_size"], decoding["guess_set_size"]) == (3, 3, 2)


async def test_shared_memory_size_and_opt_out_reach_the_engine(tokenizer):
    """--memory-tokens reaches batch_engine; lookahead.shared_memory false reaches the request's LookaheadConfig."""
    decoder = ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one", " two"])))
    async with running_app(make_config(lookahead={"memory_tokens": 1234}), decoder) as (_, client):
        for lookahead in ({}, {"shared_memory": False}, {"shared_memory": True}):
            body = chat_body("Say hello.", **GREEDY, lookahead=lookahead)
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert decoder.memory_tokens == 1234
    assert [config.shared_memory for config in decoder.lookaheads] == [True, False, True]


async def test_the_memory_file_is_loaded_at_start_and_saved_once_at_shutdown(tokenizer, tmp_path):
    decoder = ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one"])))
    path = str(tmp_path / "memory.json.gz")
    async with running_app(make_config(lookahead={"memory_file": path}), decoder) as (_, client):
        assert (await client.post("/v1/chat/completions", json=chat_body("Hi.", **GREEDY))).status_code == 200
        assert decoder.memory_file == path and decoder.saved_memory == []  # nothing saved while serving
    assert decoder.saved_memory == [path]


async def test_without_a_memory_file_nothing_is_saved(tokenizer):
    decoder = ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one"])))
    async with running_app(make_config(), decoder) as (_, client):
        assert (await client.post("/v1/chat/completions", json=chat_body("Hi.", **GREEDY))).status_code == 200
    assert decoder.memory_file is None and decoder.saved_memory == []


async def test_chat_stream_chunk_sequence_with_usage(client):
    body = chat_body("Say hello.", **GREEDY, stream=True, stream_options={"include_usage": True})
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-2]
    assert content and all(c["choices"][0]["delta"].keys() == {"content"} for c in content)
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in content)
    final, usage_chunk = chunks[-2], chunks[-1]
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] >= 1
    assert usage_chunk["decoding"]["steps"] >= len(content)  # one content chunk per step at most
    assert "decoding" not in final


async def test_stream_without_usage_has_no_usage_chunk(client):
    body = chat_body("Say hello.", **GREEDY, stream=True)
    events = sse_events((await client.post("/v1/chat/completions", json=body)).text)
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


async def test_stream_and_non_stream_give_the_same_text(client):
    body = chat_body("Write one sentence about cats.", temperature=0, max_tokens=20)
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    streamed = sse_events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in streamed[:-1])
    assert text == whole["choices"][0]["message"]["content"]


async def test_stop_string_across_token_boundary_stream_equals_non_stream(client, tokenizer):
    body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 16}
    reference = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(reference, add_special_tokens=False)]
    # a stop string made of the end of one token and the start of the next
    boundary = next(i for i in range(1, len(pieces)) if len(pieces[i - 1].strip()) >= 2 and len(pieces[i]) >= 2)
    stop = pieces[boundary - 1][-2:] + pieces[boundary][:2]
    expected = reference[: reference.index(stop)]
    whole = (await client.post("/v1/completions", json={**body, "stop": [stop]})).json()
    streamed = sse_events((await client.post("/v1/completions", json={**body, "stop": stop, "stream": True})).text)
    chunks = [json.loads(e) for e in streamed[:-1]]
    assert whole["choices"][0]["text"] == expected
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] <= boundary + 1


async def test_completions_shape_and_token_prompt(client, tokenizer):
    body = {"prompt": "def fibonacci(n):", "temperature": 0, "max_tokens": 8}
    data = (await client.post("/v1/completions", json=body)).json()
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert data["choices"][0].keys() == {"index", "text", "logprobs", "finish_reason"}
    assert data["decoding"]["method"] == "lookahead"
    ids = tokenizer.encode("def fibonacci(n):")
    by_ids = (await client.post("/v1/completions", json={**body, "prompt": ids})).json()
    assert by_ids["choices"][0]["text"] == data["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


async def test_completions_stream_ends_with_usage_and_done(client):
    body = {"prompt": "Hello", "temperature": 0, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events((await client.post("/v1/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["object"] == "text_completion" and usage["decoding"]["steps"] <= 6


async def test_content_parts_and_developer_role(client):
    parts = chat_body("", **GREEDY)
    parts["messages"] = [
        {"role": "developer", "content": "You answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]},
    ]
    plain = chat_body("", **GREEDY)
    plain["messages"] = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Say hello."},
    ]
    a = (await client.post("/v1/chat/completions", json=parts)).json()
    b = (await client.post("/v1/chat/completions", json=plain)).json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


async def test_unknown_fields_are_ignored_and_model_may_be_omitted(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "user": "someone", "frobnicate": {"x": 1}, "response_format": {"type": "text"}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def test_max_tokens_clamped_to_the_context_when_omitted(decoder):
    """No max_tokens: min(default_max_tokens, context - prompt)."""
    async with running_app(make_config(default_max_tokens=3), decoder) as (_, client):
        body = chat_body("Tell me a long story.", temperature=0)
        data = (await client.post("/v1/chat/completions", json=body)).json()
        assert data["usage"]["completion_tokens"] == 3 and data["choices"][0]["finish_reason"] == "length"


async def test_models_list_and_retrieve(client):
    data = (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in data["data"]] == [
        ("SmolLM2-135M-Instruct", "model", "lookahead-server")
    ]
    assert (await client.get("/v1/models/SmolLM2-135M-Instruct")).json()["id"] == "SmolLM2-135M-Instruct"
    missing = await client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_served_model_name(decoder):
    async with running_app(make_config(served_model_name="smol"), decoder) as (_, client):
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["smol"]
        response = await client.post("/v1/chat/completions", json={**chat_body("Hi", **GREEDY), "model": "smol"})
        assert response.json()["model"] == "smol"


async def test_metrics_after_requests_are_consistent(decoder):
    async with running_app(make_config(), decoder) as (app, client):
        body = chat_body("List four animals.", temperature=0, max_tokens=16)
        one = (await client.post("/v1/chat/completions", json=body)).json()
        two = (await client.post("/v1/chat/completions", json={**body, "stop": ["\n"]})).json()
        await client.post("/v1/chat/completions", json={**body, "temperature": 9})  # rejected
        metrics_text = (await client.get("/metrics")).text
        samples = scrape(app)
    for name in (
        "prompt_tokens_total", "generation_tokens_total", "decode_steps_total", "draft_tokens_total",
        "accepted_tokens_total", "requests_total", "requests_rejected_total", "client_disconnects_total",
        "acceptance_rate_bucket", "steps_per_token_bucket", "tokens_per_step_bucket",
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "step_duration_seconds_bucket",
        "requests_running", "requests_waiting", "config_info", "accepted_tokens_per_position_total",
    ):
        assert f"lookahead_{name}" in metrics_text, name
    usages = [one["usage"], two["usage"]]
    assert samples["lookahead_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert samples["lookahead_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert samples["lookahead_decode_steps_total"] == one["decoding"]["steps"] + two["decoding"]["steps"]
    accepted = one["decoding"]["accepted_tokens"] + two["decoding"]["accepted_tokens"]
    assert samples["lookahead_accepted_tokens_total"] == accepted
    per_position = sum(v for k, v in samples.items() if k.startswith("lookahead_accepted_tokens_per_position_total"))
    assert per_position == accepted
    finished = sum(samples[f'lookahead_requests_total{{finish_reason="{r}"}}'] for r in ("stop", "length"))
    assert finished == 2
    assert samples['lookahead_requests_rejected_total{reason="invalid_request"}'] == 1
    assert samples["lookahead_time_to_first_token_seconds_count"] == 2
    assert samples["lookahead_steps_per_token_count"] == 2
    assert samples["lookahead_requests_running"] == 0 and samples["lookahead_requests_waiting"] == 0
    info = next(k for k in samples if k.startswith("lookahead_config_info"))
    assert f'window_size="{LookaheadSettings().window_size}"' in info
    assert 'model="SmolLM2-135M-Instruct"' in info and 'device="cpu"' in info
