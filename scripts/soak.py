"""Bounded soak test of lookahead-server, on loopback only.

Contract: ``python scripts/soak.py --duration 600 --concurrency 4`` starts ``python -m server`` on a free loopback
port (extra server flags through ``--server-arg``), or drives a running one with ``--base-url
http://127.0.0.1:PORT`` (its pid from ``--pid``, else found from the listening port). ``--concurrency`` workers
send one request after another for ``--duration`` seconds: chat and completions, streamed and not, greedy and
sampled, lookahead on and off, and deliberate bad requests (``--bad-share``, 5 %), each with the status it must get.

It reports requests served, statuses (deliberate and unexplained), p50/p99 latency (whole requests, and time to
first text of streams), throughput, and the server's resident memory at start, after the warm-up (the
baseline: the largest sample during the first ``--warmup`` seconds) and at the end (idle). Exit status 1 when
memory grew more than ``--max-memory-growth`` (default 10 %) over the baseline, when anything is unexplained
(a 5xx, an undeliberate 4xx, a transport error or timeout, a malformed stream, a greedy request whose text
differs from the first answer to the same request, server counters that disagree with what clients saw, a
traceback in the log or a non-zero exit of a server the script started), or when nothing was served; 2 for
bad arguments (a non-loopback URL, say); else 0. ``--report FILE`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a file: the server package lives in the repository root

from server.spawn import ServerProcess, start_server  # noqa: E402
from server.sse import data_events  # noqa: E402

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MODEL = "SmolLM2-135M-Instruct"
CHAT_PROMPTS = (
    "Name a fruit.", "What is 2 + 2?", "Say something about the moon.", "Give me three colors.",
    "Write a haiku about the sea.", "List the days of the week.", "What is the capital of France?",
    "Explain what a CPU does in one sentence.",
)
TEXT_PROMPTS = ("1, 2, 3, 4,", "def fibonacci(n):", "The quick brown fox", "Once upon a time", "import numpy as np\n")
MAX_TOKENS = (8, 16, 32)
ERROR_FIELDS = {"message", "type", "param", "code"}
MiB = 2**20


@dataclass(frozen=True)
class Plan:
    """One request: what to send and what must come back."""

    kind: str
    method: str
    path: str
    body: bytes | None
    stream: bool = False
    expect: int = 200
    greedy_key: str | None = None  # same key, same text (greedy requests only)
    lookahead: bool = True


@dataclass
class Tally:
    """Everything the workers observed."""

    statuses: Counter = field(default_factory=Counter)
    deliberate: Counter = field(default_factory=Counter)
    unexplained: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)
    served: int = 0
    completion_tokens: int = 0
    greedy: dict[str, str] = field(default_factory=dict)
    cross_method: dict[str, dict[bool, str]] = field(default_factory=dict)

    def fail(self, reason: str, detail: str) -> None:
        self.unexplained[reason] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{reason}: {detail[:300]}")


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def good_plan(rng: random.Random) -> Plan:
    """A valid request: chat or completion, stream or not, greedy or sampled, lookahead on or off."""
    is_chat = rng.random() < 0.6
    stream = rng.random() < 0.5
    greedy = rng.random() < 0.7
    lookahead = rng.random() < 0.7
    max_tokens = rng.choice(MAX_TOKENS)
    prompt = rng.choice(CHAT_PROMPTS if is_chat else TEXT_PROMPTS)
    fields: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream, "lookahead": {"enabled": lookahead}}
    if greedy:
        fields["temperature"] = 0
    else:
        fields.update(temperature=0.8, top_p=0.95)
        if rng.random() < 0.5:
            fields["seed"] = rng.randrange(2**31)
    body = chat(prompt, **fields) if is_chat else {"model": MODEL, "prompt": prompt, **fields}
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    kind = f"{'chat' if is_chat else 'text'}-{'stream' if stream else 'whole'}-{'greedy' if greedy else 'sample'}"
    key = f"{path}|{prompt}|{max_tokens}|{lookahead}" if greedy else None
    return Plan(kind, "POST", path, json.dumps(body).encode(), stream, 200, key, lookahead)


def bad_plan(rng: random.Random, max_request_bytes: int) -> Plan:
    """A deliberate bad request and the status it must get."""
    chat_path = "/v1/chat/completions"
    choices = [
        ("bad-json", "POST", chat_path, b'{"messages": [', 400),
        ("bad-temperature", "POST", chat_path, json.dumps(chat("Hi", temperature=5)).encode(), 400),
        ("bad-model", "POST", chat_path, json.dumps({**chat("Hi"), "model": "gpt-4o"}).encode(), 404),
        ("bad-stops", "POST", chat_path, json.dumps(chat("Hi", stop=[f"s{i}" for i in range(1025)])).encode(), 400),
        ("bad-surrogate", "POST", "/v1/completions", b'{"prompt": "\\ud800"}', 400),
        ("bad-nan", "POST", "/v1/completions", b'{"prompt": "Hi", "top_p": NaN}', 400),
        ("bad-method", "GET", chat_path, None, 405),
        ("bad-route", "GET", "/v1/nothing", None, 404),
    ]
    if rng.random() < 0.1:  # rarely: a body over the limit (1 MiB by default) costs the server little
        return Plan("bad-too-large", "POST", chat_path, b"{" + b" " * max_request_bytes + b"}", expect=413)
    kind, method, path, body, expect = rng.choice(choices)
    return Plan(kind, method, path, body, expect=expect)


def parse_stream(text: str) -> tuple[str, str | None]:
    """(text, a problem or None) of an SSE body: JSON events without an error, then ``[DONE]``."""
    events = data_events(text)
    if not events or events[-1] != "[DONE]":
        return "", f"stream did not end with [DONE]: {events[-2:]}"
    pieces: list[str] = []
    for event in events[:-1]:
        data = json.loads(event)
        if "error" in data:
            return "", f"error event: {event}"
        for choice in data.get("choices", []):
            pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(pieces), None


def whole_text(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def has_text(line: str) -> bool:
    """True for an SSE data line whose chunk carries completion text (not the role-only opening chunk)."""
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return False
    try:
        choices = json.loads(line[5:]).get("choices") or [{}]
    except ValueError:
        return False
    return bool(choices[0].get("text") or choices[0].get("delta", {}).get("content"))


async def send(client: httpx.AsyncClient, plan: Plan, headers: dict[str, str]) -> tuple[int, str, float | None]:
    """(status, body text, seconds to the first chunk with text of a stream)."""
    started = time.perf_counter()
    first: float | None = None
    lines: list[str] = []
    hdrs = {**headers, "content-type": "application/json"} if plan.body is not None else headers
    async with client.stream(plan.method, plan.path, content=plan.body, headers=hdrs) as response:
        async for line in response.aiter_lines():
            if first is None and plan.stream and has_text(line):
                first = time.perf_counter() - started
            lines.append(line)
    return response.status_code, "\n".join(lines), first


def judge(tally: Tally, plan: Plan, status: int, body: str) -> None:
    """Classify one answer; record text of greedy requests and flag mismatches."""
    tally.statuses[status] += 1
    if status != plan.expect:
        tally.fail(f"status {status}", f"{plan.kind} expected {plan.expect}: {body}")
        return
    if plan.expect != 200:
        tally.deliberate[f"{status} {plan.kind}"] += 1
        if set(json.loads(body).get("error", {})) != ERROR_FIELDS:
            tally.fail("no envelope", f"{plan.kind}: {body}")
        return
    if plan.stream:
        text, problem = parse_stream(body)
        if problem is not None:
            tally.fail("bad stream", f"{plan.kind}: {problem}")
            return
    else:
        data = json.loads(body)
        text = whole_text(data)
        tally.completion_tokens += data["usage"]["completion_tokens"]
    tally.served += 1
    check_greedy(tally, plan, text)


def check_greedy(tally: Tally, plan: Plan, text: str) -> None:
    """Same greedy request, same text; lookahead vs autoregressive kept apart (reported, not failed)."""
    if plan.greedy_key is None:
        return
    first = tally.greedy.setdefault(plan.greedy_key, text)
    if first != text:
        tally.fail("greedy mismatch", f"{plan.greedy_key}: {first!r} then {text!r}")
    method_free = plan.greedy_key.rsplit("|", 1)[0]
    tally.cross_method.setdefault(method_free, {}).setdefault(plan.lookahead, text)


async def worker(client: httpx.AsyncClient, tally: Tally, deadline: float, seed: int, args: argparse.Namespace,
                 headers: dict[str, str]) -> None:
    """Send requests one after another until the deadline."""
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        plan = bad_plan(rng, args.max_request_bytes) if rng.random() < args.bad_share else good_plan(rng)
        tally.kinds[plan.kind] += 1
        started = time.perf_counter()
        try:
            status, body, first = await send(client, plan, headers)
        except (httpx.HTTPError, OSError) as exc:
            tally.fail(f"transport {type(exc).__name__}", f"{plan.kind}: {exc!r}")
            continue
        if status == 200:
            tally.latencies.append(time.perf_counter() - started)
            if first is not None:
                tally.first_tokens.append(first)
        try:
            judge(tally, plan, status, body)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            tally.fail("malformed body", f"{plan.kind}: {exc!r}: {body}")


async def sample_memory(pid: int, samples: list[tuple[float, int]], stop: asyncio.Event, every: float) -> None:
    """Resident memory every ``every`` seconds until ``stop``."""
    started = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - started, psutil.Process(pid).memory_info().rss))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))], 4)


def scrape(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_idle(base_url: str, headers: dict[str, str], timeout: float = 120.0) -> dict[str, float]:
    """The metrics once nothing runs or waits (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base_url, headers)
        if samples.get("lookahead_requests_running") == 0 and samples.get("lookahead_requests_waiting") == 0:
            return samples
        if time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def counter_check(tally: Tally, before: dict[str, float], after: dict[str, float]) -> None:
    """The server's counters must agree with what the clients saw."""
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = grew('lookahead_requests_total{finish_reason="stop"}') + grew(
        'lookahead_requests_total{finish_reason="length"}')
    if finished != tally.served:
        tally.fail("metrics", f"server finished {finished:.0f} requests, clients were served {tally.served}")
    for reason in ("abort", "error"):
        count = grew(f'lookahead_requests_total{{finish_reason="{reason}"}}')
        if count:
            tally.fail("metrics", f"the server counted {count:.0f} requests ending with {reason}")


def pid_listening_on(port: int) -> int | None:
    """The pid of the process listening on a local TCP port (same user), if any."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            return connection.pid
    return None


def summarize(args: argparse.Namespace, tally: Tally, memory: list[tuple[float, int]], end_rss: int,
              elapsed: float) -> dict[str, Any]:
    """The report (figures only, no judgement)."""
    warm = [rss for seconds, rss in memory if seconds <= args.warmup] or [memory[0][1]]
    baseline = max(warm)
    cross = sum(1 for texts in tally.cross_method.values() if len(set(texts.values())) > 1)
    return {
        "duration_s": round(elapsed, 1), "concurrency": args.concurrency, "requests": sum(tally.kinds.values()),
        "served": tally.served, "throughput_rps": round(tally.served / elapsed, 3) if elapsed else 0.0,
        "completion_tokens_non_stream": tally.completion_tokens,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "deliberate_errors": dict(sorted(tally.deliberate.items())),
        "unexplained": dict(sorted(tally.unexplained.items())), "unexplained_examples": tally.examples,
        "latency_s": {"p50": percentile(tally.latencies, 0.5), "p99": percentile(tally.latencies, 0.99),
                      "max": round(max(tally.latencies), 4) if tally.latencies else None},
        "stream_first_text_s": {"p50": percentile(tally.first_tokens, 0.5),
                                "p99": percentile(tally.first_tokens, 0.99)},
        "kinds": dict(sorted(tally.kinds.items())),
        "greedy_keys": len(tally.greedy), "lookahead_vs_autoregressive_differences": cross,
        "memory_mib": {"start": round(memory[0][1] / MiB, 1), "baseline": round(baseline / MiB, 1),
                       "end": round(end_rss / MiB, 1), "growth_pct": round(100 * (end_rss - baseline) / baseline, 2)},
    }


async def run_load(args: argparse.Namespace, base_url: str, pid: int, headers: dict[str, str]) -> dict[str, Any]:
    """Drive the load and measure; returns the report (with ``unexplained`` filled in)."""
    tally = Tally()
    before = wait_idle(base_url, headers)
    memory: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(pid, memory, stop, 1.0))
    started = time.monotonic()
    deadline = started + args.duration
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client, tally, deadline, args.seed + n, args, headers)
                               for n in range(args.concurrency)))
    elapsed = time.monotonic() - started
    after = wait_idle(base_url, headers)
    await asyncio.sleep(1.0)
    stop.set()
    await sampler
    counter_check(tally, before, after)
    end_rss = psutil.Process(pid).memory_info().rss
    return summarize(args, tally, memory, end_rss, elapsed)


def verdict(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    problems = [f"{count} x {reason}" for reason, count in report["unexplained"].items()]
    if report["served"] == 0:
        problems.append("nothing was served")
    if report["memory_mib"]["growth_pct"] > 100 * args.max_memory_growth:
        problems.append(f"memory grew {report['memory_mib']['growth_pct']} % (limit {100 * args.max_memory_growth} %)")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (at most 86400)")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients (at most 256)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before the memory baseline "
                        "(default: 10 %% of the duration, at least 5)")
    parser.add_argument("--base-url", help="drive a running server (loopback only) instead of starting one")
    parser.add_argument("--pid", type=int, help="the running server's pid (default: found from the port)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for a started server")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20, help="the server's body limit")
    parser.add_argument("--bad-share", type=float, default=0.05, help="share of deliberate bad requests")
    parser.add_argument("--max-memory-growth", type=float, default=0.10, help="allowed growth over the baseline")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 86400 or not 1 <= args.concurrency <= 256:
        parser.error("--duration must lie in (0, 86400] and --concurrency in [1, 256]")
    if args.base_url and urlparse(args.base_url).hostname not in LOOPBACK:
        parser.error("--base-url must be a loopback address (127.0.0.1, localhost, ::1)")
    args.warmup = max(5.0, 0.1 * args.duration) if args.warmup is None else args.warmup
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server: ServerProcess | None = None
    log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    if args.base_url:
        base_url = args.base_url.rstrip("/")
        pid = args.pid or pid_listening_on(urlparse(base_url).port or 80)
        if pid is None:
            print("soak: cannot find the server's pid from its port; pass --pid", file=sys.stderr)
            return 2
    else:
        server = start_server(args.server_arg, log_path, timeout=300, cwd=ROOT)
        base_url, pid = server.base_url, server.process.pid
    try:
        report = asyncio.run(run_load(args, base_url, pid, headers))
    finally:
        if server is not None:
            server.stop(90)
    if server is not None:
        returncode = server.process.returncode
        report["server"] = {"exit_status": returncode, "log": str(log_path)}
        if returncode != 0:
            report["unexplained"]["server exit"] = returncode
        tracebacks = log_path.read_text(errors="replace").count("Traceback")
        if tracebacks:
            report["unexplained"]["tracebacks in the server log"] = tracebacks
    problems = verdict(report, args)
    report["passed"] = not problems
    print(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    for problem in problems:
        print(f"soak: FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
