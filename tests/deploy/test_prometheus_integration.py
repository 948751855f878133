"""A real Prometheus scrapes the real server and answers acceptance rate and steps per token.

Starts ``python -m server`` (the default model) on a free loopback port, sends a few greedy chat
completions so lookahead steps happen, then starts the ``prometheus`` binary (Debian package ``prometheus``)
scraping it every second, and reads the series back through Prometheus' HTTP query API. Skips, with the
reason, only when no ``prometheus`` binary is installed. Every wait has a deadline; both processes are
stopped (SIGTERM, then SIGKILL) whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from server.spawn import ServerStartError, free_port, start_server
from tests.deploy import promql
from tests.deploy.conftest import ROOT
from tests.deploy.test_dashboard import ISSUE_4_SERIES, readme_queries

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPTS = [
    "Count from 1 to 30, separated by commas.",
    "List the days of the week, then list them again.",
    "Count from 1 to 30, separated by commas.",
]
MAX_TOKENS = 16
SERVER_START_SECONDS = 90
PROMETHEUS_START_SECONDS = 30
SERIES_SECONDS = 45
ACCEPTANCE_RATE = "sum(lookahead_acceptance_rate_sum) / sum(lookahead_acceptance_rate_count)"
STEPS_PER_TOKEN = "sum(lookahead_steps_per_token_sum) / sum(lookahead_steps_per_token_count)"
ACCEPTANCE_RATE_RATE = "sum(rate(lookahead_accepted_tokens_total[1m])) / sum(rate(lookahead_draft_tokens_total[1m]))"


@dataclass
class Process:
    """A child process, its log file and a name for messages."""

    name: str
    popen: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        """The end of the process' combined output."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def assert_running(self) -> None:
        """Fail with the log tail when the process has exited."""
        if self.popen.poll() is not None:
            pytest.fail(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")


def start(name: str, command: list[str], log: Path, env: dict[str, str] | None = None) -> Process:
    """Start ``command`` in its own process group with stdout and stderr going to ``log``."""
    with open(log, "wb") as sink:
        popen = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
            start_new_session=True,
        )  # fmt: skip
    return Process(name, popen, log)


def stop(process: Process, grace_seconds: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited within ``grace_seconds``."""
    if process.popen.poll() is not None:
        return
    os.killpg(process.popen.pid, signal.SIGTERM)
    try:
        process.popen.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait(timeout=10)


def wait_for(what: str, check: Callable[[], Any], seconds: float, process: Process | None = None) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``seconds`` or if ``process`` dies."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None:
            process.assert_running()
        try:
            result = check()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        time.sleep(0.5)
    tail = f"\n{process.name} log:\n{process.log_tail()}" if process else ""
    pytest.fail(f"timed out after {seconds:.0f} s waiting for {what}{tail}")


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """The prometheus executable; skip the module when it is not installed."""
    binary = shutil.which("prometheus") or next(
        (path for path in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if os.access(path, os.X_OK)), None
    )
    if binary is None:
        reason = "prometheus binary not found (install the Debian package: apt-get install -y prometheus)"
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return binary


@pytest.fixture(scope="module")
def server(prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real server on a free loopback port, ready (GET /health 200); yields its base URL."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    try:
        running = start_server(log_path=log, timeout=SERVER_START_SECONDS, cwd=ROOT)
    except ServerStartError as error:
        pytest.fail(str(error))
    try:
        yield running.base_url
    finally:
        running.stop(15)


def chat(base: str, prompt: str) -> dict:
    """One greedy, non-streaming chat completion."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def completions(server: str) -> list[dict]:
    """A few completions, sent before Prometheus starts (their counters are already in the first scrape)."""
    return [chat(server, prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def prometheus(
    prometheus_binary: str, server: str, completions: list[dict], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Prometheus scraping the server every second, with its first scrape done; yields its base URL."""
    directory = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "lookahead-server", "static_configs": [{"targets": [server.split("//")[1]]}]}],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        prometheus_binary,
        f"--config.file={directory / 'prometheus.yml'}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    process = start("prometheus", command, directory / "prometheus.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("Prometheus /-/ready", lambda: httpx.get(f"{base}/-/ready", timeout=5).status_code == 200,
                 PROMETHEUS_START_SECONDS, process)  # fmt: skip
        wait_for("the first scrape", lambda: query(base, "lookahead_steps_per_token_count"), SERIES_SECONDS, process)
        yield base
    finally:
        stop(process)


def query(base: str, expr: str) -> list[dict]:
    """Evaluate ``expr`` now through /api/v1/query; the result vector (fails on a query error)."""
    response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    payload = response.json()
    assert payload["status"] == "success", f"{expr}: {payload.get('error')}"
    return payload["data"]["result"]


def scalar(base: str, expr: str) -> float:
    """The single value of ``expr``, waiting (bounded) until Prometheus has it."""
    result = wait_for(f"a value for {expr}", lambda: query(base, expr), SERIES_SECONDS)
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_acceptance_rate_and_steps_per_token_through_the_query_api(prometheus: str, completions: list[dict]) -> None:
    """Both per-request ratios come back from Prometheus, in (0, 1], matching what the responses reported."""
    acceptance_rate = scalar(prometheus, ACCEPTANCE_RATE)
    steps_per_token = scalar(prometheus, STEPS_PER_TOKEN)
    assert 0 < acceptance_rate <= 1
    assert 0 < steps_per_token <= 1
    reported = [c["decoding"]["steps"] / c["usage"]["completion_tokens"] for c in completions]
    assert steps_per_token == pytest.approx(sum(reported) / len(reported), rel=1e-6)
    generated = scalar(prometheus, "sum(lookahead_generation_tokens_total)")
    assert generated == sum(c["usage"]["completion_tokens"] for c in completions)


def test_the_rate_form_and_every_issue_4_series(prometheus: str, server: str) -> None:
    """After one more request the README's rate() form has a value, and every issue-4 series was scraped."""
    chat(server, PROMPTS[0])
    rate = wait_for(
        ACCEPTANCE_RATE_RATE,
        lambda: [r for r in query(prometheus, ACCEPTANCE_RATE_RATE) if float(r["value"][1]) > 0],
        SERIES_SECONDS,
    )
    assert 0 < float(rate[0]["value"][1]) <= 1
    names = {r["metric"]["__name__"] for r in query(prometheus, '{__name__=~"lookahead_.+"}')}
    assert sorted(set(ISSUE_4_SERIES) - names) == []


def test_every_dashboard_query_evaluates(prometheus: str, dashboard: dict) -> None:
    """Each dashboard expression, Grafana variables filled in, runs on the real Prometheus and returns data."""
    empty = []
    for owner, expr in promql.dashboard_queries(dashboard):
        if not query(prometheus, promql.substitute_grafana_variables(expr)):
            empty.append(f"{owner}: {expr}")
    assert empty == [], json.dumps(empty, indent=1)


def test_readme_queries_evaluate(prometheus: str) -> None:
    """The README's PromQL runs on the real Prometheus and returns data."""
    assert [expr for _, expr in readme_queries() if not query(prometheus, expr)] == []


def test_the_autoscaling_query_selects_the_server(prometheus: str) -> None:
    """KEDA's trigger (docker/k8s/scaledobject.yaml) selects the scraped server's series (``job`` included) and
    evaluates to one number: the requests waiting, none while idle."""
    manifest = yaml.safe_load((ROOT / "docker" / "k8s" / "scaledobject.yaml").read_text())
    (trigger,) = manifest["spec"]["triggers"]
    result = query(prometheus, trigger["metadata"]["query"])
    assert len(result) == 1 and float(result[0]["value"][1]) == 0, result
