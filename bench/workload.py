"""A repeated workload, with and without the server-wide n-gram memory, side by side in one process.

Contract: ``python -m bench.workload`` sends the same requests, one after another, through two
``BatchEngine`` s (the server's decode loop) that differ only in their memory: one holds a
``decoding.proposers.ngram_memory.NGramMemory`` of ``--memory-tokens``, the other none. Requests alternate between the
two engines so both see the same machine load. Each request is one prompt of a held-out split wrapped in the same
system prompt and task template (what repeats across a real service's requests); ``--rounds 2`` sends the
set twice (retries, agent loops). It prints, per request and
in total, tokens, steps, accepted guesses and those from the memory, checks that both engines return the same
tokens, and writes JSON with ``--json``. The lookahead settings and batch policy are the server's device preset,
or ``--preset``'s (``--preset cuda`` on a CPU counts the GPU setting's steps; its times there mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import transformers
from transformers import PreTrainedModel

from bench.datasets import PromptSpec, encode_prompt, load_dataset
from bench.settings import SERVER_MEMORY_TOKENS, batch_policy
from decoding.batch import BatchEngine, BatchPolicy
from decoding.decoder import Decoder, configure_threads
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers.ngram_memory import NGramMemory
from decoding.step.stream import StepCounts
from server.config import ServerConfig, decoder_lookahead
from server.config_layers import load_config

SYSTEM_PROMPT = "You are a concise assistant. Follow the answer format exactly."
TEMPLATE = (
    "Answer the request below.\nFormat: a one-line summary, then three bullet points starting with '- ', "
    "then a line 'In short:' with one sentence.\n\nRequest: {request}"
)
HELD_OUT = {"chat": (16, 24), "humaneval": (100, 108)}


@dataclass(frozen=True)
class Served:
    """One request through one engine: its tokens, summed step counts and seconds."""

    tokens: list[int]
    counts: StepCounts
    seconds: float


def templated(spec: PromptSpec) -> PromptSpec:
    """``spec`` inside the workload's system prompt and task template (a chat request)."""
    request = spec.text if spec.text is not None else spec.messages[-1]["content"]
    messages = (
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TEMPLATE.format(request=request)},
    )
    return PromptSpec(id=spec.id, messages=messages)


def serve(
    engine: BatchEngine,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    config: LookaheadConfig | None,
    prediction: Sequence[int] | None = None,
    sampling: SamplingParams = SamplingParams(),
) -> Served:
    """Run one request alone through ``engine`` to its end (greedy unless ``sampling`` says otherwise; with a
    predicted output, when given; autoregressive when ``config`` is None)."""
    started = time.perf_counter()
    engine.add("request", prompt_ids, stop, sampling, config, prediction)
    tokens: list[int] = []
    counts = StepCounts()
    while engine.has_work:
        for _, step in engine.step():
            if isinstance(step, BaseException):
                raise step
            tokens.extend(step.token_ids)
            counts += step.stats.counts()
    return Served(tokens, counts, time.perf_counter() - started)


def run_workload(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    stop: StopCriteria,
    config: LookaheadConfig,
    policy: BatchPolicy,
    memory_tokens: int,
) -> list[tuple[Served, Served]]:
    """Each prompt through an engine with a memory, then through one without: ``(with, without)`` per prompt."""
    remembering = BatchEngine(model, policy, memory=NGramMemory(memory_tokens))
    forgetting = BatchEngine(model, policy)
    return [(serve(remembering, ids, stop, config), serve(forgetting, ids, stop, config)) for ids in prompts]


def summary(results: Sequence[tuple[Served, Served]]) -> dict[str, dict[str, float]]:
    """Totals per engine: tokens, steps, tokens per step, accepted share of tokens, memory share of accepted,
    seconds."""
    report = {}
    for index, name in enumerate(("with_memory", "without_memory")):
        counts = sum((pair[index].counts for pair in results), StepCounts())
        report[name] = {
            "tokens": counts.tokens,
            "steps": counts.steps,
            "tokens_per_step": counts.tokens / max(counts.steps, 1),
            "accepted_share": counts.accepted / max(counts.tokens, 1),
            "memory_accepted": counts.memory_accepted,
            "seconds": sum(pair[index].seconds for pair in results),
        }
    return report


def load_preset(device: str, preset: str | None = None) -> tuple[ServerConfig, LookaheadConfig, Decoder]:
    """The lookahead settings and batch policy of ``preset`` (default: the device's, ``cuda`` when ``device``
    starts with it, else ``cpu``) and the model loaded as the device's preset says, with its threads set. The
    returned config is ``preset``'s."""
    device_preset = "cuda" if device.startswith("cuda") else "cpu"
    config = load_config(device_preset=preset or device_preset)
    model = config if preset in (None, device_preset) else load_config(device_preset=device_preset)
    lookahead = decoder_lookahead(config.lookahead)
    configure_threads(model.threads)
    transformers.utils.logging.disable_progress_bar()
    decoder = Decoder.load(model.model, device, model.dtype, model.quantize, model.weight_layout, model.weights)
    return config, lookahead, decoder


def preset_parser(prog: str, doc: str, limit_help: str, max_tokens: int) -> argparse.ArgumentParser:
    """The arguments every side-by-side preset benchmark takes: ``--limit`` (8), ``--max-tokens``, ``--device``
    (and its preset), ``--preset`` (another preset's lookahead settings) and ``--json``; ``doc``'s first paragraph
    describes it."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help=f"{limit_help} (8)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens per request ({max_tokens})")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the preset and the device (cpu)")
    parser.add_argument("--preset", choices=("cpu", "cuda"),
                        help="whose lookahead settings and batch policy (the device's); the model loads as the "
                             "device's preset says")
    parser.add_argument("--json", metavar="PATH", help="write the per-request rows and the summary")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 1 when the two engines' outputs differ."""
    parser = preset_parser("python -m bench.workload", __doc__, "requests", 128)
    parser.add_argument("--dataset", choices=sorted(HELD_OUT), default="chat", help="held-out prompts to template")
    parser.add_argument("--rounds", type=int, default=1, help="times the whole set is sent (2: retries, loops) (1)")
    parser.add_argument("--memory-tokens", type=int, default=SERVER_MEMORY_TOKENS,
                        help=f"the memory's size ({SERVER_MEMORY_TOKENS})")
    args = parser.parse_args(argv)
    config, lookahead, decoder = load_preset(args.device, args.preset)
    low, high = HELD_OUT[args.dataset]
    specs = [templated(spec) for spec in load_dataset(args.dataset)[low:high][: args.limit]] * args.rounds
    prompts = [encode_prompt(decoder.tokenizer, spec) for spec in specs]
    stop = StopCriteria(args.max_tokens, decoder.eos_token_ids())
    results = run_workload(decoder.loaded.model, prompts, stop, lookahead, batch_policy(config), args.memory_tokens)
    rows = []
    for spec, (remembered, plain) in zip(specs, results, strict=True):
        rows.append({
            "id": spec.id, "tokens": remembered.counts.tokens, "same_tokens": remembered.tokens == plain.tokens,
            "steps_with": remembered.counts.steps, "steps_without": plain.counts.steps,
            "accepted_with": remembered.counts.accepted, "accepted_without": plain.counts.accepted,
            "memory_accepted": remembered.counts.memory_accepted,
        })
        print(*(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    return report_and_status(rows, summary(results), lookahead, args.json)


def report_and_status(
    rows: list[dict[str, object]], report: dict[str, object], lookahead: LookaheadConfig, path: str | None
) -> int:
    """Print ``report``, write rows, report and settings as JSON to ``path`` when given; 0 when every row has the
    same tokens both ways, else 1."""
    print(json.dumps(report, indent=1))
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "summary": report, "lookahead": vars(lookahead)}, handle, indent=1)
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
