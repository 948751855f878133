"""``python -m bench conversation``: multi-turn chats with the prefix cache on and off, side by side in one process.

Contract: a conversation is an MT-bench question (the held-out split), its own second turn, then ``FOLLOW_UPS``
(made up, the kind a chat UI sends): ``--turns`` user turns (8), each answered greedily with up to ``--max-tokens``
tokens (200) at the device preset's lookahead settings, and every prompt holds the whole conversation so far
(the chat template over all messages), as a chat UI, an agent loop or ``previous_response_id`` sends it. Each
turn runs on two ``BatchEngine`` s (the server's decode loop) that differ only in their prefix cache
(``decoding.step.prefix_cache``: ``--prefix-cache-tokens``, the preset's by default, against none), one after the other
in alternating order; each keeps its own history, and their outputs must be identical (else exit 1). It prints,
per turn (the median over ``--limit`` conversations), the prompt tokens, the tokens reused, the time to first
token (from ``add`` to the first step that commits a token: the prefill, and the lookup and copy with the cache)
and the turn's wall time on and off; then the total wall time and its speed-up, the time to first token of the
last turn against the first, the largest resident set of the process and the cache's bytes (``--json`` writes
it all). ``timed_turn`` and ``Timing`` are shared with ``python -m bench agent``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from bench.cli import PRESETS, add_lookahead_flags, add_model_flags, lookahead_config, start
from bench.datasets import PromptSpec, encode_prompt, load_split, mtbench_second_turns
from bench.settings import resolve
from decoding.batch import BatchEngine
from decoding.decoder import Decoder
from decoding.params import LookaheadConfig, StopCriteria
from server.config_layers import load_config

TURNS = 8
MAX_TOKENS = 200
EARLY_STEPS = 16  # the steps after the prefill whose tokens per step show whether restored guesses help
SYSTEM = "You are a helpful assistant. Answer clearly and completely."
FOLLOW_UPS = (
    "Can you explain that in simpler words?",
    "Give me a concrete example.",
    "What is a common mistake people make here?",
    "Summarize everything we discussed so far in three bullet points.",
    "How would you explain it to a ten-year-old?",
    "What should I read next to learn more about this?",
)


@dataclass(frozen=True)
class Timing:
    """One turn through one engine: its prompt and reused tokens, seconds to its first token and in all, its output,
    and the tokens and steps of its first ``EARLY_STEPS`` steps after the prefill."""

    prompt_tokens: int
    cached_tokens: int
    first_token: float
    seconds: float
    tokens: list[int]
    early_tokens: int
    early_steps: int


def timed_turn(engine: BatchEngine, prompt: Sequence[int], stop: StopCriteria,
               config: LookaheadConfig | None) -> Timing:
    """Run one greedy request alone through ``engine`` and time it (``Timing``)."""
    started = time.perf_counter()
    engine.add("turn", prompt, stop, lookahead=config)
    tokens: list[int] = []
    first, cached, early_tokens, early_steps = 0.0, 0, 0, 0
    while engine.has_work:
        for _, step in engine.step():
            if isinstance(step, BaseException):
                raise step
            cached += step.cached_tokens
            if step.token_ids and not first:
                first = time.perf_counter() - started
            elif not step.stats.prefill and early_steps < EARLY_STEPS:
                early_tokens, early_steps = early_tokens + len(step.token_ids), early_steps + 1
            tokens.extend(step.token_ids)
    return Timing(len(prompt), cached, first, time.perf_counter() - started, tokens, early_tokens, early_steps)


def side_by_side(engines: dict[str, BatchEngine], tokenizer, messages: list[dict[str, str]],
                 next_user: Callable[[int, str], str], turns: int, stop: StopCriteria,
                 config: LookaheadConfig | None) -> tuple[dict[str, list[Timing]], bool]:
    """One conversation of ``turns`` turns through each engine, turn by turn, the engines' order rotating each
    turn; ``next_user(turn, reply)`` is user turn ``turn`` (from 1) after the reply before it. Each engine's
    timings, and whether every turn's output was the same on all of them."""
    names = list(engines)
    histories = {name: list(messages) for name in names}
    timings: dict[str, list[Timing]] = {name: [] for name in names}
    same = True
    for turn in range(turns):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            spec = PromptSpec(f"turn {turn}", messages=tuple(histories[name]))
            timings[name].append(timed_turn(engines[name], encode_prompt(tokenizer, spec), stop, config))
        outputs = [timings[name][-1].tokens for name in names]
        same &= all(output == outputs[0] for output in outputs)
        for name in names:
            reply = tokenizer.decode(timings[name][-1].tokens, skip_special_tokens=True)
            histories[name].append({"role": "assistant", "content": reply})
            if turn + 1 < turns:
                histories[name].append({"role": "user", "content": next_user(turn + 1, reply)})
    return timings, same


def max_rss_mb() -> float:
    """The largest resident set of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench conversation``'s flags."""
    parser = argparse.ArgumentParser(prog="python -m bench conversation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=3, help="conversations: the first N held-out MT-bench (3)")
    parser.add_argument("--turns", type=int, default=TURNS, help=f"user turns per conversation ({TURNS})")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens per answer ({MAX_TOKENS})")
    parser.add_argument("--prefix-cache-tokens", type=int, help="the cache's budget (the preset's)")
    parser.add_argument("--no-lookahead", action="store_true", help="answer with the autoregressive loop")
    parser.add_argument("--preset", choices=PRESETS, help="whose lookahead settings and batch policy (this device's)")
    parser.add_argument("--json", metavar="PATH", help="write the turns and the summary as JSON")
    add_lookahead_flags(parser)
    add_model_flags(parser)
    return parser


def median_turns(runs: list[list[Timing]], field: str) -> list[float]:
    """Per turn, the median of ``field`` over the conversations."""
    return [statistics.median(getattr(run[turn], field) for run in runs) for turn in range(len(runs[0]))]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 when every turn's output was the same with the cache on and off, 1 otherwise."""
    args = build_parser().parse_args(argv)
    resolved = resolve(args, args.preset)
    budget = args.prefix_cache_tokens if args.prefix_cache_tokens is not None else \
        _preset_budget(resolved.preset)
    config = None if args.no_lookahead else lookahead_config(resolved.args)
    loaded, _ = start(resolved)
    stop = StopCriteria(args.max_tokens, frozenset(Decoder(loaded).eos_token_ids()))
    second = mtbench_second_turns()
    questions = load_split("mtbench", "heldout", args.limit)
    runs: dict[str, list[list[Timing]]] = {"on": [], "off": []}
    same = True
    engines = {"on": BatchEngine(loaded.model, replace(resolved.policy, prefix_cache_tokens=budget)),
               "off": BatchEngine(loaded.model, replace(resolved.policy, prefix_cache_tokens=0))}
    timed_turn(engines["off"], encode_prompt(loaded.tokenizer, questions[0]), StopCriteria(8), config)  # warm-up
    for question in questions:
        messages = [{"role": "system", "content": SYSTEM}, *question.messages]

        def next_user(turn: int, reply: str, question: PromptSpec = question) -> str:
            return second[question.id] if turn == 1 else FOLLOW_UPS[(turn - 2) % len(FOLLOW_UPS)]

        timings, agreed = side_by_side(engines, loaded.tokenizer, messages, next_user, args.turns, stop, config)
        same &= agreed
        for name, turns in timings.items():
            runs[name].append(turns)
        first = {name: [round(t.first_token, 2) for t in turns] for name, turns in timings.items()}
        print(f"{question.id}: prompts {[t.prompt_tokens for t in timings['on']]}, first token on {first['on']} off "
              f"{first['off']}{'' if agreed else ' OUTPUTS DIFFER'}", file=sys.stderr, flush=True)
    report = summarize(runs, engines["on"], budget)
    print(format_report(report, args.limit))
    if not same:
        print("outputs differ with the prefix cache on and off", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as sink:
            json.dump({"summary": report, "runs": {name: [[{k: v for k, v in asdict(t).items() if k != "tokens"}
                                                          for t in run] for run in value]
                                                   for name, value in runs.items()}}, sink, indent=1)
    return 0 if same else 1


def _preset_budget(preset: str) -> int:
    """The server's ``batch.prefix_cache_tokens`` in ``preset``."""
    return load_config(device_preset=preset).batch.prefix_cache_tokens


def summarize(runs: dict[str, list[list[Timing]]], engine: BatchEngine, budget: int) -> dict:
    """Per-turn medians, totals and ratios of the runs with the cache on and off."""
    on, off = runs["on"], runs["off"]
    total_on = sum(t.seconds for run in on for t in run)
    total_off = sum(t.seconds for run in off for t in run)
    first_on, first_off = median_turns(on, "first_token"), median_turns(off, "first_token")
    stats = engine.prefix_cache_stats()
    return {
        "prompt_tokens": median_turns(on, "prompt_tokens"), "cached_tokens": median_turns(on, "cached_tokens"),
        "first_token_on": first_on, "first_token_off": first_off,
        "turn_seconds_on": median_turns(on, "seconds"), "turn_seconds_off": median_turns(off, "seconds"),
        "total_seconds_on": total_on, "total_seconds_off": total_off, "speedup": total_off / total_on,
        "last_over_first_on": first_on[-1] / first_on[0], "last_over_first_off": first_off[-1] / first_off[0],
        "max_rss_mb": max_rss_mb(), "cache_bytes": stats.bytes if stats else 0, "budget_tokens": budget,
    }


def format_report(report: dict, conversations: int) -> str:
    """The per-turn table and the totals, as printed."""
    lines = [f"medians over {conversations} conversations | turn | prompt | reused | first token on / off (s) | "
             "turn on / off (s)"]
    for turn, prompt in enumerate(report["prompt_tokens"]):
        lines.append(f"| {turn + 1} | {prompt:.0f} | {report['cached_tokens'][turn]:.0f} | "
                     f"{report['first_token_on'][turn]:.3f} / {report['first_token_off'][turn]:.3f} | "
                     f"{report['turn_seconds_on'][turn]:.2f} / {report['turn_seconds_off'][turn]:.2f} |")
    lines.append(f"total wall on {report['total_seconds_on']:.1f} s, off {report['total_seconds_off']:.1f} s: "
                 f"{report['speedup']:.2f}x; first token, last turn / first: on {report['last_over_first_on']:.2f}x, "
                 f"off {report['last_over_first_off']:.2f}x; max RSS {report['max_rss_mb']:.0f} MiB, cache "
                 f"{report['cache_bytes'] / 2**20:.0f} MiB of a {report['budget_tokens']}-token budget")
    return "\n".join(lines)
