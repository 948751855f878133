"""The playground page in headless Chromium against the real server, used as a person would use it.

One browser session: enter the API key, send a message with Enter, watch the answer stream with its stats and
highlighted multi-token steps; compare lookahead on and off side by side; start a long answer and press Stop,
then see the server count the abort. Needs Debian's ``chromium`` and ``chromium-driver`` (``make test`` installs
them) and the ``selenium`` package; skips, saying why, only when the browser or its driver is missing.
Screenshots go to a temporary folder, or to ``$LOOKAHEAD_SCREENSHOT_DIR`` (``docs/`` refreshes the README's).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import API_KEY

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900")
CHAT_PROMPT = "Write a JSON list of five fruits, each with a name and a color."
COMPARE_PROMPT = "Repeat the word hello ten times."
LONG_PROMPT = "Write a long story about a dragon who learns to paint."


def find_binary(names: tuple[str, ...]) -> str | None:
    return next((path for path in map(shutil.which, names) if path), None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through chromedriver, with a fresh profile; skipped when either binary is missing."""
    binary, driver_path = find_binary(BROWSERS), find_binary(DRIVERS)
    if binary is None or driver_path is None:
        pytest.skip(f"headless browser test needs Chromium and chromedriver (found browser={binary}, "
                    f"driver={driver_path}); install Debian packages chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = tempfile.mkdtemp(prefix="playground-profile-")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("LOOKAHEAD_SCREENSHOT_DIR")
    return Path(folder) if folder else tmp_path_factory.mktemp("screenshots")


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def by_id(driver: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def select_all(driver: Any, css: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def set_field(driver: Any, element_id: str, value: str) -> None:
    """Replace a field's value by typing, then leave it (fires ``change``)."""
    from selenium.webdriver.common.keys import Keys

    field = by_id(driver, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE, value, Keys.TAB)


def type_and_send(driver: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = by_id(driver, "message")
    box.click()
    box.send_keys(text, Keys.ENTER)


def answers(driver: Any) -> list[Any]:
    return select_all(driver, ".answer")


def stat(answer: Any, name: str) -> str:
    from selenium.webdriver.common.by import By

    return answer.find_element(By.CSS_SELECTOR, f'[data-stat="{name}"] b').text


def aborted_requests(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    match = re.search(r'^lookahead_requests_total\{finish_reason="abort"\} (\S+)$', metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_chat_compare_and_stop_in_the_browser(browser, server, shots):
    driver = browser
    driver.get(f"{server.base_url}/")
    assert "lookahead-server" in driver.title

    # The server wants a key: the page says so until one is entered.
    wait_until(lambda: "API key" in by_id(driver, "server-status").text, 60, "the page to ask for the API key")
    set_field(driver, "api-key", API_KEY)
    wait_until(lambda: by_id(driver, "server-status").text.startswith("ready"), 30, "models to load")
    assert by_id(driver, "model").get_attribute("value") == "SmolLM2-135M-Instruct"
    set_field(driver, "max-tokens", "100")

    # Shift+Enter is a new line, not a send.
    from selenium.webdriver.common.keys import Keys

    box = by_id(driver, "message")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert box.get_attribute("value") == "first line\nsecond line" and not answers(driver)
    box.send_keys(Keys.CONTROL, "a", Keys.DELETE)

    check_chat(driver, shots)
    check_compare(driver, shots)
    check_stop(driver, server.base_url)


def check_chat(driver: Any, shots: Path) -> None:
    """Enter sends; the answer streams; stats and highlighted multi-token steps appear."""
    type_and_send(driver, CHAT_PROMPT)
    wait_until(lambda: answers(driver) and answers(driver)[0].get_attribute("data-state") == "streaming", 60,
               "the answer to start streaming")
    answer = answers(driver)[0]
    wait_until(lambda: answer.get_attribute("data-state") == "done", 120, "the answer to finish")
    assert "name" in answer.text and "color" in answer.text
    tokens, steps = int(stat(answer, "tokens")), int(stat(answer, "steps"))
    assert 1 <= steps < tokens <= 100
    assert float(stat(answer, "tokens/step")) > 1.0 and stat(answer, "acceptance").endswith("%")
    assert float(stat(answer, "tok/s")) > 0
    multi = select_all(driver, ".answer .step.s2, .answer .step.s3, .answer .step.s4, .answer .step.s5")
    assert multi, "no highlighted multi-token step"
    assert all(int(span.get_attribute("data-tokens")) >= 2 for span in multi)
    assert by_id(driver, "window-size").get_attribute("placeholder").isdigit()  # the default, once reported
    save(driver, shots / "playground.png")


def check_compare(driver: Any, shots: Path) -> None:
    """Compare sends the prompt twice, lookahead then plain, and shows both stats side by side."""
    by_id(driver, "new-chat").click()
    by_id(driver, "compare").click()
    set_field(driver, "max-tokens", "48")
    type_and_send(driver, COMPARE_PROMPT)
    wait_until(lambda: len(answers(driver)) == 2 and all(a.get_attribute("data-state") == "done"
                                                          for a in answers(driver)), 120, "both answers")
    fast, slow = answers(driver)
    assert fast.text.splitlines()[0].startswith("lookahead") and slow.text.startswith("plain")
    assert int(stat(slow, "steps")) == int(stat(slow, "tokens"))  # one token per plain step
    assert int(stat(fast, "steps")) < int(stat(fast, "tokens"))
    comparison = wait_until(lambda: select_all(driver, ".comparison"), 10, "the comparison line")[0]
    assert "identical text" in comparison.text
    save(driver, shots / "compare.png")
    by_id(driver, "compare").click()


def check_stop(driver: Any, base_url: str) -> None:
    """Stop aborts the fetch: the answer says stopped, stops growing, and the server counts an abort."""
    by_id(driver, "new-chat").click()
    set_field(driver, "max-tokens", "400")
    before = aborted_requests(base_url)
    type_and_send(driver, LONG_PROMPT)
    wait_until(lambda: answers(driver) and len(answers(driver)[0].text) > 40, 60, "a long answer to stream")
    by_id(driver, "stop").click()
    answer = answers(driver)[0]
    wait_until(lambda: answer.get_attribute("data-state") == "stopped", 10, "the answer to show stopped")
    wait_until(lambda: aborted_requests(base_url) >= before + 1, 30, "the server to count the abort")
    text = answer.text
    time.sleep(1.0)
    assert answer.text == text and int(stat(answer, "tokens")) < 400
    assert by_id(driver, "send").is_enabled() and not by_id(driver, "stop").is_enabled()


def save(driver: Any, path: Path) -> None:
    """A screenshot, kept small (the README embeds them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.execute_script("document.querySelector('.settings').scrollTop = 0;")
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size < 300_000
