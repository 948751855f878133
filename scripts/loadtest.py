"""Load test of lookahead-server with many concurrent streaming clients (issue #6), on loopback only.

Contract: ``python scripts/loadtest.py --spawn`` starts ``python -m server serve`` on a free loopback port (extra
server flags through ``--server-arg``, repeated), waits for ``/health``, and stops it with SIGTERM at the end;
``--base-url http://127.0.0.1:PORT/v1`` drives a running server instead. Any host outside 127.0.0.0/8,
``localhost`` and ``::1`` is refused (exit status 2).

For each prompt set (``--sets``: HumanEval code prompts, sent raw to ``/v1/completions``; chat questions, sent
as one user message to ``/v1/chat/completions``, as ``python -m bench`` encodes them), each lookahead mode
(``--lookahead on,off``: "off" sends ``"lookahead": {"enabled": false}``, "on" sends nothing, the server's
default) and each concurrency level (``--concurrency 1,2,4,8,16``), that many clients of the official async
OpenAI SDK each send ``--requests-per-client`` greedy streaming requests back to back, with ``max_tokens``
``--max-tokens``, issuing no new request after ``--max-seconds`` from the start of the level. Client ``c``'s
``r``-th request at level ``L`` gets prompt ``(r * L + c) mod len(prompts)``, so every level starts on the same
prompts. The SDK never retries (``max_retries=0``): a 429 or 503 is counted as a rejection, anything else that
goes wrong (another status, a transport error or timeout, an error event mid-stream, a stream without its usage
chunk) as an error; none is dropped. One uncounted warm-up request per prompt set runs first.

Every request asks for ``stream_options.include_usage`` and the ``stream_steps`` extension, so all token counts
come from the server: ``usage.completion_tokens`` and ``decoding`` from the usage chunk, and each chunk's
``step.tokens``. Per (set, mode, level) row:

- done, 429, 503, errors: requests served, rejected with that status, failed otherwise;
- tok/s: completion tokens of the served requests / wall time of the level (first request sent to last answer);
- x c1: tok/s over the tok/s of the same set and mode at the lowest level (concurrency 1 by default);
- TTFT p50/p95: seconds from sending a request to the first chunk with text;
- ITL p50/p95: per-token inter-token latency. A chunk after the first text chunk that carries ``k`` tokens,
  arriving ``g`` seconds after the previous such chunk, contributes ``k`` samples of ``g / k`` (so a lookahead
  step that commits 3 tokens in 90 ms gives three samples of 30 ms); percentiles over all tokens of the row;
- tok/step: completion tokens / decoding steps, summed over the row's requests (the server's ``decoding``);
- method: the ``decoding.method`` the server reported (``la`` lookahead, ``ar`` autoregressive).

It prints a markdown table (a header line with the date, the machine and the server flags first) and, with
``--json PATH``, writes ``{"header": {...}, "rows": [...], "errors": [...]}``. Exit status 1 when any request
(the warm-up included) was rejected or failed, nothing was served, or a spawned server exited non-zero or logged
a traceback; 2 for bad arguments; else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a file: bench.datasets lives in the repository root

from bench.datasets import PromptSpec, load_dataset  # noqa: E402
from server.spawn import launch  # noqa: E402

PROMPT_SETS = ("humaneval", "chat")
MODES = ("on", "off")
WARMUP_TOKENS = 8
METHOD_ABBREVIATIONS = {"lookahead": "la", "autoregressive": "ar"}


@dataclass
class RequestResult:
    """What one streamed request produced; ``failure`` is None when it was served."""

    failure: str | None = None  # "429", "503" or "error"
    detail: str = ""
    completion_tokens: int = 0
    steps: int = 0
    method: str | None = None
    decoding: dict[str, Any] | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Row:
    """One (prompt set, lookahead mode, concurrency level) of the report; latencies in seconds."""

    prompt_set: str
    mode: str
    concurrency: int
    methods: list[str]
    requests: int
    rejected_429: int
    rejected_503: int
    errors: int
    completion_tokens: int
    wall_seconds: float
    throughput: float
    relative_throughput: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    tokens_per_step: float | None
    eager_forwards: int | None = None  # the server's forwards that ran eagerly during the level (None: unread)


# --- arithmetic -------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Linearly interpolated percentile (numpy's default), None for no values.

    Example: ``percentile([1, 2, 3, 4], 0.5)`` -> 2.5; ``percentile([10, 20], 0.95)`` -> 19.5.
    """
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def token_gaps(chunks: Sequence[tuple[float, int]]) -> list[float]:
    """Per-token inter-token latencies from ``(arrival time, tokens)`` of a stream's chunks from the first text.

    The first chunk opens the clock (its tokens belong to the TTFT); each later chunk with ``k > 0`` tokens
    contributes ``k`` samples of (gap since the previous chunk with tokens) / ``k``; chunks without tokens
    are skipped. Example: ``[(1.0, 1), (1.1, 1), (1.4, 3), (1.5, 0)]`` -> ``[0.1, 0.1, 0.1, 0.1]``.
    """
    gaps: list[float] = []
    previous: float | None = None
    for arrived, tokens in chunks:
        if previous is not None and tokens > 0:
            gaps.extend([(arrived - previous) / tokens] * tokens)
        if previous is None or tokens > 0:
            previous = arrived
    return gaps


def summarize_level(prompt_set: str, mode: str, concurrency: int, results: Sequence[RequestResult],
                    wall_seconds: float) -> Row:
    """Fold one level's request results into a row (``relative_throughput`` is filled in later)."""
    served = [result for result in results if result.failure is None]
    tokens = sum(result.completion_tokens for result in served)
    steps = sum(result.steps for result in served)
    ttfts = [result.ttft for result in served if result.ttft is not None]
    itls = [gap for result in served for gap in result.itl]
    return Row(
        prompt_set=prompt_set, mode=mode, concurrency=concurrency,
        methods=sorted({result.method for result in served if result.method}),
        requests=len(served),
        rejected_429=sum(result.failure == "429" for result in results),
        rejected_503=sum(result.failure == "503" for result in results),
        errors=sum(result.failure == "error" for result in results),
        completion_tokens=tokens, wall_seconds=wall_seconds,
        throughput=tokens / wall_seconds if wall_seconds > 0 else 0.0, relative_throughput=None,
        ttft_p50=percentile(ttfts, 0.5), ttft_p95=percentile(ttfts, 0.95),
        itl_p50=percentile(itls, 0.5), itl_p95=percentile(itls, 0.95),
        tokens_per_step=tokens / steps if steps else None,
    )


def with_relative_throughput(rows: Sequence[Row]) -> list[Row]:
    """Each row's throughput over that of the same set and mode at its lowest concurrency level."""
    base: dict[tuple[str, str], Row] = {}
    for row in rows:
        key = (row.prompt_set, row.mode)
        if key not in base or row.concurrency < base[key].concurrency:
            base[key] = row
    relative = []
    for row in rows:
        reference = base[(row.prompt_set, row.mode)].throughput
        ratio = row.throughput / reference if reference > 0 else None
        relative.append(replace(row, relative_throughput=ratio))
    return relative


# --- requests ---------------------------------------------------------------------------------------------


def request_kwargs(spec: PromptSpec, mode: str, model: str, max_tokens: int) -> dict[str, Any]:
    """SDK keyword arguments for one greedy streaming request of ``spec`` in lookahead ``mode``."""
    extra: dict[str, Any] = {"stream_steps": True}
    if mode == "off":
        extra["lookahead"] = {"enabled": False}
    kwargs: dict[str, Any] = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body=extra)
    if spec.text is not None:
        kwargs["prompt"] = spec.text
    else:
        kwargs["messages"] = [dict(message) for message in spec.messages or ()]
    return kwargs


def chunk_text(chunk: Any) -> str:
    """The text a completion or chat chunk carries ('' for the role, finish and usage chunks)."""
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    delta = getattr(choice, "delta", None)
    return (delta.content if delta is not None else choice.text) or ""


def extension(chunk: Any, name: str) -> dict[str, Any] | None:
    """A top-level extension object (``step``, ``decoding``) of a chunk, as a dict."""
    value = (chunk.model_extra or {}).get(name)
    return value if isinstance(value, dict) else None


def classify(error: Exception) -> tuple[str, str]:
    """``("429" | "503" | "error", detail)`` for an exception raised by the SDK while streaming."""
    if isinstance(error, openai.APIStatusError):
        status = str(error.status_code)
        body = error.body if isinstance(error.body, dict) else {}
        return (status if status in ("429", "503") else "error"), f"HTTP {status}: {body.get('message', error.message)}"
    return "error", f"{type(error).__name__}: {error}"


async def stream_one(client: AsyncOpenAI, spec: PromptSpec, mode: str, model: str, max_tokens: int) -> RequestResult:
    """Send one streaming request and time its chunks; never raises for a failed request."""
    kwargs = request_kwargs(spec, mode, model, max_tokens)
    create = client.completions.create if spec.text is not None else client.chat.completions.create
    result = RequestResult()
    chunks: list[tuple[float, int]] = []
    started = time.perf_counter()
    try:
        stream = await create(**kwargs)
        async for chunk in stream:
            arrived = time.perf_counter()
            step = extension(chunk, "step")
            if result.ttft is None and chunk_text(chunk):
                result.ttft = arrived - started
            if result.ttft is not None and step is not None:
                chunks.append((arrived, int(step["tokens"])))
            decoding = extension(chunk, "decoding")
            if chunk.usage is not None and decoding is not None:
                result.completion_tokens = chunk.usage.completion_tokens
                result.steps, result.method = int(decoding["steps"]), str(decoding["method"])
                result.decoding = decoding
    except (openai.APIError, httpx.HTTPError, OSError, KeyError, TypeError, ValueError) as error:
        result.failure, result.detail = classify(error)
        return result
    if result.method is None:
        result.failure, result.detail = "error", "stream ended without the usage chunk"
    result.itl = token_gaps(chunks)
    return result


async def client_loop(client: AsyncOpenAI, prompts: Sequence[PromptSpec], index: int, level: int, mode: str,
                      model: str, args: argparse.Namespace, deadline: float) -> list[RequestResult]:
    """One simulated user: ``--requests-per-client`` requests back to back, none started after ``deadline``."""
    results = []
    for number in range(args.requests_per_client):
        if time.monotonic() >= deadline:
            break
        spec = prompts[(number * level + index) % len(prompts)]
        results.append(await stream_one(client, spec, mode, model, args.max_tokens))
    return results


def eager_forward_count(metrics: str) -> int | None:
    """``lookahead_forwards_total{path="eager"}`` in a Prometheus exposition (0 when the server exports the
    counter without that path yet; None when it exports no forward counter at all).

    >>> eager_forward_count('lookahead_forwards_total{path="graph"} 7.0\\nlookahead_forwards_total{path="eager"} 2.0')
    2
    >>> eager_forward_count('lookahead_forwards_total{path="graph"} 7.0'), eager_forward_count("up 1")
    (0, None)
    """
    values = {line.split("}")[0].split('path="')[-1].rstrip('"'): float(line.split()[-1])
              for line in metrics.splitlines() if line.startswith("lookahead_forwards_total{")}
    return int(values.get("eager", 0)) if values else None


async def read_eager_forwards(client: AsyncOpenAI) -> int | None:
    """The server's eager forwards so far (``eager_forward_count`` of its ``/metrics``); None when unreadable."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(f"{root}/metrics", headers={"Authorization": f"Bearer {client.api_key}"})
        return eager_forward_count(response.text) if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def run_level(client: AsyncOpenAI, prompt_set: str, prompts: Sequence[PromptSpec], mode: str, level: int,
                    model: str, args: argparse.Namespace) -> tuple[Row, list[RequestResult]]:
    """All clients of one concurrency level at once; the row (with the eager forwards the server ran meanwhile:
    at the CUDA preset a step that fits no CUDA graph) and every request's result."""
    eager_before = await read_eager_forwards(client)
    started = time.monotonic()
    deadline = started + args.max_seconds
    per_client = await asyncio.gather(*(client_loop(client, prompts, index, level, mode, model, args, deadline)
                                        for index in range(level)))
    wall = time.monotonic() - started
    results = [result for results in per_client for result in results]
    eager_after = await read_eager_forwards(client)
    row = summarize_level(prompt_set, mode, level, results, wall)
    if eager_before is not None and eager_after is not None:
        row = replace(row, eager_forwards=eager_after - eager_before)
    return row, results


def lookahead_settings(results: Sequence[RequestResult]) -> str:
    """The lookahead W/N/G the server reported, e.g. ``"W=15 N=5 G=15"`` (``"-"`` if none used lookahead)."""
    seen = sorted({(info["window_size"], info["ngram_size"], info["guess_set_size"]) for result in results
                   if (info := result.decoding) is not None and info.get("method") == "lookahead"})
    return "; ".join(f"W={w} N={n} G={g}" for w, n, g in seen) or "-"


@dataclass
class RunOutcome:
    """What ``run_all`` measured: the rows (relative throughput filled in) and what the header needs."""

    model: str
    rows: list[Row]
    failures: list[str]
    lookahead: str


async def run_all(base_url: str, args: argparse.Namespace, prompt_sets: dict[str, list[PromptSpec]]) -> RunOutcome:
    """Every (set, mode, level) in order, after one warm-up request per set."""
    client = AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=args.request_timeout)
    failures: list[str] = []
    rows: list[Row] = []
    everything: list[RequestResult] = []
    async with client:
        model = args.model or (await client.models.list()).data[0].id
        for prompt_set, prompts in prompt_sets.items():
            warmup = await stream_one(client, prompts[0], args.lookahead[0], model, WARMUP_TOKENS)
            if warmup.failure is not None:
                failures.append(f"{prompt_set} warm-up: {warmup.detail}")
            for mode in args.lookahead:
                for level in args.concurrency:
                    row, results = await run_level(client, prompt_set, prompts, mode, level, model, args)
                    rows.append(row)
                    everything += results
                    failures += [f"{prompt_set}/{mode}/c{level}: {result.detail}" for result in results
                                 if result.failure is not None]
                    print(f"loadtest: {prompt_set} {mode} c={level}: {row.requests} done, "
                          f"{row.throughput:.1f} tok/s", file=sys.stderr, flush=True)
    return RunOutcome(model, with_relative_throughput(rows), failures, lookahead_settings(everything))


# --- report -----------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


TABLE_HEADERS = ("set", "lookahead", "method", "clients", "done", "429", "503", "errors", "tokens", "wall s",
                 "tok/s", "x c{base}", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "tok/step")


def table_cells(row: Row) -> list[str]:
    """One markdown table row's cells, in ``TABLE_HEADERS`` order."""
    methods = ",".join(METHOD_ABBREVIATIONS.get(method, method) for method in row.methods) or "-"
    return [row.prompt_set, row.mode, methods, str(row.concurrency), str(row.requests), str(row.rejected_429),
            str(row.rejected_503), str(row.errors), str(row.completion_tokens), f"{row.wall_seconds:.1f}",
            f"{row.throughput:.1f}", _num(row.relative_throughput, 2), _ms(row.ttft_p50), _ms(row.ttft_p95),
            _ms(row.itl_p50), _ms(row.itl_p95), _num(row.tokens_per_step, 2)]


def markdown_table(rows: Sequence[Row]) -> str:
    """The rows as a GitHub markdown table (text left, numbers right); ``x cN`` names the lowest level."""
    base = min((row.concurrency for row in rows), default=1)
    lines = ["| " + " | ".join(TABLE_HEADERS).format(base=base) + " |",
             "|" + "|".join("---" if index < 3 else "---:" for index in range(len(TABLE_HEADERS))) + "|"]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def machine_description() -> str:
    """``<cpu model>, N cores, <os> <arch>`` of this machine."""
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def header(args: argparse.Namespace, base_url: str, outcome: RunOutcome) -> dict[str, Any]:
    """The run's context: date, machine, server and its flags, and the load settings."""
    server = "spawned: python -m server serve " + " ".join(args.server_arg) if args.spawn else f"external {base_url}"
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_description(),
        "server": server.strip(), "model": outcome.model, "server_lookahead": outcome.lookahead,
        "concurrency": args.concurrency, "lookahead": args.lookahead,
        "sets": args.sets, "requests_per_client": args.requests_per_client, "max_tokens": args.max_tokens,
        "max_seconds": args.max_seconds, "limit": args.limit, "temperature": 0,
    }


def header_line(info: dict[str, Any]) -> str:
    """The header as one markdown line above the table."""
    return (f"**loadtest** {info['date']} | machine: {info['machine']} | server: {info['server']} | "
            f"model: {info['model']}, lookahead {info['server_lookahead']} | max_tokens {info['max_tokens']}, "
            f"requests per client {info['requests_per_client']}, at most {info['max_seconds']:g} s per level, "
            f"greedy, streamed")


# --- arguments and the server -----------------------------------------------------------------------------


def is_loopback_url(url: str) -> bool:
    """True when ``url``'s host is ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    host = urlparse(url).hostname
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_list(text: str, choices: Sequence[str], flag: str) -> list[str]:
    """``"on,off"`` -> ``["on", "off"]``; raises ``ValueError`` on an empty list, unknown or repeated names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in choices for name in names) or len(set(names)) != len(names):
        raise ValueError(f"{flag} takes a comma-separated list of distinct values from {', '.join(choices)}")
    return names


def parse_levels(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; each level in [1, 256], ascending order kept as given, no repeats."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--concurrency takes integers such as 1,2,4,8,16, not {text!r}") from error
    if not levels or any(not 1 <= level <= 256 for level in levels) or len(set(levels)) != len(levels):
        raise ValueError("--concurrency levels must be distinct integers in [1, 256]")
    return levels


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server's API root, e.g. http://127.0.0.1:8000/v1 (loopback)")
    target.add_argument("--spawn", action="store_true", help="start python -m server serve on a free loopback port")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for --spawn (repeat it)")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="concurrent clients per level (1,2,4,8,16)")
    parser.add_argument("--lookahead", default="on,off", help="modes: on (server default), off (autoregressive)")
    parser.add_argument("--sets", default="humaneval,chat", help="prompt sets: humaneval, chat")
    parser.add_argument("--limit", type=int, help="use only the first N prompts of each set")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends (2)")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="no new request after this per level")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (128)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for --spawn to be ready")
    parser.add_argument("--model", help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default="unused", help="bearer key, if the server wants one")
    parser.add_argument("--json", type=Path, help="also write the header, rows and errors as JSON here")
    args = parser.parse_args(argv)
    try:
        args.concurrency = parse_levels(args.concurrency)
        args.lookahead = parse_list(args.lookahead, MODES, "--lookahead")
        args.sets = parse_list(args.sets, PROMPT_SETS, "--sets")
    except ValueError as error:
        parser.error(str(error))
    if args.base_url and not is_loopback_url(args.base_url):
        parser.error("--base-url must be a loopback address (127.0.0.0/8, localhost or ::1)")
    if args.requests_per_client < 1 or args.max_tokens < 1 or args.max_seconds <= 0 or (args.limit or 1) < 1:
        parser.error("--requests-per-client, --max-tokens, --limit and --max-seconds must be positive")
    return args


@dataclass
class SpawnedServer:
    """A server this script started: its ``/v1`` URL, log, and (once stopped) exit status."""

    base_url: str
    log_path: Path
    exit_status: int | None = None

    def problems(self) -> list[str]:
        """Why the server's end looks wrong: a non-zero exit, tracebacks in its log."""
        found = [] if self.exit_status == 0 else [f"server exit status {self.exit_status}"]
        tracebacks = self.log_path.read_text(errors="replace").count("Traceback")
        return found + ([f"{tracebacks} tracebacks in {self.log_path}"] if tracebacks else [])


@contextlib.contextmanager
def spawned_server(extra: Sequence[str], timeout: float) -> Iterator[SpawnedServer]:
    """``python -m server serve`` on a free loopback port, ready; SIGTERM (then kill after 60 s) at the end."""
    log_path = Path(tempfile.mkdtemp(prefix="loadtest-")) / "server.log"
    process = launch(["serve", *extra], log_path, cwd=ROOT)
    print(f"loadtest: server log {log_path}", file=sys.stderr, flush=True)
    server = SpawnedServer(f"{process.base_url}/v1", log_path)
    try:
        process.wait_ready(timeout)  # ServerStartError is a RuntimeError
        yield server
    finally:
        server.exit_status = process.stop(60)


def load_prompt_sets(names: Sequence[str], limit: int | None) -> dict[str, list[PromptSpec]]:
    """The named prompt sets from ``bench.datasets`` (HumanEval is fetched and cached on first use)."""
    return {name: load_dataset(name, limit) for name in names}


def report(info: dict[str, Any], rows: Sequence[Row], failures: Sequence[str], json_path: Path | None) -> None:
    """Print the header line and the table; write the JSON when asked; list failures on stderr."""
    print(header_line(info))
    print()
    print(markdown_table(rows))
    if json_path is not None:
        json_path.write_text(json.dumps({"header": info, "rows": [asdict(row) for row in rows],
                                         "errors": list(failures)}, indent=2))
    for line in failures[:20]:
        print(f"loadtest: failed: {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the load test; the exit status (see the module docstring)."""
    args = parse_args(argv)
    prompt_sets = load_prompt_sets(args.sets, args.limit)
    server: SpawnedServer | None = None
    with contextlib.ExitStack() as stack:
        if args.spawn:
            server = stack.enter_context(spawned_server(args.server_arg, args.startup_timeout))
        base_url = server.base_url if server is not None else args.base_url.rstrip("/")
        outcome = asyncio.run(run_all(base_url, args, prompt_sets))
    failures = outcome.failures + (server.problems() if server is not None else [])
    report(header(args, base_url, outcome), outcome.rows, failures, args.json)
    served = sum(row.requests for row in outcome.rows)
    return 1 if failures or served == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
