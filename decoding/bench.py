"""Benchmark: greedy, lookahead and ``model.generate`` side by side in one process, and the step-cost curve.

Contract: ``python -m decoding.bench`` loads one model, encodes a prompt set, and for each prompt runs every
requested method in turn (the order rotates from prompt to prompt so drift in machine load hits all methods
alike), all greedy, same ``max_tokens``, stopping at EOS. It prints a per-prompt and a total table (tokens,
forward passes, tokens per step, tok/s, speedup vs greedy and vs ``generate``, identical to greedy) and
optionally writes JSON ``{"config": {...}, "runs": [RunRecord...], "summary": {...}}``. ``--step-cost``
instead times one forward pass of k new tokens over a KV cache of ``--context`` tokens. Our methods run on
the model with its linears prepared as the server prepares them (``--quantize``, ``--weight-layout``); when
that packs them, ``generate`` and ``prompt_lookup`` run on a second copy with transformers' ``nn.Linear``,
as transformers users run them.

The pieces are callable without the CLI: ``run_benchmark(model, prompts, runners, max_tokens, stop_ids)``
takes token-id prompts and returns ``RunRecord``s; ``summarize(runs)`` and ``prompt_rows(runs)`` do the
arithmetic; ``measure_step_cost(model)`` returns ``StepCost`` rows.

Definitions (see docs/lookahead.md, "What to measure"): ``steps`` = forward passes of the decode, prefill
included (for ``generate``/``prompt_lookup`` counted with a forward pre-hook on the model); tokens per step =
new tokens / steps; speedup of A vs B = B's total seconds / A's total seconds over the prompts both ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from decoding.datasets import DATASETS, DatasetError, PromptFileError, PromptSpec, load_dataset, load_prompt_file
from decoding.decoder import (
    QUANTIZE,
    WEIGHT_LAYOUTS,
    Decoder,
    check_linear_options,
    configure_threads,
    prepare_linears,
)
from decoding.engine import Step, context_length, generate_autoregressive, generate_lookahead
from decoding.errors import DecodingError, InvalidParameterError
from decoding.kv_cache import SlotCache, new_cache
from decoding.loading import DEFAULT_MODEL, LoadedModel, load_model
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria

METHODS = ("greedy", "lookahead", "generate", "prompt_lookup")
DEFAULT_METHODS = "greedy,lookahead,generate"
STEP_COST_KS = (1, 2, 4, 8, 16, 32, 64, 128)
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Decoded:
    """What one decode produced: new token ids (no stop token), forward passes, guessed tokens offered/accepted."""

    output_ids: list[int]
    steps: int | None
    offered: int | None = None
    accepted: int | None = None


@dataclass(frozen=True)
class RunRecord:
    """One timed decode of one prompt by one method (a row of the JSON ``runs``)."""

    id: str
    method: str
    new_tokens: int
    steps: int | None
    seconds: float
    output_ids: list[int]
    offered: int | None = None
    accepted: int | None = None


@dataclass(frozen=True)
class MethodSummary:
    """Totals of one method over the prompts it ran; speedups are None when the baseline did not run."""

    method: str
    prompts: int
    new_tokens: int
    steps: int | None
    seconds: float
    tokens_per_step: float | None
    tokens_per_second: float
    speedup_vs_greedy: float | None
    speedup_vs_generate: float | None
    median_speedup_vs_greedy: float | None
    median_speedup_vs_generate: float | None
    identical_to_greedy: int | None
    acceptance_rate: float | None


@dataclass(frozen=True)
class StepCost:
    """Median wall time of one forward pass with ``k`` new tokens, reading the last / every position's logits."""

    k: int
    ms_last_logits: float
    ms_all_logits: float


Runner = Callable[[PreTrainedModel, Sequence[int], StopCriteria], Decoded]


# --- decoding methods -------------------------------------------------------------------------------------


def _collect(steps: Iterator[Step]) -> Decoded:
    """Drain a step generator into a ``Decoded`` (one step per forward pass)."""
    tokens: list[int] = []
    count = offered = accepted = 0
    for step in steps:
        tokens.extend(step.token_ids)
        count += 1
        offered += step.stats.offered
        accepted += step.stats.accepted
    return Decoded(tokens, count, offered, accepted)


def decode_greedy(model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria) -> Decoded:
    """Our greedy reference loop (``generate_autoregressive``)."""
    return _collect(generate_autoregressive(model, prompt_ids, stop, SamplingParams()))


def decode_lookahead(
    model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria, config: LookaheadConfig
) -> Decoded:
    """Greedy lookahead decoding with ``config``."""
    return _collect(generate_lookahead(model, prompt_ids, stop, SamplingParams(), config))


def decode_generate(
    model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria, prompt_lookup_tokens: int | None = None
) -> Decoded:
    """``model.generate`` with ``do_sample=False`` (prompt-lookup decoding when ``prompt_lookup_tokens``).

    A trailing stop token is stripped so the output compares with ours; forward passes are counted with a
    pre-hook on the model's forward.
    """
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    stop_ids = sorted(stop.stop_token_ids)
    extra = {} if prompt_lookup_tokens is None else {"prompt_lookup_num_tokens": prompt_lookup_tokens}
    try:
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=stop.max_tokens,
            do_sample=False,
            eos_token_id=stop_ids or None,
            pad_token_id=stop_ids[0] if stop_ids else model.generation_config.pad_token_id,
            **extra,
        )
    finally:
        hook.remove()
    tokens = output[0, input_ids.shape[1] :].tolist()
    if tokens and tokens[-1] in stop.stop_token_ids:
        tokens.pop()
    return Decoded(tokens, forwards[0])


def parse_methods(text: str) -> list[str]:
    """``"greedy,lookahead"`` -> ``["greedy", "lookahead"]``; raises ``ValueError`` on unknown or repeated names."""
    methods = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in methods if name not in METHODS]
    if not methods or unknown:
        raise ValueError(f"unknown methods {unknown or text!r}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"method listed twice in {text!r}")
    return methods


def _on_model(model: PreTrainedModel, runner: Runner) -> Runner:
    """``runner`` pinned to ``model`` whatever model it is handed."""
    return lambda _model, prompt_ids, stop: runner(model, prompt_ids, stop)


def make_runners(
    methods: Sequence[str],
    lookahead: LookaheadConfig,
    prompt_lookup_tokens: int,
    transformers_model: PreTrainedModel | None = None,
) -> dict[str, Runner]:
    """Map each method name (see ``METHODS``) to its runner, in the given order. ``transformers_model``, when
    given, is the model ``generate`` and ``prompt_lookup`` run on (the others run on the benchmark's model)."""
    transformers_methods: dict[str, Runner] = {
        "generate": decode_generate,
        "prompt_lookup": partial(decode_generate, prompt_lookup_tokens=prompt_lookup_tokens),
    }
    if transformers_model is not None:
        transformers_methods = {name: _on_model(transformers_model, run) for name, run in transformers_methods.items()}
    table: dict[str, Runner] = {
        "greedy": decode_greedy,
        "lookahead": partial(decode_lookahead, config=lookahead),
        **transformers_methods,
    }
    return {name: table[name] for name in methods}


# --- running ----------------------------------------------------------------------------------------------


def rotation(methods: Sequence[str], index: int) -> list[str]:
    """The run order for prompt ``index``: ``methods`` rotated left by ``index``. ``(["a","b","c"], 1)`` -> b, c, a."""
    if not methods:
        return []
    shift = index % len(methods)
    return [*methods[shift:], *methods[:shift]]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_run(
    model: PreTrainedModel, prompt_id: str, method: str, runner: Runner, prompt_ids: Sequence[int], stop: StopCriteria
) -> RunRecord:
    """Run one decode and time it end to end (prefill included)."""
    gc.collect()
    _synchronize(model.device)
    started = time.perf_counter()
    decoded = runner(model, prompt_ids, stop)
    _synchronize(model.device)
    seconds = time.perf_counter() - started
    return RunRecord(
        id=prompt_id,
        method=method,
        new_tokens=len(decoded.output_ids),
        steps=decoded.steps,
        seconds=seconds,
        output_ids=decoded.output_ids,
        offered=decoded.offered,
        accepted=decoded.accepted,
    )


def run_benchmark(
    model: PreTrainedModel,
    prompts: Sequence[tuple[str, Sequence[int]]],
    runners: Mapping[str, Runner],
    max_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
    warmup: int = 1,
    progress: Callable[[RunRecord], None] | None = None,
) -> list[RunRecord]:
    """Run every method on every ``(id, token ids)`` prompt, interleaved; return the records in run order.

    Before timing, each method decodes ``warmup`` times ``WARMUP_TOKENS`` tokens of the first prompt.
    """
    stop = StopCriteria(max_tokens, frozenset(stop_token_ids))
    if prompts and warmup > 0:
        short = StopCriteria(min(WARMUP_TOKENS, max_tokens), stop.stop_token_ids)
        for _ in range(warmup):
            for runner in runners.values():
                runner(model, prompts[0][1], short)
    records = []
    for index, (prompt_id, prompt_ids) in enumerate(prompts):
        for method in rotation(list(runners), index):
            record = time_run(model, prompt_id, method, runners[method], prompt_ids, stop)
            records.append(record)
            if progress is not None:
                progress(record)
    return records


# --- arithmetic -------------------------------------------------------------------------------------------


def by_method(runs: Sequence[RunRecord]) -> dict[str, dict[str, RunRecord]]:
    """``{method: {prompt id: record}}``, methods in the order of their first record."""
    grouped: dict[str, dict[str, RunRecord]] = {}
    for run in runs:
        grouped.setdefault(run.method, {})[run.id] = run
    return grouped


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def speedup(baseline: Mapping[str, RunRecord], runs: Mapping[str, RunRecord]) -> float | None:
    """Total baseline seconds / total seconds of ``runs`` over the prompt ids both have (None if none)."""
    common = [prompt_id for prompt_id in runs if prompt_id in baseline]
    if not common:
        return None
    return _ratio(sum(baseline[i].seconds for i in common), sum(runs[i].seconds for i in common))


def median_speedup(baseline: Mapping[str, RunRecord], runs: Mapping[str, RunRecord]) -> float | None:
    """Median over the common prompt ids of the per-prompt speedup (baseline seconds / seconds)."""
    ratios = [_ratio(baseline[i].seconds, run.seconds) for i, run in runs.items() if i in baseline]
    ratios = [ratio for ratio in ratios if ratio is not None]
    return statistics.median(ratios) if ratios else None


def _identical_count(baseline: Mapping[str, RunRecord] | None, runs: Mapping[str, RunRecord]) -> int | None:
    if baseline is None:
        return None
    return sum(1 for i, run in runs.items() if i in baseline and baseline[i].output_ids == run.output_ids)


def summarize_method(method: str, grouped: Mapping[str, Mapping[str, RunRecord]]) -> MethodSummary:
    """Totals, speedups and the identical count of ``method`` (``grouped`` comes from ``by_method``)."""
    runs = grouped[method]
    greedy, generate = grouped.get("greedy"), grouped.get("generate")
    tokens = sum(run.new_tokens for run in runs.values())
    seconds = sum(run.seconds for run in runs.values())
    steps = None if any(run.steps is None for run in runs.values()) else sum(run.steps for run in runs.values())
    offered = sum(run.offered or 0 for run in runs.values())
    return MethodSummary(
        method=method,
        prompts=len(runs),
        new_tokens=tokens,
        steps=steps,
        seconds=seconds,
        tokens_per_step=None if steps is None else _ratio(tokens, steps),
        tokens_per_second=_ratio(tokens, seconds) or 0.0,
        speedup_vs_greedy=speedup(greedy, runs) if greedy else None,
        speedup_vs_generate=speedup(generate, runs) if generate else None,
        median_speedup_vs_greedy=median_speedup(greedy, runs) if greedy else None,
        median_speedup_vs_generate=median_speedup(generate, runs) if generate else None,
        identical_to_greedy=_identical_count(greedy, runs),
        acceptance_rate=_ratio(sum(run.accepted or 0 for run in runs.values()), offered) if offered else None,
    )


def summarize(runs: Sequence[RunRecord]) -> list[MethodSummary]:
    """One ``MethodSummary`` per method, in the order methods first appear in ``runs``."""
    grouped = by_method(runs)
    return [summarize_method(method, grouped) for method in grouped]


def first_difference(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """Index of the first token where ``output`` differs from ``reference`` (None when equal).

    Example: ``([1, 2, 3], [1, 2, 4])`` -> 2; ``([1, 2], [1, 2, 3])`` -> 2; ``([1], [1])`` -> None.
    """
    for index, (expected, got) in enumerate(zip(reference, output, strict=False)):
        if expected != got:
            return index
    return None if len(reference) == len(output) else min(len(reference), len(output))


# --- printing ---------------------------------------------------------------------------------------------

PROMPT_HEADERS = ("prompt", "method", "tokens", "steps", "tok/step", "tok/s", "vs greedy", "vs generate", "identical")
TOTAL_HEADERS = (
    "method",
    "prompts",
    "tokens",
    "steps",
    "tok/step",
    "tok/s",
    "vs greedy",
    "vs generate",
    "median vs greedy",
    "median vs generate",
    "identical",
    "accept",
)


def _num(value: float | int | None, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}{suffix}"


def _identical_cell(reference: RunRecord | None, run: RunRecord) -> str:
    """``ref`` for greedy itself, ``yes``, ``no@i`` (first differing token), or ``-`` without greedy."""
    if reference is None:
        return "-"
    if reference is run:
        return "ref"
    difference = first_difference(reference.output_ids, run.output_ids)
    return "yes" if difference is None else f"no@{difference}"


def prompt_rows(runs: Sequence[RunRecord]) -> list[list[str]]:
    """One printable row per (prompt, method), prompts in run order, methods in their first-seen order."""
    grouped = by_method(runs)
    greedy, generate = grouped.get("greedy", {}), grouped.get("generate", {})
    prompt_ids = list(dict.fromkeys(run.id for run in runs))
    return [
        _prompt_row(records[prompt_id], greedy.get(prompt_id), generate.get(prompt_id))
        for prompt_id in prompt_ids
        for records in grouped.values()
        if prompt_id in records
    ]


def _prompt_row(run: RunRecord, greedy: RunRecord | None, generate: RunRecord | None) -> list[str]:
    """Printable cells of one run, with its speedups against the same prompt's greedy and generate runs."""
    return [
        run.id,
        run.method,
        str(run.new_tokens),
        _num(run.steps),
        _num(_ratio(run.new_tokens, run.steps) if run.steps is not None else None),
        _num(_ratio(run.new_tokens, run.seconds), 1),
        _num(_ratio(greedy.seconds, run.seconds) if greedy else None, 2, "x"),
        _num(_ratio(generate.seconds, run.seconds) if generate else None, 2, "x"),
        _identical_cell(greedy, run),
    ]


def total_rows(summaries: Sequence[MethodSummary]) -> list[list[str]]:
    """One printable row per method summary."""
    return [
        [
            s.method,
            str(s.prompts),
            str(s.new_tokens),
            _num(s.steps),
            _num(s.tokens_per_step),
            _num(s.tokens_per_second, 1),
            _num(s.speedup_vs_greedy, 2, "x"),
            _num(s.speedup_vs_generate, 2, "x"),
            _num(s.median_speedup_vs_greedy, 2, "x"),
            _num(s.median_speedup_vs_generate, 2, "x"),
            "-" if s.identical_to_greedy is None else f"{s.identical_to_greedy}/{s.prompts}",
            _num(None if s.acceptance_rate is None else 100 * s.acceptance_rate, 0, "%"),
        ]
        for s in summaries
    ]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A plain-text table; the first ``left`` columns are left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.ljust(width) if index < left else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * width for width in widths]), *(line(row) for row in rows)])


def machine_description(device: torch.device) -> str:
    """CPU model and core count, plus the GPU name on CUDA."""
    cpu = platform.processor() or platform.machine()
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                cpu = text.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    description = f"{cpu}, {os.cpu_count()} cores"
    if device.type == "cuda":
        description += f", {torch.cuda.get_device_name(device)}"
    return description


def environment(loaded: LoadedModel, threads: int, linears: str = "torch") -> dict[str, object]:
    """Machine, library versions, model, device, dtype, what runs the linear layers (``prepare_linears``) and
    thread count (for the header and the JSON)."""
    return {
        "machine": machine_description(loaded.device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads() if threads <= 0 else threads,
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "linears": linears,
    }


# --- step cost --------------------------------------------------------------------------------------------


def _median_forward_ms(
    model: PreTrainedModel, cache: SlotCache, input_ids: torch.Tensor, context: int, keep: int, repeats: int
) -> float:
    """Median ms of ``repeats`` forward passes of ``input_ids`` after one warm-up, rolling the cache back to
    ``context`` slots after each. ``keep`` is ``logits_to_keep`` (0 = every position)."""
    position_ids = torch.arange(context, context + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    times = []
    for attempt in range(repeats + 1):
        _synchronize(input_ids.device)
        started = time.perf_counter()
        model(
            input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=keep
        )
        _synchronize(input_ids.device)
        elapsed = time.perf_counter() - started
        cache.commit(context, [])
        if attempt:
            times.append(elapsed)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def measure_step_cost(
    model: PreTrainedModel, context: int = 300, ks: Sequence[int] = STEP_COST_KS, repeats: int = 7, seed: int = 0
) -> list[StepCost]:
    """Time one forward of k random tokens over a ``SlotCache`` holding ``context`` random tokens, per k.

    Raises ``InvalidParameterError`` when ``context + max(ks)`` does not fit the model's context length.
    """
    if context < 1 or context + max(ks) > context_length(model):
        limit = context_length(model)
        raise InvalidParameterError("context", f"context {context} + k {max(ks)} does not fit the model ({limit})")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    cache = new_cache(model, context + max(ks))
    prefix = torch.randint(vocab, (1, context), generator=generator).to(model.device)
    model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
    results = []
    for k in ks:
        input_ids = torch.randint(vocab, (1, k), generator=generator).to(model.device)
        last = _median_forward_ms(model, cache, input_ids, context, 1, repeats)
        every = _median_forward_ms(model, cache, input_ids, context, 0, repeats)
        results.append(StepCost(k, last, every))
    return results


def step_cost_rows(results: Sequence[StepCost]) -> list[list[str]]:
    """Printable rows: k, ms and ratio to the first row (k=1), for last-logit and all-logit forwards."""
    base = results[0] if results else None
    return [
        [
            str(r.k),
            f"{r.ms_last_logits:.1f}",
            _num(_ratio(r.ms_last_logits, base.ms_last_logits), 2, "x"),
            f"{r.ms_all_logits:.1f}",
            _num(_ratio(r.ms_all_logits, base.ms_all_logits), 2, "x"),
        ]
        for r in results
    ]


STEP_COST_HEADERS = ("k", "ms (last logits)", "vs k=1", "ms (all logits)", "vs k=1")


# --- command line -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m decoding.bench`` argument parser."""
    defaults = LookaheadConfig()
    parser = argparse.ArgumentParser(prog="python -m decoding.bench", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", choices=DATASETS, default="humaneval", help="built-in prompt set")
    source.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": str} or {"messages": [...]} a line')
    parser.add_argument("--chat-template", action="store_true", help="wrap raw-text prompts in a user message")
    parser.add_argument("--limit", type=int, default=10, help="first N prompts (0 = all; default 10)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per decode (default 256)")
    parser.add_argument("--window-size", type=int, default=defaults.window_size, help="W")
    parser.add_argument("--ngram-size", type=int, default=defaults.ngram_size, help="N")
    parser.add_argument("--guess-set-size", type=int, default=defaults.guess_set_size, help="G")
    parser.add_argument("--no-prompt-pool", action="store_true", help="do not seed the pool from the prompt")
    parser.add_argument("--no-output-pool", action="store_true", help="do not add n-grams of the output to the pool")
    parser.add_argument("--no-align-window", action="store_true", help="always shift the window by one column")
    parser.add_argument("--lazy-window", action="store_true", help="plain one-token steps when no candidate exists")
    parser.add_argument("--break-even", type=float, default=0.0, help="fall back to one-token steps below this")
    parser.add_argument("--copy-length", type=int, default=0, help="copy steps of up to this many tokens (0: off)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (10)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="default model name, local directory or hub id")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1...")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    parser.add_argument("--quantize", choices=QUANTIZE, default="none", help="int8: decoding.quantize (CPU)")
    parser.add_argument(
        "--weight-layout",
        choices=WEIGHT_LAYOUTS,
        default="auto",
        help="our methods' linears (decoding.linears; auto: packed on a float32 CPU); generate runs on nn.Linear",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {WARMUP_TOKENS}-token decodes per method")
    parser.add_argument("--json", metavar="PATH", help="write config, runs and summary as JSON")
    parser.add_argument("--step-cost", action="store_true", help="measure the step-cost curve instead")
    parser.add_argument("--context", type=int, default=300, help="KV-cache tokens for --step-cost (300)")
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards per k for --step-cost (7)")
    return parser


def lookahead_config(args: argparse.Namespace) -> LookaheadConfig:
    """The ``LookaheadConfig`` the flags describe, validated (raises ``InvalidParameterError``)."""
    config = LookaheadConfig(
        window_size=args.window_size,
        ngram_size=args.ngram_size,
        guess_set_size=args.guess_set_size,
        prompt_pool=not args.no_prompt_pool,
        output_pool=not args.no_output_pool,
        align_window=not args.no_align_window,
        lazy_window=args.lazy_window,
        break_even=args.break_even,
        copy_length=args.copy_length,
    )
    config.validate()
    return config


def select_prompts(args: argparse.Namespace) -> list[PromptSpec]:
    """The prompt specs the flags name (``--prompts`` file or ``--dataset``), cut to ``--limit``."""
    limit = args.limit if args.limit > 0 else None
    if args.prompts:
        prompts = load_prompt_file(args.prompts)
        return prompts if limit is None else prompts[:limit]
    return load_dataset(args.dataset, limit)


def encode_prompt(tokenizer, spec: PromptSpec, chat_template: bool = False) -> list[int]:
    """Token ids of ``spec``: raw text as a continuation (or as one user message when ``chat_template``),
    messages through the tokenizer's chat template with the assistant turn opened."""
    if spec.text is not None and not chat_template:
        return list(tokenizer(spec.text).input_ids)
    messages = list(spec.messages) if spec.messages is not None else [{"role": "user", "content": spec.text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _print_progress(total: int) -> Callable[[RunRecord], None]:
    done = [0]

    def report(run: RunRecord) -> None:
        done[0] += 1
        print(
            f"[{done[0]}/{total}] {run.id} {run.method}: {run.new_tokens} tokens, {_num(run.steps)} steps, "
            f"{run.seconds:.2f} s",
            file=sys.stderr,
            flush=True,
        )

    return report


def _header(env: Mapping[str, object], lines: Sequence[str]) -> str:
    """The machine/library/model lines every report starts with, then ``lines``."""
    first = f"machine: {env['machine']} | torch {env['torch']} | transformers {env['transformers']}"
    second = (
        f"model: {env['model']} | device {env['device']} | dtype {env['dtype']} | linears {env['linears']}"
        f" | threads {env['threads']}"
    )
    return "\n".join([first, second, *lines])


def _benchmark_lines(
    source: str, count: int, max_tokens: int, methods: Sequence[str], config: LookaheadConfig
) -> list[str]:
    """Header lines describing the prompts, methods and lookahead settings of a decode benchmark."""
    return [
        f"prompts: {source} x {count} | max tokens {max_tokens} | methods {', '.join(methods)}",
        f"lookahead: W={config.window_size} N={config.ngram_size} G={config.guess_set_size} | prompt pool "
        f"{config.prompt_pool} | output pool {config.output_pool} | align window {config.align_window} | "
        f"lazy window {config.lazy_window} | break-even {config.break_even} | copy length {config.copy_length}",
    ]


def to_json(payload: Mapping[str, object]) -> str:
    """``payload`` as indented JSON, except that each element of ``runs`` stays on one line."""
    parts = []
    for key, value in payload.items():
        if key == "runs" and isinstance(value, list):
            body = "[\n" + ",\n".join("    " + json.dumps(item) for item in value) + "\n  ]" if value else "[]"
        else:
            body = json.dumps(value, indent=2).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _write_json(path: str, payload: Mapping[str, object]) -> None:
    Path(path).write_text(to_json(payload), encoding="utf-8")
    print(f"wrote {path}")


def run_decode_benchmark(
    args: argparse.Namespace, loaded: LoadedModel, linears: str, transformers_model: PreTrainedModel | None
) -> dict[str, object]:
    """The decode benchmark the flags describe: prints both tables, returns the JSON payload. ``loaded`` runs our
    methods with its linears prepared as ``linears`` says; ``transformers_model`` (default: the same model) runs
    ``generate`` and ``prompt_lookup``."""
    methods = parse_methods(args.methods)
    config = lookahead_config(args)
    specs = select_prompts(args)
    prompts = [(spec.id, encode_prompt(loaded.tokenizer, spec, args.chat_template)) for spec in specs]
    env = environment(loaded, args.threads, linears)
    lines = _benchmark_lines(args.prompts or args.dataset, len(prompts), args.max_tokens, methods, config)
    print(_header(env, lines), flush=True)
    runners = make_runners(methods, config, args.prompt_lookup_tokens, transformers_model)
    eos = Decoder(loaded).eos_token_ids()
    settings = {**vars(args), "environment": env, "lookahead": asdict(config), "eos_token_ids": sorted(eos)}
    progress = _print_progress(len(prompts) * len(methods))
    if args.json:
        progress = _saving_progress(args.json, settings, progress)
    runs = run_benchmark(loaded.model, prompts, runners, args.max_tokens, eos, args.warmup, progress)
    summaries = summarize(runs)
    print("\nper prompt\n" + format_table(PROMPT_HEADERS, prompt_rows(runs), left=2))
    print("\ntotal\n" + format_table(TOTAL_HEADERS, total_rows(summaries)), flush=True)
    return {
        "config": settings,
        "runs": [asdict(run) for run in runs],
        "summary": {"methods": [asdict(summary) for summary in summaries]},
    }


def _saving_progress(
    path: str, settings: Mapping[str, object], report: Callable[[RunRecord], None]
) -> Callable[[RunRecord], None]:
    """``report``, then rewrite ``path`` with every run so far marked ``"partial": true``: a benchmark cut off by a
    time limit still leaves its runs (the finished benchmark overwrites the file with its summary)."""
    done: list[dict[str, object]] = []

    def save(run: RunRecord) -> None:
        report(run)
        done.append(asdict(run))
        Path(path).write_text(to_json({"config": settings, "partial": True, "runs": done}), encoding="utf-8")

    return save


def transformers_twin(args: argparse.Namespace, linears: str) -> PreTrainedModel | None:
    """A second copy of the model for ``generate`` and ``prompt_lookup`` when ours runs packed linears, so they
    run as transformers users run them (``nn.Linear``); None (share ours) otherwise, or when neither is asked."""
    if linears != "packed" or not {"generate", "prompt_lookup"} & set(parse_methods(args.methods)):
        return None
    return load_model(args.model, args.device, args.dtype).model


def run_step_cost(args: argparse.Namespace, loaded: LoadedModel, linears: str) -> dict[str, object]:
    """The step-cost curve: prints its table, returns the JSON payload."""
    env = environment(loaded, args.threads, linears)
    line = f"step cost: one forward of k new tokens over a KV cache of {args.context} tokens, median of {args.repeats}"
    print(_header(env, [line + " after 1 warm-up"]), flush=True)
    results = measure_step_cost(loaded.model, args.context, STEP_COST_KS, args.repeats)
    print("\n" + format_table(STEP_COST_HEADERS, step_cost_rows(results), left=0), flush=True)
    return {"config": {**vars(args), "environment": env}, "step_cost": [asdict(result) for result in results]}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments or unreadable prompts)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.warmup < 0 or args.repeats < 1 or args.prompt_lookup_tokens < 1:
        parser.error("--max-tokens, --repeats and --prompt-lookup-tokens must be >= 1, --warmup >= 0")
    try:
        parse_methods(args.methods)
        lookahead_config(args)
        check_linear_options(args.quantize, args.weight_layout)
    except ValueError as error:
        parser.error(str(error))
    configure_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    try:
        loaded = load_model(args.model, args.device, args.dtype)
        linears = prepare_linears(loaded.model, args.quantize, args.weight_layout)
        if args.step_cost:
            payload = run_step_cost(args, loaded, linears)
        else:
            payload = run_decode_benchmark(args, loaded, linears, transformers_twin(args, linears))
    except (DecodingError, DatasetError, PromptFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        _write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
