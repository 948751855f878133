"""The GPU check's step-cost part, run in its own process: what one step of k tokens costs on the GPU.

Contract: ``python -m bench.gpu_step_cost --out FILE [--random-weights]`` times one step of k tokens (``STEP_KS``:
1..128) over ``CONTEXT`` (300) cached tokens for 1, 4 and 8 sequences, on the default model in float32 (or, with
``--random-weights`` or when it does not load, random weights of its exact shape: the same kernels, the same times):
today's eager ``forward_packed`` (batch 1), the static step run eagerly, and its CUDA graph replayed (CUDA events,
median of ``REPEATS`` runs), and the whole static step as the engine runs it through graphs (host work included),
and for one sequence the graph with the attention of before the tree kernel (``static_graphs_sdpa_ms``: SDPA over
gathered keys, ``tree_kernel=False``). With ``--fused``, the fused step instead (``"fused"``: the forward compiled
by inductor, captured) for ``FUSED_ROWS``: replayed, whole, and the seconds of each row's first build (a new class
compiles there). FILE is rewritten after every row as ``{"model", "rows", "complete"}``, so a run cut off by its
time budget keeps the rows it measured; the captures follow the rows. Exit status 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

STEP_KS = (1, 2, 4, 8, 16, 32, 64, 96, 128)
STEP_BATCHES = (1, 4, 8)
CONTEXT = 300
REPEATS = 50
PROMPT = [(17 * index) % 1000 + 5 for index in range(CONTEXT)]  # the cached tokens each timed step attends to
FUSED_ROWS = ((1, 1), (1, 2), (1, 8), (1, 32), (1, 64), (1, 128), (8, 1))  # (batch, k): five compiles in all


def default_model_shape() -> torch.nn.Module:
    """A random-weight LLaMA of SmolLM2-135M-Instruct's exact shape (30 layers, 576 wide, 9:3 heads, 49152 tokens,
    tied embeddings): the default model's kernels and times, when its weights are not on this machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def load_default(device: str, random_weights: bool) -> tuple[torch.nn.Module, str]:
    """The default model on ``device`` in float32 and where it came from ("default model" or "random weights")."""
    if not random_weights:
        try:
            from decoding.weights.loading import load_model

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


def step_cost(model: torch.nn.Module, emit: Callable[[dict], None]) -> None:
    """Time every (batch, k) row (module contract), handing each to ``emit`` as it is measured."""
    from decoding.batch import forward_batch
    from decoding.forward.kv_cache import KVPool, new_cache
    from decoding.forward.packed import forward_packed
    from decoding.forward.slices import Slice
    from decoding.forward.static import StaticStep

    runners = {mode: StaticStep(model, KVPool(model, max(STEP_BATCHES), 1024, scratch_tokens=256), mode)
               for mode in ("eager", "graphs")}
    # One stream through graphs with attention as before the tree kernel (SDPA over gathered keys): what it pays.
    runners["graphs_sdpa"] = StaticStep(model, KVPool(model, 1, 1024, scratch_tokens=256), "graphs", tree_kernel=False)
    with torch.inference_mode():
        caches = {}
        for mode, runner in runners.items():
            caches[mode] = [runner.pool.acquire(1024) for _ in range(runner.pool.sequences)]
            for cache in caches[mode]:
                forward_batch(model, [Slice(PROMPT, torch.arange(CONTEXT), None, torch.arange(1), cache)], runner)
        for batch in STEP_BATCHES:
            for k in STEP_KS:
                row = {"batch": batch, "k": k}
                steps = {}
                for mode, runner in runners.items():
                    if batch > runner.pool.sequences:
                        continue
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
                    forward_packed(model, [Slice(PROMPT, torch.arange(CONTEXT), None, torch.arange(1), cache)])

                    def eager_step(cache=cache, k=k):
                        forward_packed(model, [Slice(list(range(5, 5 + k)), torch.arange(CONTEXT, CONTEXT + k), None,
                                                     torch.arange(k), cache)])
                        cache.commit(CONTEXT, [])

                    row["forward_packed_ms"] = round(cuda_median_ms(eager_step, repeats=REPEATS // 2), 3)
                emit(row)
    graphs = runners["graphs"]
    emit({"captures": graphs.captures, "capture_seconds": round(graphs.capture_seconds, 2), "mode_after": graphs.mode})


def fused_step_cost(model: torch.nn.Module, emit: Callable[[dict], None]) -> None:
    """The fused step's rows (``FUSED_ROWS``): each (batch, k) replayed and whole, with the seconds its first
    build took (a new class of buckets compiles there), then the step's compiles, captures and mode."""
    from decoding.batch import forward_batch
    from decoding.forward.kv_cache import KVPool
    from decoding.forward.slices import Slice
    from decoding.forward.static import StaticStep

    runner = StaticStep(model, KVPool(model, max(STEP_BATCHES), 1024, scratch_tokens=256), "fused")
    with torch.inference_mode():
        caches = [runner.pool.acquire(1024) for _ in range(max(STEP_BATCHES))]
        for cache in caches:
            forward_batch(model, [Slice(PROMPT, torch.arange(CONTEXT), None, torch.arange(1), cache)], runner)
        for batch, k in FUSED_ROWS:
            slices = [Slice(list(range(5, 5 + k)), torch.arange(CONTEXT, CONTEXT + k), None, torch.arange(k), cache,
                            tuple(range(-1, k - 1))) for cache in caches[:batch]]
            started = time.perf_counter()
            compiled = runner.prepare(slices)
            torch.cuda.synchronize()
            row = {"batch": batch, "k": k, "fused_build_s": round(time.perf_counter() - started, 2),
                   "static_fused_ms": round(cuda_median_ms(lambda c=compiled: runner.launch(c)), 3)}

            def whole_step(slices=slices):
                runner.collect(slices, *runner.launch(runner.prepare(slices)))
                for slice_ in slices:
                    slice_.cache.commit(CONTEXT, [])

            row["static_fused_whole_step_ms"] = round(cuda_median_ms(whole_step), 3)
            emit(row)
    emit({"fused_compiles": runner.fused.compiles if runner.fused else None, "fused_captures": runner.captures,
          "fused_capture_seconds": round(runner.capture_seconds, 2), "fused_mode_after": runner.mode})


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and write FILE after every row; 2 without a CUDA device."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file, rewritten after every row")
    parser.add_argument("--random-weights", action="store_true", help="time random weights of the default shape")
    parser.add_argument("--fused", action="store_true", help="time the fused step (inductor's forward, captured)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the step cost needs one", file=sys.stderr)
        return 2
    model, source = load_default("cuda", args.random_weights)
    payload: dict = {"model": source, "rows": [], "complete": False}

    def emit(row: dict) -> None:
        payload["rows"].append(row)
        args.out.write_text(json.dumps(payload, indent=1))
        print(json.dumps(row), flush=True)

    (fused_step_cost if args.fused else step_cost)(model, emit)
    payload["complete"] = True
    args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
