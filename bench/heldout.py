"""``python -m bench heldout``: lookahead against our greedy loop and transformers' prompt lookup, on prompts that
no setting was chosen on.

Contract: ``main(argv)`` takes the ``--split`` (default ``heldout``) of ``--dataset`` from
``bench.datasets.load_split`` (the one definition of the splits), loads one model and, for each prompt, runs
each of ``--methods`` in one process, interleaved in rotating order (``bench.measure.run_benchmark``): our greedy
loop, lookahead stepped through ``step_batch`` under the preset's batch policy (the server's code path), and
``model.generate`` with prompt lookup of ``--prompt-lookup-tokens`` (10) tokens, and where asked llama.cpp on the
same GGUF file (``llama_cpp``, ``bench.llama_cpp``); all greedy, the same
``--max-tokens`` (256 for HumanEval, 192 for the chat-like sets), stopping at EOS. It prints one row per prompt
(``PromptComparison``: tokens, steps and tokens per step of lookahead and prompt lookup, each one's speed-up over
the greedy loop, whether lookahead's output was greedy's) and the totals (per method: tokens per step,
overall and median speed-up vs greedy, identical outputs; and on how many prompts lookahead took no more steps
than prompt lookup), and with ``--output`` writes JSON ``{"config", "runs", "prompts", "summary"}``.

``--memory-tokens N`` gives lookahead's decodes one shared ``NGramMemory`` of N tokens, as a server's requests
share theirs: each prompt can draw on the outputs of the prompts before it in the run (the warm-up's are
forgotten); prompt lookup and greedy run without. ``--memory-file PATH`` (a file ``python -m bench memory`` wrote
from tune-split prompts, or a server's ``--memory-file``) starts that memory from the file instead of empty (the
memory then defaults to the server's size): a server that has answered those requests before. ``--preset cpu|cuda``
names whose lookahead settings and batch policy run (default: this device's); the model
loads as this device's preset says either way. ``--preset cuda --methods lookahead,prompt_lookup`` on a CPU
counts the GPU setting's tokens per step, which is what it buys where a step's cost hardly grows with its size;
its times on a CPU say nothing about a GPU, so there, with greedy and lookahead both run, the report adds a prediction
(``bench.gpu_prediction``): each forward priced on the H200's measured step curve plus host work per step, the
mean input tokens of a lookahead step, and lookahead's predicted speed-up there. ``--simulate-gpu`` takes the steps
as a server on that GPU would: drafts priced on its relative curve (``gpu_prediction.relative_curve``, what the
server's calibration measures there, instead of the curve measured here) and the payoff guard's measured price fed
each step's predicted wall time (``gpu_prediction.predicted_wall``; ``decoding.payoff``). ``--payoff-guard``:
``server`` (default) the guard the server keeps for the preset's policy (``decoding.batch.payoff_guard``), its
measured price from the simulation, or from each step's wall time where the preset is this device's, as the
server's engine measures it (``bench.cli.server_wall``; ``--preset cuda`` on a CPU without ``--simulate-gpu``: the
curve's price alone); ``curve``: that guard on the curve's price alone; ``off``: none. Every other flag overrides
one setting, as in ``python -m bench``.

``--baseline REV`` runs an earlier commit in the same run (``bench.baseline``): ``--methods greedy,lookahead,
base_greedy,base_lookahead --baseline 507a7ad`` adds that commit's greedy loop and lookahead, each run as that
commit's ``bench heldout`` ran it (its own preset, model loading and timing), in a child process on a detached
worktree under ``<cache>/baselines/``, interleaved per prompt with ours. A second table then gives per prompt the
base methods' speed-ups over our greedy, our lookahead's over base lookahead, and whether base greedy's output is
our greedy's (a commit that expanded GGUF weights to float32 can leave it after a while: reported, not failed) and
base lookahead's is base greedy's; the totals add our greedy's and lookahead's speed-ups over the commit's (JSON
``summary.baseline``). With ``--memory-tokens``/``--memory-file`` the child builds its own shared memory alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from transformers import PreTrainedModel

from bench.baseline import BASE_METHODS, BaselineError, add_baseline_flag, check_baseline, comparison
from bench.cli import (
    PRESETS,
    add_lookahead_flags,
    add_model_flags,
    calibrated,
    lookahead_config,
    measure_prompts,
    server_wall,
    start,
    transformers_twin,
)
from bench.datasets import DATASETS, SPLIT_NAMES, DatasetError, encode_prompt, load_split
from bench.gpu_prediction import describe, predict, predicted_wall, relative_curve
from bench.measure import WARMUP_TOKENS, GuardFactory, Wall, parse_methods
from bench.records import RunRecord
from bench.report import by_method, first_difference, format_table, summarize, write_json
from bench.settings import SERVER_MEMORY_TOKENS, Resolved, resolve
from decoding.batch import engine_guard
from decoding.decoder import Decoder, check_linear_options
from decoding.errors import DecodingError
from decoding.proposers.ngram_memory import MemoryFileError, NGramMemory, load_memory
from decoding.weights.loading import LoadedModel

HELDOUT_METHODS = ("greedy", "lookahead", "prompt_lookup", "llama_cpp", *BASE_METHODS)
DEFAULT_HELDOUT_METHODS = "greedy,lookahead,prompt_lookup"  # llama_cpp where asked: an optional extra
SAME_WEIGHTS = ("greedy", "lookahead")  # the methods whose outputs must be identical (lookahead's guarantee)
CODE_MAX_TOKENS = 256
CHAT_MAX_TOKENS = 192
PROMPT_HEADERS = (
    "prompt", "tokens", "lookahead steps", "tok/step", "prompt lookup steps", "tok/step", "lookahead vs greedy",
    "prompt lookup vs greedy", "identical",
)
TOTAL_HEADERS = ("method", "prompts", "tokens", "steps", "tok/step", "vs greedy", "median vs greedy", "identical")
GUARDS = ("server", "curve", "off")


@dataclass(frozen=True)
class PromptComparison:
    """One prompt's row: the reference output's length (greedy's, else lookahead's), each method's forward passes
    and tokens per step, its speed-up over the greedy loop (greedy seconds / its seconds), and whether every
    method produced the reference's tokens (``first_difference``: where the first that did not left it)."""

    id: str
    tokens: int
    lookahead_steps: int | None
    lookahead_tokens_per_step: float | None
    prompt_lookup_steps: int | None
    prompt_lookup_tokens_per_step: float | None
    lookahead_speedup: float | None
    prompt_lookup_speedup: float | None
    identical: bool
    first_difference: int | None


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench heldout`` argument parser; flags the server configures default to None."""
    parser = argparse.ArgumentParser(prog="python -m bench heldout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=DATASETS, default="humaneval", help="built-in prompt set (humaneval)")
    parser.add_argument("--split", choices=SPLIT_NAMES, default="heldout", help="which split (heldout)")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of the split (0 = all; default 8)")
    parser.add_argument("--max-tokens", type=int,
                        help=f"new tokens per decode ({CODE_MAX_TOKENS} for humaneval, {CHAT_MAX_TOKENS} otherwise)")
    parser.add_argument("--preset", choices=PRESETS, help="whose lookahead settings and batch policy (this device's)")
    parser.add_argument("--methods", default=DEFAULT_HELDOUT_METHODS,
                        help=f"comma list of {', '.join(HELDOUT_METHODS)} (lookahead required; default "
                        f"{DEFAULT_HELDOUT_METHODS}; base_* with --baseline)")
    add_baseline_flag(parser)
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (10)")
    parser.add_argument("--memory-tokens", type=int, default=0,
                        help="lookahead's decodes share a server-wide n-gram memory of this many tokens, as the "
                             f"server's do (its default: {SERVER_MEMORY_TOKENS}), starting empty (0: none, each "
                             "decode alone)")
    parser.add_argument("--memory-file", metavar="PATH",
                        help="start the shared memory from this memory file (python -m bench memory); implies "
                             f"--memory-tokens {SERVER_MEMORY_TOKENS} unless given")
    parser.add_argument("--payoff-guard", choices=GUARDS, default="server",
                        help="lookahead's payoff guard: the server's for the preset (default), on the curve's price "
                             "alone, or off")
    parser.add_argument("--simulate-gpu", action="store_true",
                        help="with --preset cuda: price drafts on the predicted GPU's relative curve and the payoff "
                             "guard on each step's predicted wall time there")
    add_lookahead_flags(parser)
    add_model_flags(parser)
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {WARMUP_TOKENS}-token decodes per method")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed runs per prompt and method, interleaved; the run of median time is kept (1)")
    parser.add_argument("--output", metavar="PATH", help="write config, runs, rows and summary as JSON")
    return parser


def parse_heldout_methods(text: str) -> list[str]:
    """``--methods`` as a list: names among ``HELDOUT_METHODS``, lookahead among them; raises ``ValueError``."""
    methods = parse_methods(text)
    if not set(methods) <= set(HELDOUT_METHODS) or "lookahead" not in methods:
        others = ", ".join(name for name in HELDOUT_METHODS if name != "lookahead")
        raise ValueError(f"--methods: lookahead and any of {others} (got {text!r})")
    return methods


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Resolved:
    """Parse ``argv``, fill the dataset's max tokens and the preset's settings, and validate everything that needs
    no model (``parser.error``, exit status 2, on a bad value)."""
    args = parser.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = CODE_MAX_TOKENS if args.dataset == "humaneval" else CHAT_MAX_TOKENS
    if args.memory_file and not args.memory_tokens:
        args.memory_tokens = SERVER_MEMORY_TOKENS
    if args.max_tokens < 1 or min(args.warmup, args.limit, args.memory_tokens) < 0 or args.prompt_lookup_tokens < 1:
        parser.error("--max-tokens and --prompt-lookup-tokens must be >= 1, --warmup, --limit and --memory-tokens >= 0")
    if args.rounds < 1 or (args.rounds > 1 and args.memory_tokens):
        parser.error("--rounds must be >= 1, and 1 with a shared memory (a later round would copy an earlier one's "
                     "output)")
    try:
        check_baseline(args, parse_heldout_methods(args.methods))
        resolved = resolve(args, args.preset)
        if args.simulate_gpu and resolved.preset != "cuda":
            raise ValueError("--simulate-gpu needs --preset cuda (the GPU's settings)")
        lookahead_config(resolved.args)
        check_linear_options(resolved.args.quantize, resolved.args.weight_layout, resolved.args.weights)
    except (ValueError, DecodingError) as error:  # ConfigError and InvalidParameterError are ValueErrors
        parser.error(str(error))
    return resolved


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _tokens_per_step(run: RunRecord | None) -> float | None:
    return None if run is None or run.steps is None else _ratio(run.new_tokens, run.steps)


def compare_prompt(records: Mapping[str, RunRecord]) -> PromptComparison:
    """The row of one prompt from its ``{method: record}``; the reference is greedy's output, else lookahead's, and
    ``identical`` compares the methods that run the same weights (``SAME_WEIGHTS``): prompt lookup runs
    transformers on de-quantized float32 weights and llama.cpp its own arithmetic, so their agreement is only
    counted per method (``identical_to_greedy``)."""
    greedy, lookahead, lookup = records.get("greedy"), records["lookahead"], records.get("prompt_lookup")
    reference = greedy or lookahead
    same_weights = [records[name] for name in SAME_WEIGHTS if name in records]
    differences = [first_difference(reference.output_ids, run.output_ids) for run in same_weights]
    differences = [index for index in differences if index is not None]

    def speedup(run: RunRecord | None) -> float | None:
        return None if run is None or greedy is None else _ratio(greedy.seconds, run.seconds)

    return PromptComparison(
        id=lookahead.id,
        tokens=reference.new_tokens,
        lookahead_steps=lookahead.steps,
        lookahead_tokens_per_step=_tokens_per_step(lookahead),
        prompt_lookup_steps=None if lookup is None else lookup.steps,
        prompt_lookup_tokens_per_step=_tokens_per_step(lookup),
        lookahead_speedup=speedup(lookahead),
        prompt_lookup_speedup=speedup(lookup),
        identical=not differences,
        first_difference=min(differences) if differences else None,
    )


def compare(runs: Sequence[RunRecord]) -> list[PromptComparison]:
    """One ``PromptComparison`` per prompt, in run order."""
    grouped = by_method(runs)
    prompt_ids = list(dict.fromkeys(run.id for run in runs))
    return [compare_prompt({method: rows[i] for method, rows in grouped.items() if i in rows}) for i in prompt_ids]


def steps_wins(rows: Sequence[PromptComparison]) -> tuple[int, int]:
    """``(K, M)``: lookahead took no more forward passes than prompt lookup on K of the M prompts both ran."""
    both = [row for row in rows if row.lookahead_steps is not None and row.prompt_lookup_steps is not None]
    return sum(row.lookahead_steps <= row.prompt_lookup_steps for row in both), len(both)


def _cell(value: float | int | None, suffix: str = "") -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}{suffix}"


def prompt_rows(rows: Sequence[PromptComparison]) -> list[list[str]]:
    """Printable cells of each ``PromptComparison``."""
    return [
        [
            row.id,
            str(row.tokens),
            _cell(row.lookahead_steps),
            _cell(row.lookahead_tokens_per_step),
            _cell(row.prompt_lookup_steps),
            _cell(row.prompt_lookup_tokens_per_step),
            _cell(row.lookahead_speedup, "x"),
            _cell(row.prompt_lookup_speedup, "x"),
            "yes" if row.identical else f"no@{row.first_difference}",
        ]
        for row in rows
    ]


def total_lines(runs: Sequence[RunRecord], rows: Sequence[PromptComparison]) -> tuple[str, dict[str, object]]:
    """The totals table and closing lines, and the JSON ``summary``."""
    summaries = summarize(runs)
    table = [
        [
            s.method,
            str(s.prompts),
            str(s.new_tokens),
            _cell(s.steps),
            _cell(s.tokens_per_step),
            _cell(s.speedup_vs_greedy, "x"),
            _cell(s.median_speedup_vs_greedy, "x"),
            "-" if s.identical_to_greedy is None else f"{s.identical_to_greedy}/{s.prompts}",
        ]
        for s in summaries
    ]
    wins, both = steps_wins(rows)
    identical = sum(row.identical for row in rows)
    checked = any(run.method == "greedy" for run in runs)
    verdict = (f"lookahead's output identical to greedy's on {identical} of {len(rows)}" if checked
               else "lookahead's output not checked (no greedy run)")
    lines = [format_table(TOTAL_HEADERS, table), verdict]
    if both:
        lines.append(f"lookahead took <= prompt lookup's steps on {wins} of {both} prompts")
    speedups = [row.lookahead_speedup for row in rows if row.lookahead_speedup is not None]
    summary = {
        "methods": [asdict(s) for s in summaries],
        "prompts": len(rows),
        "identical": identical if checked else None,
        "lookahead_steps_at_most_prompt_lookup": wins if both else None,
        "lookahead_median_speedup": statistics.median(speedups) if speedups else None,
    }
    return "\n".join(lines), summary


def payoff_settings(resolved: Resolved, device: str) -> tuple[Resolved, GuardFactory, Wall | None]:
    """What ``--payoff-guard`` and ``--simulate-gpu`` ask for (module contract): the settings (the simulated GPU's
    relative curve in the policy), lookahead's payoff guard and what prices it."""
    args = resolved.args
    wall: Wall | None = None
    if args.simulate_gpu:
        policy = dataclasses.replace(resolved.policy, step_cost=relative_curve())
        resolved, wall = dataclasses.replace(resolved, policy=policy), predicted_wall
    else:
        wall = server_wall(resolved, device)
    if args.payoff_guard == "off":
        return resolved, lambda policy: None, None
    return resolved, engine_guard, None if args.payoff_guard == "curve" else wall


def run_heldout(
    resolved: Resolved, loaded: LoadedModel, linears: str, transformers_model: PreTrainedModel | None
) -> dict[str, object]:
    """Run the comparison the flags describe on ``loaded`` (prompt lookup on ``transformers_model`` when given):
    prints both tables, returns the JSON payload."""
    args = resolved.args
    methods = parse_heldout_methods(args.methods)
    specs = load_split(args.dataset, args.split, args.limit or None)
    prompts = [(spec.id, encode_prompt(loaded.tokenizer, spec)) for spec in specs]
    source = f"{args.dataset} {args.split} split, preset {resolved.preset}"
    memory = NGramMemory(args.memory_tokens) if args.memory_tokens else None
    reset = None
    if memory is not None and args.memory_file:
        load_memory(memory, args.memory_file, Decoder(loaded).vocabulary_id)
        saved = memory.snapshot()  # what the file gave, to put back after the warm-up without reading it again

        def reset() -> None:
            memory.clear()
            memory.add_documents(saved)

        source += (f", shared memory of {args.memory_tokens} tokens starting with {memory.documents} documents of "
                   f"{args.memory_file} (then the earlier prompts')")
    elif memory is not None:
        source += f", shared memory of {args.memory_tokens} tokens (filled by the earlier prompts)"
    resolved, guard, wall = payoff_settings(resolved, loaded.model.device.type)
    runs, settings = measure_prompts(
        resolved, loaded, linears, transformers_model, prompts, methods, source, args.output, memory, reset, guard,
        wall,
    )
    settings["memory_tokens"] = args.memory_tokens
    settings["memory_file"] = args.memory_file
    rows = compare(runs)
    totals, summary = total_lines(runs, rows)
    print("\nper prompt\n" + format_table(PROMPT_HEADERS, prompt_rows(rows)))
    print("\ntotal\n" + totals, flush=True)
    prediction = predict(runs) if resolved.preset == "cuda" else None  # what the GPU would run
    if prediction is not None:
        summary["gpu_prediction"] = asdict(prediction)
        print(describe(prediction), flush=True)
    if any(name in BASE_METHODS for name in methods):
        table, summary["baseline"] = comparison(runs, settings["baseline"])
        print(f"\nper prompt, against {args.baseline}\n" + table, flush=True)
    return {
        "config": settings,
        "runs": [asdict(run) for run in runs],
        "prompts": [asdict(row) for row in rows],
        "summary": summary,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments or a prompt set that cannot be read)."""
    resolved = parse(build_parser(), argv)
    args = resolved.args
    try:
        load_split(args.dataset, args.split, 1)  # fetch the prompt set before the model
        loaded, linears = start(resolved)
        resolved = calibrated(resolved, loaded)
        payload = run_heldout(resolved, loaded, linears, transformers_twin(args, linears))
    except (DecodingError, DatasetError, MemoryFileError, BaselineError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.output:
        write_json(args.output, payload)
    return 0
