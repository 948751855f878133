"""The server as a GPU user starts it (``--config configs/cuda.yaml``: W=16 N=5 G=32, the recycled tree, the
static step in ``graphs`` mode, steps overlapped with their delivery), on the CPU: every bucket the start builds is
rehearsed (the capture's inputs, CUDA's code path and output strides), then a chat completion, a stream, a forced
tool call and ``n = 2`` are served through it with the official ``openai`` SDK, each greedy answer identical to the
plain autoregressive loop's, and the start's work (the shapes built, the step-cost curve measured) shows in
``/metrics``. The KV pool has 4 rows here (``--max-running 4``) instead of 32: the same shapes, an eighth of the
memory."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from openai import OpenAI

from server.spawn import ServerProcess, start_server
from tests.e2e.conftest import ROOT
from tests.e2e.test_openai_sdk import WEATHER_TOOL
from tests.hardening.live import scrape

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
MAX_TOKENS = 16  # a CUDA-preset step verifies ~100-400 tokens: slow on a CPU, so answers stay short
WARM_BUCKETS = 53  # decoding.forward.static.warm_buckets for the default model's 8192-token context


@pytest.fixture(scope="module")
def cuda_preset_server(tmp_path_factory) -> Iterator[ServerProcess]:
    # the payoff guard off: on this CPU the preset's ~200-token steps do not pay, so the guard would rightly rest
    # the lookahead whose path through the graphs this test walks
    flags = ("--config", str(ROOT / "configs" / "cuda.yaml"), "--device", "cpu", "--weights", "float32",
             "--weight-layout", "torch", "--max-running", "4", "--no-payoff-guard")
    # the start rehearses 53 buckets of up to 512 tokens: about a minute and a half on a 2-core CPU
    running = start_server(flags, tmp_path_factory.mktemp("cuda-preset") / "server.log", timeout=600, cwd=ROOT)
    yield running
    assert running.stop() == 0, running.log()


@pytest.fixture(scope="module")
def client(cuda_preset_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{cuda_preset_server.base_url}/v1", api_key="unused", timeout=300)


def ask(question: str, lookahead: bool = True, **fields) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"lookahead": {"enabled": lookahead}},
            **fields}


def test_the_start_rehearsed_every_bucket_and_serves_through_them(client, cuda_preset_server):
    assert "steps overlapped" in cuda_preset_server.log()  # the preset's overlap_steps: true, on this CPU too
    samples = scrape(cuda_preset_server.base_url)
    assert samples["lookahead_static_buckets"] >= WARM_BUCKETS
    assert samples["lookahead_static_capture_failures"] == 0
    # the CUDA preset prices drafts on the curve the server measured at start, one point per token bucket
    assert samples['lookahead_step_cost{tokens="1"}'] == 1.0 and 'lookahead_step_cost{tokens="512"}' in samples
    assert samples['lookahead_step_cost{tokens="512"}'] >= samples['lookahead_step_cost{tokens="2"}']
    answer = client.chat.completions.create(**ask("Write a python function that adds two numbers."))
    plain = client.chat.completions.create(**ask("Write a python function that adds two numbers.", lookahead=False))
    assert answer.choices[0].message.content == plain.choices[0].message.content
    decoding = answer.model_extra["decoding"]
    assert decoding["method"] == "lookahead" and decoding["window_size"] == 16 and decoding["steps"] < MAX_TOKENS
    samples = scrape(cuda_preset_server.base_url)
    assert samples['lookahead_forwards_total{path="graph"}'] > 0
    assert samples.get('lookahead_forwards_total{path="eager"}', 0) == 0


def test_a_stream_equals_the_whole_answer(client):
    fields = ask("Name three colors.")
    whole = client.chat.completions.create(**fields).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **fields, stream=True) if chunk.choices)
    assert streamed == whole and whole


def test_a_forced_tool_call(client):
    fields = ask("What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                 parallel_tool_calls=False)
    fields["max_tokens"] = 40
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    assert set(arguments) == {"city", "unit"}


def test_two_choices_decoded_side_by_side_equal_one(client):
    fields = ask("Count from one to five.")
    single = client.chat.completions.create(**fields).choices[0].message.content
    both = client.chat.completions.create(**fields, n=2).choices
    assert [choice.message.content for choice in both] == [single, single]
