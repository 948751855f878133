"""The load-test script: its arithmetic on hand-made data, its request shapes, its loopback guard, and a tiny
``--spawn`` run against the real default model whose table and JSON must hold consistent counts."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from openai import AsyncOpenAI

from bench.datasets import DatasetError, PromptSpec, ensure_humaneval
from tests.scripts.module import ROOT, load_script, script_path

SCRIPT = script_path("loadtest")
TINY_MAX_TOKENS = 8

loadtest = load_script("loadtest")


# --- arithmetic -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "fraction", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 0.5, 2.5),  # order does not matter
    ([10.0, 20.0], 0.95, 19.5),
    ([0.0, 10.0, 20.0, 30.0, 40.0], 0.95, 38.0),
    ([7.0], 0.95, 7.0),
    ([3.0, 1.0, 2.0], 0.0, 1.0),
    ([3.0, 1.0, 2.0], 1.0, 3.0),
])
def test_percentile_interpolates_linearly(values, fraction, expected):
    assert loadtest.percentile(values, fraction) == pytest.approx(expected)


def test_percentile_of_nothing_is_none():
    assert loadtest.percentile([], 0.5) is None


@pytest.mark.parametrize(("chunks", "expected"), [
    ([], []),
    ([(1.0, 3)], []),  # the first text chunk only opens the clock: its tokens belong to the TTFT
    ([(1.0, 1), (1.1, 1), (1.4, 3), (1.5, 0)], [0.1, 0.1, 0.1, 0.1]),
    ([(0.0, 2), (0.2, 1), (0.5, 0), (0.8, 2)], [0.2, 0.3, 0.3]),  # a chunk without tokens does not restart it
    ([(0.0, 1), (0.4, 4)], [0.1, 0.1, 0.1, 0.1]),  # one lookahead step committing 4 tokens: 4 samples of gap/4
])
def test_token_gaps_split_each_chunk_gap_over_its_tokens(chunks, expected):
    assert loadtest.token_gaps(chunks) == pytest.approx(expected)


def result(failure=None, tokens=0, steps=0, method=None, ttft=None, itl=()):
    return loadtest.RequestResult(failure=failure, completion_tokens=tokens, steps=steps, method=method, ttft=ttft,
                                  itl=list(itl))


def test_summarize_level_counts_every_outcome_and_uses_only_served_requests():
    results = [
        result(tokens=8, steps=4, method="lookahead", ttft=0.1, itl=[0.05, 0.05]),
        result(tokens=4, steps=4, method="lookahead", ttft=0.3, itl=[0.15]),
        result(failure="429"), result(failure="503"), result(failure="503"), result(failure="error"),
    ]
    row = loadtest.summarize_level("chat", "on", 6, results, wall_seconds=2.0)
    assert (row.requests, row.rejected_429, row.rejected_503, row.errors) == (2, 1, 2, 1)
    assert row.completion_tokens == 12 and row.throughput == pytest.approx(6.0)
    assert row.tokens_per_step == pytest.approx(12 / 8)
    assert row.ttft_p50 == pytest.approx(0.2) and row.ttft_p95 == pytest.approx(0.29)
    assert row.itl_p50 == pytest.approx(0.05) and row.itl_p95 == pytest.approx(0.14)
    assert row.methods == ["lookahead"] and row.relative_throughput is None


def test_summarize_level_with_nothing_served_has_no_latencies():
    row = loadtest.summarize_level("humaneval", "off", 2, [result(failure="error")], wall_seconds=1.0)
    assert row.requests == 0 and row.errors == 1 and row.throughput == 0.0
    assert row.ttft_p50 is None and row.itl_p95 is None and row.tokens_per_step is None


def test_relative_throughput_is_against_the_lowest_level_of_the_same_set_and_mode():
    def row(prompt_set, mode, level, tokens):
        served = [result(tokens=tokens, steps=tokens, method="lookahead", ttft=0.1)]
        return loadtest.summarize_level(prompt_set, mode, level, served, wall_seconds=1.0)

    rows = loadtest.with_relative_throughput([
        row("chat", "on", 1, 10), row("chat", "on", 4, 25), row("chat", "off", 2, 8), row("chat", "off", 8, 4),
        row("humaneval", "on", 1, 0), row("humaneval", "on", 2, 5),
    ])
    assert [r.relative_throughput for r in rows] == pytest.approx([1.0, 2.5, 1.0, 0.5, None, None])


def test_markdown_table_has_a_header_a_rule_and_one_line_per_row():
    rows = loadtest.with_relative_throughput([
        loadtest.summarize_level("chat", mode, level, [result(tokens=8, steps=8, method="autoregressive")], 1.0)
        for mode in ("on", "off") for level in (2, 4)
    ])
    lines = loadtest.markdown_table(rows).splitlines()
    assert len(lines) == 2 + 4 and "x c2" in lines[0] and set(lines[1]) <= set("|-:")
    assert all(line.count("|") == len(loadtest.TABLE_HEADERS) + 1 for line in lines)
    assert lines[2].startswith("| chat | on | ar | 2 | 1 | 0 | 0 | 0 | 8 | 1.0 | 8.0 | 1.00 |")


# --- requests and arguments -------------------------------------------------------------------------------


def test_request_kwargs_send_lookahead_off_explicitly_and_on_as_the_server_default():
    code = PromptSpec(id="HumanEval/0", text="def add(a, b):\n")
    chat = PromptSpec(id="chat/0", messages=({"role": "user", "content": "Hi"},))
    off = loadtest.request_kwargs(code, "off", "m", 16)
    on = loadtest.request_kwargs(chat, "on", "m", 16)
    assert off["prompt"] == code.text and "messages" not in off
    assert on["messages"] == [{"role": "user", "content": "Hi"}] and "prompt" not in on
    assert off["extra_body"] == {"stream_steps": True, "lookahead": {"enabled": False}}
    assert on["extra_body"] == {"stream_steps": True}
    for kwargs in (on, off):
        assert kwargs["stream"] is True and kwargs["stream_options"] == {"include_usage": True}
        assert kwargs["temperature"] == 0 and kwargs["max_tokens"] == 16 and kwargs["model"] == "m"


def sse(*events: dict | str) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


CHAT_STREAM = sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hel"}}], "step": {"tokens": 1, "accepted": 0, "offered": 2}},
    {"choices": [{"index": 0, "delta": {"content": "lo there"}}], "step": {"tokens": 3, "accepted": 2, "offered": 2}},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "step": {"tokens": 0, "accepted": 0,
                                                                                 "offered": 0}},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
     "decoding": {"method": "lookahead", "steps": 3, "tokens_per_step": 1.33, "accepted_tokens": 2,
                  "offered_tokens": 4, "window_size": 2, "ngram_size": 4, "guess_set_size": 4}},
    "[DONE]",
)
ERROR = {"error": {"message": "busy", "type": "x", "param": None, "code": "queue_full"}}


async def stream_against(status: int, body: bytes) -> tuple[object, list[dict]]:
    """``stream_one`` of a chat prompt against a fake server answering ``status`` and ``body``; the result and
    the JSON bodies it sent."""
    sent: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        kind = "text/event-stream" if status == 200 else "application/json"
        return httpx.Response(status, content=body, headers={"content-type": kind})

    transport = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    client = AsyncOpenAI(base_url="http://127.0.0.1:1/v1", api_key="k", max_retries=0, http_client=transport)
    async with client:
        spec = PromptSpec(id="chat/0", messages=({"role": "user", "content": "Hi"},))
        return await loadtest.stream_one(client, spec, "off", "m", 8), sent


async def test_stream_one_takes_tokens_steps_and_method_from_the_server():
    outcome, sent = await stream_against(200, CHAT_STREAM)
    assert outcome.failure is None and outcome.completion_tokens == 4 and outcome.steps == 3
    assert outcome.method == "lookahead" and outcome.decoding["window_size"] == 2
    assert outcome.ttft is not None and outcome.ttft > 0
    assert len(outcome.itl) == 3  # the second text chunk's 3 tokens; the first chunk's token is the TTFT's
    assert sent == [{"messages": [{"role": "user", "content": "Hi"}], "model": "m", "max_tokens": 8, "stream": True,
                     "stream_options": {"include_usage": True}, "temperature": 0, "stream_steps": True,
                     "lookahead": {"enabled": False}}]


@pytest.mark.parametrize(("status", "body", "failure", "detail"), [
    (429, json.dumps(ERROR).encode(), "429", "HTTP 429"),
    (503, json.dumps(ERROR).encode(), "503", "HTTP 503"),
    (500, json.dumps(ERROR).encode(), "error", "HTTP 500"),
    (400, json.dumps(ERROR).encode(), "error", "HTTP 400"),
    (200, sse({"choices": [{"index": 0, "delta": {"content": "a"}}]}, ERROR), "error", "busy"),  # mid-stream
    (200, CHAT_STREAM.replace(b'"decoding"', b'"other"'), "error", "usage chunk"),
])
async def test_stream_one_counts_rejections_and_errors_apart(status, body, failure, detail):
    outcome, sent = await stream_against(status, body)
    assert outcome.failure == failure and detail in outcome.detail
    assert len(sent) == 1  # never retried behind the table's back


@pytest.mark.parametrize(("url", "loopback"), [
    ("http://127.0.0.1:8000/v1", True), ("http://127.8.9.10/v1", True), ("http://localhost:8000/v1", True),
    ("http://[::1]:8000/v1", True), ("http://192.0.2.1:8000/v1", False), ("http://10.0.0.1/v1", False),
    ("http://example.com/v1", False), ("http://127.0.0.1.example.com/v1", False), ("http://[::2]/v1", False),
    ("127.0.0.1:8000", False),
])
def test_is_loopback_url(url, loopback):
    assert loadtest.is_loopback_url(url) is loopback


def test_arguments_are_parsed_and_bad_lists_refused():
    args = loadtest.parse_args(["--spawn", "--concurrency", "1,2", "--lookahead", "off", "--sets", "chat",
                                "--server-arg=--max-running", "--server-arg=8"])
    assert args.concurrency == [1, 2] and args.lookahead == ["off"] and args.sets == ["chat"]
    assert args.server_arg == ["--max-running", "8"] and args.requests_per_client == 2 and args.max_tokens == 128
    for bad in (["--concurrency", "0,1"], ["--concurrency", "1,1"], ["--concurrency", "a"], ["--lookahead", "maybe"],
                ["--sets", "mmlu"], ["--max-tokens", "0"], []):
        with pytest.raises(SystemExit):
            loadtest.parse_args(["--spawn", *bad] if bad else bad)


def test_refuses_a_non_loopback_base_url():
    finished = subprocess.run([sys.executable, str(SCRIPT), "--base-url", "http://192.0.2.1:8000/v1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2 and "loopback" in finished.stderr
    assert finished.stdout == ""  # nothing was measured


# --- a tiny real run -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval_available() -> None:
    try:
        ensure_humaneval()
    except DatasetError as error:
        pytest.skip(f"HumanEval prompts unavailable: {error}")


@pytest.mark.real_model
@pytest.mark.slow
def test_tiny_spawned_run_reports_consistent_rows(tmp_path, humaneval_available):
    report_path = tmp_path / "loadtest.json"
    command = [sys.executable, str(SCRIPT), "--spawn", "--server-arg=--max-running", "--server-arg=2",
               "--concurrency", "1,2", "--requests-per-client", "1", "--max-tokens", str(TINY_MAX_TOKENS),
               "--limit", "2", "--json", str(report_path)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    report = json.loads(report_path.read_text())
    assert report["errors"] == []
    assert "--max-running 2" in report["header"]["server"] and "cores" in report["header"]["machine"]
    rows = report["rows"]
    keys = [(row["prompt_set"], row["mode"], row["concurrency"]) for row in rows]
    assert keys == [(s, m, c) for s in ("humaneval", "chat") for m in ("on", "off") for c in (1, 2)]
    for row in rows:
        assert row["requests"] == row["concurrency"]  # one request per client, all served
        assert row["rejected_429"] == row["rejected_503"] == row["errors"] == 0
        assert 0 < row["completion_tokens"] <= TINY_MAX_TOKENS * row["requests"]
        assert row["throughput"] > 0 and row["wall_seconds"] > 0
        assert row["throughput"] == pytest.approx(row["completion_tokens"] / row["wall_seconds"])
        assert row["eager_forwards"] is not None and row["eager_forwards"] >= 0  # read off the server's /metrics
        assert 0 < row["ttft_p50"] <= row["ttft_p95"] and 0 < row["itl_p50"] <= row["itl_p95"]
        assert row["tokens_per_step"] >= 1.0
        assert row["methods"] == (["lookahead"] if row["mode"] == "on" else ["autoregressive"])
        if row["concurrency"] == 1:
            assert row["relative_throughput"] == pytest.approx(1.0)
        else:
            assert row["relative_throughput"] > 0

    table = [line for line in finished.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the column names, then one line per row
    assert finished.stdout.startswith("**loadtest**") and "SmolLM2" in finished.stdout.splitlines()[0]
    for line, row in zip(table[1:], rows, strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[:2] == [row["prompt_set"], row["mode"]] and cells[3] == str(row["concurrency"])
        assert cells[8] == str(row["completion_tokens"])
