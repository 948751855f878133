"""Mirroring a replica's registry into Ray's gauges (``server.ray_metrics``), with a stand-in gauge factory."""

from __future__ import annotations

from decoding import StepCounts
from server.metrics import Metrics
from server.ray_metrics import RayMirror, Sample, samples


class FakeGauge:
    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]) -> None:
        self.name, self.tag_keys, self.values = name, tag_keys, {}

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert set(tags or {}) == set(self.tag_keys)
        self.values[tuple(sorted((tags or {}).items()))] = value


def test_samples_are_every_series_but_created_timestamps():
    metrics = Metrics()
    metrics.step(StepCounts(tokens=3, steps=1, offered=2, accepted=2), 0.01, 0.01)
    metrics.request_finished("length", StepCounts(tokens=3, steps=1, offered=2, accepted=2), 0.5)
    found = {(sample.name, sample.labels): sample.value for sample in samples(metrics.registry)}
    assert found[("lookahead_generation_tokens_total", ())] == 3
    assert found[("lookahead_requests_total", (("finish_reason", "length"),))] == 1
    assert found[("lookahead_e2e_request_latency_seconds_bucket", (("le", "0.5"),))] == 1
    assert found[("lookahead_e2e_request_latency_seconds_count", ())] == 1
    assert ("lookahead_kv_cache_usage_ratio", ()) in found
    assert not [name for name, _ in found if name.endswith("_created")]


def test_the_mirror_makes_one_gauge_per_name_and_sets_every_labelled_value():
    made: list[FakeGauge] = []

    def factory(name: str, description: str, tag_keys: tuple[str, ...]) -> FakeGauge:
        made.append(FakeGauge(name, description, tag_keys))
        return made[-1]

    mirror = RayMirror(factory)
    first = [Sample("x_total", (("reason", "a"),), 1.0), Sample("x_total", (("reason", "b"),), 2.0), Sample("y", (), 5)]
    assert mirror.publish(first) == 3
    assert mirror.publish([Sample("x_total", (("reason", "a"),), 4.0)]) == 1
    gauges = {gauge.name: gauge for gauge in made}
    assert len(made) == 2 and gauges["x_total"].tag_keys == ("reason",)
    assert gauges["x_total"].values == {(("reason", "a"),): 4.0, (("reason", "b"),): 2.0}
    assert gauges["y"].values == {(): 5}


def test_a_whole_registry_mirrors_into_gauges_that_add_up():
    metrics = Metrics()
    metrics.reject("queue_full")
    made: dict[str, FakeGauge] = {}
    RayMirror(lambda name, description, keys: made.setdefault(name, FakeGauge(name, description, keys))).publish(
        samples(metrics.registry))
    assert made["lookahead_requests_rejected_total"].values[(("reason", "queue_full"),)] == 1
    assert made["lookahead_config_info"].tag_keys == ()  # no config published yet: an info without labels


def test_a_sample_with_other_label_names_than_its_gauge_is_skipped():
    made: dict[str, FakeGauge] = {}
    mirror = RayMirror(lambda name, description, keys: made.setdefault(name, FakeGauge(name, description, keys)))
    assert mirror.publish([Sample("info", (), 1.0)]) == 1
    assert mirror.publish([Sample("info", (("model", "m"),), 1.0), Sample("info", (), 1.0)]) == 1
    assert made["info"].values == {(): 1.0}
