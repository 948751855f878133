"""CORS in a real browser: headless Chromium on a page of another origin calls the live server with the headers
the ``openai`` JS SDK sends. From the allowed origin the preflight passes and the answer (streamed too) is
readable; from any other origin the browser blocks it. Skips, saying why, only when Chromium or its driver is
missing (``make test`` installs them)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from server.spawn import free_port
from tests.e2e.conftest import API_KEY, PAGE_PORT
from tests.e2e.test_playground_browser import browser  # noqa: F401  (the shared Chromium fixture)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
SDK_HEADERS = {"X-Stainless-Lang": "js", "X-Stainless-Package-Version": "5.0.0", "X-Stainless-OS": "Linux",
               "X-Stainless-Arch": "x64", "X-Stainless-Runtime": "browser:chrome",
               "X-Stainless-Runtime-Version": "140", "X-Stainless-Retry-Count": "0"}
FETCH = """
const [base, key, sdkHeaders, stream, done] = arguments;
fetch(base + "/v1/chat/completions", {
  method: "POST",
  headers: {...sdkHeaders, "Authorization": "Bearer " + key, "Content-Type": "application/json"},
  body: JSON.stringify({messages: [{role: "user", content: "Name a color."}], max_tokens: 8, temperature: 0, stream}),
}).then(async (response) => done({status: response.status, body: await response.text()}))
  .catch((error) => done({error: String(error)}));
"""


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b"<!doctype html><title>another origin</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pages() -> Iterator[dict[str, str]]:
    """Blank pages on two loopback origins: the one the session's server allows, and another."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", port), _Page) for port in (PAGE_PORT, free_port())]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {name: f"http://127.0.0.1:{server.server_address[1]}/"
           for name, server in zip(("allowed", "other"), servers, strict=True)}
    for server in servers:
        server.shutdown()


def fetch_from(browser, page: str, base_url: str, stream: bool) -> dict:  # noqa: F811
    browser.get(page)
    return browser.execute_async_script(FETCH, base_url, API_KEY, SDK_HEADERS, stream)


def test_the_allowed_origin_reads_answers_and_another_origin_is_blocked(browser, pages, server):  # noqa: F811
    answer = fetch_from(browser, pages["allowed"], server.base_url, False)
    assert answer.get("status") == 200, answer
    assert '"chat.completion"' in answer["body"]
    streamed = fetch_from(browser, pages["allowed"], server.base_url, True)
    assert streamed.get("status") == 200 and streamed["body"].rstrip().endswith("data: [DONE]"), streamed
    blocked = fetch_from(browser, pages["other"], server.base_url, False)
    assert "status" not in blocked and "Failed to fetch" in blocked["error"], blocked
