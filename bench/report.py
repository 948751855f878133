"""Benchmark reporting: the summary arithmetic, the printed tables, the environment header and the JSON.

Contract: pure functions of ``RunRecord`` / ``StepCost`` lists (no model, no timing). ``summarize(runs)``
returns one ``MethodSummary`` per method; ``prompt_rows`` / ``total_rows`` / ``step_cost_rows`` turn records
into printable cells for ``format_table``; ``environment`` describes the machine, the libraries and the loaded
model; ``to_json`` writes the ``{"config", "runs", "summary"}`` payload with one run per line.

Definitions (docs/benchmarks.md, "What is measured"): tokens per step = new tokens / forward passes (prefill
included); speedup of A vs B = B's total seconds / A's total seconds over the prompts both ran; the median
speedup is the median of the per-prompt ratios.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from bench.records import RunRecord, StepCost
from decoding.params import LookaheadConfig
from decoding.weights.loading import LoadedModel


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


# --- arithmetic -------------------------------------------------------------------------------------------


def by_method(runs: Sequence[RunRecord]) -> dict[str, dict[str, RunRecord]]:
    """``{method: {prompt id: record}}``, methods in the order of their first record."""
    grouped: dict[str, dict[str, RunRecord]] = {}
    for run in runs:
        grouped.setdefault(run.method, {})[run.id] = run
    return grouped


def _ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, None when the denominator is not positive."""
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
    """A table cell: ``-`` for None, ints as they are, floats with ``digits`` decimals and ``suffix``."""
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


def write_json(path: str, payload: Mapping[str, object]) -> None:
    """Write the final payload and say so."""
    Path(path).write_text(to_json(payload), encoding="utf-8")
    print(f"wrote {path}")


def header(env: Mapping[str, object], lines: Sequence[str]) -> str:
    """The machine/library/model lines every report starts with, then ``lines``."""
    first = f"machine: {env['machine']} | torch {env['torch']} | transformers {env['transformers']}"
    second = (
        f"model: {env['model']} | device {env['device']} | dtype {env['dtype']} | linears {env['linears']}"
        f" | threads {env['threads']}"
    )
    return "\n".join([first, second, *lines])


def benchmark_lines(
    source: str, count: int, max_tokens: int, methods: Sequence[str], config: LookaheadConfig
) -> list[str]:
    """Header lines describing the prompts, methods and lookahead settings of a decode benchmark."""
    return [
        f"prompts: {source} x {count} | max tokens {max_tokens} | methods {', '.join(methods)}",
        f"lookahead: W={config.window_size} N={config.ngram_size} G={config.guess_set_size} | prompt pool "
        f"{config.prompt_pool} | output pool {config.output_pool} | align window {config.align_window} | "
        f"lazy window {config.lazy_window} | break-even {config.break_even} | copy length {config.copy_length} "
        f"(candidates {config.copy_candidates}, min match {config.copy_min_match}, stretch {config.copy_stretch})",
    ]
