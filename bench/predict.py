"""Predicted outputs on an edit task: greedy lookahead with and without the prediction, side by side.

Contract: ``python -m bench.predict`` asks the chat model to rewrite each held-out HumanEval prompt (100-107) with
its variable names in snake_case, keeping everything else, and decodes it twice through a ``BatchEngine`` (the
server's decode loop) with the server's device-preset lookahead settings: once with the snippet itself as the
request's prediction, once without, alternating which goes first so both see the same machine load. It prints,
per request and in total, tokens, steps, tokens per step, the share of tokens accepted from the prediction and
the time ratio (without / with), checks that both decodes return the same tokens (exit status 1 if not) and
writes JSON with ``--json``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.datasets import PromptSpec, encode_prompt, load_dataset
from bench.settings import batch_policy
from bench.workload import Served, load_preset, preset_parser, report_and_status, serve
from decoding.batch import BatchEngine
from decoding.params import StopCriteria
from decoding.step.stream import StepCounts

INSTRUCTION = "Rewrite this function with the variable names in snake_case, keeping everything else:\n\n"
HELD_OUT = (100, 108)


def edit_request(snippet: str) -> PromptSpec:
    """The chat request asking to rewrite ``snippet`` (whose text is then the natural prediction)."""
    return PromptSpec(id="edit", messages=({"role": "user", "content": INSTRUCTION + snippet},))


def totals(runs: Sequence[Served]) -> dict[str, float]:
    """Tokens, steps, tokens per step, accepted share, prediction share of tokens and seconds over ``runs``."""
    counts = sum((run.counts for run in runs), StepCounts())
    return {
        "tokens": counts.tokens,
        "steps": counts.steps,
        "tokens_per_step": counts.tokens / max(counts.steps, 1),
        "accepted_share": counts.accepted / max(counts.tokens, 1),
        "prediction_share": counts.prediction_accepted / max(counts.tokens, 1),
        "seconds": sum(run.seconds for run in runs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 1 when the outputs with and without the prediction differ."""
    args = preset_parser("python -m bench.predict", __doc__, "requests, from HumanEval/100 on", 256).parse_args(argv)
    config, lookahead, decoder = load_preset(args.device, args.preset)
    tokenizer = decoder.tokenizer
    engine = BatchEngine(decoder.loaded.model, batch_policy(config))
    stop = StopCriteria(args.max_tokens, decoder.eos_token_ids())
    snippets = load_dataset("humaneval")[HELD_OUT[0] : HELD_OUT[1]][: args.limit]
    rows, with_runs, without_runs = [], [], []
    for index, spec in enumerate(snippets):
        prompt = encode_prompt(tokenizer, edit_request(spec.text))
        prediction = list(tokenizer(spec.text, add_special_tokens=False).input_ids)
        order = (True, False) if index % 2 == 0 else (False, True)
        runs = {flag: serve(engine, prompt, stop, lookahead, prediction if flag else None) for flag in order}
        with_runs.append(runs[True])
        without_runs.append(runs[False])
        rows.append({
            "id": spec.id, "tokens": runs[True].counts.tokens, "same_tokens": runs[True].tokens == runs[False].tokens,
            "steps_with": runs[True].counts.steps, "steps_without": runs[False].counts.steps,
            "prediction_tokens": len(prediction), "prediction_accepted": runs[True].counts.prediction_accepted,
            "time_ratio": round(runs[False].seconds / max(runs[True].seconds, 1e-9), 3),
        })
        print(*(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    report = {"with_prediction": totals(with_runs), "without_prediction": totals(without_runs)}
    report["time_ratio"] = report["without_prediction"]["seconds"] / max(report["with_prediction"]["seconds"], 1e-9)
    return report_and_status(rows, report, lookahead, args.json)


if __name__ == "__main__":
    sys.exit(main())
