"""Scheduling, isolation, cancellation, queue limits, readiness and drain, with a scripted stand-in decoder
(whose engine has ``decoding.BatchEngine``'s interface, so the worker runs its production loop).

The scripted decoder uses the real tokenizer, so text and token accounting are real; its steps are instant,
slowed by ``delay`` or held by a gate where a test needs a request to be in a given state.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from typing import Any

import pytest

from decoding import SamplingParams, StopCriteria
from server.jobs import Job
from server.metrics import Metrics
from server.plans import GenerationPlan, Output
from server.scheduler import Scheduler
from server.text import TextStream
from server.worker import Worker, WorkerStopped
from tests.server.conftest import make_config
from tests.server.helpers import (
    Script,
    ScriptedDecoder,
    asgi_post,
    disconnect_after,
    gated_loader,
    running_app,
    scrape,
    sse_events,
    token_steps,
    wait_for,
)

WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight", " nine", " ten"]


def decoder_with(tokenizer, scripts: dict[str, Script], default: Script | None = None) -> ScriptedDecoder:
    """A scripted decoder choosing the script whose key appears in the prompt."""
    fallback = default or Script(token_steps(tokenizer, WORDS[:3]))

    def script_for(text: str) -> Script:
        return next((script for key, script in scripts.items() if key in text), fallback)

    return ScriptedDecoder(tokenizer, script_for)


def completion(prompt: str, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": 64, "temperature": 0, **fields}


def aborted_and_disconnects(app) -> tuple[float, float]:
    samples = scrape(app)
    return samples['lookahead_requests_total{finish_reason="abort"}'], samples["lookahead_client_disconnects_total"]


async def test_worker_interleaves_running_jobs_round_robin(tokenizer):
    decoder = decoder_with(tokenizer, {})
    worker = Worker(max_running=2, engine=decoder.batch_engine())
    scheduler = Scheduler(worker, max_queue=4)
    handles = []
    for name in ("alpha", "bravo", "charlie"):
        ids = tokenizer.encode(name, add_special_tokens=False)
        plan = GenerationPlan(ids, StopCriteria(64), SamplingParams(), None, ())
        handles.append(scheduler.submit(plan, TextStream(lambda ids: tokenizer.decode(ids))))
    worker.start()  # all three are queued before the first round: alpha and bravo run, charlie waits
    try:
        results = [await handle.collect() for handle in handles]
    finally:
        worker.stop()
    assert decoder.step_log[:6] == [("alpha", 0), ("bravo", 0), ("alpha", 1), ("bravo", 1), ("alpha", 2), ("bravo", 2)]
    assert decoder.step_log[6:] == [("charlie", 0), ("charlie", 1), ("charlie", 2)]
    assert [text for text, _ in results] == [" one two three"] * 3
    assert all(isinstance(last, Output) and last.finish_reason == "length" for _, last in results)


async def test_a_new_request_does_not_wait_for_a_long_one(tokenizer):
    long = Script(token_steps(tokenizer, WORDS * 6), delay=0.01)
    decoder = decoder_with(tokenizer, {"alpha": long})
    async with running_app(make_config(), decoder) as (_, client):
        first = asyncio.create_task(client.post("/v1/completions", json=completion("alpha", max_tokens=200)))
        await wait_for(lambda: decoder.step_log, what="alpha's prefill")
        second = await client.post("/v1/completions", json=completion("bravo"))
        assert second.status_code == 200
        assert second.json()["choices"][0]["text"] == " one two three"
        assert ("alpha", len(long.steps) - 1) not in decoder.step_log  # alpha still running when bravo is done
        assert (await first).status_code == 200


async def test_failure_in_one_generation_fails_only_that_request(tokenizer):
    decoder = decoder_with(tokenizer, {"failme": Script(token_steps(tokenizer, WORDS[:5]), fail_at=2, delay=0.01)},
                           Script(token_steps(tokenizer, WORDS[:5]), delay=0.01))
    async with running_app(make_config(), decoder) as (app, client):
        bad, good, bad_stream = await asyncio.gather(
            client.post("/v1/completions", json=completion("failme")),
            client.post("/v1/completions", json=completion("fine")),
            client.post("/v1/completions", json=completion("failme", stream=True)),
        )
        assert bad.status_code == 500
        assert bad.json()["error"]["type"] == "server_error" and bad.json()["error"]["code"] == "internal_error"
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "".join(WORDS[:5])
        events = sse_events(bad_stream.text)
        assert bad_stream.status_code == 200 and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["type"] == "server_error"
        assert json.loads(events[0])["choices"][0]["text"] == " one"  # text before the failure was sent
        after = await client.post("/v1/completions", json=completion("fine again"))
        assert after.status_code == 200
        samples = scrape(app)
    assert samples['lookahead_requests_total{finish_reason="error"}'] == 2
    assert samples['lookahead_requests_total{finish_reason="length"}'] == 2
    assert sorted(decoder.closed).count("failme") == 2  # failed generators are closed


async def test_synchronous_decoder_error_is_a_500_envelope(tokenizer):
    decoder = decoder_with(tokenizer, {})
    decoder.raise_on_validate = RuntimeError("boom")
    async with running_app(make_config(), decoder) as (_, client):
        response = await client.post("/v1/completions", json=completion("x"))
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "The server had an error while processing your request.",
                                         "type": "server_error", "param": None, "code": "internal_error"}}


async def test_queue_full_is_429_with_retry_after(tokenizer):
    gate = threading.Event()
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS[:2]), gate=gate)})
    async with running_app(make_config(max_running=1, max_queue=1), decoder) as (app, client):
        runtime = app.state.runtime
        first = asyncio.create_task(client.post("/v1/completions", json=completion("alpha")))
        await wait_for(lambda: runtime.worker.running == 1, what="alpha running")
        second = asyncio.create_task(client.post("/v1/completions", json=completion("bravo")))
        await wait_for(lambda: runtime.worker.waiting == 1, what="bravo waiting")
        assert scrape(app)["lookahead_requests_waiting"] == 1
        third = await client.post("/v1/completions", json=completion("charlie"))
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["type"] == "rate_limit_error" and third.json()["error"]["code"] == "queue_full"
        gate.set()
        assert (await first).status_code == 200 and (await second).status_code == 200
        assert scrape(app)['lookahead_requests_rejected_total{reason="queue_full"}'] == 1


async def test_disconnect_while_queued_frees_the_slot(tokenizer):
    gate = threading.Event()
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS[:2]), gate=gate)})
    async with running_app(make_config(max_running=1, max_queue=1), decoder) as (app, client):
        runtime = app.state.runtime
        first = asyncio.create_task(client.post("/v1/completions", json=completion("alpha")))
        await wait_for(lambda: runtime.worker.running == 1, what="alpha running")
        disconnect = asyncio.Event()
        queued = asyncio.create_task(asgi_post(app, "/v1/completions", completion("bravo"), disconnect))
        await wait_for(lambda: runtime.worker.waiting == 1, what="bravo waiting")
        disconnect.set()
        await queued
        assert runtime.worker.waiting == 0  # freed at once, while alpha still holds the worker
        assert aborted_and_disconnects(app) == (1, 1)
        assert scrape(app)["lookahead_requests_waiting"] == 0
        gate.set()
        assert (await first).status_code == 200
    assert all(text != "bravo" for text, _ in decoder.step_log)  # bravo never ran


async def test_disconnect_mid_stream_cancels_and_counts_consistently(tokenizer):
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS * 5), delay=0.02)})
    async with running_app(make_config(), decoder) as (app, _):
        disconnect = asyncio.Event()
        await asgi_post(app, "/v1/completions", completion("alpha", stream=True, max_tokens=100), disconnect,
                        disconnect_after(3, disconnect))
        await wait_for(lambda: not app.state.runtime.worker.busy, what="worker idle")
        assert "alpha" in decoder.closed
        steps_run = len([1 for text, _ in decoder.step_log if text == "alpha"])
        assert 3 <= steps_run < 50
        samples = scrape(app)
    assert aborted_and_disconnects(app) == (1, 1)
    assert samples["lookahead_generation_tokens_total"] == steps_run  # one token per scripted word step
    assert samples["lookahead_decode_steps_total"] == steps_run
    assert samples["lookahead_requests_running"] == 0
    assert samples["lookahead_steps_per_token_count"] == 0  # per-request ratios only for finished requests


async def test_disconnect_during_prefill_of_a_non_streaming_request(tokenizer):
    gate = threading.Event()
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS), gate=gate, gate_steps=(0,))})
    async with running_app(make_config(), decoder) as (app, _):
        disconnect = asyncio.Event()
        call = asyncio.create_task(asgi_post(app, "/v1/completions", completion("alpha"), disconnect))
        await wait_for(lambda: app.state.runtime.worker.running == 1, what="alpha in prefill")
        disconnect.set()
        await asyncio.sleep(0.05)
        gate.set()  # the prefill finishes; the cancel flag stops the request before its next step
        await call
        await wait_for(lambda: not app.state.runtime.worker.busy, what="worker idle")
    assert [index for text, index in decoder.step_log if text == "alpha"] == [0]
    assert "alpha" in decoder.closed
    assert aborted_and_disconnects(app) == (1, 1)


async def test_health_before_ready_and_warmup_not_counted(tokenizer):
    decoder = decoder_with(tokenizer, {})
    release, slow_load = gated_loader(decoder)

    config = make_config(warmup=True)
    async with running_app(config, load_decoder=slow_load, wait_ready=False) as (app, client):
        health = await client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        busy = await client.post("/v1/completions", json=completion("x"))
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "service_unavailable"
        assert busy.headers["retry-after"] == "1"
        release.set()
        await wait_for(lambda: app.state.runtime.state == "ready", what="ready")
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert decoder.step_log  # the warm-up decode ran
        samples = scrape(app)
    assert samples['lookahead_requests_rejected_total{reason="not_ready"}'] == 1
    assert sum(v for k, v in samples.items() if k.startswith("lookahead_requests_total")) == 0
    assert samples["lookahead_generation_tokens_total"] == 0


async def test_drain_finishes_in_flight_work_and_refuses_new(tokenizer):
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS), delay=0.02)})
    async with running_app(make_config(), decoder) as (app, client):
        runtime = app.state.runtime
        in_flight = asyncio.create_task(client.post("/v1/completions", json=completion("alpha")))
        await wait_for(lambda: decoder.step_log, what="alpha started")
        drain = asyncio.create_task(runtime.drain(30))
        await wait_for(lambda: runtime.state == "draining", what="draining")
        assert (await client.get("/health")).status_code == 503
        refused = await client.post("/v1/completions", json=completion("bravo"))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
        done = await in_flight
        assert done.status_code == 200 and done.json()["choices"][0]["text"] == "".join(WORDS)
        await drain
        assert scrape(app)['lookahead_requests_rejected_total{reason="draining"}'] == 1


async def test_drain_grace_over_cancels_the_rest(tokenizer):
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS * 10), delay=0.02)})
    async with running_app(make_config(), decoder) as (app, client):
        streamed = asyncio.create_task(client.post("/v1/completions", json=completion("alpha", stream=True)))
        whole = asyncio.create_task(client.post("/v1/completions", json=completion("alpha")))
        await wait_for(lambda: len(decoder.step_log) >= 4, what="both started")
        await app.state.runtime.drain(0.1)
        response = await whole
        assert response.status_code == 503
        events = sse_events((await streamed).text)
        assert json.loads(events[-1])["error"]["code"] == "service_unavailable"
        assert scrape(app)['lookahead_requests_total{finish_reason="abort"}'] == 2


def test_metrics_registries_are_independent():
    first, second = Metrics(), Metrics()
    first.reject("queue_full")
    assert second.rejected.labels(reason="queue_full")._value.get() == 0


class HeldTokenizer:
    """The real tokenizer, except that encoding a text holding "HOLD" blocks until ``release`` is set."""

    def __init__(self, inner: Any, entered: threading.Event, release: threading.Event) -> None:
        self.inner, self.entered, self.release = inner, entered, release

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __deepcopy__(self, memo: dict) -> HeldTokenizer:
        return HeldTokenizer(copy.deepcopy(self.inner, memo), self.entered, self.release)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        if "HOLD" in text:
            self.entered.set()
            assert self.release.wait(30)
        return self.inner.encode(text, *args, **kwargs)


async def test_a_long_prompt_encode_does_not_stall_other_streams(tokenizer):
    """While one request's prompt is being tokenized (held here), a running stream still gets every chunk:
    the encode runs off the event loop, and the worker's detokenization does not wait for its lock."""
    entered, release = threading.Event(), threading.Event()
    scripts = {"alpha": Script(token_steps(tokenizer, WORDS), delay=0.02)}
    decoder = ScriptedDecoder(HeldTokenizer(tokenizer, entered, release), decoder_with(tokenizer, scripts).script_for)
    async with running_app(make_config(), decoder) as (_, client):
        streamed = asyncio.create_task(client.post("/v1/completions", json=completion("alpha", stream=True)))
        await wait_for(lambda: decoder.step_log, what="alpha started")
        held = asyncio.create_task(client.post("/v1/completions", json=completion("HOLD bravo")))
        try:
            await wait_for(entered.is_set, what="the held encode")
            response = await asyncio.wait_for(streamed, 20)
            assert not release.is_set() and not held.done()  # alpha finished while bravo's encode was held
        finally:
            release.set()
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1]) == "".join(WORDS)
        assert (await held).status_code == 200


def test_the_worker_registry_admits_a_request_all_or_none_within_its_limit():
    """Admission checks and queues under the registry's one lock: a request whose sequences would pass the
    limit is refused whole, nothing of it queued; without a limit (the warm-up) it always goes in."""
    plan = GenerationPlan(prompt_ids=[1], stop=StopCriteria(1, frozenset()), sampling=SamplingParams(),
                          lookahead=None, stop_strings=())
    worker = Worker(max_running=1)  # not started: jobs stay queued

    def jobs(count: int) -> list[Job]:
        return [Job(plan, TextStream(str), lambda item: None) for _ in range(count)]

    assert worker.submit_many(jobs(2), limit=3) and worker.waiting == 2
    assert not worker.submit_many(jobs(2), limit=3) and worker.waiting == 2  # 4 > 3: none of the two
    assert worker.submit_many(jobs(1), limit=3) and worker.waiting == 3
    assert worker.submit_many(jobs(5), limit=None) and worker.waiting == 8


async def test_a_worker_call_runs_on_the_worker_thread_and_reports_back(tokenizer):
    """``Worker.call``: an idle worker wakes for it; the function gets the engine on the decode thread, between
    iterations (while jobs run too); its result or exception comes back through the future; once the worker has
    stopped a call fails with ``WorkerStopped`` and nothing runs."""
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS), delay=0.01)})
    engine = decoder.batch_engine()
    worker = Worker(max_running=1, engine=engine)
    scheduler = Scheduler(worker, max_queue=2)
    worker.start()
    ran: list[str] = []

    def record(target: Any) -> str:
        assert target is engine
        ran.append(threading.current_thread().name)
        return "done"

    def fail(target: Any) -> None:
        raise ValueError("refused")

    try:
        assert await asyncio.wrap_future(worker.call(record)) == "done"  # idle: the call wakes the worker
        plan = GenerationPlan(tokenizer.encode("alpha", add_special_tokens=False), StopCriteria(64),
                              SamplingParams(), None, ())
        handle = scheduler.submit(plan, TextStream(lambda ids: tokenizer.decode(ids)))
        await wait_for(lambda: len(decoder.step_log) >= 2, what="the job running")
        assert await asyncio.wrap_future(worker.call(record)) == "done"  # between two of the job's steps
        with pytest.raises(ValueError, match="refused"):
            await asyncio.wrap_future(worker.call(fail))
        text, _ = await handle.collect()
    finally:
        worker.stop()
    assert ran == ["decode-worker", "decode-worker"] and text == "".join(WORDS)  # the job went on unharmed
    with pytest.raises(WorkerStopped):
        worker.call(record).result(timeout=1)
    assert len(ran) == 2
