"""``lookahead-server tune``: measure this device, choose W/N/G and the step policy, write a config preset.

Contract: ``tune_command(args)`` loads the model, takes a few HumanEval and chat prompts, runs
``bench.tune.tune`` and writes ``configs/tuned-<device>.yaml`` (or ``--output``). The server applies that
file over the shipped device preset whenever it exists (see ``server.config``), so the next start uses it.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import yaml

from server.config import CONFIG_DIR, load_config


def add_tune_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of ``lookahead-server tune``."""
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="default model, local directory or hub id")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--weight-layout", choices=["auto", "packed", "torch"], default="auto",
                        help="linear layers as the server runs them (auto: packed on a float32 CPU)")
    parser.add_argument("--prompts-per-set", type=int, default=3, help="HumanEval and chat prompts each (3)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt (96)")
    parser.add_argument("--output", help="preset to write (default configs/tuned-<device>.yaml)")


def preset_text(result, device: str, model: str) -> str:
    """The YAML preset for ``result`` (a ``bench.tune.TuneResult``), with a header saying what was measured."""
    best = result.best
    chosen = next(candidate for candidate in result.candidates if candidate.config == best)
    header = [
        f"# Written by `lookahead-server tune` on {datetime.date.today()} ({platform.machine()}, {device}, {model}).",
        f"# Measured: {result.measured_speedup:.2f}x the greedy loop over {result.tokens} tokens "
        f"({chosen.tokens_per_step:.2f} tokens/step; predicted {chosen.predicted_speedup:.2f}x); "
        f"output identical to greedy on {result.identical} of {result.prompts} prompts"
        + (f"; copy steps of {best.copy_length} tokens (the device preset's)." if best.copy_length else "."),
        "# Candidates (W, N, G (break_even): tokens/step, predicted speedup): "
        + "; ".join(
            f"{c.config.window_size},{c.config.ngram_size},{c.config.guess_set_size} ({c.config.break_even}): "
            f"{c.tokens_per_step:.2f}, {c.predicted_speedup:.2f}x"
            for c in result.candidates
        ),
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
        from bench.tune import monotone  # the curve the tuner predicted with (noise dips pooled away)

        ms = monotone([cost.ms_last_logits for cost in result.step_cost])
        points = zip(result.step_cost, ms, strict=True)
        body["batch"] = {"step_cost": [[cost.k, round(value / ms[0], 3)] for cost, value in points]}
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)


def tune_command(args: argparse.Namespace) -> int:
    """Run the tuner and write the preset; 0 on success."""
    from bench.datasets import encode_prompt, load_dataset
    from bench.tune import tune
    from decoding import Decoder, InvalidParameterError, ModelLoadError, configure_threads

    configure_threads(args.threads)
    try:
        decoder = Decoder.load(args.model, device=args.device, dtype=args.dtype, weight_layout=args.weight_layout)
    except (ModelLoadError, InvalidParameterError) as exc:
        print(f"lookahead-server tune: {exc}", file=sys.stderr)
        return 1
    specs = [*load_dataset("humaneval", args.prompts_per_set), *load_dataset("chat", args.prompts_per_set)]
    prompts = [encode_prompt(decoder.tokenizer, spec) for spec in specs]
    device = decoder.device.split(":")[0]
    copy_length = load_config(device_preset=device).lookahead.copy_length  # the preset's, which the tuned layer keeps
    result = tune(
        decoder.loaded.model, prompts, decoder.eos_token_ids(), args.max_tokens, report=print, copy_length=copy_length
    )
    output = Path(args.output) if args.output else CONFIG_DIR / f"tuned-{device}.yaml"
    output.write_text(preset_text(result, decoder.device, decoder.loaded.name))
    best = result.best
    print(
        f"best W={best.window_size} N={best.ngram_size} G={best.guess_set_size} lazy_window={best.lazy_window} "
        f"break_even={best.break_even}: measured {result.measured_speedup:.2f}x greedy; wrote {output}"
    )
    return 0
