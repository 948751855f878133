"""The step-cost curve measured at start: its points, their bounds, the fastest of each k's runs, the caches it
leaves as they were, and an engine that prices on it."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding import calibration
from decoding.batch import BatchPolicy
from decoding.calibration import measure_step_cost, step_counts
from decoding.forward.kv_cache import KVPool
from decoding.forward.static import TOKEN_BUCKETS, StaticStep
from tests.conftest import tiny_llama


def test_a_curve_on_the_eager_path_starts_at_one_and_never_falls():
    with torch.inference_mode():
        curve = measure_step_cost(tiny_llama(), None, 64, rounds=1)
    assert [tokens for tokens, _ in curve] == [1, 2, 4, 8, 16, 32, 64]
    assert curve[0] == (1, 1.0)
    costs = [cost for _, cost in curve]
    assert costs == sorted(costs) and all(cost <= tokens for tokens, cost in curve)


def test_a_curve_through_the_static_step_uses_its_buckets_and_gives_its_row_back():
    model = tiny_llama()
    static = StaticStep(model, KVPool(model, 2, 600, scratch_tokens=512), "graphs")
    with torch.inference_mode():
        curve = measure_step_cost(model, static, 200, rounds=1)
    assert [tokens for tokens, _ in curve] == [count for count in TOKEN_BUCKETS if count <= 200]
    assert static.pool.free == 2 and static.replays > len(curve)  # every timed step ran through the bucket


def test_each_point_is_its_fastest_run_capped_at_k_and_made_monotone(monkeypatch):
    """Scripted run times (seconds by k, one list per round, the untimed round first): the curve takes each k's
    fastest timed run, relative to k = 1, never below the point before and never above k."""
    rounds = {1: [9.0, 2.0, 1.0, 1.5], 2: [9.0, 0.5, 0.9, 3.0], 4: [9.0, 2.5, 2.0, 2.2], 8: [9.0, 90.0, 50.0, 60.0]}
    runs = {count: iter(times) for count, times in rounds.items()}
    monkeypatch.setattr(calibration, "_run", lambda model, static, cache, count, vocab: next(runs[count]))
    monkeypatch.setattr(calibration, "_lead_in", lambda *args: None)
    monkeypatch.setattr(calibration, "_fill", lambda *args: None)
    curve = measure_step_cost(tiny_llama(), None, 8, rounds=3, budget_seconds=60)
    assert curve == ((1, 1.0), (2, 1.0), (4, 2.0), (8, 8.0))  # 0.5 / 1 -> 1.0 (monotone); 50 / 1 -> 8 (cap)


def test_timed_rounds_stop_at_the_budget_after_the_first(monkeypatch):
    clock = itertools.count(0.0, 10.0)  # every reading 10 s later: one round spends the whole budget
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: next(clock))
    calls = []
    monkeypatch.setattr(calibration, "_run", lambda model, static, cache, count, vocab: calls.append(count) or 1.0)
    monkeypatch.setattr(calibration, "_lead_in", lambda *args: calls.append("lead-in"))
    monkeypatch.setattr(calibration, "_fill", lambda *args: None)
    measure_step_cost(tiny_llama(), None, 4, rounds=3, budget_seconds=5)
    # the untimed round, then one timed round whose every step follows an untimed one-token step
    assert calls == [1, 2, 4, "lead-in", 1, "lead-in", 2, "lead-in", 4]


@pytest.mark.parametrize(("max_tokens", "static", "expected"), [
    (1, False, [1, 2]), (5, False, [1, 2, 4]), (1024, False, [2**power for power in range(11)]),
    (100, True, [1, 2, 4, 8, 16, 32, 64, 96]),
])
def test_step_counts(max_tokens, static, expected):
    assert step_counts(max_tokens, static) == expected


def test_an_engine_built_to_measure_prices_on_the_measured_curve():
    from decoding.decoder import Decoder
    from decoding.weights.loading import LoadedModel

    model = tiny_llama()
    decoder = Decoder(LoadedModel(model, None, "tiny", "", model.device, model.dtype), "torch")
    preset = BatchPolicy(max_step_tokens=32)
    assert decoder.batch_engine(preset).policy.step_cost == preset.step_cost
    measured = decoder.batch_engine(BatchPolicy(max_step_tokens=32, measure_step_cost=True)).policy.step_cost
    assert [tokens for tokens, _ in measured] == [1, 2, 4, 8, 16, 32] and measured != preset.step_cost
