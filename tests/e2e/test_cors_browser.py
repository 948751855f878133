"""CORS in a real browser: headless Chromium on a page of another origin calls the live server with the headers
the ``openai`` JS SDK sends. From the allowed origin the preflight passes and the answer (streamed too) is
readable; from any other origin the browser blocks it. Skips, saying why, only when Chromium or its driver is
missing (``make test`` installs them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import API_KEY, page_server
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


@pytest.fixture(scope="module")
def pages(allowed_origin: str) -> Iterator[dict[str, str]]:
    """Blank pages on two loopback origins: the one the session's server allows, and another."""
    with page_server() as other:
        yield {"allowed": f"{allowed_origin}/", "other": f"{other}/"}


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
