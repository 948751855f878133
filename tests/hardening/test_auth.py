"""API keys: a live server with a keys file, ``--api-key`` and ``--protect-metrics`` at debug log level; every
``/v1/*`` route needs ``Authorization: Bearer <key>``, wrong or missing keys get 401 in OpenAI's envelope,
``/health`` stays open, ``/metrics`` is protected, and neither the keys nor a wrong key ever reach the log. The
checker compares every key every time; bad keys files stop the command before the model loads."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server import auth, cli
from server.auth import KeyChecker
from server.config import ServerConfig
from server.errors import AuthenticationError
from tests.e2e.conftest import ServerProcess, start_server
from tests.hardening.live import MODEL, assert_envelope, completion_body

FILE_KEYS = [f"sk-file-alpha-{secrets.token_hex(12)}", f"sk-file-bravo-{secrets.token_hex(12)}"]
FLAG_KEY = f"sk-flag-{secrets.token_hex(12)}"
WRONG_KEY = f"sk-wrong-{secrets.token_hex(12)}"
ROUTES = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
          ("POST", "/v1/completions", completion_body("Hi", max_tokens=1)),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
          ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 1})]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("auth")
    keys_file = folder / "keys.txt"
    keys_file.write_text(f"# team keys\n\n{FILE_KEYS[0]}\n   {FILE_KEYS[1]}   \n")
    server = start_server(folder / "server.log", "--api-keys-file", str(keys_file), "--api-key", FLAG_KEY,
                          "--protect-metrics", "--log-level", "debug", "--no-warmup")
    yield server
    assert server.stop() == 0


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.real_model
@pytest.mark.parametrize("key", [*FILE_KEYS, FLAG_KEY], ids=["file-alpha", "file-bravo", "flag"])
def test_every_configured_key_opens_every_route(keyed, key):
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        for method, path, body in ROUTES:
            response = client.request(method, path, json=body, headers=bearer(key))
            assert response.status_code == 200, (path, response.text)
        assert client.get("/metrics", headers=bearer(key)).status_code == 200
        lowercase = client.get("/v1/models", headers={"Authorization": f"bearer {key}"})
        assert lowercase.status_code == 200


@pytest.mark.real_model
@pytest.mark.parametrize("headers", [
    {}, bearer(WRONG_KEY), bearer(FILE_KEYS[0][:-1]), bearer(FILE_KEYS[0] + "x"), bearer(FILE_KEYS[0].upper()),
    {"Authorization": f"Basic {FLAG_KEY}"}, {"Authorization": "Bearer"}, {"Authorization": f"Bearer {FLAG_KEY} extra"},
    {"Authorization": FLAG_KEY}, {"X-Api-Key": FLAG_KEY},
], ids=["missing", "wrong", "prefix", "longer", "case", "basic", "bearer-only", "key-and-junk", "no-scheme",
        "other-header"])
def test_wrong_or_missing_keys_get_401_envelopes(keyed, headers):
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        for method, path, body in ROUTES:
            response = client.request(method, path, json=body, headers=headers)
            error = assert_envelope(response, 401)
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert all(key not in response.text for key in (*FILE_KEYS, FLAG_KEY, WRONG_KEY))
        assert_envelope(client.get("/metrics", headers=headers), 401)
        assert client.get("/health", headers=headers).status_code == 200  # open by default


@pytest.mark.real_model
def test_the_openai_sdk_authenticates(keyed):
    good = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=FILE_KEYS[1], max_retries=0)
    assert [model.id for model in good.models.list()] == [MODEL]
    wrong = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=WRONG_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=1)


@pytest.mark.real_model
def test_keys_never_reach_the_log(keyed):
    """Runs after the requests above (file order): the debug log saw every kind of request, with every key."""
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "stream": True}, headers=bearer(FLAG_KEY))
        client.get("/v1/models", headers=bearer(WRONG_KEY))
    log = keyed.log()
    assert '"GET /v1/models HTTP/1.1" 401' in log and '"GET /v1/models HTTP/1.1" 200' in log  # the log is real
    for key in (*FILE_KEYS, FLAG_KEY, WRONG_KEY):
        assert key not in log
        assert key[-12:] not in log  # not even a tail (OpenAI shows one; we show nothing)


async def test_protected_health_needs_a_key(real_model):
    from decoding import Decoder
    from tests.server.helpers import running_app

    config = ServerConfig(warmup=False, api_key=FLAG_KEY, protect_health=True)
    async with running_app(config, Decoder(real_model)) as (_, client):
        assert_envelope(await client.get("/health"), 401)
        assert (await client.get("/health", headers=bearer(FLAG_KEY))).status_code == 200
        assert (await client.get("/metrics")).status_code == 200  # only what is asked for is protected


def test_checker_compares_every_key_every_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    checker = KeyChecker(["first", "second", "third"])
    for token in ("first", "third", "nothing"):
        calls.clear()
        assert checker.matches(token) is (token != "nothing")
        assert len(calls) == 3  # no early exit on a match
        assert {len(a) for a, _ in calls} | {len(b) for _, b in calls} == {32}  # digests: lengths never differ
    with pytest.raises(AuthenticationError):
        checker.check("Bearer nothing")
    KeyChecker([]).check(None)  # no keys: open


def test_keys_file_parsing_and_errors(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n  one  \n\ntwo\n# three\n")
    config = ServerConfig(api_key="zero", api_keys_file=str(keys))
    assert auth.load_api_keys(config) == ("zero", "one", "two")
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(auth.ConfigError):
            auth.load_api_keys(ServerConfig(api_keys_file=str(path)))


@pytest.mark.parametrize("content", [None, "# only a comment\n"])
def test_bad_keys_file_exits_2_before_loading_the_model(tmp_path, capsys, content):
    path = Path(tmp_path / "keys")
    if content is not None:
        path.write_text(content)
    assert cli.main(["--api-keys-file", str(path), "--device", "cpu"]) == 2
    message = capsys.readouterr().err
    assert "keys file" in message
