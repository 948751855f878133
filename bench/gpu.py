"""The GPU check: every GPU test and timing of the static step in one command, written to one folder.

Contract: ``python -m bench gpu --out DIR`` (``scripts/gpu-check`` wraps it) runs, within about 9 minutes on one
H100, each part that what it finds there allows, and writes ``DIR/gpu.json`` (everything) and ``DIR/gpu.md`` (the
tables). A part that cannot run says why in both, and the rest still runs:

1. ``tests``: ``pytest tests/decoding/test_cuda.py`` (graph replay == eager static step bit for bit, lookahead ==
   greedy through CUDA graphs in float32 with TF32 off, the real model at the CUDA preset).
2. ``step_cost``: one step of k tokens (k = 1..128) over 300 cached tokens for 1, 4 and 8 sequences, on the
   default model (or, when it is not there, random weights of its exact shape: the same kernels, the same times):
   today's eager ``forward_packed`` (batch 1), the static step run eagerly, and its CUDA graph replayed; CUDA
   events, median of many runs. Also the whole static step as the engine runs it (host work included).
3. ``heldout``: ``python -m bench heldout --preset cuda`` on HumanEval, chat and MT-bench x 8 prompts (our greedy,
   our lookahead, prompt lookup, interleaved in one process), and ``python -m bench --methods
   greedy,generate_compiled`` (``generate`` with a static cache, compiled): needs the default model.
4. ``load``: ``scripts/loadtest.py --spawn`` at 1 and 8 clients through the server: needs the model and the
   server's packages (fastapi, uvicorn, sse-starlette, pydantic: carried as wheels, see ``scripts/gpu-check``).

Goals (issue #30): <= 3 ms per step for every k <= 128 at batch 1; our greedy >= compiled ``generate``; lookahead
>= 2.5x our greedy on HumanEval and >= 1.5x on chat; one stream through the server within 10% of the engine, 8
streams >= 5x one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

STEP_KS = (1, 2, 4, 8, 16, 32, 64, 96, 128)
STEP_BATCHES = (1, 4, 8)
CONTEXT = 300
REPEATS = 50
HELDOUT_SETS = ("humaneval", "chat", "mtbench")
ROOT = Path(__file__).resolve().parents[1]


def default_model_shape() -> torch.nn.Module:
    """A random-weight LLaMA of SmolLM2-135M-Instruct's exact shape (30 layers, 576 wide, 9:3 heads, 49152 tokens,
    tied embeddings): the default model's kernels and times, when its weights are not on this machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def load_default(device: str) -> tuple[torch.nn.Module, str]:
    """The default model on ``device`` in float32 and where it came from ("default model" or "random weights")."""
    try:
        from decoding.loading import load_model

        return load_model(device=device, dtype="float32").model, "default model"
    except Exception as error:  # no cached model and no way to fetch it here
        print(f"default model unavailable ({error}); timing random weights of its shape", file=sys.stderr)
        return default_model_shape().to(device), "random weights of the default model's shape"


def cuda_median_ms(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median milliseconds of ``run()`` between CUDA events, after 3 warm-up runs."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_cost(model: torch.nn.Module) -> list[dict]:
    """The step-cost rows (module contract, part 2)."""
    from decoding.batch import forward_batch
    from decoding.kv_cache import KVPool, new_cache
    from decoding.packed import Slice, forward_packed
    from decoding.static import StaticStep

    rows = []
    runners = {mode: StaticStep(model, KVPool(model, max(STEP_BATCHES), 1024, scratch_tokens=256), mode)
               for mode in ("eager", "graphs")}
    prompt = [(17 * index) % 1000 + 5 for index in range(CONTEXT)]
    with torch.inference_mode():
        caches = {}
        for mode, runner in runners.items():
            caches[mode] = [runner.pool.acquire(1024) for _ in range(max(STEP_BATCHES))]
            for cache in caches[mode]:
                forward_batch(model, [Slice(prompt, torch.arange(CONTEXT), None, torch.arange(1), cache)], runner)
        for batch in STEP_BATCHES:
            for k in STEP_KS:
                row = {"batch": batch, "k": k}
                steps = {}
                for mode, runner in runners.items():
                    slices = [Slice(list(range(5, 5 + k)), torch.arange(CONTEXT, CONTEXT + k), None, torch.arange(k),
                                    cache, tuple(range(-1, k - 1))) for cache in caches[mode][:batch]]
                    compiled = runner.prepare(slices)
                    row[f"static_{mode}_ms"] = round(cuda_median_ms(lambda r=runner, c=compiled: r.launch(c)), 3)
                    steps[mode] = slices

                def whole_step(runner=runners["graphs"], slices=steps["graphs"]):
                    runner.collect(slices, *runner.launch(runner.prepare(slices)))
                    for slice_ in slices:
                        slice_.cache.commit(CONTEXT, [])  # back to the 300 cached tokens

                row["static_graphs_whole_step_ms"] = round(cuda_median_ms(whole_step), 3)
                if batch == 1:
                    cache = new_cache(model, CONTEXT + 256)
                    forward_packed(model, [Slice(prompt, torch.arange(CONTEXT), None, torch.arange(1), cache)])

                    def eager_step(cache=cache, k=k):
                        forward_packed(model, [Slice(list(range(5, 5 + k)), torch.arange(CONTEXT, CONTEXT + k), None,
                                                     torch.arange(k), cache)])
                        cache.commit(CONTEXT, [])

                    row["forward_packed_ms"] = round(cuda_median_ms(eager_step, repeats=REPEATS // 2), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    graphs = runners["graphs"]
    rows.append({"captures": graphs.captures, "capture_seconds": round(graphs.capture_seconds, 2),
                 "mode_after": graphs.mode})
    return rows


def run_command(command: Sequence[str], timeout: float) -> dict:
    """Run ``command`` from the repository root; its exit status, last lines and seconds."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        status, output = "timeout", f"{error.stdout or ''}{error.stderr or ''}"
    tail = output if isinstance(output, str) else output.decode(errors="replace")
    return {"command": " ".join(command), "status": status, "seconds": round(time.perf_counter() - started, 1),
            "tail": tail.strip().splitlines()[-25:]}


def model_available() -> str | None:
    """None when the default model loads here, else why not."""
    try:
        from decoding.loading import cache_root

        if any((cache_root() / "models").glob("*/config.json")) or any((cache_root() / "gguf").glob("*.gguf")):
            return None
        return f"no converted model or GGUF under {cache_root()} (see scripts/gpu-check --help)"
    except Exception as error:
        return str(error)


def server_available() -> str | None:
    """None when the server's packages import here, else which one is missing."""
    for name in ("fastapi", "uvicorn", "sse_starlette", "pydantic", "openai"):
        try:
            __import__(name)
        except ImportError:
            return f"{name} is not installed (carry it as a wheel: scripts/gpu-check --help)"
    return None


def markdown(report: dict) -> str:
    """The report's tables."""
    lines = [f"# GPU check, {report['date']}, commit {report['commit']}", "",
             f"{report['device']}; torch {report['torch']}; model: {report.get('model', '-')}", ""]
    tests = report["tests"]
    lines += ["## CUDA tests", "", f"`{tests['command']}`: status {tests['status']}, {tests['seconds']} s: "
              f"{tests['tail'][-1] if tests['tail'] else ''}", ""]
    rows = [row for row in report.get("step_cost", []) if "k" in row]
    if rows:
        lines += ["## Step cost (ms, CUDA events, median)", "",
                  "| batch | k | forward_packed | static eager | static graph | whole static step (graph) |",
                  "|---|---|---|---|---|---|"]
        for row in rows:
            cells = (row["batch"], row["k"], row.get("forward_packed_ms", "-"), row["static_eager_ms"],
                     row["static_graphs_ms"], row["static_graphs_whole_step_ms"])
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
        lines.append("")
    for name in ("heldout", "load"):
        part = report.get(name)
        lines += [f"## {name}", ""]
        if isinstance(part, str):
            lines += [f"skipped: {part}", ""]
            continue
        for run in part or []:
            lines += [f"`{run['command']}`: status {run['status']}, {run['seconds']} s", "", "```",
                      *run["tail"], "```", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench gpu --out DIR``; returns 2 without a CUDA device."""
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-results", help="folder for gpu.json and gpu.md (gpu-results)")
    parser.add_argument("--skip", default="", help="comma list of parts to leave out: tests, step_cost, heldout, load")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip() or "unknown",
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    python = sys.executable
    report["tests"] = {"command": "-", "status": "skipped", "seconds": 0, "tail": []} if "tests" in skip else \
        run_command([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/decoding/test_cuda.py"], 240)
    if "step_cost" not in skip:
        model, source = load_default("cuda")
        report["model"] = source
        report["step_cost"] = step_cost(model)
        del model
        torch.cuda.empty_cache()
    missing = model_available()
    if "heldout" not in skip:
        report["heldout"] = missing or [
            *(run_command([python, "-m", "bench", "heldout", "--dataset", name, "--preset", "cuda", "--device", "cuda",
                           "--output", str(out / f"heldout-{name}.json")], 120) for name in HELDOUT_SETS),
            run_command([python, "-m", "bench", "--device", "cuda", "--dataset", "humaneval", "--limit", "4",
                         "--methods", "greedy,generate_compiled", "--json", str(out / "generate-compiled.json")], 120),
        ]
    if "load" not in skip:
        report["load"] = missing or server_available() or [
            run_command([python, "scripts/loadtest.py", "--spawn", "--server-arg=--device=cuda", "--concurrency",
                         "1,8", "--limit", "4", "--max-seconds", "40", "--json", str(out / "load.json")], 150)]
    (out / "gpu.json").write_text(json.dumps(report, indent=2))
    (out / "gpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
