"""The metrics module: what each feeding call adds to the exported series."""

from __future__ import annotations

from decoding import StepCounts
from server.metrics import Metrics


def test_memory_accepted_tokens_count_what_steps_took_from_the_shared_memory():
    metrics = Metrics()
    value = metrics.registry.get_sample_value
    assert value("lookahead_memory_accepted_tokens_total") == 0
    metrics.step(StepCounts(tokens=4, steps=1, offered=3, accepted=3, memory_accepted=2), 0.01, 0.01)
    metrics.step(StepCounts(tokens=2, steps=1, offered=3, accepted=1), 0.01, 0.01)
    metrics.step(StepCounts(tokens=3, steps=1, offered=3, accepted=2, memory_accepted=2), 0.01, 0.01)
    assert value("lookahead_memory_accepted_tokens_total") == 4
    assert value("lookahead_accepted_tokens_total") == 6


def test_per_source_counters_count_what_each_source_offered_and_had_accepted():
    metrics = Metrics()
    value = metrics.registry.get_sample_value
    metrics.step(StepCounts(tokens=4, steps=1, offered=16, accepted=3,
                            sources=(("copy", 16, 3), ("pool", 4, 1))), 0.01, 0.01)
    metrics.step(StepCounts(tokens=1, steps=1, offered=4, accepted=0, sources=(("pool", 4, 0),)), 0.01, 0.01)
    assert value("lookahead_source_offered_tokens_total", {"source": "copy"}) == 16
    assert value("lookahead_source_accepted_tokens_total", {"source": "copy"}) == 3
    assert value("lookahead_source_offered_tokens_total", {"source": "pool"}) == 8
    assert value("lookahead_source_accepted_tokens_total", {"source": "pool"}) == 1
    assert value("lookahead_source_accepted_tokens_total", {"source": "memory"}) is None  # never offered


def test_kv_cache_usage_is_tokens_held_over_capacity():
    metrics = Metrics()
    value = metrics.registry.get_sample_value
    metrics.set_kv_tokens(300)
    assert value("lookahead_kv_cache_usage_ratio") == 0  # capacity not known yet
    metrics.set_kv_capacity(2 * 8192)
    assert value("lookahead_kv_cache_tokens") == 300
    assert value("lookahead_kv_cache_capacity_tokens") == 16384
    assert value("lookahead_kv_cache_usage_ratio") == 300 / 16384
    metrics.set_kv_tokens(20000)  # never above 1
    assert value("lookahead_kv_cache_usage_ratio") == 1.0
    metrics.set_kv_tokens(0)
    assert value("lookahead_kv_cache_usage_ratio") == 0
