"""``python -m bench compile``: the CPU forwards side by side in one process on the default model: the fused step
the server runs (``decoding.forward.fused``), the lean step it replaced (``lean.forward``: the model's own modules, one
ATen op at a time) and ``torch.compile``'s graphs around the native products (``decoding.forward.compiled``).

Contract: ``main(argv)`` loads the default model as the CPU preset loads it (one thread). With ``compiled`` among
``--forwards`` it builds the ``CompiledForward`` and times the compile: one greedy and one lookahead decode of a
short prompt with it (the graphs a decode needs: a prefill chunk, one-token and multi-token steps), with the
graph count and recompiles torch reports. Then it decodes each of the first ``--limit`` prompts of ``--dataset``
with greedy and with lookahead (the CPU preset's settings) under each forward, alternating the order from prompt
to prompt, and prints ms per token for each (median over prompts of each prompt's seconds / tokens; wall clock
and this thread's CPU time, steadier on a shared machine), each forward's ratio to the lean step's (the median
of each prompt's CPU-time ratio), whether lookahead's output equalled greedy's under each forward, and on how
many prompts each forward's outputs equalled the lean step's. ``--cold`` compiles into a fresh inductor cache
(what a first start on a new machine pays); without it inductor's on-disk cache may hold the graphs from an
earlier run. ``--json PATH`` writes the figures. Exit status 2 on bad arguments or when the model is not one
the asked forwards run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from bench.datasets import DatasetError, encode_prompt, load_dataset
from bench.measure import decode_greedy, decode_lookahead
from bench.records import Decoded
from bench.report import write_json
from decoding.decoder import Decoder, configure_threads
from decoding.forward import fused, lean
from decoding.forward.compiled import CompiledForward
from decoding.forward.packed import LEAN_FORWARD
from decoding.params import StopCriteria
from server.config import decoder_lookahead
from server.config_layers import load_config

FORWARDS = ("fused", "lean", "compiled")
BASELINE = "lean"
METHODS = ("greedy", "lookahead")
WARMUP_PROMPT = "def fibonacci(n):\n    "


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval", choices=("humaneval", "chat", "alpacaeval", "mtbench"))
    parser.add_argument("--limit", type=int, default=6, help="first N prompts (default 6)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per decode (default 128)")
    parser.add_argument("--forwards", default=",".join(FORWARDS),
                        help=f"comma-separated, from {', '.join(FORWARDS)} (default all; lean is the baseline)")
    parser.add_argument("--cold", action="store_true", help="compile into a fresh inductor cache")
    parser.add_argument("--json", help="write the figures here")
    return parser


def use_forward(decoder: Decoder, compiled: CompiledForward | None, forward: str) -> None:
    """Step ``decoder``'s model with ``forward``: ``fused`` as the server does (``forward_packed``'s own choice),
    ``lean`` with ``lean.forward``, ``compiled`` with ``compiled``."""
    model = decoder.loaded.model
    if forward == "fused":
        model.__dict__.pop(LEAN_FORWARD, None)
    else:
        setattr(model, LEAN_FORWARD, compiled if forward == "compiled" else lean.forward)


def decoders_of(decoder: Decoder, max_tokens: int) -> dict[str, Callable[[Sequence[int]], Decoded]]:
    """Greedy and lookahead (the CPU preset's settings) decodes of ``max_tokens`` on ``decoder``'s model."""
    lookahead = decoder_lookahead(load_config(device_preset="cpu").lookahead)
    model, stop = decoder.loaded.model, StopCriteria(max_tokens, decoder.eos_token_ids())
    return {"greedy": lambda ids: decode_greedy(model, ids, stop),
            "lookahead": lambda ids: decode_lookahead(model, ids, stop, lookahead)}


def compile_figures(decoder: Decoder, compiled: CompiledForward, max_tokens: int) -> dict[str, object]:
    """Seconds the first compiled greedy and lookahead decodes of ``WARMUP_PROMPT`` take (the compile), and the
    graphs and recompiles torch counted."""
    from torch._dynamo.utils import counters

    use_forward(decoder, compiled, "compiled")
    ids = decoder.tokenizer(WARMUP_PROMPT)["input_ids"]
    started = time.perf_counter()
    for decode in decoders_of(decoder, max_tokens).values():
        decode(ids)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


def speed_figures(decoder: Decoder, compiled: CompiledForward | None, forwards: Sequence[str], dataset: str,
                  limit: int, max_tokens: int) -> dict:
    """ms per token of greedy and lookahead under each of ``forwards`` (the lean one among them), alternated prompt
    by prompt; each forward's CPU-time ratio to the lean step's; exactness counts."""
    prompts = [encode_prompt(decoder.tokenizer, spec) for spec in load_dataset(dataset, limit)]
    decodes = decoders_of(decoder, max_tokens)
    times: dict[tuple[str, str], list[float]] = {(f, m): [] for f in forwards for m in METHODS}
    cpu: dict[tuple[str, str], list[float]] = {(f, m): [] for f in forwards for m in METHODS}
    identical = dict.fromkeys(forwards, 0)
    equals_baseline = dict.fromkeys(forwards, 0)
    for index, ids in enumerate(prompts):
        outputs = {}
        for forward in forwards if index % 2 == 0 else forwards[::-1]:
            use_forward(decoder, compiled, forward)
            for method in METHODS if index % 2 == 0 else METHODS[::-1]:
                started, started_cpu = time.perf_counter(), time.thread_time()
                decoded = decodes[method](ids)
                times[forward, method].append(1000 * (time.perf_counter() - started) / len(decoded.output_ids))
                cpu[forward, method].append(1000 * (time.thread_time() - started_cpu) / len(decoded.output_ids))
                outputs[forward, method] = decoded.output_ids
            identical[forward] += outputs[forward, "greedy"] == outputs[forward, "lookahead"]
        for forward in forwards:
            equals_baseline[forward] += all(outputs[forward, m] == outputs[BASELINE, m] for m in METHODS)
    use_forward(decoder, compiled, "fused")
    medians = {f"{f} {m}": statistics.median(times[f, m]) for f in forwards for m in METHODS}
    cpu_medians = {f"{f} {m}": statistics.median(cpu[f, m]) for f in forwards for m in METHODS}
    ratios = {f"{f} {m}": statistics.median(c / e for c, e in zip(cpu[f, m], cpu[BASELINE, m], strict=True))
              for f in forwards if f != BASELINE for m in METHODS}
    return {"dataset": dataset, "prompts": len(prompts), "max_tokens": max_tokens, "ms_per_token": medians,
            "cpu_ms_per_token": cpu_medians, "cpu_ratio": ratios,
            "lookahead_identical_to_greedy": identical, "identical_to_lean": equals_baseline}


def report(figures: dict) -> str:
    """The figures as lines of text."""
    lines = []
    compile_ = figures.get("compile")
    if compile_:
        lines.append(f"compile: {compile_['seconds']:.1f} s ({'fresh' if compile_.get('cold') else 'warm'} inductor "
                     f"cache), {compile_['graphs']} graphs, {compile_['recompiles']} recompiles")
    speed = figures.get("speed")
    if speed:
        ms = speed["ms_per_token"]
        lines.append(f"{speed['dataset']}, {speed['prompts']} prompts, {speed['max_tokens']} tokens, one thread:")
        for key, value in ms.items():
            lines.append(f"  {key:20s} {value:7.2f} ms/token, {speed['cpu_ms_per_token'][key]:7.2f} ms of CPU")
        for key, ratio in speed["cpu_ratio"].items():
            forward, method = key.split()
            time_ratio = ms[key] / ms[f"{BASELINE} {method}"]
            lines.append(f"  {method}: {forward} / {BASELINE} = {time_ratio:.3f}x time, {ratio:.3f}x CPU "
                         "(median of per-prompt ratios)")
        lines.append(f"  lookahead == greedy on {speed['lookahead_identical_to_greedy']} of {speed['prompts']}")
        lines.append(f"  outputs == the lean step's (both methods) on {speed['identical_to_lean']} of "
                     f"{speed['prompts']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments or a model the asked forwards cannot run)."""
    args = parser().parse_args(argv)
    forwards = [name.strip() for name in args.forwards.split(",") if name.strip()]
    if args.limit < 1 or args.max_tokens < 1:
        parser().error("--limit and --max-tokens must be >= 1")
    if not set(forwards) <= set(FORWARDS) or BASELINE not in forwards or len(set(forwards)) != len(forwards):
        parser().error(f"--forwards: distinct names from {', '.join(FORWARDS)}, {BASELINE} among them")
    configure_threads(1)
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    decoder = Decoder.load("default", device="cpu")
    model = decoder.loaded.model
    compiled = CompiledForward.build(model) if "compiled" in forwards else None
    if ("compiled" in forwards and compiled is None) or ("fused" in forwards and fused.plan_for(model) is None):
        print("error: an asked forward does not run this model here", file=sys.stderr)
        return 2
    figures: dict[str, object] = {}
    if compiled is not None:
        figures["compile"] = {**compile_figures(decoder, compiled, 32), "cold": args.cold}
    try:
        figures["speed"] = speed_figures(decoder, compiled, forwards, args.dataset, args.limit, args.max_tokens)
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    figures["machine"] = {"threads": torch.get_num_threads(), "linears": decoder.linears}
    print(report(figures))
    if args.json:
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
