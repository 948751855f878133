"""``bench.counters``: the sync counter sees reads and blocking copies only; the op counter counts dispatched ops."""

from __future__ import annotations

import torch

from bench.counters import SyncCounter, count_aten_ops


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
