"""``python -m bench tune``: measure this device, choose W/N/G and the step policy, write a config file.

Contract: the tuner, ``tune(model, prompts, stop_token_ids)``, chooses W, N, G and the step policy for the loaded
model on this device by measurement and returns a ``TuneResult``:

1. it measures the step-cost curve (one forward of k tokens over a KV cache, ``bench.measure``) and makes it
   non-decreasing (``monotone``): a forward over more tokens never costs less, so a dip is noise (on a GPU,
   where the curve is flat, noise alone would otherwise pick the window);
2. it derives the step policy from the curve: when a 2-8-token forward costs clearly more than a one-token
   forward (CPUs), steps without candidates are plain one-token steps (``lazy_window``) and a request falls
   back to one-token steps while it accepts fewer guesses than ``break_even = cost(8) / cost(1) - 1``;
3. for each (W, N, G) of a grid suited to that curve it runs greedy lookahead over the prompts and records
   every step's input size and committed tokens (a greedy trajectory does not depend on the hardware), and
   predicts the decode time from the curve; then it tries the best of them with lower break-evens
   (``BREAK_EVEN_SCALES``, down to 0: no gate at all): the derived one prices every guessing step as an
   8-token forward that accepts at the running mean's pace, while acceptance comes in bursts that a gate closed
   too early misses;
4. it confirms the best prediction with a timed, interleaved run against the greedy loop on the same
   prompts: that measured speedup is what the result reports, with how many outputs were identical (all of
   them in float32; in bfloat16 a multi-token step rounds differently from a one-token step, and a near-tie
   can break the other way).

Its prompts come from the ``tune`` splits alone (``tune_prompts``: the first few HumanEval and chat prompts
of ``bench.datasets.SPLITS``), never from the held-out prompts that figures are reported on.

The command, ``main(argv)`` (``tune_command(args)``), resolves the configuration exactly as ``lookahead-server
serve`` would (``server.flags``: device preset, ``--config``, flags; the model, device, dtype, threads, linears and
copy steps it tunes with are the server's), loads the model, takes a few HumanEval and chat prompts, runs ``tune``
and writes a config file of the chosen lookahead settings and the measured step-cost curve to ``--output``
(default ``tuned-<device>.yaml`` in the current directory; ``preset_text``). Nothing is applied behind the user's
back: the server runs it when started with ``--config`` naming that file, or when its values are copied into
``configs/<device>.yaml``.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from transformers import PreTrainedModel

from bench.datasets import PromptSpec, encode_prompt, load_split
from bench.measure import measure_step_cost
from bench.records import StepCost
from decoding import Decoder, InvalidParameterError, ModelLoadError, configure_threads
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from server.config import ConfigError
from server.flags import add_config_flags, build_config

CPU_GRID = ((1, 3, 2), (1, 4, 2), (1, 5, 3), (1, 6, 2), (2, 4, 2), (2, 5, 3), (3, 4, 3), (4, 5, 4))
GPU_GRID = ((5, 4, 5), (7, 5, 7), (10, 5, 10), (15, 5, 15), (15, 6, 15), (20, 6, 20))
COSTLY_RATIO = 1.2
BREAK_EVEN_SCALES = (0.5, 0.25, 0.0)  # 0: verify whenever a candidate is found (the CPU preset's choice)
COST_KS = (1, 2, 4, 8, 16, 32, 64, 128)
TUNE_SETS = ("humaneval", "chat")


@dataclass(frozen=True)
class Candidate:
    """One (W, N, G) setting: its greedy trajectory summed up, and the time the cost curve predicts."""

    config: LookaheadConfig
    tokens: int
    steps: int
    predicted_ms: float
    predicted_speedup: float

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class TuneResult:
    """The measured curve, every candidate, and the chosen setting with its measured speedup."""

    step_cost: list[StepCost]
    candidates: list[Candidate]
    best: LookaheadConfig
    greedy_seconds: float
    lookahead_seconds: float
    tokens: int
    identical: int = 0
    prompts: int = 0

    @property
    def measured_speedup(self) -> float:
        return self.greedy_seconds / self.lookahead_seconds if self.lookahead_seconds else 0.0


def tune_prompts(per_set: int, sets: Sequence[str] = TUNE_SETS) -> list[PromptSpec]:
    """The first ``per_set`` prompts of the ``tune`` split of each of ``sets`` (fewer when a split is shorter):
    with the defaults and ``per_set`` 3, HumanEval/0-2 and chat/0-2."""
    return [spec for name in sets for spec in load_split(name, "tune", per_set)]


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators).

    >>> monotone([3.0, 1.0, 2.0, 5.0])
    [2.0, 2.0, 2.0, 5.0]
    """
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for value in values:
        blocks.append((value, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean, count), (low_mean, low_count) = blocks.pop(), blocks.pop()
            total = low_count + count
            blocks.append(((low_mean * low_count + mean * count) / total, total))
    return [mean for mean, count in blocks for _ in range(count)]


def cost_function(step_cost: Sequence[StepCost]) -> Callable[[int], float]:
    """Milliseconds of a forward over k tokens: the measured curve made ``monotone``, interpolated linearly
    (clamped below, extrapolated proportionally above)."""
    ks = [row.k for row in step_cost]
    ms = monotone([row.ms_last_logits for row in step_cost])

    def cost(k: int) -> float:
        if k <= ks[0]:
            return ms[0]
        if k >= ks[-1]:
            return ms[-1] * k / ks[-1]
        index = bisect.bisect_left(ks, k)
        low, high = ks[index - 1], ks[index]
        return ms[index - 1] + (ms[index] - ms[index - 1]) * (k - low) / (high - low)

    return cost


def step_policy(cost: Callable[[int], float]) -> tuple[bool, float]:
    """``(lazy_window, break_even)`` for a cost curve: lazy and gated where multi-token forwards are costly.

    >>> step_policy(lambda k: 1.0 if k == 1 else 1.5)
    (True, 0.5)
    >>> step_policy(lambda k: 1.0)
    (False, 0.0)
    """
    ratio = cost(8) / cost(1)
    if ratio < COSTLY_RATIO:
        return False, 0.0
    return True, round(min(ratio - 1.0, 2.0), 2)


def candidate_line(candidate: Candidate) -> str:
    """One progress line: the setting, its tokens per step and predicted speedup."""
    config = candidate.config
    return (
        f"W={config.window_size} N={config.ngram_size} G={config.guess_set_size} break_even={config.break_even}: "
        f"{candidate.tokens_per_step:.2f} tokens/step, predicted {candidate.predicted_speedup:.2f}x greedy"
    )


def trajectory(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], config: LookaheadConfig, stop: StopCriteria
) -> list[tuple[int, int]]:
    """``(input_tokens, committed)`` of every decode step (prefill excluded) over all prompts, greedy."""
    steps = []
    for prompt in prompts:
        for step in generate_lookahead(model, prompt, stop, lookahead=config):
            if not step.stats.prefill:
                steps.append((step.stats.input_tokens, step.stats.committed))
    return steps


def evaluate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: LookaheadConfig,
    stop: StopCriteria,
    cost: Callable[[int], float],
) -> Candidate:
    """Predict ``config``'s decode time from its trajectory; greedy would take one cost(1) per token."""
    steps = trajectory(model, prompts, config, stop)
    tokens = sum(committed for _, committed in steps)
    predicted = sum(cost(inputs) for inputs, _ in steps)
    greedy = tokens * cost(1)
    return Candidate(config, tokens, len(steps), predicted, greedy / predicted if predicted else 0.0)


def timed_comparison(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], config: LookaheadConfig, stop: StopCriteria
) -> tuple[float, float, int, int]:
    """Seconds of the greedy loop and of lookahead over the prompts, interleaved; tokens generated by
    lookahead; and how many prompts' outputs were identical to the greedy loop's."""
    greedy_seconds = lookahead_seconds = 0.0
    tokens = identical = 0
    for prompt in prompts:
        started = time.perf_counter()
        reference = [token for step in generate_autoregressive(model, prompt, stop) for token in step.token_ids]
        greedy_seconds += time.perf_counter() - started
        started = time.perf_counter()
        output = [
            token for step in generate_lookahead(model, prompt, stop, lookahead=config) for token in step.token_ids
        ]
        lookahead_seconds += time.perf_counter() - started
        identical += output == reference
        tokens += len(output)
    return greedy_seconds, lookahead_seconds, tokens, identical


@torch.inference_mode()
def tune(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    stop_token_ids: frozenset[int],
    max_tokens: int = 96,
    grid: Sequence[tuple[int, int, int]] | None = None,
    report: Callable[[str], None] = lambda line: None,
    copy_length: int = 0,
    break_even_scales: Sequence[float] = BREAK_EVEN_SCALES,
) -> TuneResult:
    """Measure, search and confirm (see the module docstring). ``report`` receives progress lines; every setting
    is evaluated with copy steps of ``copy_length`` (the one the server will run with); where the curve calls
    for a break-even, the best grid setting is also evaluated at that break-even times each of
    ``break_even_scales``."""
    step_cost = measure_step_cost(model, ks=COST_KS, repeats=5)
    cost = cost_function(step_cost)
    lazy, break_even = step_policy(cost)
    report(f"step cost: k=1 {cost(1):.1f} ms, k=8 {cost(8):.1f} ms -> lazy_window={lazy}, break_even={break_even}")
    if grid is None:
        grid = CPU_GRID if lazy else GPU_GRID
    stop = StopCriteria(max_tokens, stop_token_ids)
    candidates = []
    for window_size, ngram_size, guess_set_size in grid:
        config = LookaheadConfig(
            window_size,
            ngram_size,
            guess_set_size,
            lazy_window=lazy,
            break_even=min(break_even, ngram_size - 1),
            copy_length=copy_length,
        )
        candidates.append(evaluate(model, prompts, config, stop, cost))
        report(candidate_line(candidates[-1]))
    leader = max(candidates, key=lambda candidate: candidate.predicted_speedup).config
    for scale in break_even_scales if leader.break_even > 0 else ():
        config = replace(leader, break_even=round(leader.break_even * scale, 2))
        candidates.append(evaluate(model, prompts, config, stop, cost))
        report(candidate_line(candidates[-1]))
    best = max(candidates, key=lambda candidate: candidate.predicted_speedup).config
    greedy_seconds, lookahead_seconds, tokens, identical = timed_comparison(model, prompts, best, stop)
    return TuneResult(step_cost, candidates, best, greedy_seconds, lookahead_seconds, tokens, identical, len(prompts))


# ---- The command: python -m bench tune ----------------------------------------------------------------------

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
    """The YAML config file for ``result`` (a ``TuneResult``), with a header saying what was
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
