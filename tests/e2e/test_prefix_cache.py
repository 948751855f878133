"""The prefix cache through the real server and the official ``openai`` SDK: a 3-turn chat whose later turns report
``prompt_tokens_details.cached_tokens`` and answer exactly as with the cache off (``cache_prompt: false``); the
Responses API's ``previous_response_id`` reuses it without any client change; the metrics count it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["Name three colors of the rainbow.", "Which of them is the warmest?", "Write one sentence about it."]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, cache_prompt: bool) -> list[tuple[str, int, int]]:
    """The three turns, each prompt the whole conversation so far: (text, prompt tokens, cached tokens) each."""
    messages: list[dict[str, str]] = []
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                  extra_body={"cache_prompt": cache_prompt})
        text = response.choices[0].message.content
        details = response.usage.prompt_tokens_details
        turns.append((text, response.usage.prompt_tokens, details.cached_tokens))
        messages.append({"role": "assistant", "content": text})
    return turns


def test_a_three_turn_chat_reuses_its_prefix_and_answers_as_without(client):
    off = chat(client, cache_prompt=False)
    on = chat(client, cache_prompt=True)
    assert [turn[0] for turn in on] == [turn[0] for turn in off]  # the same text, turn by turn
    assert all(turn[2] == 0 for turn in off)
    assert on[1][2] > 0 and on[2][2] > 0
    assert all(cached < prompt for _, prompt, cached in on)  # the last prompt token always runs
    assert on[2][2] > on[1][2]  # turn 3 reuses turn 2's prompt and answer too


def test_streamed_usage_and_completions_report_cached_tokens(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt + "Again:", max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details is not None


def test_previous_response_id_reuses_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input="Tell me a fact about the sea.", temperature=0,
                                    max_output_tokens=32)
    second = client.responses.create(model=MODEL, input="Tell me another.", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=32)
    assert second.usage.input_tokens_details.cached_tokens > 0
    plain = client.responses.create(model=MODEL, input="Tell me another.", previous_response_id=first.id,
                                    temperature=0, max_output_tokens=32, extra_body={"cache_prompt": False})
    assert plain.usage.input_tokens_details.cached_tokens == 0 and plain.output_text == second.output_text
    metrics = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    hits = next(line for line in metrics.splitlines() if line.startswith("lookahead_prefix_cache_hits_total"))
    assert float(hits.split()[-1]) > 0
    assert "lookahead_prefix_cache_bytes" in metrics


def test_cache_prompt_must_be_a_boolean(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"cache_prompt": "sometimes"})
