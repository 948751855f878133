"""``python -m bench anatomy``: its counters count what they say, and its report has the issue's keys and shows the
static step's one read per step against the eager path's several."""

from __future__ import annotations

import json

import pytest

from bench import anatomy


@pytest.fixture(scope="module")
def report():
    return anatomy.run("cuda", graphs=False, kernels=False)


def test_the_report_has_each_measure_for_greedy_and_lookahead(report, tmp_path):
    for name in ("greedy", "lookahead"):
        row = report[name]
        assert {"step_host_ms", "kernels_per_forward", "reads_per_step", "host_ms", "aten_ops_forward",
                "syncs_in_step", "syncs_in_static"} <= set(row)
        assert row["steps"] > 0 and row["step_host_ms"] > 0 and row["kernels_per_forward"] == row["aten_ops_forward"]
        assert {"plan", "inputs", "read", "finish", "other"} <= set(row["phases_ms"])
        assert 0 < row["step_host_ms_replayed"]  # the replay committed the recorded decode's tokens (checked)
    for name in ("greedy", "lookahead"):  # the server's worker, serial and overlapped
        serial, overlapped = report["server"][name]["serial"], report["server"][name]["overlapped"]
        assert serial["delivered_in_flight_ms"] == 0 and serial["critical_ms"] == serial["worker_ms"] > 0
        assert 0 < overlapped["delivered_in_flight_ms"] and overlapped["critical_ms"] < overlapped["worker_ms"]
        assert serial["steps"] == overlapped["steps"] > 0
    json.dumps(report)  # the --json file is this, as is


def test_the_static_step_reads_once_and_never_inside_the_forward(report):
    """One device-to-host read a step, lookahead included: the recycled source's top-k come back with the argmax."""
    assert report["settings"]["recycled"]  # the preset recycles logits: their top-k ride on the one read
    for name in ("greedy", "lookahead"):
        assert report["static"][name]["reads_per_step"] == report["static"][name]["reads_per_step_max"] == 1
        assert report["static"][name]["syncs_in_step"] == 1
        assert report["static"][name]["syncs_in_static"] == 0
        assert report["eager"][name]["syncs_in_step"] > 1  # the counter is not blind: the eager path copies
    assert report["static"]["lookahead"]["median_step_tokens"] > 16  # the preset's window and tree, not a plain step


def test_the_static_forward_dispatches_fewer_ops(report):
    assert report["static"]["lookahead"]["aten_ops_forward"] <= 700 < report["eager"]["lookahead"]["aten_ops_forward"]
