"""The real server in a subprocess, driven by the official ``openai`` SDK, sync and async."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import API_KEY, start_server

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say something about the moon."]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def ask(content: str, **fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 16, **fields}


def test_models(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_sync_non_stream_and_stream_agree(client):
    response = client.chat.completions.create(**ask(PROMPTS[0]))
    choice = response.choices[0]
    assert response.id.startswith("chatcmpl-") and response.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens >= 1
    decoding = response.model_extra["decoding"]
    assert decoding["method"] == "lookahead" and 1 <= decoding["steps"] <= response.usage.completion_tokens

    chunks = list(client.chat.completions.create(**ask(PROMPTS[0]), stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}}


def test_streamed_tool_call_reassembles_into_the_whole_one(client):
    fields = {**ask("What is the weather in Paris?"), "max_tokens": 64, "tools": [WEATHER_TOOL],
              "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**fields)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**fields, stream=True):
        deltas = (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []
        for delta in deltas:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    expected = [(call.function.name, call.function.arguments) for call in whole.choices[0].message.tool_calls]
    assert [(call["name"], call["arguments"]) for call in calls.values()] == expected
    assert all(call["id"].startswith("call_") for call in calls.values())
    arguments = json.loads(expected[0][1])
    assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["city"], str)


class City(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(**ask("Give the capital of France as JSON.", max_tokens=48),
                                              response_format=City)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city


class CityFacts(BaseModel):
    """The issue's model: unbounded strings and a float, as a user writes it."""

    name: str
    country: str
    population_millions: float


@pytest.mark.parametrize("temperature", [None, 0])
@pytest.mark.parametrize("question", [
    "Give the capital of France as JSON.", "Tell me about Tokyo.", "What is the biggest city in Brazil?",
])
def test_parse_of_an_unbounded_model_finishes_within_96_tokens(client, question, temperature):
    """A strict schema from pydantic (closed, every field required) on the 135M model: the JSON closes and parses
    (the server's default temperature, seeded; and greedy)."""
    fields = ask(question, max_tokens=96, seed=7) | ({} if temperature is None else {"temperature": temperature})
    if temperature is None:
        del fields["temperature"]
    completion = client.chat.completions.parse(**fields, response_format=CityFacts)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, CityFacts) and completion.choices[0].finish_reason == "stop"


def test_completions_sync(client):
    response = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    assert response.object == "text_completion" and response.choices[0].text
    assert response.usage.completion_tokens == 8 or response.choices[0].finish_reason == "stop"


def test_completions_with_a_list_of_prompts(client):
    response = client.completions.create(model=MODEL, prompt=["The sky is", "Two plus two is"], max_tokens=4,
                                         temperature=0)
    assert [choice.index for choice in response.choices] == [0, 1]
    alone = client.completions.create(model=MODEL, prompt="Two plus two is", max_tokens=4, temperature=0)
    assert response.choices[1].text == alone.choices[0].text
    first = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    assert response.usage.prompt_tokens == first.usage.prompt_tokens + alone.usage.prompt_tokens
    assert response.usage.completion_tokens == first.usage.completion_tokens + alone.usage.completion_tokens


def test_completions_echo_logprobs_without_new_tokens(client):
    """lm-evaluation-harness' loglikelihood request shape."""
    response = client.completions.create(model=MODEL, prompt="The capital of France is Paris", echo=True,
                                         logprobs=1, max_tokens=0, temperature=0)
    [choice] = response.choices
    assert choice.text == "The capital of France is Paris" and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == response.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert response.usage.completion_tokens == 0


def test_chat_with_n_choices(client):
    response = client.chat.completions.create(**ask(PROMPTS[0], n=2, max_tokens=8))
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.choices[0].message.content == response.choices[1].message.content  # greedy
    one = client.chat.completions.create(**ask(PROMPTS[0], max_tokens=8))
    assert response.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert response.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_lookahead_extension_through_extra_body(client):
    response = client.chat.completions.create(
        **ask(PROMPTS[1]), extra_body={"lookahead": {"window_size": 3, "ngram_size": 3, "guess_set_size": 2}}
    )
    decoding = response.model_extra["decoding"]
    assert (decoding["window_size"], decoding["ngram_size"], decoding["guess_set_size"]) == (3, 3, 2)
    plain = client.chat.completions.create(**ask(PROMPTS[1]), extra_body={"lookahead": {"enabled": False}})
    assert plain.model_extra["decoding"]["method"] == "autoregressive"
    assert plain.choices[0].message.content == response.choices[0].message.content


def test_bad_input_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**ask("Hi", temperature=5))
    assert error.value.status_code == 400 and error.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ask("Hi"), extra_body={"lookahead": {"window_size": 1000}})
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**ask("Hi", n=9))  # over max_n
    assert error.value.body["param"] == "n"


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(**{**ask("Hi"), "model": "gpt-4o"})
    assert error.value.code == "model_not_found"


def test_wrong_api_key_raises_authentication_error(server):
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


async def test_async_stream_with_usage(async_client):
    stream = await async_client.chat.completions.create(
        **ask(PROMPTS[2]), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].model_extra["decoding"]["steps"] >= 1
    assert all(chunk.usage is None for chunk in chunks[:-1])
    whole = await async_client.chat.completions.create(**ask(PROMPTS[2]))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content


async def test_concurrent_streams_match_sequential_greedy_text(async_client):
    sequential = []
    for prompt in PROMPTS:
        response = await async_client.chat.completions.create(**ask(prompt))
        sequential.append(response.choices[0].message.content)

    async def stream(prompt: str) -> str:
        chunks = await async_client.chat.completions.create(**ask(prompt), stream=True)
        return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks])

    concurrent = await asyncio.gather(*(stream(prompt) for prompt in PROMPTS))
    assert list(concurrent) == sequential


def test_sigterm_drains_in_flight_stream_and_exits_zero(tmp_path):
    server = start_server(tmp_path / "drain.log", "--no-warmup")
    try:
        with httpx.Client(timeout=120) as http:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True}
            with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert '"text"' in first
                server.process.send_signal(15)  # SIGTERM mid-stream
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the in-flight stream finished
        assert '"finish_reason":"length"' in rest[-2]
        assert server.process.wait(60) == 0, server.log()
        assert "draining" in server.log()
    finally:
        server.stop()
