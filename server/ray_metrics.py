"""A replica's Prometheus registry mirrored into Ray's metrics, so that an aggregate over replicas is right.

Contract: behind Ray Serve's proxy, ``GET /metrics`` answers from whichever replica the proxy picks, so a
Prometheus scrape through it sees one random replica at a time. Instead, each replica copies every sample of
its own ``server.metrics.Metrics`` registry into a Ray gauge of the same name (``samples``, then
``RayMirror.publish``); Ray exports it on each node's metrics port as ``ray_<name>`` with the labels it had plus
Serve's ``deployment``, ``replica`` and ``application`` tags. Counters and histogram buckets are copied as
their cumulative values, so ``rate``, ``increase`` and ``histogram_quantile`` over ``ray_lookahead_*`` series
read exactly as over ``lookahead_*`` (a restarted replica is a counter reset, which ``rate`` handles).
``_created`` samples are left out. A gauge's tag keys are those of the first sample of its name; a later sample
of that name with other label names is skipped (a Ray metric's tag keys are fixed; the replica starts mirroring
only once it is ready, when ``lookahead_config_info`` has its labels). This module imports no Ray: the gauge
factory is handed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry


@dataclass(frozen=True)
class Sample:
    """One exported sample: its full name (``lookahead_requests_total``), labels and value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def samples(registry: CollectorRegistry) -> list[Sample]:
    """Every sample of ``registry`` but the ``_created`` timestamps, labels sorted by key.

    >>> from prometheus_client import Counter
    >>> registry = CollectorRegistry()
    >>> Counter("hits", "Hits.", ["route"], registry=registry).labels(route="/a").inc(2)
    >>> samples(registry)
    [Sample(name='hits_total', labels=(('route', '/a'),), value=2.0)]
    """
    found = []
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            found.append(Sample(sample.name, tuple(sorted(sample.labels.items())), float(sample.value)))
    return found


class GaugeLike(Protocol):
    """What the mirror needs of a gauge (``ray.serve.metrics.Gauge``)."""

    def set(self, value: float, tags: dict[str, str] | None = None) -> None: ...


GaugeFactory = Callable[[str, str, tuple[str, ...]], GaugeLike]  # (name, description, tag keys) -> gauge


class RayMirror:
    """Copies samples into gauges made by ``gauge_factory``, one gauge per sample name, created on first sight."""

    def __init__(self, gauge_factory: GaugeFactory) -> None:
        self._factory = gauge_factory
        self._gauges: dict[str, tuple[tuple[str, ...], GaugeLike]] = {}

    def publish(self, found: Iterable[Sample]) -> int:
        """Set each sample's gauge to its value; returns how many samples were set (others were skipped)."""
        count = 0
        for sample in found:
            keys = tuple(key for key, _ in sample.labels)
            if sample.name not in self._gauges:
                gauge = self._factory(sample.name, f"Mirror of {sample.name}.", keys)
                self._gauges[sample.name] = (keys, gauge)
            expected, gauge = self._gauges[sample.name]
            if keys != expected:
                continue
            gauge.set(sample.value, tags=dict(sample.labels) or None)
            count += 1
        return count
