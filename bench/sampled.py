"""Sampled decoding: tokens per step of seeded lookahead, and whether it gives the plain loop's text.

Contract: ``python -m bench.sampled`` decodes the held-out HumanEval and chat prompts (``--limit`` of each,
``--seeds`` decodes of each) with ``--temperature`` (0.7) and seed = the decode's position, through a
``BatchEngine`` (the server's decode loop) with the server's shared memory, twice: lookahead at the device preset
and the autoregressive loop, alternating which goes first. It prints per decode and in total tokens, steps,
tokens per step and accepted / offered guesses of lookahead, and how many decodes gave the same tokens both ways
(a seed decides the text: all of them), and writes JSON with ``--json``. Counts, not times: ``--preset cuda`` on
a CPU counts the GPU setting's steps.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from bench.datasets import encode_prompt, load_split
from bench.settings import SERVER_MEMORY_TOKENS, batch_policy
from bench.workload import load_preset, preset_parser, serve
from decoding.batch import BatchEngine
from decoding.params import SamplingParams, StopCriteria
from decoding.proposers.ngram_memory import NGramMemory
from decoding.step.stream import StepCounts

SETS = {"humaneval": 256, "chat": 192}  # held-out split and max tokens of each


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 (the report says how many outputs matched)."""
    parser = preset_parser("python -m bench.sampled", __doc__, "held-out prompts of each set", 0)
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0.7)")
    parser.add_argument("--seeds", type=int, default=1, help="decodes of each prompt, each with its own seed (1)")
    args = parser.parse_args(argv)
    config, lookahead, decoder = load_preset(args.device, args.preset)
    engine = BatchEngine(decoder.loaded.model, batch_policy(config), memory=NGramMemory(SERVER_MEMORY_TOKENS))
    rows: list[dict[str, Any]] = []
    totals = {"lookahead": StepCounts(), "autoregressive": StepCounts()}
    for name, max_tokens in SETS.items():
        stop = StopCriteria(args.max_tokens or max_tokens, frozenset(decoder.eos_token_ids()))
        specs = [spec for spec in load_split(name, "heldout", args.limit) for _ in range(args.seeds)]
        for index, spec in enumerate(specs):
            prompt = encode_prompt(decoder.tokenizer, spec)
            sampling = SamplingParams(temperature=args.temperature, seed=len(rows))
            methods = {"lookahead": lookahead, "autoregressive": None}
            order = list(methods) if index % 2 == 0 else list(reversed(methods))
            served = {method: serve(engine, prompt, stop, methods[method], sampling=sampling) for method in order}
            for method, run in served.items():
                totals[method] += run.counts
            counts = served["lookahead"].counts
            rows.append({"set": name, "id": spec.id, "tokens": counts.tokens, "steps": counts.steps,
                         "tokens_per_step": round(counts.tokens / max(counts.steps, 1), 3),
                         "accepted": counts.accepted, "offered": counts.offered,
                         "same_tokens": served["lookahead"].tokens == served["autoregressive"].tokens})
            print(*(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    counts = totals["lookahead"]
    report = {"temperature": args.temperature, "prompts": len(rows), "tokens": counts.tokens, "steps": counts.steps,
              "tokens_per_step": counts.tokens / max(counts.steps, 1), "accepted": counts.accepted,
              "offered": counts.offered, "same_tokens": sum(row["same_tokens"] for row in rows),
              "lookahead": {name: getattr(lookahead, name) for name in ("window_size", "ngram_size",
                                                                         "guess_set_size", "copy_length")}}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "report": report}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
