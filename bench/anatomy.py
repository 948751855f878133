"""The anatomy of a step: host work per phase, ATen ops per forward, blocking copies, graphs per bucket.

Contract: ``python -m bench anatomy [--preset cpu|cuda] [--json FILE]`` (``main(argv)``) decodes with a greedy
and a lookahead stream of the preset (its W/N/G, copies and batch policy), and a ``rested`` one (the same lookahead
stream, kept on plain one-token steps by the payoff guard, ``decoding.payoff``, after its first verifying step: what
a rested step costs the host) on ``tiny_deep_llama``: the default
model's depth (30 LLaMA layers) at a tiny width, so that a forward's arithmetic is negligible and what is left is
the work a GPU step pays on the host. Each is run twice, each step one ``BatchEngine.step()`` (the server's engine
step, whole): through today's eager path (``forward_packed``) and through the static step (``decoding.forward.static``,
eager mode on the CPU). It prints, per path and stream:

- ``step_host_ms`` (also ``host_ms``): CPU thread milliseconds per engine step, the device's work excluded (median
  over the decode), and per phase (each exclusive of the others): ``plan`` (propose, allocate, layout),
  ``inputs`` (the static step's input buffer and its check; the eager path builds its inputs and masks inside
  ``forward_packed``, outside ``lean.forward``: counted there), ``commit`` (staging the pool's deferred KV moves:
  their index, copied without blocking), ``read`` (the step's results to Python), ``finish`` (verify, commit,
  pool, proposers' feedback, the stream's ``Step``) and ``other`` (the engine's own bookkeeping: the bucket, the
  results). The device's work is the forward (``lean.forward``, or the static forward's launch: its mask is built
  inside it, as on a GPU) and the KV moves (a gather and a scatter: ``commit_device_ms``).
- ``step_host_ms_replayed`` (static path): the same host work with the device's work replayed
  (``replayed_host_ms``): the decode again, each forward answered by the first decode's recorded outputs, so that no
  forward runs on the CPU between two steps' host work, as on a GPU's host. On this CPU the forward's memory traffic
  evicts the host's working set from the caches between steps: ``step_host_ms`` pays that, a GPU's host does not.
- ``aten_ops_forward``: ATen ops dispatched by one forward (``count_aten_ops``) at the decode's median step: the
  kernels a captured plain forward (``"graphs"``) launches. ``kernels_per_forward``: on the static path, the kernels
  of the fused step (``"fused"``: the forward compiled by inductor) at that step, counted as ``bench.kernels`` does
  (with ``fused_kernels``, its library calls and generated kernels apart); elsewhere, or with ``--no-kernels``,
  the ATen ops.
- ``reads_per_step``: device-to-host reads into Python per step (``item``, ``tolist``, ``bool()`` ...; median, and
  ``reads_per_step_max``); ``syncs_in_step``: those plus blocking host-to-device copies (``SyncCounter``);
  ``syncs_in_static``: those inside the forward. Counted in a second, identical decode, so that the counter's own
  Python is not timed.
- ``graphs_per_bucket``: graphs ``torch.compile(fullgraph=True, dynamic=False)`` made for each bucket over a whole
  decode, recompiles made errors (static path only).

- ``server``: the server's worker around the static path's greedy and lookahead steps (``bench.worker_anatomy``), its
  loop serial and overlapped (``batch.overlap_steps``).

The JSON has ``{"preset": ..., "eager": {"greedy": {...}, "lookahead": {...}, "rested": {...}}, "static": {...},
"server": {...}}``;
the top-level ``"greedy"``, ``"lookahead"`` and ``"rested"`` are the static path's. The greedy and lookahead streams
run without the payoff guard (each row is one kind of step).

``--held-out SETS`` measures instead the default model's replayed host work on held-out prompts
(``bench.held_out_host``: the tiny model's text repeats itself, so its lookahead steps commit more than real text's);
``--device cuda`` the GPU's wall, host and device ms (``bench.device_anatomy``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from transformers import LlamaForCausalLM

from bench.counters import OpCounter, SyncCounter, count_aten_ops
from bench.kernels import fused_kernels
from bench.probe import (
    DECODE_TOKENS,
    DEPTH,
    Clock,
    anatomy_prompt,
    engine_step,
    open_decode,
    patched,
    preset_lookahead,
    replayed_host_ms,
    tiny_deep_llama,
)
from bench.report import write_json
from bench.worker_anatomy import worker_rows, worker_table
from decoding.batch import BatchPolicy, forward_batch
from decoding.forward import lean
from decoding.forward.kv_cache import KVPool
from decoding.forward.static import StaticStep
from decoding.params import LookaheadConfig

GRAPH_DECODE_TOKENS = 24  # the compile count's decode: each new bucket costs a compile
STREAMS = ("greedy", "lookahead", "rested")
def _phases(clock: Clock, static: StaticStep | None) -> list[tuple[object, str, Callable]]:
    """What to patch so that ``clock`` splits an engine step into the module contract's phases."""
    from decoding import batch

    patches = [(batch, "plan_batch", clock.wrap("plan", batch.plan_batch)),
               (batch, "finish_batch", clock.wrap("finish", batch.finish_batch)),
               (batch, "forward_packed", clock.wrap("inputs", batch.forward_packed)),  # less lean.forward
               (lean, "forward", clock.wrap("forward", lean.forward))]
    if static is not None:
        pool = static.pool
        patches += [(static, "prepare", clock.wrap("inputs", static.prepare)),
                    (pool, "stage_moves", clock.wrap("commit", pool.stage_moves)),
                    (pool, "apply_moves", clock.wrap("commit_device", pool.apply_moves)),
                    (static, "launch", clock.wrap("forward", static.launch)),
                    (static, "collect", clock.wrap("read", static.collect))]
    return patches


def measure_decode(
    model: LlamaForCausalLM, lookahead: LookaheadConfig | None, policy: BatchPolicy, static: StaticStep | None,
    max_tokens: int = DECODE_TOKENS, rested: bool = False,
) -> dict:
    """Decode one stream through ``BatchEngine.step`` (prefill excluded from the figures) and report the module
    contract's measures: timed in one decode, the syncs counted in a second, identical one (the counter's own
    Python would be timed too)."""
    clock = Clock()
    engine = open_decode(model, lookahead, policy, static, max_tokens, rested)
    per_step: list[dict[str, float]] = []
    tokens: list[int] = []
    with torch.inference_mode(), patched(_phases(clock, static)):
        while engine.has_work:
            clock.reset()
            started = time.thread_time()
            step = engine_step(engine)
            total = time.thread_time() - started
            if step.stats.prefill:
                continue
            phases = dict(clock.phases)
            device = phases.get("forward", 0.0) + phases.get("commit_device", 0.0)
            per_step.append({**phases, "other": total - sum(phases.values()), "host": total - device})
            tokens.append(step.stats.input_tokens)
    syncs, reads = _count_syncs(model, lookahead, policy, static, max_tokens, rested)
    phases = sorted({name for step in per_step for name in step} - {"forward", "host", "commit_device"})
    host_ms = round(1000 * statistics.median(step["host"] for step in per_step), 3)
    return {
        "steps": len(per_step),
        "median_step_tokens": statistics.median_low(tokens),
        "host_ms": host_ms,
        "step_host_ms": host_ms,
        "phases_ms": {name: round(1000 * statistics.median(step.get(name, 0.0) for step in per_step), 3)
                      for name in phases},
        "forward_ms": round(1000 * statistics.median(step.get("forward", 0.0) for step in per_step), 3),
        "commit_device_ms": round(1000 * statistics.median(step.get("commit_device", 0.0) for step in per_step), 3),
        "syncs_in_step": statistics.median_low(syncs),
        "reads_per_step": statistics.median_low(reads),
        "reads_per_step_max": max(reads),
    }


def _count_syncs(model: LlamaForCausalLM, lookahead: LookaheadConfig | None, policy: BatchPolicy,
                 static: StaticStep | None, max_tokens: int, rested: bool = False) -> tuple[list[int], list[int]]:
    """Per decode step (prefill excluded): the blocking copies and reads (``SyncCounter``), and the reads alone."""
    engine = open_decode(model, lookahead, policy, static, max_tokens, rested)
    syncs: list[int] = []
    reads: list[int] = []
    with torch.inference_mode():
        while engine.has_work:
            with SyncCounter(model.device) as counter:
                step = engine_step(engine)
            if not step.stats.prefill:
                syncs.append(counter.count)
                reads.append(counter.reads)
    return syncs, reads


def forward_ops(model: LlamaForCausalLM, static: StaticStep | None, tokens: int) -> tuple[int, int]:
    """ATen ops of one forward of ``tokens`` tokens after a 96-token prompt, and the blocking copies inside
    it: the static forward's, or the eager ``lean.forward``'s (``forward_packed``'s inputs and masks excluded)."""
    from decoding.forward.kv_cache import new_cache
    from decoding.forward.packed import forward_packed
    from decoding.forward.slices import Slice

    prompt = anatomy_prompt(model.config.vocab_size)
    cache = static.pool.acquire(len(prompt) + tokens) if static is not None else new_cache(model, len(prompt) + tokens)
    visible = torch.ones((tokens, tokens), dtype=torch.bool).tril_()
    with torch.inference_mode():
        forward_batch(model, [Slice(prompt, torch.arange(len(prompt)), None, torch.arange(1), cache)], static)
        slice_ = Slice(list(range(tokens)), torch.arange(tokens) + len(prompt), visible, torch.arange(tokens), cache,
                       tuple(range(-1, tokens - 1)))
        if static is not None:
            compiled = static.prepare([slice_])
            ops = count_aten_ops(lambda: static.launch(compiled))
            with SyncCounter(model.device) as counter:
                static.launch(compiled)
            static.pool.release(cache)
            return ops, counter.count
        counts: list[int] = []
        counter = SyncCounter(model.device)
        original = lean.forward

        def counted(*args, **kwargs):
            with OpCounter() as ops_counter, counter:
                result = original(*args, **kwargs)
            counts.append(sum(ops_counter.ops.values()))
            return result

        lean.forward = counted
        try:
            forward_packed(model, [slice_])
        finally:
            lean.forward = original
        return counts[0], counter.count


def graphs_per_bucket(model: LlamaForCausalLM, lookahead: LookaheadConfig, policy: BatchPolicy) -> dict[str, int]:
    """Graphs compiled per bucket over a whole greedy-then-lookahead decode with ``torch.compile(fullgraph=True,
    dynamic=False, backend="aot_eager")``, recompiles made errors."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[int] = []

    def counting(graph_module, example_inputs):
        graphs.append(1)
        return aot_eager(graph_module, example_inputs)

    static = StaticStep(model, KVPool(model, 2, 1024, scratch_tokens=256), mode="compile", backend=counting)
    per_bucket: dict[str, int] = {}
    previous = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        for config in (None, lookahead):
            known = set(static._buckets)
            engine = open_decode(model, config, policy, static, GRAPH_DECODE_TOKENS)
            while engine.has_work:
                before = len(graphs)
                engine_step(engine)
                for bucket in set(static._buckets) - known:
                    per_bucket[f"{bucket.sequences}x{bucket.tokens}@{bucket.attended}"] = len(graphs) - before
                known = set(static._buckets)
    finally:
        torch._dynamo.config.error_on_recompile = previous
        torch._dynamo.reset()
    return per_bucket


def run(preset: str, graphs: bool = True, kernels: bool = True) -> dict:
    """Every measure of the module contract for ``preset``; ``kernels``: count the fused step's kernels (two
    compiles of the 30-layer model: minutes on a small CPU)."""
    lookahead, policy = preset_lookahead(preset)
    policy = dataclasses.replace(policy, max_step_tokens=max(policy.max_step_tokens, 256))
    report: dict = {"preset": preset, "settings": dataclasses.asdict(lookahead)}
    for path in ("eager", "static"):
        model = tiny_deep_llama()
        static = StaticStep(model, KVPool(model, 2, 1024, scratch_tokens=256)) if path == "static" else None
        report[path] = {}
        for name, config, rested in (("greedy", None, False), ("lookahead", lookahead, False),
                                     ("rested", lookahead, True)):
            measured = measure_decode(model, config, policy, static, rested=rested)
            if static is not None:
                measured["step_host_ms_replayed"] = replayed_host_ms(model, config, policy, static, rested=rested)
            ops, inside = forward_ops(model, static, measured["median_step_tokens"])
            measured.update(aten_ops_forward=ops, kernels_per_forward=ops, syncs_in_static=inside)
            if kernels and path == "static":
                count = fused_kernels(tiny_deep_llama(), measured["median_step_tokens"])
                measured.update(kernels_per_forward=count.kernels, fused_kernels=dataclasses.asdict(count))
            report[path][name] = measured
    report["server"] = server_rows(lookahead, policy)
    if graphs:
        counted = graphs_per_bucket(tiny_deep_llama(), lookahead, policy)
        for name in ("greedy", "lookahead"):
            report["static"][name]["graphs_per_bucket"] = counted
    for name in STREAMS:
        report[name] = report["static"][name]
    return report


def server_rows(lookahead: LookaheadConfig, policy: BatchPolicy) -> dict:
    """``bench.worker_anatomy.worker_rows``: the server's worker around the static path's greedy and lookahead steps,
    its loop serial and overlapped."""
    model = tiny_deep_llama()
    static = StaticStep(model, KVPool(model, 2, 1024, scratch_tokens=256))
    return worker_rows(model, static, lookahead, policy, anatomy_prompt(model.config.vocab_size), DECODE_TOKENS)


def table(report: dict) -> str:
    """The report as a markdown table, one row per path and stream."""
    lines = ["| path | stream | step tokens | host ms | host ms, device replayed | phases (ms) | forward ms | "
             "kernels | reads | syncs in step | syncs in forward |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in ("eager", "static"):
        for name in STREAMS:
            row = report[path][name]
            phases = ", ".join(f"{phase} {value:.3f}" for phase, value in row["phases_ms"].items())
            replayed = row.get("step_host_ms_replayed")
            lines.append(f"| {path} | {name} | {row['median_step_tokens']} | {row['step_host_ms']:.3f} | "
                         f"{'-' if replayed is None else f'{replayed:.3f}'} | {phases} | {row['forward_ms']:.2f} | "
                         f"{row['kernels_per_forward']} | {row['reads_per_step']} | {row['syncs_in_step']} | "
                         f"{row['syncs_in_static']} |")
    for name in ("greedy", "lookahead"):
        count = report["static"][name].get("fused_kernels")
        if count is not None:
            lines.append("")
            lines.append(f"fused step, {name}: {count['kernels']} kernels a forward ({count['fused']} generated, "
                         f"{count['library']} library calls; ATen ops {report['static'][name]['aten_ops_forward']})")
    server = report.get("server")
    if server:
        lines += ["", *worker_table(server, "server's worker, static path")]
    graphs = report["static"]["lookahead"].get("graphs_per_bucket")
    if graphs is not None:
        lines.append("")
        lines.append(f"graphs per bucket over a greedy and a lookahead decode: {graphs}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench anatomy``: print the table; ``--json FILE`` writes the report too."""
    parser = argparse.ArgumentParser(prog="python -m bench anatomy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("cpu", "cuda"), default="cuda",
                        help="whose lookahead settings and batch policy to take (default: cuda)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--no-graphs", action="store_true", help="skip the graphs-per-bucket count")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the fused step's kernel count (two inductor compiles, the slowest part)")
    parser.add_argument("--held-out", metavar="SETS",
                        help="instead: the default model's host ms a step, device replayed, on the first held-out "
                             "prompt of each comma-separated set (bench.held_out_host; e.g. humaneval,chat)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: wall, host and device ms a step on the GPU, through captured graphs "
                             "(bench.device_anatomy); the CPU's report otherwise")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.held_out:
        from bench.held_out_host import held_out_rows, held_out_table

        rows = held_out_rows(args.held_out.split(","), args.preset)
        print(f"preset {args.preset}: the default model in float32, its static step run eagerly on this CPU")
        print("\n".join(held_out_table(rows)))
        if args.json:
            write_json(args.json, {"preset": args.preset, "held_out": rows})
        return 0
    if args.device == "cuda":
        from bench import device_anatomy

        report = device_anatomy.run_device("cuda", args.preset)
        print(device_anatomy.table(report))
        if args.json:
            write_json(args.json, report)
        return 0
    report = run(args.preset, graphs=not args.no_graphs, kernels=not args.no_kernels)
    settings = report["settings"]
    print(f"preset {args.preset}: W={settings['window_size']} N={settings['ngram_size']} "
          f"G={settings['guess_set_size']}, {DEPTH}-layer width-48 LLaMA, CPU thread time per step")
    print(table(report))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
