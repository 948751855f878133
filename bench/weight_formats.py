"""``python -m bench weights``: the default model's GGUF weights as they are against its float32 packed weights,
side by side in one process, and the resident memory of a process that loads each.

Contract: ``main(argv)`` loads the model twice in this process (``--weights gguf`` and ``float32``, the CPU
preset otherwise, one thread), then decodes each of the first ``--limit`` prompts of ``--dataset`` with greedy
and with lookahead (the preset's settings) on both, alternating which weights go first from prompt to prompt;
it prints tokens/s per weights and method (median over prompts of each prompt's tokens / seconds) and the
ratios, and whether each weights' lookahead output equalled its own greedy output on every prompt. With
``--step-cost`` it also times the engine's forward of k tokens over a 300-token cache on both (``bench.measure.
measure_step_cost``, every row's logits), the two alternated ``--rounds`` times, and prints each one's curve
relative to its own one-token forward (the median of the rounds). With
``--memory`` it also starts one fresh process per weights that loads the model, runs one short decode and
reports its resident set size (``psutil``), before and after the load. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil
import torch

from bench.datasets import DatasetError, encode_prompt, load_dataset
from bench.measure import STEP_COST_KS, decode_greedy, decode_lookahead, measure_step_cost
from bench.report import write_json
from decoding.decoder import Decoder, configure_threads
from decoding.params import StopCriteria
from server.config import decoder_lookahead
from server.config_layers import load_config

WEIGHTS = ("gguf", "float32")
METHODS = ("greedy", "lookahead")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval", choices=("humaneval", "chat", "alpacaeval", "mtbench"))
    parser.add_argument("--limit", type=int, default=6, help="first N prompts (default 6)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per decode (default 128)")
    parser.add_argument("--memory", action="store_true", help="also measure each weights' resident memory")
    parser.add_argument("--step-cost", action="store_true", help="also time forwards of k tokens on both")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the step-cost timing (default 3)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rss-child", choices=WEIGHTS, help=argparse.SUPPRESS)  # the memory probe's own process
    return parser


def resident_mb() -> float:
    """This process's resident set size in MB."""
    return psutil.Process().memory_info().rss / 1e6


def probe_memory(weights: str) -> dict[str, float]:
    """Load the default model with ``weights`` in this process, decode 16 tokens; the RSS before and after."""
    import transformers  # noqa: F401  (imported before the first reading: it is part of any serving process)

    before = resident_mb()
    decoder = Decoder.load("default", device="cpu", weights=weights)
    ids = decoder.tokenizer("def fibonacci(n):")["input_ids"]
    decode_greedy(decoder.loaded.model, ids, StopCriteria(16))
    return {"before_load_mb": before, "after_load_mb": resident_mb(), "linears": decoder.linears}


def memory_figures() -> dict[str, dict[str, float]]:
    """``probe_memory`` of each weights, each in a fresh process."""
    figures = {}
    for weights in WEIGHTS:
        output = subprocess.run([sys.executable, "-m", "bench", "weights", "--rss-child", weights], check=True,
                                capture_output=True, text=True).stdout
        figures[weights] = json.loads(output.strip().splitlines()[-1])
    return figures


def step_cost_figures(decoders: dict[str, Decoder], rounds: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per weights and k: the median over ``rounds`` alternated runs of a forward's ms (every row's logits) and its
    ratio to the one-token forward."""
    runs: dict[str, list[dict[int, float]]] = {weights: [] for weights in decoders}
    for index in range(rounds):
        for weights in (WEIGHTS if index % 2 == 0 else WEIGHTS[::-1]):
            costs = measure_step_cost(decoders[weights].loaded.model, ks=STEP_COST_KS, repeats=5)
            runs[weights].append({cost.k: cost.ms_all_logits for cost in costs})
    figures = {}
    for weights, curves in runs.items():
        medians = {k: statistics.median(curve[k] for curve in curves) for k in STEP_COST_KS}
        figures[weights] = {k: {"ms": ms, "ratio": ms / medians[1]} for k, ms in medians.items()}
    return figures


def speed_figures(decoders: dict[str, Decoder], dataset: str, limit: int, max_tokens: int) -> dict:
    """Greedy and lookahead tokens/s on both weights, alternated prompt by prompt (see the module contract)."""
    config = load_config(device_preset="cpu")
    lookahead = decoder_lookahead(config.lookahead)
    prompts = [encode_prompt(decoders["gguf"].tokenizer, spec) for spec in load_dataset(dataset, limit)]
    rates: dict[tuple[str, str], list[float]] = {(w, m): [] for w in WEIGHTS for m in METHODS}
    identical = dict.fromkeys(WEIGHTS, 0)
    for index, ids in enumerate(prompts):
        order = WEIGHTS if index % 2 == 0 else WEIGHTS[::-1]
        for weights in order:
            model = decoders[weights].loaded.model
            stop = StopCriteria(max_tokens, decoders[weights].eos_token_ids())
            outputs = {}
            for method in METHODS if index % 2 == 0 else METHODS[::-1]:
                start = time.perf_counter()
                decoded = (decode_greedy(model, ids, stop) if method == "greedy"
                           else decode_lookahead(model, ids, stop, lookahead))
                rates[weights, method].append(len(decoded.output_ids) / (time.perf_counter() - start))
                outputs[method] = decoded.output_ids
            identical[weights] += outputs["greedy"] == outputs["lookahead"]
    medians = {f"{w} {m}": statistics.median(rates[w, m]) for w in WEIGHTS for m in METHODS}
    return {"dataset": dataset, "prompts": len(prompts), "max_tokens": max_tokens, "tokens_per_second": medians,
            "lookahead_identical_to_greedy": identical}


def report(figures: dict) -> str:
    """The figures as lines of text."""
    lines = []
    speed = figures.get("speed")
    if speed:
        rates = speed["tokens_per_second"]
        lines.append(f"{speed['dataset']}, {speed['prompts']} prompts, {speed['max_tokens']} tokens, one thread:")
        for key, value in rates.items():
            lines.append(f"  {key:20s} {value:7.1f} tok/s")
        for method in METHODS:
            lines.append(f"  {method}: gguf / float32 = {rates[f'gguf {method}'] / rates[f'float32 {method}']:.2f}x")
        lines.append(f"  lookahead == greedy on {speed['lookahead_identical_to_greedy']} of {speed['prompts']}")
    for weights, curve in figures.get("step_cost", {}).items():
        points = ", ".join(f"{k}: {point['ms']:.1f} ms ({point['ratio']:.2f}x)" for k, point in curve.items())
        lines.append(f"step cost {weights}: {points}")
    for weights, memory in figures.get("memory", {}).items():
        lines.append(f"RSS {weights}: {memory['before_load_mb']:.0f} MB before the load, "
                     f"{memory['after_load_mb']:.0f} MB after load and a decode ({memory['linears']})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments)."""
    args = parser().parse_args(argv)
    configure_threads(1)
    if args.rss_child:
        print(json.dumps(probe_memory(args.rss_child)))
        return 0
    if args.limit < 1 or args.max_tokens < 1 or args.rounds < 1:
        parser().error("--limit, --max-tokens and --rounds must be >= 1")
    decoders = {weights: Decoder.load("default", device="cpu", weights=weights) for weights in WEIGHTS}
    try:
        figures = {"speed": speed_figures(decoders, args.dataset, args.limit, args.max_tokens)}
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.step_cost:
        figures["step_cost"] = step_cost_figures(decoders, args.rounds)
    if args.memory:
        figures["memory"] = memory_figures()
    figures["machine"] = {"threads": torch.get_num_threads()}
    print(report(figures))
    if args.json:
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
