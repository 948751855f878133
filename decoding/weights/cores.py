"""How many threads fit this process: ``threads: auto`` resolved.

Contract: ``usable_cores()`` is the number of physical cores this process may run on, at least 1: the CPUs of its
affinity mask (``os.sched_getaffinity``), counted once per physical core (SMT siblings, from
``/sys/devices/system/cpu/cpu*/topology/thread_siblings_list`` where readable; each CPU is its own core where
not), and no more than the cgroup's CPU quota allows (``/sys/fs/cgroup/cpu.max`` in cgroup v2,
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1; a quota of 1.5 CPUs gives 1). ``resolve_threads(value)``
turns a config's ``threads`` (a count, ``0`` for torch's default, or ``"auto"``) into a count; ``parse_threads``
reads a flag's text. They read the system once per call; nothing is cached.

Why physical cores: the decoder's native products are bound by memory and FMA units, which SMT siblings share, so
a second thread on a sibling adds contention, not throughput (llama.cpp defaults to physical cores for the same
reason).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

AUTO = "auto"
SYSTEM = Path("/sys")


def usable_cores(affinity: Iterable[int] | None = None, system: Path = SYSTEM) -> int:
    """The physical cores this process may use (module contract); ``affinity`` and ``system`` (the ``/sys``
    root) are for tests."""
    cpus = sorted(_affinity() if affinity is None else set(affinity))
    cores = _physical_cores(cpus, system) if cpus else 1
    quota = cgroup_quota(system)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def resolve_threads(value: int | str, affinity: Iterable[int] | None = None, system: Path = SYSTEM) -> int:
    """A config's ``threads`` as a count: ``"auto"`` -> ``usable_cores()``; an int as it is (``0``, torch's
    default, stays 0). Raises ``ValueError`` on anything else."""
    if value == AUTO:
        return usable_cores(affinity, system)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"threads must be a count >= 0 or {AUTO!r}, got {value!r}")
    return value


def parse_threads(text: str) -> int | str:
    """A ``--threads`` flag's text: ``"auto"`` or a count >= 0 (raises ``ValueError`` otherwise, which argparse
    reports as a usage error)."""
    if text == AUTO:
        return AUTO
    return resolve_threads(int(text))


def cgroup_quota(system: Path = SYSTEM) -> float | None:
    """The CPUs the cgroup's quota allows (quota / period), or None where there is no quota or it cannot be read."""
    try:
        quota, period = (system / "fs" / "cgroup" / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        version_one = system / "fs" / "cgroup" / "cpu"
        quota_us = int((version_one / "cpu.cfs_quota_us").read_text())
        period_us = int((version_one / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _physical_cores(cpus: list[int], system: Path) -> int:
    """How many distinct physical cores ``cpus`` fall on: CPUs listed as SMT siblings count once."""
    cores = set()
    for cpu in cpus:
        siblings = system / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(frozenset(parse_cpu_list(siblings.read_text())))
        except (OSError, ValueError):
            cores.add(frozenset({cpu}))
    return len(cores)


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list as a set.

    >>> sorted(parse_cpu_list("0-2,8,10-11"))
    [0, 1, 2, 8, 10, 11]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            cpus.update(range(int(low), int(high) + 1))
        elif part:
            cpus.add(int(part))
    if not cpus:
        raise ValueError(f"an empty CPU list: {text!r}")
    return cpus
