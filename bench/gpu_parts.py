"""The GPU check's parts (``bench.gpu`` runs them), what each needs, its tables in gpu.md, and the goals.

Contract: ``PARTS`` lists, in running order, each ``bench.gpu.Part``: its device call (1 or 2), its time budget
and what it needs (``model_missing``: the default model in the cache; ``server_missing``: the server, the SDK and
the load test's clients import here). Every part runs its GPU work in child processes (``PartContext.run`` or
``server.spawn``) and records results through its context as each piece ends; files it writes are named through
``PartContext.output`` (at most 8 in all). ``markdown(report)`` renders a report, whatever parts it holds;
``goals(report)`` lists each goal of issue #40 that the report measures: (goal, measured, met).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.gpu_runner import ROOT, Part, PartContext, PartTimeout

HELDOUT_SETS = ("humaneval", "chat", "mtbench")
CUDA_TESTS = "tests/decoding/test_cuda.py"
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
FIRST_REQUEST_TOKENS = 128


def model_missing() -> str | None:
    """None when the default model is in the cache (converted, or its GGUF), else why not."""
    from decoding.weights.loading import cache_root

    root = cache_root()
    if any((root / "models").glob("*/config.json")) or any((root / "gguf").glob("*.gguf")):
        return None
    return f"no converted model or GGUF under {root}: call 2 joins it (scripts/gpu-check --help)"


@functools.cache
def server_missing() -> str | None:
    """None when the server, the SDK and the load test's clients import here (in a fresh process), else why not."""
    done = subprocess.run([sys.executable, "-c", "import httpx, openai, server.app, server.cli"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]
    return f"{last} (the wheels of call 1 go to /tmp/site: scripts/gpu-check --help)"


def both_missing() -> str | None:
    """The model's reason, else the server's."""
    return model_missing() or server_missing()


def pytest_command(context: PartContext, marker: str) -> list[str]:
    """``pytest -m marker`` over the CUDA tests."""
    return [context.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, CUDA_TESTS]


def run_tests(context: PartContext) -> None:
    """The CUDA tests that need no real model (tiny seeded models)."""
    context.run(pytest_command(context, "not real_model"))


def run_model_tests(context: PartContext) -> None:
    """The CUDA tests on the real default model (the CUDA preset through graphs among them)."""
    context.run(pytest_command(context, "real_model"))


def run_step_cost(context: PartContext, fused: bool = False) -> None:
    """``bench.gpu_step_cost`` into step-cost.json (``--fused``: fused-step-cost.json); its rows, so far, into the
    report whatever happens."""
    path = context.output.file("fused-step-cost.json" if fused else "step-cost.json")
    command = [context.python, "-m", "bench.gpu_step_cost", "--out", str(path), *(["--fused"] if fused else [])]
    if model_missing() is not None:
        command.append("--random-weights")
    try:
        context.run(command)
    finally:
        if path.exists():
            payload = json.loads(path.read_text())
            context.record("model", payload["model"])
            context.record("complete", payload["complete"])
            context.record("rows", payload["rows"])


def heldout_summary(path: Path) -> list[dict]:
    """Per method of a ``bench heldout --output`` file: tok/s, speed-up over greedy, tok/step, identical."""
    methods = json.loads(path.read_text())["summary"]["methods"]
    keys = ("method", "prompts", "tokens_per_second", "speedup_vs_greedy", "tokens_per_step", "identical_to_greedy")
    return [{key: round(value, 3) if isinstance(value := method.get(key), float) else value for key in keys}
            for method in methods]


def run_heldout(context: PartContext) -> None:
    """Our greedy loop and lookahead at the CUDA preset on each held-out set, one process and file per set."""
    for name in HELDOUT_SETS:
        path = context.output.file(f"heldout-{name}.json")
        run = context.run([context.python, "-m", "bench", "heldout", "--dataset", name, "--preset", "cuda",
                           "--device", "cuda", "--methods", "greedy,lookahead", "--output", str(path)])
        if run["status"] == 0 and path.exists():
            context.record(name, heldout_summary(path))


class RequestFailed(RuntimeError):
    """A request the server answered with an error, or whose stream ended without its usage."""


def streamed_request(base_url: str, model: str, timeout: float) -> dict:
    """One greedy streamed chat completion: seconds to the first text, in all, and the tokens it made. Raises
    ``RequestFailed`` when the stream carries an error or ends without its usage (on the first GPU run both
    requests ended so, and the part read them as served)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": FIRST_REQUEST_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    first, tokens = None, None
    with urllib.request.urlopen(request, timeout=max(timeout, 1)) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RequestFailed(f"the stream ended with an error: {chunk['error'].get('message')}")
            if first is None and any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices", [])):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
    seconds = time.perf_counter() - started
    if not tokens:
        raise RequestFailed("the stream ended without its usage (no completion tokens)")
    return {"ttft_seconds": None if first is None else round(first, 3), "seconds": round(seconds, 3),
            "completion_tokens": tokens, "tokens_per_second": round(tokens / seconds, 1) if tokens else None}


def server_startup(context: PartContext, device: str) -> None:
    """Spawn ``python -m server serve --device DEVICE``: seconds until ``/health`` answers, then two streamed
    requests (``streamed_request``); the server's exit status, and its log's tail when it did not start."""
    from server.spawn import ServerStartError, launch

    log = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "server.log"
    started = time.perf_counter()
    server = launch(["serve", "--device", device], log, cwd=ROOT)
    try:
        try:
            server.wait_ready(max(context.remaining(), 1))
        except ServerStartError as error:
            context.record("log_tail", server.log_tail(25).splitlines())
            if context.remaining() <= 0:
                raise PartTimeout(str(error).splitlines()[0]) from error
            raise
        context.record("startup_seconds", round(time.perf_counter() - started, 2))
        with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=30) as response:
            model = json.loads(response.read())["data"][0]["id"]
        for key in ("first_request", "second_request"):
            try:
                context.record(key, streamed_request(server.base_url, model, context.remaining()))
            except (TimeoutError, urllib.error.URLError) as error:
                if context.remaining() <= 0:
                    raise PartTimeout(f"{key}: {error}") from error
                raise
    finally:
        context.record("exit_status", server.stop(20))


def run_server(context: PartContext) -> None:
    """The server's start-up and first requests at the CUDA preset."""
    server_startup(context, "cuda")


def run_load(context: PartContext) -> None:
    """``scripts/loadtest.py --spawn`` at 1 and 8 streams (lookahead on) into load.json; its rows into the report."""
    path = context.output.file("load.json")
    context.run([context.python, "scripts/loadtest.py", "--spawn", "--server-arg=--device=cuda", "--concurrency",
                 "1,8", "--lookahead", "on", "--sets", "humaneval,chat", "--limit", "4", "--max-tokens", "256",
                 "--max-seconds", "20", "--json", str(path)])
    if path.exists():
        keys = ("prompt_set", "concurrency", "requests", "errors", "throughput", "relative_throughput", "ttft_p50",
                "tokens_per_step", "eager_forwards")
        context.record("rows", [{key: row.get(key) for key in keys} for row in json.loads(path.read_text())["rows"]])


def run_anatomy(context: PartContext) -> None:
    """``python -m bench anatomy --device cuda`` (``bench.device_anatomy``): wall, host and device ms of a step through
    captured graphs, tiny-width 30-layer model, and the server's worker serial and overlapped; into the report."""
    path = Path(tempfile.mkdtemp(prefix="gpu-anatomy-")) / "anatomy.json"  # not a file of its own: 8 come back
    run = context.run([context.python, "-m", "bench", "anatomy", "--device", "cuda", "--json", str(path)])
    if run["status"] == 0 and path.exists():
        report = json.loads(path.read_text())
        context.record("static", report["static"])
        context.record("server", report["server"])


PARTS = (
    Part("tests", 1, 130, run_tests, summary="CUDA tests on tiny models"),
    Part("step_cost", 1, 80, run_step_cost, summary="step cost, random weights of the default shape"),
    Part("fused_step_cost", 1, 90, functools.partial(run_step_cost, fused=True),
         summary="the fused step's cost and compiles, random weights of the default shape"),
    Part("model_tests", 2, 75, run_model_tests, model_missing, "CUDA tests on the default model"),
    Part("heldout", 2, 105, run_heldout, model_missing, "greedy and lookahead on the held-out sets"),
    Part("server", 2, 75, run_server, both_missing, "server start-up and its first request"),
    Part("load", 2, 75, run_load, both_missing, "load test at 1 and 8 streams"),
    Part("anatomy", 2, 45, run_anatomy, summary="wall, host and device ms a step through graphs; the worker's share"),
)


def _step(report: dict, batch: int, k: int | None = None) -> list[float]:
    rows = report.get("parts", {}).get("step_cost", {}).get("results", {}).get("rows", [])
    return [row["static_graphs_whole_step_ms"] for row in rows
            if row.get("batch") == batch and (k is None or row.get("k") == k)]


def _heldout(report: dict, name: str, method: str, key: str) -> float | None:
    results = report.get("parts", {}).get("heldout", {}).get("results", {})
    return next((row.get(key) for row in results.get(name, []) if row["method"] == method), None)


def _load(report: dict, concurrency: int, key: str) -> float | None:
    rows = report.get("parts", {}).get("load", {}).get("results", {}).get("rows", [])
    return next((row.get(key) for row in rows if row["prompt_set"] == "humaneval" and
                 row["concurrency"] == concurrency), None)


def goals(report: dict) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for each goal of the module contract of ``bench.gpu`` that ``report`` measures."""
    found: list[tuple[str, str, bool]] = []
    for label, values, limit in (("whole greedy step, batch 1, k=1 <= 1.2 ms", _step(report, 1, 1), 1.2),
                                 ("whole step, batch 1, every k <= 128 <= 2.0 ms", _step(report, 1), 2.0),
                                 ("whole greedy step, batch 8, k=1 <= 1.6 ms", _step(report, 8, 1), 1.6)):
        if values:
            found.append((label, f"{max(values)} ms", max(values) <= limit))
    greedy = [value for name in HELDOUT_SETS if (value := _heldout(report, name, "greedy", "tokens_per_second"))]
    if greedy:
        found.append(("greedy >= 700 tok/s (each held-out set)", f"{min(greedy):.0f} tok/s", min(greedy) >= 700))
    for name, floor in (("humaneval", 2.0), ("mtbench", 1.4), ("chat", 1.4)):
        speedup = _heldout(report, name, "lookahead", "speedup_vs_greedy")
        if speedup is not None:
            found.append((f"lookahead >= {floor}x greedy on {name}", f"{speedup:.2f}x", speedup >= floor))
    one, engine = _load(report, 1, "throughput"), _heldout(report, "humaneval", "lookahead", "tokens_per_second")
    if one and engine:
        found.append(("one stream within 10% of the engine (HumanEval)", f"{one:.0f} vs {engine:.0f} tok/s",
                      one >= 0.9 * engine))
    eight = _load(report, 8, "relative_throughput")
    if eight is not None:
        found.append(("8 streams >= 4x one (HumanEval)", f"{eight:.2f}x", eight >= 4.0))
    return found


def _table(headers: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join("-" if cell is None else str(cell) for cell in row) + " |" for row in rows]
    return [*lines, ""]


def part_lines(name: str, section: dict) -> list[str]:
    """One part's section of gpu.md: status, then its tables and its commands' last lines."""
    results = section.get("results", {})
    lines = [f"## {name}: {section['status']}, {section.get('seconds', '-')} s of {section['budget_seconds']}", ""]
    if section.get("error"):
        lines += [f"error: {section['error']}", ""]
    if name == "step_cost" and results.get("rows"):
        lines += [f"model: {results.get('model')}; complete: {results.get('complete')}", ""]
        lines += ["Step cost (ms, CUDA events, median):", ""]
        lines += _table(("batch", "k", "forward_packed", "static eager", "static graph", "whole static step (graph)",
                         "graph, SDPA attention"),
                        [(row["batch"], row["k"], row.get("forward_packed_ms"), row["static_eager_ms"],
                          row["static_graphs_ms"], row["static_graphs_whole_step_ms"], row.get("static_graphs_sdpa_ms"))
                         for row in results["rows"] if "k" in row])
    if name == "fused_step_cost" and results.get("rows"):
        lines += [f"model: {results.get('model')}; complete: {results.get('complete')}", ""]
        lines += ["The fused step (ms, CUDA events, median; a row's first build compiles its class):", ""]
        lines += _table(("batch", "k", "first build s", "fused graph", "whole fused step"),
                        [(row["batch"], row["k"], row["fused_build_s"], row["static_fused_ms"],
                          row["static_fused_whole_step_ms"]) for row in results["rows"] if "k" in row])
        lines += [f"- {key}: {value}" for row in results["rows"] if "k" not in row for key, value in row.items()]
    for set_name in HELDOUT_SETS:
        if set_name in results:
            lines += [f"{set_name}:", ""]
            lines += _table(("method", "prompts", "tok/s", "vs greedy", "tok/step", "identical"),
                            [tuple(row.values())[:6] for row in results[set_name]])
    for key in ("startup_seconds", "first_request", "second_request", "exit_status"):
        if key in results:
            lines.append(f"- {key}: {results[key]}")
    if name == "anatomy" and results.get("static"):
        lines += _table(("stream", "step tokens", "wall ms", "host ms", "device ms"),
                        [(stream, row["median_step_tokens"], row["wall_ms"], row["host_ms"], row["device_ms"])
                         for stream, row in results["static"].items()])
        lines += ["", *_table(("worker", "loop", "worker ms", "delivered in flight", "critical ms"),
                              [(stream, loop, row["worker_ms"], row["delivered_in_flight_ms"], row["critical_ms"])
                               for stream, loops in results.get("server", {}).items()
                               for loop, row in loops.items()])]
    if name == "load" and results.get("rows"):
        lines += ["", *_table(tuple(results["rows"][0]), [tuple(row.values()) for row in results["rows"]])]
    for run in results.get("runs", []):
        lines += ["", f"`{run['command']}`: status {run['status']}, {run['seconds']} s", "", "```", *run["tail"][-10:],
                  "```"]
    return [*lines, ""]


def markdown(report: dict) -> str:
    """The report as markdown: header, the goals it measures, each part, and what was skipped and why."""
    lines = [f"# GPU check, {report.get('date')}, commit {report.get('commit')}", "",
             f"{report.get('device')}; torch {report.get('torch')}; parts: {', '.join(report.get('selected', []))}",
             ""]
    measured = goals(report)
    if measured:
        lines += ["## Goals", "", *_table(("goal", "measured", "met"), [(g, m, "yes" if ok else "NO")
                                                                       for g, m, ok in measured])]
    for name, section in report.get("parts", {}).items():
        lines += part_lines(name, section)
    if report.get("skipped"):
        lines += ["## Skipped", "", *(f"- {name}: {why}" for name, why in report["skipped"].items()), ""]
    return "\n".join(lines)
