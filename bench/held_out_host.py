"""The host's work of held-out decodes on the default model, their device work replayed: #42's host measure on real
text (``python -m bench anatomy --held-out humaneval,chat``).

Contract: ``held_out_rows(datasets, preset, max_tokens, replays, prompts)`` decodes the first ``prompts`` held-out
prompts of each dataset with the default model (float32, its static step run eagerly on this CPU, one thread) at
``preset``'s settings, greedy and lookahead, and returns per dataset and stream: the host ms per engine step with the
device's work replayed (``bench.probe.replay_host_ms``: the median of ``replays`` replays of one recorded decode,
each the median over its steps, prefill left out) for each prompt and their median, the decode's steps and tokens,
and the median input tokens of its steps. The anatomy's tiny random model decodes text that repeats itself (its
lookahead commits ~13 tokens a step), so its per-step host work is inflated by large commits; the default model on a
held-out prompt takes the steps a GPU server would (the replay is as steady as a CPU allows: a few percent between
replays). ``held_out_table(rows)`` prints them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.datasets import encode_prompt, load_split
from bench.probe import preset_lookahead, record_decode, replay_host_ms
from decoding.decoder import Decoder
from decoding.forward.kv_cache import KVPool
from decoding.forward.static import StaticStep
from decoding.weights.loading import load_model


def held_out_rows(datasets: Sequence[str], preset: str = "cuda", max_tokens: int = 64, replays: int = 5,
                  prompts: int = 1) -> dict:
    """Per dataset and stream (``"greedy"``, ``"lookahead"``), the measures of the module contract."""
    loaded = load_model(device="cpu", dtype="float32")
    model, (config, policy) = loaded.model, preset_lookahead(preset)
    stop_ids = frozenset(Decoder(loaded).eos_token_ids())
    static = StaticStep(model, KVPool(model, 2, 2048, scratch_tokens=512))
    rows: dict = {}
    for dataset in datasets:
        specs = load_split(dataset, "heldout", prompts)
        rows[dataset] = {}
        for name, settings in (("greedy", None), ("lookahead", config)):
            per_prompt, steps, tokens, sizes = {}, 0, 0, []
            for spec in specs:
                recording = record_decode(model, settings, policy, static, max_tokens,
                                          prompt=encode_prompt(loaded.tokenizer, spec), stop_ids=stop_ids)
                per_prompt[spec.id] = replay_host_ms(recording, replays)
                decoding = [step.stats.input_tokens for step in recording.steps if not step.stats.prefill]
                steps, tokens, sizes = steps + len(decoding), tokens + len(recording.tokens), sizes + decoding
            rows[dataset][name] = {"host_ms_replayed": per_prompt,
                                   "median_host_ms_replayed": statistics.median(per_prompt.values()),
                                   "steps": steps, "tokens": tokens,
                                   "median_step_tokens": statistics.median(sizes) if sizes else None}
    return rows


def held_out_table(rows: dict) -> list[str]:
    """``held_out_rows``' as markdown lines."""
    lines = ["| held-out set | stream | host ms a step, device replayed (per prompt) | steps | tokens | "
             "median step tokens |", "|---|---|---|---|---|---|"]
    for dataset, streams in rows.items():
        for name, row in streams.items():
            each = ", ".join(f"{prompt} {value:.3f}" for prompt, value in row["host_ms_replayed"].items())
            lines.append(f"| {dataset} | {name} | **{row['median_host_ms_replayed']:.3f}** ({each}) | {row['steps']} "
                         f"| {row['tokens']} | {row['median_step_tokens']} |")
    return lines
