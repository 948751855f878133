"""``python -m bench memory``: a memory file (``--memory-file``) holding the completions of prompts of a tune split,
as a server that had answered them would hold them.

Contract: ``main(argv)`` decodes each of the first ``--limit`` prompts of the ``tune`` split of each ``--dataset``
(or every prompt of ``--prompts FILE.jsonl``) with our greedy loop, ``--max-tokens`` new tokens each (256 for
HumanEval, 192 for the others, as ``bench heldout`` decodes), adds each prompt's last ``MEMORY_PROMPT_TAIL`` tokens
and its completion to one ``NGramMemory(--memory-tokens)`` exactly as a finished server request is added, and
writes it to ``--output`` (``decoding.proposers.ngram_memory.save_memory``, under the model's vocabulary id). ``python
-m bench heldout --memory-file PATH`` then starts its shared memory from it: the held-out figures of a server that has
been serving other requests of the same kind. Held-out splits are refused: a memory that held the reported
prompts' own completions would measure nothing. ``build(decoder, prompts, ...)`` is the loop, for tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.datasets import DatasetError, PromptFileError, encode_prompt, load_prompt_file, load_split
from bench.heldout import CHAT_MAX_TOKENS, CODE_MAX_TOKENS
from bench.measure import decode_greedy
from bench.settings import SERVER_MEMORY_TOKENS
from decoding.decoder import Decoder, configure_threads
from decoding.errors import DecodingError
from decoding.params import StopCriteria
from decoding.proposers.ngram_memory import NGramMemory, save_memory
from decoding.step.stream import MEMORY_PROMPT_TAIL

TUNED_SETS = ("humaneval", "chat", "alpacaeval")  # the built-in sets with a tune split (MT-bench has none)


def build(decoder: Decoder, prompts: Sequence[list[int]], max_tokens: int, memory: NGramMemory) -> int:
    """Greedy-decode each prompt and add it to ``memory`` as the server adds a finished request; return the
    tokens generated."""
    stop = StopCriteria(max_tokens, decoder.eos_token_ids())
    generated = 0
    for prompt in prompts:
        output = decode_greedy(decoder.loaded.model, prompt, stop).output_ids
        if output:
            memory.add(prompt[-MEMORY_PROMPT_TAIL:] + output)
        generated += len(output)
    return generated


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", action="append", choices=TUNED_SETS,
                        help="take prompts from this set's tune split (repeatable)")
    source.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": str} or {"messages": [...]} a line')
    parser.add_argument("--limit", type=int, default=0, help="first N prompts of each split (0 = all)")
    parser.add_argument("--max-tokens", type=int,
                        help=f"new tokens per decode ({CODE_MAX_TOKENS} for humaneval, {CHAT_MAX_TOKENS} otherwise)")
    parser.add_argument("--memory-tokens", type=int, default=SERVER_MEMORY_TOKENS,
                        help=f"the memory's size (the server's: {SERVER_MEMORY_TOKENS})")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model (the embedded default)")
    parser.add_argument("--output", required=True, metavar="PATH", help="the memory file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments, prompts or model)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.limit < 0 or args.memory_tokens < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        parser.error("--limit must be >= 0, --memory-tokens and --max-tokens >= 1")
    configure_threads(1)
    memory = NGramMemory(args.memory_tokens)
    try:
        decoder = Decoder.load(args.model, "cpu", "float32")
        sets = [(name, load_split(name, "tune", args.limit or None)) for name in args.dataset or ()]
        if args.prompts:
            sets = [("prompts", load_prompt_file(args.prompts)[: args.limit or None])]
        for name, specs in sets:
            default = CODE_MAX_TOKENS if name == "humaneval" else CHAT_MAX_TOKENS
            prompts = [encode_prompt(decoder.tokenizer, spec) for spec in specs]
            generated = build(decoder, prompts, args.max_tokens or default, memory)
            print(f"{name}: {len(prompts)} prompts, {generated} tokens generated", flush=True)
    except (DecodingError, DatasetError, PromptFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    documents = save_memory(memory, args.output, decoder.vocabulary_id)
    print(f"wrote {args.output}: {documents} documents, {len(memory)} tokens")
    return 0
