"""A step's wall, host and device milliseconds on the device itself: ``python -m bench anatomy --device cuda``.

Contract: ``run_device(device, preset)`` decodes ``bench.anatomy``'s greedy, lookahead and rested streams on
``tiny_deep_llama`` (the default model's 30 layers at a tiny width: the work a step pays around its arithmetic) through
the static step in ``graphs`` mode on ``device`` (CUDA: captured graphs; the CPU: their rehearsal, the same code
path), each engine step one ``BatchEngine.step()``, and reports per stream, medians over the decode after its prefill:

- ``wall_ms``: an engine step's wall clock (the step's one read waits for the device);
- ``host_ms``: the same decode with the device's work replayed (``bench.probe.replay_host_ms``, from the recorded
  run that captured its buckets): the host's own work, the CUDA API calls of the input copy and the read included,
  the forward's device time not;
- ``device_ms``: ``wall_ms - host_ms``, what the step waits for the device (its graph and the pool's KV moves);
- ``median_step_tokens``.

``server``: the worker around the greedy and lookahead steps on that device, serial and overlapped
(``bench.worker_anatomy``). Random weights: no model file is needed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench.probe import (
    DECODE_TOKENS,
    Recording,
    anatomy_prompt,
    engine_step,
    preset_lookahead,
    record_decode,
    replay_host_ms,
    tiny_deep_llama,
)
from bench.worker_anatomy import worker_rows, worker_table
from decoding.forward.kv_cache import KVPool
from decoding.forward.static import StaticStep


def run_device(device: str = "cuda", preset: str = "cuda", max_tokens: int = DECODE_TOKENS) -> dict:
    """The module contract's report for ``device``."""
    lookahead, policy = preset_lookahead(preset)
    policy = dataclasses.replace(policy, max_step_tokens=max(policy.max_step_tokens, 256), static_step="graphs")
    model = tiny_deep_llama().to(device)
    static = StaticStep(model, KVPool(model, 2, 1024, scratch_tokens=256), mode="graphs")
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu (graphs rehearsed)"
    report: dict = {"device": name, "preset": preset, "static": {}}
    with torch.inference_mode():
        for stream, config, rested in (("greedy", None, False), ("lookahead", lookahead, False),
                                       ("rested", lookahead, True)):
            recording = record_decode(model, config, policy, static, max_tokens, rested)  # captures every bucket
            wall, tokens = _wall_ms(recording)
            host = replay_host_ms(recording)
            report["static"][stream] = {"wall_ms": wall, "host_ms": host, "device_ms": round(wall - host, 3),
                                        "median_step_tokens": tokens}
    report["server"] = worker_rows(model, static, lookahead, policy, anatomy_prompt(model.config.vocab_size),
                                   max_tokens)
    report["static_stats"] = dataclasses.asdict(static.stats())
    return report


def _wall_ms(recording: Recording) -> tuple[float, int]:
    """Median wall milliseconds of an engine step over ``recording``'s decode run again (its prefill left out; every
    bucket it meets captured by the recording's run), and its median input tokens."""
    engine = recording.open()
    walls, tokens = [], []
    while engine.has_work:
        started = time.perf_counter()
        step = engine_step(engine)
        seconds = time.perf_counter() - started
        if not step.stats.prefill:
            walls.append(seconds)
            tokens.append(step.stats.input_tokens)
    return round(1000 * statistics.median(walls), 3), statistics.median_low(tokens)


def table(report: dict) -> str:
    """The report as markdown: one row per stream, then the worker's rows."""
    lines = [f"{report['device']}, preset {report['preset']}, static step in graphs mode", "",
             "| stream | step tokens | wall ms | host ms | device ms |", "|---|---|---|---|---|"]
    for stream, row in report["static"].items():
        lines.append(f"| {stream} | {row['median_step_tokens']} | {row['wall_ms']:.3f} | {row['host_ms']:.3f} | "
                     f"{row['device_ms']:.3f} |")
    return "\n".join([*lines, "", *worker_table(report["server"], "server's worker")])
