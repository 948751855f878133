"""``python -m bench anatomy``: its counters count what they say, and its report has the issue's keys and shows the
static step's one read per step against the eager path's several."""

from __future__ import annotations

import json

import pytest
import torch

from bench import anatomy
from bench.anatomy import SyncCounter, count_aten_ops


def test_the_sync_counter_sees_reads_and_blocking_copies_only():
    x = torch.arange(4)
    with SyncCounter("cpu") as counter:
        x.sum()  # device work: no sync
        x.to("cpu", non_blocking=True)  # a copy that does not wait
        torch.empty(4).copy_(x)  # a copy within one device
        x.tolist()
        int(x[0])
        x.to("cpu")  # to the device, blocking
        torch.tensor([1, 2], device="cpu")
    assert counter.calls == ["tolist", "__int__", "to", "tensor"]


def test_the_op_counter_counts_dispatched_ops():
    x = torch.ones(3)
    assert count_aten_ops(lambda: (x + 1).mul_(2).view(3, 1)) == 3


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
