"""``threads: auto`` resolved (decoding.weights.cores): the affinity mask's CPUs, SMT siblings counted once, capped by
the cgroup's quota, at least one; counts and ``0`` pass through; the thread setting reaches torch and the native
pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding.decoder import TORCH_DEFAULT_THREADS, configure_threads, native_steps
from decoding.weights import native
from decoding.weights.cores import parse_cpu_list, parse_threads, resolve_threads, usable_cores


def fake_system(root: Path, siblings: dict[int, str] | None = None, cpu_max: str | None = None) -> Path:
    """A ``/sys`` with ``siblings`` (CPU -> its thread_siblings_list) and, given, a cgroup v2 ``cpu.max``."""
    for cpu, listed in (siblings or {}).items():
        topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    if cpu_max is not None:
        (root / "fs" / "cgroup").mkdir(parents=True)
        (root / "fs" / "cgroup" / "cpu.max").write_text(cpu_max + "\n")
    return root


def test_every_cpu_is_a_core_where_the_topology_cannot_be_read(tmp_path):
    assert usable_cores({0, 1, 2, 3}, fake_system(tmp_path)) == 4


def test_smt_siblings_count_once(tmp_path):
    system = fake_system(tmp_path, {0: "0,4", 1: "1,5", 4: "0,4", 5: "1,5"})
    assert usable_cores({0, 1, 4, 5}, system) == 2
    assert usable_cores({0, 4}, system) == 1  # both threads of one core
    assert usable_cores({0, 1}, system) == 2  # one thread of each of two cores


def test_the_cgroup_quota_caps_the_count(tmp_path):
    assert usable_cores(range(8), fake_system(tmp_path / "a", cpu_max="250000 100000")) == 2  # 2.5 CPUs
    assert usable_cores(range(8), fake_system(tmp_path / "b", cpu_max="50000 100000")) == 1  # half a CPU: one
    assert usable_cores(range(8), fake_system(tmp_path / "c", cpu_max="max 100000")) == 8  # no quota


def test_a_cgroup_v1_quota_is_read_too(tmp_path):
    version_one = tmp_path / "fs" / "cgroup" / "cpu"
    version_one.mkdir(parents=True)
    (version_one / "cpu.cfs_quota_us").write_text("300000\n")
    (version_one / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(range(8), tmp_path) == 3


def test_this_process_gets_at_least_one_and_no_more_than_its_cpus():
    assert 1 <= usable_cores() <= len(__import__("os").sched_getaffinity(0))


def test_a_config_value_resolves_to_a_count(tmp_path):
    system = fake_system(tmp_path, {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert resolve_threads("auto", {0, 1, 2, 3}, system) == 2
    assert resolve_threads(3) == 3 and resolve_threads(0) == 0
    for wrong in (-1, "two", True, 1.5):
        with pytest.raises(ValueError):
            resolve_threads(wrong)
    assert parse_threads("auto") == "auto" and parse_threads("2") == 2
    with pytest.raises(ValueError):
        parse_threads("-2")


def test_cpu_lists_parse():
    assert parse_cpu_list("0-2,8,10-11\n") == {0, 1, 2, 8, 10, 11}
    with pytest.raises(ValueError):
        parse_cpu_list("")


def test_configure_threads_gives_the_native_pool_the_threads_and_torch_one():
    before = torch.get_num_threads()
    try:
        assert configure_threads(2) == 2
        assert native.threads() == 2
        assert torch.get_num_threads() == (1 if native.available() else 2)
        assert configure_threads("auto") == usable_cores() == native.threads()
        assert configure_threads(0) == TORCH_DEFAULT_THREADS == native.threads()  # torch's default count
    finally:
        configure_threads(1)
        torch.set_num_threads(before)


def test_without_the_native_kernels_torch_gets_the_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(native, "available", lambda: False)
    try:
        assert configure_threads(2) == 2
        assert torch.get_num_threads() == 2
    finally:
        configure_threads(1)
        torch.set_num_threads(before)


def test_torch_gets_the_threads_where_its_own_kernels_run_the_model():
    before = torch.get_num_threads()
    try:
        assert not native_steps(weight_layout="torch") and not native_steps(quantize="int8")
        assert native_steps(device="cpu") == native.available()
        assert configure_threads(2, native_model=native_steps(weight_layout="torch")) == 2
        assert torch.get_num_threads() == 2 and native.threads() == 2
    finally:
        configure_threads(1)
        torch.set_num_threads(before)
