"""Overlapped steps (``server.worker``, ``batch.overlap_steps``): each step's results are delivered while the engine's
next step is in flight, with the same text as the serial loop; a stop string, a failure and a disconnect end their
request as they do serially, and nothing touches the engine while a step is in flight (the scripted engine and
``decoding.BatchEngine`` both raise if anything does)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from decoding import BatchEngine, BatchPolicy, LookaheadConfig, SamplingParams, StopCriteria
from server.plans import GenerationPlan, Output
from server.scheduler import Scheduler
from server.text import TextStream
from server.worker import Worker
from tests.server.conftest import make_config
from tests.server.helpers import (
    Script,
    ScriptedDecoder,
    asgi_post,
    disconnect_after,
    running_app,
    scrape,
    token_steps,
    wait_for,
)

WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight"]
OVERLAPPED = {"batch": {"overlap_steps": True}}


def scripted(tokenizer, scripts: dict[str, Script]) -> ScriptedDecoder:
    fallback = Script(token_steps(tokenizer, WORDS))
    return ScriptedDecoder(tokenizer, lambda text: next((s for key, s in scripts.items() if key in text), fallback))


async def run_jobs(worker: Worker, prompts: list[list[int]], decode, lookahead=None, max_tokens: int = 64,
                   stops: tuple[str, ...] = ()) -> list[str]:
    """Submit one job per prompt at once and return their texts (the worker started and stopped here)."""
    scheduler = Scheduler(worker, max_queue=len(prompts))
    handles = [scheduler.submit(GenerationPlan(prompt, StopCriteria(max_tokens), SamplingParams(), lookahead, stops),
                                TextStream(decode, stops)) for prompt in prompts]
    worker.start()
    try:
        results = [await handle.collect() for handle in handles]
    finally:
        worker.stop()
    assert all(isinstance(last, Output) and last.finish_reason is not None for _, last in results)
    return [text for text, _ in results]


async def test_each_step_is_delivered_while_the_next_one_is_in_flight(tokenizer):
    events: list[str] = []
    decoder = scripted(tokenizer, {})
    engine = decoder.batch_engine()
    launch, complete = engine.launch, engine.complete
    engine.launch = lambda: (events.append("launch"), launch())[1]
    engine.complete = lambda launched: (events.append("complete"), complete(launched))[1]
    worker = Worker(max_running=2, engine=engine, overlap=True)
    assert worker.overlapping
    original_post = Worker._consume

    def consume(self, job, step):
        events.append("deliver")
        return original_post(self, job, step)

    prompts = [tokenizer.encode(name, add_special_tokens=False) for name in ("alpha", "bravo")]
    try:
        Worker._consume = consume
        texts = await run_jobs(worker, prompts, tokenizer.decode)
    finally:
        Worker._consume = original_post
    serial = await run_jobs(Worker(max_running=2, engine=scripted(tokenizer, {}).batch_engine(), overlap=False),
                            prompts, tokenizer.decode)
    assert texts == serial == ["".join(WORDS)] * 2
    # every delivery but the last step's lies between a launch and its complete; the last step's follows it
    in_flight = False
    late = []
    for event in events:
        if event == "deliver":
            late.append(not in_flight)
        in_flight = {"launch": True, "complete": False}.get(event, in_flight)
    assert late.count(False) == 2 * (len(WORDS) - 1) and late[-2:] == [True, True] and sum(late) == 2
    assert events.count("launch") == events.count("complete") == len(WORDS)


async def test_the_engine_is_asked_only_when_it_says_it_is_asynchronous(tokenizer):
    engine = scripted(tokenizer, {}).batch_engine()
    assert not Worker(max_running=1, engine=engine).overlapping  # the scripted engine is synchronous (a CPU's)
    engine.asynchronous = True
    assert Worker(max_running=1, engine=engine).overlapping
    assert not Worker(max_running=1, engine=engine, overlap=False).overlapping


async def test_a_stop_string_ends_an_overlapped_request_after_the_step_in_flight(tokenizer, caplog):
    decoder = scripted(tokenizer, {})
    async with running_app(make_config(**OVERLAPPED), decoder) as (app, client):
        assert app.state.runtime.worker.overlapping
        caplog.set_level(logging.ERROR, logger="server.worker")
        response = await client.post("/v1/completions", json={"prompt": "alpha", "max_tokens": 64, "stop": [" four"]})
        stream = await client.post("/v1/completions", json={"prompt": "bravo", "max_tokens": 64, "stop": [" four"],
                                                              "stream": True})
        await wait_for(lambda: not app.state.runtime.worker.busy, what="worker idle")
        samples = scrape(app)
    assert response.json()["choices"][0]["text"] == " one two three"
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert '"text":" three"' in stream.text.replace(": ", ":") and " four" not in stream.text
    assert sorted(decoder.closed) == ["alpha", "bravo"]  # each left the engine once its step in flight was read
    assert not [record for record in caplog.records if "removing a request" in record.getMessage()]
    assert samples['lookahead_requests_total{finish_reason="stop"}'] == 2


async def test_a_failure_and_a_disconnect_end_only_their_overlapped_requests(tokenizer):
    decoder = scripted(tokenizer, {"failme": Script(token_steps(tokenizer, WORDS), fail_at=3, delay=0.01),
                                   "leave": Script(token_steps(tokenizer, WORDS * 4), delay=0.02)})
    async with running_app(make_config(**OVERLAPPED), decoder) as (app, client):
        disconnect = asyncio.Event()
        bad, good, _ = await asyncio.gather(
            client.post("/v1/completions", json={"prompt": "failme", "max_tokens": 64}),
            client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 64}),
            asgi_post(app, "/v1/completions", {"prompt": "leave", "max_tokens": 64, "stream": True}, disconnect,
                      disconnect_after(3, disconnect)))
        await wait_for(lambda: not app.state.runtime.worker.busy, what="worker idle")
        samples = scrape(app)
    assert bad.status_code == 500 and good.json()["choices"][0]["text"] == "".join(WORDS)
    assert samples['lookahead_requests_total{finish_reason="error"}'] == 1
    assert samples['lookahead_requests_total{finish_reason="abort"}'] == 1
    assert sorted(decoder.closed) == ["failme", "fine", "leave"]
    assert len([1 for text, _ in decoder.step_log if text == "leave"]) < len(WORDS) * 4


@pytest.mark.parametrize("lookahead", [None, LookaheadConfig(4, 4, 4)])
async def test_the_real_engine_overlapped_gives_the_serial_text(tiny_model, lookahead):
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [10, 11, 12, 13, 10, 11], [42, 3, 3, 3]]

    def decode(ids):
        return "".join(f"<{token}>" for token in ids)

    texts = {}
    for overlap in (False, True):
        worker = Worker(max_running=2, engine=BatchEngine(tiny_model, BatchPolicy()), overlap=overlap)
        assert worker.overlapping == overlap
        texts[overlap] = await run_jobs(worker, prompts, decode, lookahead, max_tokens=20, stops=("<7><9><5>",))
    assert texts[True] == texts[False] and all(texts[True])


@pytest.mark.parametrize("failing", ["launch", "complete"])
async def test_an_engine_failure_in_either_half_ends_every_running_request_and_the_worker_goes_on(tokenizer,
                                                                                                  failing):
    decoder = scripted(tokenizer, {})
    engine = decoder.batch_engine()
    real = getattr(engine, failing)
    calls = [0]

    def flaky(*args):
        calls[0] += 1
        if calls[0] == 3:  # the third step: both requests have delivered text
            if failing == "complete":
                real(*args)  # the step was read: nothing left in flight
            raise RuntimeError("the device failed")
        return real(*args)

    setattr(engine, failing, flaky)
    worker = Worker(max_running=2, engine=engine, overlap=True)
    scheduler = Scheduler(worker, max_queue=4)
    plans = [GenerationPlan(tokenizer.encode(name, add_special_tokens=False), StopCriteria(64), SamplingParams(), None,
                            ()) for name in ("alpha", "bravo")]
    handles = [scheduler.submit(plan, TextStream(tokenizer.decode)) for plan in plans]
    worker.start()
    try:
        for handle in handles:
            with pytest.raises(RuntimeError, match="the device failed"):
                await handle.collect()
        after = scheduler.submit(GenerationPlan(tokenizer.encode("charlie", add_special_tokens=False),
                                                StopCriteria(64), SamplingParams(), None, ()),
                                 TextStream(tokenizer.decode))
        text, last = await after.collect()
    finally:
        worker.stop()
    assert text == "".join(WORDS) and last.finish_reason == "length"  # the worker went on
    assert engine.in_flight is None and not engine.has_work
