"""CORS (``--allowed-origins``): off by default, preflights from allowed origins answered with what the ``openai``
JS SDK sends, other origins left without an allow-origin header, real answers (errors included) carrying it."""

from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from server.cli import build_config, build_parser
from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, token_steps

ORIGIN = "http://localhost:3000"
SDK_HEADERS = ("authorization, content-type, x-stainless-lang, x-stainless-package-version, x-stainless-os, "
               "x-stainless-arch, x-stainless-runtime, x-stainless-runtime-version, x-stainless-retry-count, "
               "x-stainless-timeout, openai-organization, openai-project")


def preflight(origin: str) -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": "POST", "access-control-request-headers": SDK_HEADERS}


@pytest.fixture
async def client():
    """An app with one allowed origin; the model never loads (preflights and /v1/models need none)."""
    app = create_app(make_config(allowed_origins=[ORIGIN]), load_decoder=lambda config: None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        yield client


async def test_preflight_from_an_allowed_origin_allows_the_sdk_headers(client):
    response = await client.options("/v1/chat/completions", headers=preflight(ORIGIN))
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    methods = {method.strip() for method in response.headers["access-control-allow-methods"].split(",")}
    assert {"GET", "POST", "OPTIONS"} <= methods
    allowed = {header.strip().lower() for header in response.headers["access-control-allow-headers"].split(",")}
    assert {header.strip() for header in SDK_HEADERS.split(",")} <= allowed


async def test_preflight_from_another_origin_gets_no_allow_origin(client):
    response = await client.options("/v1/chat/completions", headers=preflight("http://evil.example"))
    assert "access-control-allow-origin" not in response.headers
    response = await client.get("/v1/models", headers={"origin": "http://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


async def test_no_cors_headers_by_default():
    app = create_app(make_config(), load_decoder=lambda config: None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        response = await client.options("/v1/chat/completions", headers=preflight(ORIGIN))
        assert not any(name.startswith("access-control-") for name in response.headers)
        response = await client.get("/v1/models", headers={"origin": ORIGIN})
        assert not any(name.startswith("access-control-") for name in response.headers)


async def test_a_real_post_and_an_error_carry_the_header(tokenizer):
    decoder = ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one", " two"])))
    config = make_config(allowed_origins=[ORIGIN], api_key="k")
    async with running_app(config, decoder) as (_, client):
        headers = {"origin": ORIGIN, "authorization": "Bearer k"}
        response = await client.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=2), headers=headers)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN
        streamed = await client.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=2, stream=True),
                                     headers=headers)
        assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == ORIGIN
        refused = await client.post("/v1/chat/completions", json=chat_body("Hi"), headers={"origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_the_flag_takes_several_origins():
    args = build_parser().parse_args(["serve", "--allowed-origins", ORIGIN, "https://app.example", "--port", "1"])
    assert build_config(args).allowed_origins == [ORIGIN, "https://app.example"]
    assert make_config().allowed_origins == []
