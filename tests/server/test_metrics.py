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
