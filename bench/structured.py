"""Structured output: what a grammar mask costs, and constrained lookahead against constrained greedy, side by side.

Contract: ``python -m bench.structured`` first times the grammar libraries it can import (llguidance, the one the
server uses; xgrammar when installed) on one JSON schema over the default model's vocabulary: compile time and
the median time of one next-token mask as the engine uses it (computed, then unpacked to one bool per token, the same
way for both; outlines-core, when installed: its index build and its allowed-token list),
walking the tokens of a valid document. Then it asks the chat model, for each held-out AlpacaEval prompt (odd
positions), for a JSON answer matching ``ANSWER_SCHEMA`` and decodes it through a ``BatchEngine`` (the server's
decode loop) twice with the server's device preset: autoregressive and lookahead, both under the grammar,
alternating which goes first. It prints per request and in total tokens, steps, tokens per step and the time
ratio, checks that both return the same tokens (exit status 1 if not) and that they parse, and writes JSON with
``--json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.datasets import PromptSpec, encode_prompt, load_split
from bench.settings import batch_policy
from bench.workload import Served, load_preset, preset_parser, report_and_status, serve
from decoding.batch import BatchEngine
from decoding.grammar import GrammarCompiler
from decoding.params import Grammar, LookaheadConfig, SamplingParams, StopCriteria

ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "answer": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
    },
    "required": ["topic", "answer", "keywords"],
    "additionalProperties": False,
}
EXAMPLE = {"topic": "Ada Lovelace", "answer": "She wrote the first program, for Babbage's engine, in 1843.",
           "keywords": ["programming", "history", "mathematics"]}
INSTRUCTION = "Answer in JSON with the keys topic, answer and keywords.\n\n"


def median_mask_seconds(consume: Callable[[int], Any], mask: Callable[[], Any], tokens: Sequence[int]) -> float:
    """Median seconds of ``mask()`` at each position of ``tokens`` (``consume`` moves past a token)."""
    times = []
    for token in tokens:
        started = time.perf_counter()
        mask()
        times.append(time.perf_counter() - started)
        consume(token)
    return statistics.median(times)


def time_llguidance(tokenizer: Any, vocab_size: int, tokens: Sequence[int]) -> dict[str, float]:
    """llguidance through ``decoding.grammar`` (what the engine runs): setup, compile and median mask times."""
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    constraint = compiler.constraint(Grammar.json_schema(ANSWER_SCHEMA))
    compile_seconds = time.perf_counter() - started
    median = median_mask_seconds(constraint.advance, constraint.allowed, tokens)
    return {"tokenizer_setup_s": setup, "compile_s": compile_seconds, "mask_median_us": median * 1e6}


def time_xgrammar(tokenizer: Any, vocab_size: int, tokens: Sequence[int]) -> dict[str, float] | None:
    """xgrammar's setup, compile and median mask (bitmask fill + unpack) times; None when it is not installed."""
    try:
        import numpy
        import xgrammar
    except ImportError:
        return None
    started = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    setup = time.perf_counter() - started
    started = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(ANSWER_SCHEMA)))
    compile_seconds = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask() -> Any:
        matcher.fill_next_token_bitmask(bitmask)
        return numpy.unpackbits(bitmask.numpy().view(numpy.uint8), bitorder="little")[:vocab_size].astype(bool)

    median = median_mask_seconds(matcher.accept_token, mask, tokens)
    return {"tokenizer_setup_s": setup, "compile_s": compile_seconds, "mask_median_us": median * 1e6}


def time_outlines(tokenizer: Any, tokens: Sequence[int]) -> dict[str, float] | None:
    """outlines-core's vocabulary setup, index build (its compile) and median time of its allowed-token list;
    None when it is not installed."""
    try:
        import outlines_core
    except ImportError:
        return None
    started = time.perf_counter()
    texts: dict[str, list[int]] = {}
    for piece, token in tokenizer.get_vocab().items():
        if token != tokenizer.eos_token_id:
            texts.setdefault(tokenizer.convert_tokens_to_string([piece]), []).append(token)
    vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, texts)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(ANSWER_SCHEMA))
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_seconds = time.perf_counter() - started
    median = median_mask_seconds(guide.advance, guide.get_tokens, tokens)
    return {"tokenizer_setup_s": setup, "compile_s": compile_seconds, "mask_median_us": median * 1e6}


def structured_request(spec: PromptSpec) -> PromptSpec:
    """The chat request asking for ``spec``'s answer as JSON."""
    request = spec.text if spec.messages is None else spec.messages[-1]["content"]
    return PromptSpec(id=spec.id, messages=({"role": "user", "content": INSTRUCTION + request},))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 1 when constrained lookahead and constrained greedy differ."""
    args = preset_parser("python -m bench.structured", __doc__, "held-out AlpacaEval requests", 192).parse_args(argv)
    config, lookahead, decoder = load_preset(args.device, args.preset)
    tokenizer = decoder.tokenizer
    vocab_size = decoder.grammars.vocab_size
    document = tokenizer(json.dumps(EXAMPLE), add_special_tokens=False).input_ids
    libraries = {"llguidance": time_llguidance(tokenizer, vocab_size, document),
                 "xgrammar": time_xgrammar(tokenizer, vocab_size, document),
                 "outlines_core": time_outlines(tokenizer, document)}
    print(json.dumps(libraries, indent=1), flush=True)
    engine = BatchEngine(decoder.loaded.model, batch_policy(config), grammars=decoder.grammars)
    stop = StopCriteria(args.max_tokens, decoder.eos_token_ids())
    sampling = SamplingParams(grammar=Grammar.json_schema(ANSWER_SCHEMA))
    rows, runs = [], {"greedy": [], "lookahead": []}
    for index, spec in enumerate(load_split("alpacaeval", "heldout", args.limit)):
        prompt = encode_prompt(tokenizer, structured_request(spec))
        methods: dict[str, LookaheadConfig | None] = {"greedy": None, "lookahead": lookahead}
        order = list(methods) if index % 2 == 0 else list(reversed(methods))
        served: dict[str, Served] = {name: serve(engine, prompt, stop, methods[name], sampling=sampling)
                                     for name in order}
        for name, run in served.items():
            runs[name].append(run)
        text = tokenizer.decode(served["lookahead"].tokens)
        rows.append({
            "id": spec.id, "tokens": served["lookahead"].counts.tokens,
            "same_tokens": served["lookahead"].tokens == served["greedy"].tokens,
            "parses": _parses(text), "steps_greedy": served["greedy"].counts.steps,
            "steps_lookahead": served["lookahead"].counts.steps,
            "time_ratio": round(served["greedy"].seconds / max(served["lookahead"].seconds, 1e-9), 3),
        })
        print(*(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    report = {"libraries": libraries, **{name: _totals(done) for name, done in runs.items()}}
    report["time_ratio"] = report["greedy"]["seconds"] / max(report["lookahead"]["seconds"], 1e-9)
    report["time_ratio_median"] = statistics.median(row["time_ratio"] for row in rows)
    report["parsed"] = sum(row["parses"] for row in rows)
    return report_and_status(rows, report, lookahead, args.json)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _totals(runs: Sequence[Served]) -> dict[str, float]:
    tokens = sum(run.counts.tokens for run in runs)
    steps = sum(run.counts.steps for run in runs)
    return {"tokens": tokens, "steps": steps, "tokens_per_step": tokens / max(steps, 1),
            "seconds": sum(run.seconds for run in runs)}


if __name__ == "__main__":
    sys.exit(main())
