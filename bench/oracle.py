"""``python -m bench.oracle``: the tokens per step that copy and memory candidates could reach on a split's greedy
outputs, with no model in the loop: what each source is worth before any setting is built on it.

Contract: ``main(argv)`` decodes each prompt of ``--split`` (default ``tune``: this is for choosing settings) of
``--dataset`` once with our greedy loop, then replays every output for each source of ``SOURCES``: a step at
output position ``t`` takes the source's candidates from the prompt and ``output[:t]`` (``ContextIndex.best_copies``)
and, for a source with a memory, from an ``NGramMemory`` holding the outputs of the prompts before it in the run
(each with its prompt's last ``MEMORY_PROMPT_TAIL`` tokens, as the server stores them); it commits one token plus
the longest prefix of ``output[t:]`` any candidate matches. ``replay`` is that count for one output. Each source is
thus credited with its best candidate at every step, as the token tree verifies all of them: an upper bound for
copies alone, without the window and the pool's n-grams (which a real decode adds) and without gates (which a real
decode may close). It prints tokens per step per source and with ``--output`` writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.datasets import DATASETS, SPLIT_NAMES, DatasetError, encode_prompt, load_split
from bench.measure import decode_greedy
from bench.report import format_table, write_json
from decoding.decoder import Decoder, configure_threads
from decoding.errors import DecodingError
from decoding.params import StopCriteria
from decoding.proposers.ngram_memory import NGramMemory
from decoding.proposers.pool import ContextIndex
from decoding.step.stream import MEMORY_PROMPT_TAIL

EVERY = 1 << 20  # "every earlier occurrence": more copies than any text has


@dataclass(frozen=True)
class Source:
    """Candidates of one step: ``copies`` continuations (``length`` tokens) of earlier occurrences in the text
    whose context matches ``min_match`` tokens, plus ``remembered`` from the memory of earlier outputs."""

    name: str
    copies: int
    min_match: int
    remembered: int = 0
    length: int = 32


SOURCES = (
    Source("1 copy of 16, 3-gram match (CPU preset)", 1, 2, length=16),
    Source("4 copies, 2-gram match", 4, 1),
    Source("4 copies of 16, 1-gram match (CUDA preset)", 4, 0, length=16),
    Source("8 copies, 1-gram match", 8, 0),
    Source("every earlier occurrence", EVERY, 0),
    Source("8 copies + 8 from earlier outputs, 1-gram match", 8, 0, remembered=8),
)


def replay(prompt: Sequence[int], output: Sequence[int], source: Source, memory: NGramMemory | None = None) -> int:
    """Steps a decode of ``output`` after ``prompt`` takes when each step commits one token plus the longest
    prefix of the rest that one of ``source``'s candidates proposes (the prefill's first token is one step).

    >>> replay([1, 2, 3], [4, 1, 2, 3, 4], Source("copies", 1, 0))  # 4 | 1 | 2 3 4 (copied from the prompt)
    3
    >>> replay([1, 2, 3], [4, 1, 2, 3, 4], Source("none", 0, 0))
    5
    """
    if not output:
        return 0
    text = list(prompt) + list(output[:1])
    index = ContextIndex()
    position, steps = 1, 1
    while position < len(output):
        index.extend(text, len(text) - 1)
        candidates = index.best_copies(text, source.length, source.min_match, source.copies) if source.copies else []
        if memory is not None and source.remembered:
            candidates += memory.candidates(text, source.length, source.remembered, source.min_match)
        rest = output[position:]
        accepted = max((_common_prefix(candidate, rest) for candidate in candidates), default=0)
        taken = min(1 + accepted, len(output) - position)
        text.extend(output[position : position + taken])
        position += taken
        steps += 1
    return steps


def _common_prefix(candidate: Sequence[int], rest: Sequence[int]) -> int:
    count = 0
    for mine, theirs in zip(candidate, rest, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def replay_all(decodes: Sequence[tuple[list[int], list[int]]], source: Source) -> tuple[int, int]:
    """``(tokens, steps)`` of ``source`` over ``(prompt, output)`` pairs in order, its memory (when it has one)
    holding the outputs before each."""
    memory = NGramMemory(1 << 22) if source.remembered else None
    tokens = steps = 0
    for prompt, output in decodes:
        steps += replay(prompt, output, source, memory)
        tokens += len(output)
        if memory is not None and output:
            memory.add(prompt[-MEMORY_PROMPT_TAIL:] + output)
    return tokens, steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.oracle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=DATASETS, default="humaneval", help="built-in prompt set (humaneval)")
    parser.add_argument("--split", choices=SPLIT_NAMES, default="tune", help="which split (tune)")
    parser.add_argument("--limit", type=int, default=40, help="first N prompts of the split (40)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per decode (256)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model (the embedded default)")
    parser.add_argument("--output", metavar="PATH", help="write the sources' figures as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a prompt set or model that cannot be read)."""
    args = build_parser().parse_args(argv)
    configure_threads(1)
    try:
        specs = load_split(args.dataset, args.split, args.limit or None)
        decoder = Decoder.load(args.model, "cpu", "float32")
    except (DecodingError, DatasetError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stop = StopCriteria(args.max_tokens, decoder.eos_token_ids())
    decodes = []
    for spec in specs:
        prompt = encode_prompt(decoder.tokenizer, spec)
        decodes.append((prompt, decode_greedy(decoder.loaded.model, prompt, stop).output_ids))
    rows = []
    for source in SOURCES:
        tokens, steps = replay_all(decodes, source)
        rows.append({**asdict(source), "tokens": tokens, "steps": steps, "tokens_per_step": tokens / max(steps, 1)})
    print(f"{args.dataset} {args.split} split, {len(decodes)} prompts x {args.max_tokens} tokens, greedy outputs")
    print(format_table(("source", "steps", "tok/step"),
                       [[row["name"], str(row["steps"]), f"{row['tokens_per_step']:.2f}"] for row in rows]))
    if args.output:
        write_json(args.output, {"dataset": args.dataset, "split": args.split, "prompts": len(decodes),
                                 "max_tokens": args.max_tokens, "sources": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
