"""The soak script: a short bounded run against the shared live server must pass (served requests, deliberate
errors answered as expected, nothing unexplained, memory within 10 %), and its judgement must be able to fail."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace

import pytest

from tests.scripts.module import ROOT, load_script, script_path

SCRIPT = script_path("soak")
SHORT_SECONDS = 25  # long enough for the 10 served requests the test asks and a memory trend

soak = load_script("soak")


@pytest.mark.real_model
@pytest.mark.slow
def test_short_soak_passes(live, tmp_path):
    report_path = tmp_path / "soak.json"
    command = [sys.executable, str(SCRIPT), "--base-url", live.base_url, "--pid", str(live.process.pid),
               "--duration", str(SHORT_SECONDS), "--concurrency", "3", "--bad-share", "0.2", "--warmup", "8",
               "--report", str(report_path)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SHORT_SECONDS + 240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    report = json.loads(report_path.read_text())
    print(json.dumps({key: report[key] for key in ("requests", "served", "statuses", "latency_s", "memory_mib")}))
    assert report["passed"] and report["unexplained"] == {}
    assert report["served"] >= 10 and report["deliberate_errors"]
    assert set(report["statuses"]) <= {"200", "400", "404", "405", "413"}
    assert report["latency_s"]["p50"] is not None and report["latency_s"]["p99"] >= report["latency_s"]["p50"]
    assert report["memory_mib"]["growth_pct"] < 10


def test_refuses_anything_but_loopback():
    finished = subprocess.run([sys.executable, str(SCRIPT), "--base-url", "http://192.0.2.1:8000"],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2 and "loopback" in finished.stderr


def plan(expect: int = 200, stream: bool = False, key: str | None = None, lookahead: bool = True):
    return soak.Plan("kind", "POST", "/v1/completions", b"{}", stream, expect, key, lookahead)


WHOLE = json.dumps({"choices": [{"text": "four"}], "usage": {"completion_tokens": 1}})


@pytest.mark.parametrize("status, body, expect, reason", [
    (500, '{"error": {"message": "m", "type": "t", "param": null, "code": null}}', 200, "status 500"),
    (429, '{"error": {"message": "m", "type": "t", "param": null, "code": null}}', 200, "status 429"),
    (200, WHOLE, 400, "status 200"),
    (400, '{"detail": "x"}', 400, "no envelope"),
])
def test_judge_flags_what_is_unexplained(status, body, expect, reason):
    tally = soak.Tally()
    soak.judge(tally, plan(expect), status, body)
    assert tally.unexplained == {reason: 1}


def test_judge_flags_bad_streams_and_greedy_mismatches():
    tally = soak.Tally()
    soak.judge(tally, plan(stream=True), 200, 'data: {"choices": [{"text": "a"}]}\n\n')  # no [DONE]
    soak.judge(tally, plan(stream=True), 200, 'data: {"error": {"message": "m"}}\n\ndata: [DONE]\n\n')
    soak.judge(tally, plan(key="k"), 200, WHOLE)
    soak.judge(tally, plan(stream=True, key="k"), 200, 'data: {"choices": [{"text": "four"}]}\n\ndata: [DONE]\n\n')
    soak.judge(tally, plan(key="k"), 200, WHOLE.replace("four", "five"))
    assert tally.unexplained == {"bad stream": 2, "greedy mismatch": 1}
    assert tally.served == 3


def test_verdict_fails_on_memory_growth_and_on_nothing_served():
    args = Namespace(max_memory_growth=0.10)
    report = {"unexplained": {}, "served": 5, "memory_mib": {"growth_pct": 10.5}}
    assert soak.verdict(report, args) == ["memory grew 10.5 % (limit 10.0 %)"]
    report = {"unexplained": {"status 500": 2}, "served": 0, "memory_mib": {"growth_pct": 0.0}}
    assert soak.verdict(report, args) == ["2 x status 500", "nothing was served"]


def test_percentile_is_nearest_rank():
    values = [float(n) for n in range(1, 101)]
    assert (soak.percentile(values, 0.5), soak.percentile(values, 0.99), soak.percentile([], 0.5)) == (50.0, 99.0, None)


def test_first_text_skips_the_role_chunk():
    assert not soak.has_text('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert soak.has_text('data: {"choices":[{"delta":{"content":"Hi"}}]}')
    assert soak.has_text('data: {"choices":[{"text":"Hi"}]}')
    assert not soak.has_text("data: [DONE]") and not soak.has_text(": ping")
