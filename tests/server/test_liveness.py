"""Liveness (``/live``) apart from readiness (``/health``), and the KV-cache gauges a router reads, with the
scripted stand-in decoder."""

from __future__ import annotations

import asyncio
import threading

from tests.server.conftest import make_config
from tests.server.helpers import Script, gated_loader, running_app, scrape, token_steps, wait_for
from tests.server.test_scheduler import WORDS, completion, decoder_with


async def test_live_while_loading_and_ready_but_not_after_a_failed_start(tokenizer):
    decoder = decoder_with(tokenizer, {})
    release, slow_load = gated_loader(decoder)

    async with running_app(make_config(), load_decoder=slow_load, wait_ready=False) as (app, client):
        assert (await client.get("/health")).status_code == 503
        live = await client.get("/live")
        assert live.status_code == 200 and live.json() == {"status": "alive"}
        release.set()
        await wait_for(lambda: app.state.runtime.state == "ready", what="ready")
        assert (await client.get("/live")).status_code == 200

    def failing_load(config):
        raise RuntimeError("no such model")

    async with running_app(make_config(), load_decoder=failing_load, wait_ready=False) as (app, client):
        await wait_for(lambda: app.state.runtime.state == "failed", what="failed")
        live = await client.get("/live")
        assert live.status_code == 503 and live.json() == {"status": "failed"}
        assert (await client.get("/health")).json() == {"status": "failed"}


async def test_live_fails_when_the_worker_thread_is_gone(tokenizer):
    async with running_app(make_config(), decoder_with(tokenizer, {})) as (app, client):
        assert (await client.get("/live")).status_code == 200
        await asyncio.to_thread(app.state.runtime.worker.stop)
        assert (await client.get("/live")).status_code == 503


async def test_live_stays_open_with_protected_health(tokenizer):
    config = make_config(api_key="secret", protect_health=True)
    async with running_app(config, decoder_with(tokenizer, {})) as (app, client):
        assert (await client.get("/health")).status_code == 401
        assert (await client.get("/live")).status_code == 200
        assert "/live" not in app.openapi()["paths"]


async def test_kv_cache_gauges_follow_the_running_requests(tokenizer):
    gate = threading.Event()
    decoder = decoder_with(tokenizer, {"alpha": Script(token_steps(tokenizer, WORDS[:4]), gate=gate, gate_steps=(2,))})
    config = make_config(max_running=2)
    async with running_app(config, decoder) as (app, client):
        samples = scrape(app)
        assert samples["lookahead_kv_cache_capacity_tokens"] == 2 * decoder.context_length
        assert samples["lookahead_kv_cache_tokens"] == 0
        call = asyncio.create_task(client.post("/v1/completions", json=completion("alpha")))
        await wait_for(lambda: scrape(app)["lookahead_kv_cache_tokens"] > 0, what="tokens held")
        prompt_tokens = len(tokenizer("alpha")["input_ids"])
        held = scrape(app)["lookahead_kv_cache_tokens"]
        assert prompt_tokens < held <= prompt_tokens + 4  # the prompt and the tokens produced before the gate
        assert scrape(app)["lookahead_kv_cache_usage_ratio"] == held / (2 * decoder.context_length)
        gate.set()
        assert (await call).status_code == 200
        await wait_for(lambda: not app.state.runtime.worker.busy, what="idle")
        assert scrape(app)["lookahead_kv_cache_tokens"] == 0
