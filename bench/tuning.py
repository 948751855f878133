"""``python -m bench tune``: measure this device, choose W/N/G and the step policy, write a config file.

Contract: ``main(argv)`` (``tune_command(args)``) resolves the configuration exactly as ``lookahead-server serve``
would (``server.flags``: device preset, ``--config``, flags; the model, device, dtype, threads, linears and copy
steps it tunes with are the server's),
loads the model, takes a few HumanEval and chat prompts, runs ``bench.tune.tune`` and writes a config file
of the chosen lookahead settings and the measured step-cost curve to ``--output`` (default
``tuned-<device>.yaml`` in the current directory). Nothing is applied behind the user's back: the server runs
it when started with ``--config`` naming that file, or when its values are copied into ``configs/<device>.yaml``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from bench.datasets import encode_prompt
from bench.tune import monotone, tune, tune_prompts
from decoding import Decoder, InvalidParameterError, ModelLoadError, configure_threads
from server.config import ConfigError
from server.flags import add_config_flags, build_config

PROG = "python -m bench tune"

# The config values that decide what is tuned: the model and how it runs, and the copy steps the tuner keeps.
TUNED_WITH = ("model", "device", "dtype", "quantize", "weight_layout", "weights", "threads", "lookahead.copy_length")


def build_parser() -> argparse.ArgumentParser:
    """``--config`` and the serve flags the tuner runs with (``TUNED_WITH``), then the tuner's own."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_config_flags(parser, TUNED_WITH)
    add_tune_flags(parser)
    return parser


def add_tune_flags(parser: argparse.ArgumentParser) -> None:
    """The tuner's own flags."""
    parser.add_argument("--prompts-per-set", type=int, default=3, help="HumanEval and chat prompts each (3)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt (96)")
    parser.add_argument("--output", help="config file to write (default tuned-<device>.yaml, current directory)")


def preset_text(result, device: str, model: str) -> str:
    """The YAML config file for ``result`` (a ``bench.tune.TuneResult``), with a header saying what was
    measured and how to use it."""
    best = result.best
    chosen = next(candidate for candidate in result.candidates if candidate.config == best)
    header = [
        f"# Written by `{PROG}` on {datetime.date.today()} ({platform.machine()}, {device}, {model}).",
        f"# Measured: {result.measured_speedup:.2f}x the greedy loop over {result.tokens} tokens "
        f"({chosen.tokens_per_step:.2f} tokens/step; predicted {chosen.predicted_speedup:.2f}x); "
        f"output identical to greedy on {result.identical} of {result.prompts} prompts"
        + (f"; copy steps of {best.copy_length} tokens (the server's)." if best.copy_length else "."),
        "# Candidates (W, N, G (break_even): tokens/step, predicted speedup): "
        + "; ".join(
            f"{c.config.window_size},{c.config.ngram_size},{c.config.guess_set_size} ({c.config.break_even}): "
            f"{c.tokens_per_step:.2f}, {c.predicted_speedup:.2f}x"
            for c in result.candidates
        ),
        f"# Serve with: lookahead-server --config <this file> (layered over configs/{device.split(':')[0]}.yaml).",
    ]
    body = {
        "lookahead": {
            "window_size": best.window_size,
            "ngram_size": best.ngram_size,
            "guess_set_size": best.guess_set_size,
            "lazy_window": best.lazy_window,
            "break_even": best.break_even,
        }
    }
    if len(result.step_cost) >= 2:  # the batching policy prices lookahead tokens with this device's curve
        ms = monotone(  # the curve the tuner predicted with (noise dips pooled away)
[cost.ms_last_logits for cost in result.step_cost])
        points = zip(result.step_cost, ms, strict=True)
        body["batch"] = {"step_cost": [[cost.k, round(value / ms[0], 3)] for cost, value in points]}
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench tune``; the exit status."""
    return tune_command(build_parser().parse_args(argv))


def tune_command(args: argparse.Namespace) -> int:
    """Run the tuner with the server's configuration (``server.flags.build_config``, as ``serve`` resolves it)
    and write the config file; 0 on success, 2 for a bad configuration, 1 when the model cannot load."""

    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    configure_threads(config.threads)
    try:
        decoder = Decoder.load(config.model, config.device, config.dtype, config.quantize, config.weight_layout,
                               config.weights)
    except (ModelLoadError, InvalidParameterError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    specs = tune_prompts(args.prompts_per_set)
    prompts = [encode_prompt(decoder.tokenizer, spec) for spec in specs]
    device = decoder.device.split(":")[0]
    copy_length = config.lookahead.copy_length
    result = tune(
        decoder.loaded.model, prompts, decoder.eos_token_ids(), args.max_tokens, report=print, copy_length=copy_length
    )
    output = Path(args.output or f"tuned-{device}.yaml")
    output.write_text(preset_text(result, decoder.device, decoder.loaded.name))
    best = result.best
    print(
        f"best W={best.window_size} N={best.ngram_size} G={best.guess_set_size} lazy_window={best.lazy_window} "
        f"break_even={best.break_even}: measured {result.measured_speedup:.2f}x greedy; wrote {output}\n"
        f"serve it with: lookahead-server --config {output}"
    )
    return 0
