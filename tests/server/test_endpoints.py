"""The request path's shape: each endpoint module alone looks at its request type, and a route only delegates.

``isinstance`` on a request type (``REQUEST_TYPES``) belongs to that type's endpoint module; anywhere else it is a
switch on the endpoint that the endpoint's own module should hold. A route handler in ``server/app.py`` parses,
delegates and answers in at most ``ROUTE_LINES`` lines. A request's decoding parameters are validated once, where
it is planned, off the event loop (the engine's ``add`` keeps the decoder's own guard, on the worker thread).
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, token_steps

SERVER = Path(__file__).resolve().parents[2] / "server"
REQUEST_TYPES = {  # request model -> the one module that may switch on it
    "ChatCompletionRequest": "chat.py",
    "CompletionRequest": "completions.py",
    "TokenizeRequest": "tokenization.py",
    "DetokenizeRequest": "tokenization.py",
    "CorpusRequest": "corpus.py",
    "ResponseRequest": "responses.py",
    "GenerationFields": "",  # the shared base: no module switches on it
}
ROUTE_LINES = 10
ROUTE_DECORATORS = {"get", "post", "put", "delete", "patch"}


def request_type_checks(source: str) -> list[tuple[int, str]]:
    """(line, type name) of each ``isinstance(..., T)`` (or a tuple of types) naming a request type in ``source``.

    >>> request_type_checks("isinstance(r, (str, CompletionRequest))\\nisinstance(r, protocol.TokenizeRequest)")
    [(1, 'CompletionRequest'), (2, 'TokenizeRequest')]
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for kind in kinds:
                name = kind.id if isinstance(kind, ast.Name) else getattr(kind, "attr", None)
                if name in REQUEST_TYPES:
                    found.append((node.lineno, name))
    return sorted(found)


def test_the_check_finds_a_switch_on_a_request_type():
    assert request_type_checks("def f(r):\n    return isinstance(r, ChatCompletionRequest)\n") == [
        (2, "ChatCompletionRequest")]
    assert request_type_checks("isinstance(r, ChatMessage)") == []


def test_only_an_endpoint_module_switches_on_its_request_type():
    offenders = {}
    for path in sorted(SERVER.rglob("*.py")):
        checks = [(line, name) for line, name in request_type_checks(path.read_text())
                  if REQUEST_TYPES[name] != str(path.relative_to(SERVER))]
        if checks:
            offenders[str(path.relative_to(SERVER))] = checks
    assert offenders == {}


def test_route_handlers_only_delegate():
    routes = {}
    for node in ast.walk(ast.parse((SERVER / "app.py").read_text())):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and any(
            isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) in ROUTE_DECORATORS
            for decorator in node.decorator_list
        ):
            routes[node.name] = node.end_lineno - node.lineno + 1
    assert len(routes) >= 8, routes  # the walk sees the routes
    assert {name: lines for name, lines in routes.items() if lines > ROUTE_LINES} == {}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body("hi", n=2, max_tokens=4)),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 4}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
])
async def test_a_request_is_validated_once_where_it_is_planned_off_the_event_loop(tokenizer, path, body):
    decoder = ScriptedDecoder(tokenizer, lambda prompt: Script(token_steps(tokenizer, [" one", " two"])))
    async with running_app(make_config(), decoder) as (_, client):
        loop_thread = threading.current_thread().name
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    choices = 4 if body.get("n") and "prompt" in body else body.get("n", 1)
    planned = [name for name in decoder.validated_on if name != "decode-worker"]
    assert len(planned) == choices and loop_thread not in planned  # once per choice, in the planning thread
    assert decoder.validated_on.count("decode-worker") == choices  # the engine's own guard at add


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_a_typed_body_is_read_as_json_whatever_its_content_type(tokenizer, content_type):
    """``curl -d`` sends a form content type: the body is still JSON to the server, as before typed bodies."""
    decoder = ScriptedDecoder(tokenizer, lambda prompt: Script(token_steps(tokenizer, [" one"])))
    headers = {"content-type": content_type} if content_type else {}
    async with running_app(make_config(), decoder) as (_, client):
        response = await client.post("/v1/completions", content=b'{"prompt": "a", "max_tokens": 2}', headers=headers)
        not_object = await client.post("/v1/completions", content=b'[1]', headers=headers)
    assert response.status_code == 200, response.text
    assert not_object.status_code == 400 and not_object.json()["error"]["message"] == (
        "The request body must be a JSON object.")


async def test_a_typed_body_is_read_only_once_the_request_is_authorized(tokenizer):
    """A client without the key learns nothing about its body: 401 before 413 or a 400."""
    async with running_app(make_config(api_key="k", max_request_bytes=1024), ScriptedDecoder(tokenizer, None)) as (
            _, client):
        large = await client.post("/v1/chat/completions", content=b"{" + b" " * 2000 + b"}")
        broken = await client.post("/tokenize", content=b"{")
        keyed = await client.post("/tokenize", content=b"{", headers={"authorization": "Bearer k"})
    assert (large.status_code, broken.status_code, keyed.status_code) == (401, 401, 400)
