"""``python -m bench threads``: our greedy loop, lookahead and llama.cpp at several thread counts, side by side in one
process, on held-out prompts.

Contract: ``main(argv)`` loads one model as the device's preset says, then for each of the first ``--limit``
prompts of ``--split`` of ``--dataset`` runs every (method, thread count) pair of ``--methods`` x ``--counts``
(default ``greedy,lookahead,llama_cpp`` x ``1,2``), interleaved in rotating order (``bench.measure.run_benchmark``);
before each decode ``decoding.decoder.configure_threads`` gives the pair's count to the native kernels' pool (torch
keeps one thread beside it; transformers' methods get torch at the count; llama.cpp gets its own context with that
many threads; lookahead at each count keeps its own payoff guard, priced as the server's engine prices it:
``bench.cli.server_wall``). It prints per method the tokens, seconds,
tokens per second and tokens per step, its speed-up over our greedy loop at one thread, over llama.cpp at the same
count and over our greedy loop at the same count, and whether its output is greedy's at one thread token for token
(llama.cpp's text is its own: reported, not required); ``--output`` writes the JSON ``{"config", "runs",
"summary"}``. Methods are named ``METHOD@COUNT`` (``greedy@2``).

``--step-cost`` instead times one forward of k new tokens over a cache of 300 (``bench.measure.measure_step_cost``,
every row's logits, as a lookahead step reads them) at each count, ``--rounds`` rounds with the counts
interleaved, and prints per k the median ms at each count and its ratio to the first count's.

Why: a thread count changes no output of ours (the native kernels give the same bits at any count), so the only
question is speed, and on a machine others share it must be asked side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict

from transformers import PreTrainedModel

from bench.cli import (
    PRESETS,
    add_lookahead_flags,
    add_model_flags,
    calibrated,
    gguf_file,
    json_settings,
    lookahead_config,
    parse_ks,
    server_wall,
    start,
)
from bench.datasets import DATASETS, SPLIT_NAMES, DatasetError, encode_prompt, load_split
from bench.heldout import CHAT_MAX_TOKENS, CODE_MAX_TOKENS
from bench.measure import (
    WARMUP_TOKENS,
    Decoded,
    Runner,
    RunRecord,
    make_runners,
    measure_step_cost,
    parse_methods,
    run_benchmark,
)
from bench.report import environment, format_table, header, write_json
from bench.settings import Resolved, resolve
from decoding.decoder import Decoder, configure_threads
from decoding.errors import DecodingError
from decoding.params import StopCriteria
from decoding.weights.cores import parse_threads, resolve_threads

THREAD_METHODS = ("greedy", "lookahead", "llama_cpp")
HEADERS = ["method", "tokens", "seconds", "tok/s", "tok/step", "vs greedy@1", "vs llama.cpp", "vs greedy",
           "= greedy@1"]


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench threads`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m bench threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=DATASETS, default="humaneval", help="built-in prompt set (humaneval)")
    parser.add_argument("--split", choices=SPLIT_NAMES, default="heldout", help="which split (heldout)")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of the split (0 = all; default 8)")
    parser.add_argument("--max-tokens", type=int, help=f"new tokens per decode ({CODE_MAX_TOKENS} for humaneval, "
                        f"{CHAT_MAX_TOKENS} otherwise)")
    parser.add_argument("--preset", choices=PRESETS, help="whose lookahead settings and batch policy (this device's)")
    parser.add_argument("--methods", default=",".join(THREAD_METHODS),
                        help=f"comma list of {', '.join(THREAD_METHODS)}")
    parser.add_argument("--counts", default="1,2", help="comma list of thread counts, or auto (default 1,2)")
    add_lookahead_flags(parser)
    add_model_flags(parser)
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {WARMUP_TOKENS}-token decodes per pair")
    parser.add_argument("--step-cost", action="store_true", help="time forwards of k tokens at each count instead")
    parser.add_argument("--ks", type=parse_ks, default=(1, 2, 4, 8, 16, 32), help="step sizes k (1,2,4,8,16,32)")
    parser.add_argument("--rounds", type=int, default=5, help="--step-cost rounds, counts interleaved (5)")
    parser.add_argument("--output", metavar="PATH", help="write config, runs and summary as JSON")
    return parser


def parse_counts(text: str) -> list[int]:
    """``"1,2"`` or ``"1,auto"`` -> counts >= 1 (auto resolved here); raises ``ValueError``."""
    counts = [resolve_threads(parse_threads(part.strip())) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ValueError(f"--counts: distinct thread counts >= 1, got {text!r}")
    return counts


def at_threads(runner: Runner, count: int) -> Runner:
    """``runner`` with the threads set to ``count`` first (``decoding.decoder.configure_threads``)."""

    def run(model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria) -> Decoded:
        configure_threads(count)
        return runner(model, prompt_ids, stop)

    return run


def summary_rows(runs: Sequence[RunRecord]) -> tuple[list[list[str]], list[dict[str, object]]]:
    """One row per ``METHOD@COUNT`` in run order, and the same figures as dicts."""
    totals: dict[str, tuple[int, float, int | None]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    for run in runs:
        tokens, seconds, steps = totals.get(run.method, (0, 0.0, 0))
        steps = None if steps is None or run.steps is None else steps + run.steps
        totals[run.method] = (tokens + run.new_tokens, seconds + run.seconds, steps)
        outputs[(run.method, run.id)] = list(run.output_ids)
    speed = {method: tokens / seconds for method, (tokens, seconds, _) in totals.items()}

    def ratio(method: str, other: str) -> float | None:
        return speed[method] / speed[other] if other in speed and other != method else None

    rows, figures = [], []
    for method, (tokens, seconds, steps) in totals.items():
        count = method.split("@")[1]
        reference = {prompt: ids for (name, prompt), ids in outputs.items() if name == "greedy@1"}
        same = sum(outputs[(method, prompt)] == ids for prompt, ids in reference.items() if (method, prompt) in outputs)
        figure = {"method": method, "tokens": tokens, "seconds": seconds, "tokens_per_second": speed[method],
                  "tokens_per_step": tokens / steps if steps else None,
                  "vs_greedy_1": ratio(method, "greedy@1"), "vs_llama_cpp": ratio(method, f"llama_cpp@{count}"),
                  "vs_greedy": ratio(method, f"greedy@{count}"),
                  "identical_to_greedy_1": f"{same}/{len(reference)}" if reference else None}
        figures.append(figure)
        rows.append([method, str(tokens), f"{seconds:.2f}", f"{speed[method]:.1f}",
                     "-" if figure["tokens_per_step"] is None else f"{figure['tokens_per_step']:.2f}",
                     *(_times(figure[key]) for key in ("vs_greedy_1", "vs_llama_cpp", "vs_greedy")),
                     figure["identical_to_greedy_1"] or "-"])
    return rows, figures


def _times(value: object) -> str:
    return "-" if value is None else f"{value:.2f}x"


def run_threads(resolved: Resolved, counts: Sequence[int], methods: Sequence[str]) -> dict[str, object]:
    """Load the model, run every pair, print the table; returns the JSON payload."""
    args = resolved.args
    args.threads = max(counts)
    loaded, linears = start(resolved)
    resolved = calibrated(resolved, loaded)  # at the largest count: the curve every count's lookahead prices on
    specs = load_split(args.dataset, args.split, args.limit or None)
    prompts = [(spec.id, encode_prompt(loaded.tokenizer, spec)) for spec in specs]
    runners: dict[str, Runner] = {}
    for count in counts:
        made = make_runners(methods, lookahead_config(args), 10, policy=resolved.policy,
                            gguf_path=gguf_file(args) if "llama_cpp" in methods else None, threads=count,
                            wall=server_wall(resolved, loaded.model.device.type))
        runners.update({f"{name}@{count}": at_threads(runner, count) for name, runner in made.items()})
    env = environment(loaded, max(counts), linears)
    print(header(env, [f"{args.dataset} {args.split} split x {len(prompts)} prompts, {args.max_tokens} new tokens, "
                       f"preset {resolved.preset}, pairs {', '.join(runners)} (interleaved)"]), flush=True)
    eos = Decoder(loaded).eos_token_ids()
    runs = run_benchmark(loaded.model, prompts, runners, args.max_tokens, eos, args.warmup)
    rows, figures = summary_rows(runs)
    print("\n" + format_table(HEADERS, rows), flush=True)
    return {"config": {**json_settings(resolved, env), "counts": list(counts)},
            "runs": [asdict(run) for run in runs], "summary": figures}


def run_step_costs(resolved: Resolved, counts: Sequence[int]) -> dict[str, object]:
    """``--step-cost``: per k, the median over ``--rounds`` of each count's median forward (3 a round)."""
    args = resolved.args
    args.threads = max(counts)
    loaded, linears = start(resolved)
    env = environment(loaded, max(counts), linears)
    print(header(env, [f"step cost: one forward of k tokens over 300 cached, every row's logits, counts "
                       f"{', '.join(map(str, counts))} interleaved, {args.rounds} rounds of 3"]), flush=True)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for count in counts:
            configure_threads(count)
            for cost in measure_step_cost(loaded.model, 300, args.ks, 3):
                times.setdefault((count, cost.k), []).append(cost.ms_all_logits)
    medians = {key: statistics.median(values) for key, values in times.items()}
    first = counts[0]
    rows = [[str(k), *(f"{medians[(count, k)]:.2f}" for count in counts),
             *(f"{medians[(count, k)] / medians[(first, k)]:.2f}x" for count in counts[1:])] for k in args.ks]
    names = [*(f"ms @{count}" for count in counts), *(f"@{count} / @{first}" for count in counts[1:])]
    print("\n" + format_table(["k", *names], rows), flush=True)
    return {"config": {**json_settings(resolved, env), "counts": list(counts)},
            "step_cost": [{"k": k, **{str(count): medians[(count, k)] for count in counts}} for k in args.ks]}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments or a prompt set that cannot be read)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = CODE_MAX_TOKENS if args.dataset == "humaneval" else CHAT_MAX_TOKENS
    try:
        methods = parse_methods(args.methods)
        if not set(methods) <= set(THREAD_METHODS):
            raise ValueError(f"--methods: any of {', '.join(THREAD_METHODS)} (got {args.methods!r})")
        counts = parse_counts(args.counts)
        resolved = resolve(args, args.preset)
    except ValueError as error:
        parser.error(str(error))
    try:
        load_split(args.dataset, args.split, 1)
        payload = run_step_costs(resolved, counts) if args.step_cost else run_threads(resolved, counts, methods)
    except (DecodingError, DatasetError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        configure_threads(1)
    if args.output:
        write_json(args.output, payload)
    return 0
