"""``python -m bench anatomy --device cuda`` (``bench.device_anatomy``), run here on the CPU through the graphs'
rehearsal (the CUDA code path): each stream's step splits into host and device work, and the worker's rows come
with it."""

from __future__ import annotations

import json

from bench import device_anatomy
from bench.gpu_parts import part_lines


def test_the_device_report_splits_each_step_into_host_and_device_work():
    report = device_anatomy.run_device("cpu", "cuda", max_tokens=24)
    assert report["static_stats"]["mode"] == "graphs (rehearsed)" and report["static_stats"]["buckets"] > 1
    for stream in ("greedy", "lookahead", "rested"):
        row = report["static"][stream]
        assert row["wall_ms"] > row["host_ms"] > 0  # the CPU's forward is device work here
        assert row["device_ms"] == round(row["wall_ms"] - row["host_ms"], 3)
    tokens = {stream: row["median_step_tokens"] for stream, row in report["static"].items()}
    assert tokens["greedy"] == tokens["rested"] == 1 and tokens["lookahead"] > 16
    for stream in ("greedy", "lookahead"):
        serial, overlapped = report["server"][stream]["serial"], report["server"][stream]["overlapped"]
        assert serial["critical_ms"] == serial["worker_ms"] and overlapped["critical_ms"] < overlapped["worker_ms"]
    table = device_anatomy.table(report)
    assert "| lookahead |" in table and "overlapped" in table
    section = {"status": "done", "budget_seconds": 45, "results": json.loads(json.dumps(report))}
    lines = part_lines("anatomy", section)  # the GPU check's report shows the part's rows
    assert any(line.startswith("| greedy | 1 |") for line in lines) and any("| overlapped |" in line for line in lines)
