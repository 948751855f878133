"""Schemathesis against the live server, driven by its own ``/openapi.json``: bodies that fit the schema
(positive) and bodies that break it (negative), for every operation.

Checks on every response: no 5xx; the status is documented; content type and body conform to the schema;
documented headers (``Retry-After``) are present; schema-invalid bodies are refused with a 4xx; every 4xx
carries OpenAI's envelope; a stream is well formed (JSON events, then ``[DONE]``; on ``/v1/responses``
numbered events ending with the whole response). No hangs: each call has a timeout. The run is derandomized
(a fixed seed) and bounded; ``HARDENING_FUZZ_SCALE=10`` multiplies the number of cases for a longer local run.
Generations stay short: the live server's default ``max_tokens`` is 8 and larger requested values are capped
at ``TOKEN_CAP`` before sending (still schema-valid).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.sse import data_events
from tests.hardening.live import ERROR_FIELDS

pytestmark = pytest.mark.real_model
SCALE = int(os.environ.get("HARDENING_FUZZ_SCALE", "1"))
TOKEN_CAP = 4
GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
TIMEOUT_SECONDS = 60
CHECKS = [
    not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
    response_headers_conformance, negative_data_rejection,
]


def error_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx body is ``{"error": {"message", "type", "param", "code"}}`` with a message."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return None


def well_formed_stream(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 200 stream is JSON events without an error, ending with ``[DONE]``; a Responses stream's events are
    numbered from 0 and end with its ``response.completed`` (or ``response.incomplete``)."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream") or response.stream_cut_short:
        return None
    events = data_events(response.content.decode())
    if case.path == "/v1/responses":
        parsed = [json.loads(event) for event in events]
        assert [event["sequence_number"] for event in parsed] == list(range(len(parsed))), events[-3:]
        assert parsed[-1]["type"] in ("response.completed", "response.incomplete"), events[-3:]
        assert all(event["type"] != "error" for event in parsed), events
        return None
    assert events and events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        assert "error" not in json.loads(event), event
    return None


def cap_tokens(case: schemathesis.Case) -> None:
    """Lower a valid, large ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` to ``TOKEN_CAP``
    (keeps calls short)."""
    if not isinstance(case.body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = case.body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > TOKEN_CAP:
            case.body[name] = TOKEN_CAP


@pytest.fixture(scope="module")
def schema(live) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")


def fuzz(schema: Any, base_url: str, path: str, method: str, mode: GenerationMode, examples: int) -> Counter:
    """Run ``examples`` derandomized cases of one operation; return the statuses seen."""
    statuses: Counter = Counter()
    strategy = schema[path][method].as_strategy(generation_mode=mode)

    @settings(
        max_examples=examples * SCALE, derandomize=True, database=None, deadline=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        cap_tokens(case)
        response = case.call(base_url=base_url, timeout=TIMEOUT_SECONDS)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS, additional_checks=[error_envelope, well_formed_stream])

    run()
    return statuses


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_generation_routes_accept_valid_bodies(schema, live, path):
    statuses = fuzz(schema, live.base_url, path, "POST", GenerationMode.POSITIVE, 20)
    assert statuses[200] >= 5, statuses  # the fuzzer really reached the decoder
    # 400: only what no schema can say (context, content rules); 404: a previous_response_id never stored
    assert set(statuses) <= ({200, 400, 404} if path == "/v1/responses" else {200, 400}), statuses


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_generation_routes_refuse_invalid_bodies(schema, live, path):
    statuses = fuzz(schema, live.base_url, path, "POST", GenerationMode.NEGATIVE, 40)
    assert statuses and all(400 <= status < 500 for status in statuses), statuses


def test_the_corpus_route_refuses_invalid_bodies(schema, live):
    statuses = fuzz(schema, live.base_url, "/v1/memory/corpus", "POST", GenerationMode.NEGATIVE, 20)
    assert statuses and all(400 <= status < 500 for status in statuses), statuses


@pytest.mark.parametrize("path, examples", [("/v1/models", 3), ("/v1/models/{model_id}", 15), ("/health", 3),
                                            ("/metrics", 3), ("/v1/responses/{response_id}", 5),
                                            ("/v1/memory", 3)])
def test_read_routes(schema, live, path, examples):
    statuses = fuzz(schema, live.base_url, path, "GET", GenerationMode.POSITIVE, examples)
    assert statuses and set(statuses) <= {200, 404}, statuses  # 404: an unknown model id, or response id


def test_live_schema_bounds_token_ids_by_the_vocabulary(live):
    document = httpx.get(f"{live.base_url}/openapi.json", timeout=10).json()
    ids = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]
    assert ids == {"type": "integer", "minimum": 0, "maximum": 49151}  # SmolLM2's 49152 tokens
