"""What the server's metrics module really exports: families, their types, labels and sample names.

Contract: ``families()`` builds a fresh ``server.metrics.Metrics`` (it owns its registry) and returns one
``Family`` per declared collector. ``Family.sample_names`` are the series names Prometheus stores for it, as
prometheus_client exposes them: a counter ``x`` as ``x_total`` (and ``x_created``), a histogram as
``x_bucket`` / ``x_sum`` / ``x_count`` (and ``x_created``), an info ``x`` as ``x_info``, a gauge as ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "unknown": ("",),
}
# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = ("instance", "job")


@dataclass(frozen=True)
class Family:
    """One exported metric family."""

    name: str
    type: str
    labelnames: tuple[str, ...] | None  # None: a custom collector whose labels are not declared up front

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The series names this family produces."""
        return tuple(self.name + suffix for suffix in _SUFFIXES[self.type])

    def has_label(self, label: str) -> bool:
        """Whether a series of this family can carry ``label`` (``le`` for buckets, target labels for all)."""
        if label in TARGET_LABELS or (label == "le" and self.type in ("histogram", "gaugehistogram")):
            return True
        return self.labelnames is None or label in self.labelnames


def _labelnames(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Declared label names by family name, read from the registered prometheus_client collectors."""
    labels = {}
    for collector in list(getattr(registry, "_collector_to_names", {})):
        declared = getattr(collector, "_labelnames", None)
        if declared is None:
            continue
        for family in collector.collect():
            labels[family.name] = tuple(declared)
    return labels


def registry_families(registry: CollectorRegistry) -> dict[str, Family]:
    """Every family a registry exports, by family name."""
    labels = _labelnames(registry)
    return {family.name: Family(family.name, family.type, labels.get(family.name)) for family in registry.collect()}


def families() -> dict[str, Family]:
    """Every family ``server.metrics.Metrics`` declares."""
    from server.metrics import Metrics

    return registry_families(Metrics().registry)


def sample_index(exported: dict[str, Family]) -> dict[str, Family]:
    """Map each exported series name to its family."""
    return {sample: family for family in exported.values() for sample in family.sample_names}
