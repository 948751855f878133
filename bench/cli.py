"""Benchmark: greedy, lookahead and ``model.generate`` side by side in one process, and the step-cost curve.

Contract: ``python -m bench`` (``main(argv)``) loads one model, encodes a prompt set, and for each prompt runs
every requested method in turn (``bench.measure``: interleaved, all greedy, same ``max_tokens``, stopping at
EOS). It prints the settings it runs and where each came from, then a per-prompt and a total table
(``bench.report``: tokens, forward passes, tokens per step, tok/s, speedup vs greedy and vs ``generate``,
identical to greedy), and optionally writes JSON ``{"config": {...}, "runs": [RunRecord...], "summary":
{...}}``. ``--step-cost`` instead times one forward pass of k new tokens over a KV cache of ``--context``
tokens. ``python -m bench heldout`` (``bench.heldout``) compares lookahead with the greedy loop and prompt lookup
on the held-out split of a prompt set; ``python -m bench tune`` (``bench.tune``) measures this device and writes
a config file the server runs with ``--config``.

Defaults are the server's (``bench.settings``): every lookahead step setting (W, N, G, lazy window,
break-even, copy length), the batch policy and how the model is loaded (model, dtype, quantize, weight layout,
threads) come from ``server.config_layers.load_config`` with the preset of the resolved device; flags override them.
``--preset cpu|cuda`` takes the lookahead settings and the batch policy from that preset instead (the model still
loads as this device's preset says), so any prompt file can be counted at either preset's settings: on a CPU,
``--preset cuda --methods lookahead`` counts the GPU setting's tokens per step.
``--baseline REV`` adds ``base_greedy`` and ``base_lookahead`` to the methods: commit REV's greedy loop and lookahead,
run as that commit's benchmark ran them, in a child process (``bench.baseline``).
Our methods run on the model with its linears prepared as the server prepares them; when that packs them,
``generate`` and ``prompt_lookup`` run on a second copy with transformers' ``nn.Linear``, as transformers
users run them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import transformers
from transformers import PreTrainedModel

from bench.baseline import BASE_METHODS, BaselineError, add_baseline_flag, check_baseline, comparison, start_baseline
from bench.datasets import (
    DATASETS,
    DatasetError,
    PromptFileError,
    PromptSpec,
    encode_prompt,
    load_dataset,
    load_prompt_file,
)
from bench.measure import (
    DEFAULT_METHODS,
    METHODS,
    STEP_COST_KS,
    WARMUP_TOKENS,
    GuardFactory,
    Wall,
    make_runners,
    measure_step_cost,
    own_wall,
    parse_methods,
    run_benchmark,
    static_for,
)
from bench.records import RunRecord
from bench.report import (
    PROMPT_HEADERS,
    STEP_COST_HEADERS,
    TOTAL_HEADERS,
    benchmark_lines,
    environment,
    format_table,
    header,
    prompt_rows,
    step_cost_rows,
    summarize,
    to_json,
    total_rows,
    write_json,
)
from bench.settings import Resolved, describe, preset_digest, resolve
from decoding.batch import engine_guard
from decoding.calibration import calibrated as calibrated_policy
from decoding.calibration import curve_text
from decoding.decoder import (
    QUANTIZE,
    WEIGHT_LAYOUTS,
    WEIGHTS,
    Decoder,
    check_linear_options,
    configure_threads,
    load_prepared,
    native_steps,
)
from decoding.errors import DecodingError
from decoding.params import DEFAULT_MODEL, LookaheadConfig
from decoding.proposers.ngram_memory import NGramMemory
from decoding.weights.cores import parse_threads
from decoding.weights.loading import LoadedModel, default_gguf, load_model
from server.config import LOOKAHEAD_STEP_FIELDS
from server.flags import config_flags

SERVER_DEFAULT = "default: the server's"
PRESETS = ("cpu", "cuda")  # the server's device presets (``server.config_layers.load_config(device_preset=...)``)
# ``python -m bench NAME ...``: the module of ``bench`` that runs subcommand NAME with the rest of the arguments.
SUBCOMMANDS = {"heldout": "heldout", "memory": "memory_file", "anatomy": "anatomy", "agent": "agent", "gpu": "gpu",
               "tune": "tune", "weights": "weight_formats", "compile": "cpu_forwards", "threads": "threads",
               "conversation": "conversation"}

def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench`` argument parser; flags the server configures default to None (filled later)."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", choices=DATASETS, default="humaneval", help="built-in prompt set")
    source.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": str} or {"messages": [...]} a line')
    parser.add_argument("--chat-template", action="store_true", help="wrap raw-text prompts in a user message")
    parser.add_argument("--limit", type=int, default=10, help="first N prompts (0 = all; default 10)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per decode (default 256)")
    add_lookahead_flags(parser)
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of {', '.join(METHODS)}")
    add_baseline_flag(parser)
    parser.add_argument("--preset", choices=PRESETS,
                        help="whose lookahead settings and batch policy (default: this device's); the model loads "
                        "as this device's preset says either way")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (10)")
    add_model_flags(parser)
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {WARMUP_TOKENS}-token decodes per method")
    parser.add_argument("--json", metavar="PATH", help="write config, runs and summary as JSON")
    parser.add_argument("--step-cost", action="store_true", help="measure the step-cost curve instead")
    parser.add_argument("--context", type=int, default=300, help="KV-cache tokens for --step-cost (300)")
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards per k for --step-cost (7)")
    parser.add_argument("--ks", type=parse_ks, default=STEP_COST_KS,
                        help="comma list of step sizes k for --step-cost (1,2,4,...,128)")
    return parser


def add_lookahead_flags(parser: argparse.ArgumentParser) -> None:
    """The lookahead step flags (``lookahead_config`` reads them): one per step setting the server configures
    (``server.config.LOOKAHEAD_STEP_FIELDS``, named, typed and described as the server's flags), each defaulting
    to None (the server's value, filled by ``bench.settings``), and the pool switches only the benchmark has."""
    for flag in config_flags():
        name = flag.key.removeprefix("lookahead.")
        if flag.key.startswith("lookahead.") and name in LOOKAHEAD_STEP_FIELDS:
            action = argparse.BooleanOptionalAction if flag.kind is bool else None
            parser.add_argument(flag.name, dest=name, action=action, type=None if action else flag.kind,
                                help=f"{flag.help} ({SERVER_DEFAULT})")
    parser.add_argument("--no-prompt-pool", action="store_true", help="do not seed the pool from the prompt")
    parser.add_argument("--no-output-pool", action="store_true", help="do not add n-grams of the output to the pool")
    parser.add_argument("--no-align-window", action="store_true", help="always shift the window by one column")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """How the model loads and runs: model, device, dtype, quantize, weight layout, weights, threads."""
    parser.add_argument("--model", help=f"default model name, local directory or hub id ({SERVER_DEFAULT})")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1... (picks the server preset)")
    parser.add_argument("--dtype", help=f"auto, float32, float16, bfloat16 ({SERVER_DEFAULT})")
    parser.add_argument("--quantize", choices=QUANTIZE, help=f"int8: decoding.weights.quantize, CPU ({SERVER_DEFAULT})")
    parser.add_argument("--weight-layout", choices=WEIGHT_LAYOUTS,
                        help="our methods' linears (decoding.weights.linears; auto: packed on a float32 CPU); "
                        f"generate runs on nn.Linear ({SERVER_DEFAULT})")
    parser.add_argument("--weights", choices=WEIGHTS,
                        help=f"gguf: a GGUF model's quantized weights as they are; float32: de-quantized "
                        f"({SERVER_DEFAULT})")
    parser.add_argument("--threads", type=parse_threads,
                        help=f"threads of the native kernels and torch: a count, auto (the physical cores this process "
                        f"may use) or 0 (torch's default) ({SERVER_DEFAULT})")
    parser.add_argument("--gguf", type=Path, metavar="FILE.gguf",
                        help="the GGUF file the llama_cpp method runs (default: the default model's)")


def lookahead_config(args: argparse.Namespace) -> LookaheadConfig:
    """The ``LookaheadConfig`` the (resolved) flags describe, validated (raises ``InvalidParameterError``)."""
    config = LookaheadConfig(
        **{name: getattr(args, name) for name in LOOKAHEAD_STEP_FIELDS},
        prompt_pool=not args.no_prompt_pool,
        output_pool=not args.no_output_pool,
        align_window=not args.no_align_window,
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


def print_progress(total: int) -> Callable[[RunRecord], None]:
    """A progress callback printing one line per finished run to stderr."""
    done = [0]

    def report(run: RunRecord) -> None:
        done[0] += 1
        steps = "-" if run.steps is None else run.steps
        print(
            f"[{done[0]}/{total}] {run.id} {run.method}: {run.new_tokens} tokens, {steps} steps, {run.seconds:.2f} s",
            file=sys.stderr,
            flush=True,
        )

    return report


def saving_progress(
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


def json_settings(resolved: Resolved, env: Mapping[str, object]) -> dict[str, object]:
    """The JSON ``config``: every (resolved) flag, where the server-configured ones came from, the batch policy
    and the environment."""
    return {
        **vars(resolved.args),
        "sources": resolved.sources,
        "batch": asdict(resolved.policy),
        "environment": env,
        "stamp": stamp(resolved.preset),
    }


def stamp(preset: str) -> dict[str, object]:
    """Where a figure comes from: the command line, the commit (with ``+dirty`` for uncommitted changes), the UTC
    date, and the preset with its digest (``bench.settings.preset_digest``)."""
    def git(*arguments: str) -> str:
        try:
            return subprocess.run(["git", *arguments], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "command": "python -m bench " + " ".join(sys.argv[1:]),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "preset": preset,
        "preset_digest": preset_digest(preset),
    }


def measure_prompts(
    resolved: Resolved,
    loaded: LoadedModel,
    linears: str,
    transformers_model: PreTrainedModel | None,
    prompts: Sequence[tuple[str, list[int]]],
    methods: Sequence[str],
    source: str,
    output: str | None,
    memory: NGramMemory | None = None,
    reset_memory: Callable[[], None] | None = None,
    guard: GuardFactory = engine_guard,
    wall: Wall | None = None,
) -> tuple[list[RunRecord], dict[str, object]]:
    """Print the header, run ``methods`` on ``prompts`` interleaved (``bench.measure.run_benchmark``) with
    progress lines (saved to ``output`` as they come when given); return the runs and the JSON settings. With
    ``memory``, every lookahead decode (warm-up included) shares it; after the warm-up ``reset_memory`` (default:
    ``memory.clear``) puts it back as it was before. Base methods run in one ``--baseline`` child process, ended
    when the runs are (its settings under the JSON ``baseline``; the child resets its own memory too). ``guard`` and
    ``wall``: lookahead's payoff guard and what prices it (``bench.measure.decode_lookahead``)."""
    args = resolved.args
    config = lookahead_config(args)
    env = environment(loaded, args.threads, linears)
    print(header(env, benchmark_lines(source, len(prompts), args.max_tokens, methods, config)), flush=True)
    baseline = start_baseline(resolved, methods)
    try:
        runners = make_runners(
            methods, config, args.prompt_lookup_tokens, transformers_model, resolved.policy, memory,
            gguf_file(args) if "llama_cpp" in methods else None, args.threads or os.cpu_count() or 1, baseline,
            guard, wall,
        )
        eos = Decoder(loaded).eos_token_ids()
        settings = {**json_settings(resolved, env), "lookahead": asdict(config), "eos_token_ids": sorted(eos),
                    "baseline": None if baseline is None else {"commit": baseline.commit, **baseline.ready}}
        rounds = getattr(args, "rounds", 1)
        progress = print_progress(len(prompts) * len(methods) * rounds)
        if output:
            progress = saving_progress(output, settings, progress)
        forget = reset_memory or (memory.clear if memory is not None else None)  # the warm-up's outputs must go
        if baseline is not None:
            forget = _then(forget, baseline.reset)
        runs = run_benchmark(loaded.model, prompts, runners, args.max_tokens, eos, args.warmup, progress, forget,
                             rounds)
    finally:
        if baseline is not None:
            baseline.close()
    return runs, settings


def _then(first: Callable[[], None] | None, second: Callable[[], None]) -> Callable[[], None]:
    """``first`` (when given), then ``second``."""
    def both() -> None:
        if first is not None:
            first()
        second()

    return both


def run_decode_benchmark(
    resolved: Resolved, loaded: LoadedModel, linears: str, transformers_model: PreTrainedModel | None
) -> dict[str, object]:
    """The decode benchmark the flags describe: prints both tables, returns the JSON payload. ``loaded`` runs our
    methods with its linears prepared as ``linears`` says; ``transformers_model`` (default: the same model) runs
    ``generate`` and ``prompt_lookup``; lookahead steps under the server's batch policy and its payoff guard
    (priced as ``server_wall`` says)."""
    args = resolved.args
    methods = parse_methods(args.methods)
    specs = select_prompts(args)
    prompts = [(spec.id, encode_prompt(loaded.tokenizer, spec, args.chat_template)) for spec in specs]
    runs, settings = measure_prompts(
        resolved, loaded, linears, transformers_model, prompts, methods, args.prompts or args.dataset, args.json,
        wall=server_wall(resolved, loaded.model.device.type),
    )
    summaries = summarize(runs)
    print("\nper prompt\n" + format_table(PROMPT_HEADERS, prompt_rows(runs), left=2))
    print("\ntotal\n" + format_table(TOTAL_HEADERS, total_rows(summaries)), flush=True)
    payload = {
        "config": settings,
        "runs": [asdict(run) for run in runs],
        "summary": {"methods": [asdict(summary) for summary in summaries]},
    }
    if any(name in BASE_METHODS for name in methods):
        table, payload["summary"]["baseline"] = comparison(runs, settings["baseline"])
        print(f"\nagainst {args.baseline}\n" + table, flush=True)
    return payload


def gguf_file(args: argparse.Namespace) -> Path:
    """The GGUF file the ``llama_cpp`` method runs: ``--gguf``, else the default model's (raises ``ValueError``
    for another model without ``--gguf``)."""
    if getattr(args, "gguf", None) is not None:
        return args.gguf
    if args.model in (None, DEFAULT_MODEL, "default"):
        return default_gguf()
    raise ValueError(f"the llama_cpp method needs --gguf FILE for model {args.model!r}")


def transformers_twin(args: argparse.Namespace, linears: str) -> PreTrainedModel | None:
    """A second copy of the model for ``generate`` and ``prompt_lookup`` when ours runs packed linears or GGUF
    weights, so they run as transformers users run them (``nn.Linear``, float32 de-quantized weights); None (share
    ours) otherwise, or when neither is asked."""
    if linears not in ("packed", "gguf") or not {"generate", "prompt_lookup"} & set(parse_methods(args.methods)):
        return None
    return load_model(args.model, args.device, args.dtype).model


def parse_ks(text: str) -> tuple[int, ...]:
    """``--ks``: a comma list of positive step sizes, e.g. ``1,64,640`` (argparse turns ValueError into exit 2)."""
    ks = tuple(int(part) for part in text.split(","))
    if not ks or min(ks) < 1:
        raise ValueError(f"step sizes must be >= 1: {text!r}")
    return ks


def run_step_cost(resolved: Resolved, loaded: LoadedModel, linears: str) -> dict[str, object]:
    """The step-cost curve: prints its table, returns the JSON payload."""
    args = resolved.args
    env = environment(loaded, args.threads, linears)
    line = (f"step cost: one engine forward of k new tokens over a KV cache of {args.context} tokens, median of "
            f"{args.repeats}")
    print(header(env, [line + " after 1 warm-up"]), flush=True)
    results = measure_step_cost(loaded.model, args.context, args.ks, args.repeats)
    print("\n" + format_table(STEP_COST_HEADERS, step_cost_rows(results), left=0), flush=True)
    return {"config": json_settings(resolved, env), "step_cost": [asdict(result) for result in results]}


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Resolved:
    """Parse ``argv``, fill the server's defaults and validate everything that needs no model
    (``parser.error``, i.e. exit status 2, on a bad value)."""
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.warmup < 0 or args.repeats < 1 or args.prompt_lookup_tokens < 1:
        parser.error("--max-tokens, --repeats and --prompt-lookup-tokens must be >= 1, --warmup >= 0")
    try:
        check_baseline(args, parse_methods(args.methods))
        resolved = resolve(args, args.preset)
        lookahead_config(resolved.args)
        check_linear_options(resolved.args.quantize, resolved.args.weight_layout, resolved.args.weights)
    except (ValueError, DecodingError) as error:  # ConfigError and InvalidParameterError are ValueErrors
        parser.error(str(error))
    return resolved


def server_wall(resolved: Resolved, device: str) -> Wall | None:
    """What prices lookahead's payoff guard as the server's engine prices it on ``device`` (``decoding.payoff``):
    each step's own wall time where ``resolved``'s preset is the device's (``own_wall``), else None (``--preset
    cuda`` on a CPU: seconds here say nothing of a GPU, and the guard prices on the curve alone)."""
    return own_wall if resolved.preset == device else None


def calibrated(resolved: Resolved, loaded: LoadedModel) -> Resolved:
    """``resolved`` with its policy's step-cost curve measured on this machine, at the threads set now, where the
    policy asks for it (``measure_step_cost``: both presets), as the server measures it at start
    (``decoding.calibration``), so the bench's lookahead prices its drafts as the server's does; else as it is."""
    policy = resolved.policy
    if not policy.measure_step_cost:
        return resolved
    policy = calibrated_policy(loaded.model, policy, static_for(loaded.model, policy))
    print("step cost measured here: " + curve_text(policy.step_cost), flush=True)
    return replace(resolved, policy=policy)


def start(resolved: Resolved) -> tuple[LoadedModel, str]:
    """Print the settings, set the threads, load the model and prepare its linears (what runs them, as
    ``prepare_linears`` says); raises ``DecodingError`` when the model cannot be loaded."""
    args = resolved.args
    print(describe(resolved), flush=True)
    native_model = native_steps(args.quantize, args.weight_layout, args.device)
    args.threads = configure_threads(args.threads, native_model)  # "auto" resolved: what the figures and a child get
    transformers.utils.logging.disable_progress_bar()
    return load_prepared(args.model, args.device, args.dtype, args.quantize, args.weight_layout, args.weights)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments or unreadable prompts). A name of ``SUBCOMMANDS``
    as the first argument runs that module of ``bench`` with the rest."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:  # each builds on this module: imported only when asked for
        return importlib.import_module(f"bench.{SUBCOMMANDS[argv[0]]}").main(argv[1:])
    resolved = parse(build_parser(), argv)
    args = resolved.args
    try:
        loaded, linears = start(resolved)
        if args.step_cost:
            payload = run_step_cost(resolved, loaded, linears)
        else:
            resolved = calibrated(resolved, loaded)
            payload = run_decode_benchmark(resolved, loaded, linears, transformers_twin(args, linears))
    except (DecodingError, DatasetError, PromptFileError, BaselineError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, payload)
    return 0

