"""The H100 prediction of a held-out run: each forward priced on the graph curve plus host work per step."""

from __future__ import annotations

import pytest

from bench.gpu_prediction import H100_GRAPH_MS, decode_seconds, padded, predict, step_ms
from bench.records import RunRecord


def record(prompt: str, method: str, sizes: list[int], prefill: int = 1) -> RunRecord:
    return RunRecord(prompt, method, new_tokens=10, steps=len(sizes), seconds=1.0, output_ids=[1] * 10,
                     step_tokens=sizes, prefill_steps=prefill)


def test_the_curve_is_the_measured_points_and_linear_between():
    assert [step_ms(tokens) for tokens, _ in H100_GRAPH_MS] == [ms for _, ms in H100_GRAPH_MS]
    assert step_ms(20) == pytest.approx(4.46)
    assert step_ms(512) > step_ms(128)


def test_a_prediction_prices_every_forward_and_leaves_the_prefill_out_of_the_step_size():
    greedy = record("a", "greedy", [40] + [1] * 10)
    lookahead = record("a", "lookahead", [40, 128, 128, 64])
    prediction = predict([greedy, lookahead, record("b", "greedy", [5, 1])])  # b has no lookahead: left out
    assert prediction.mean_step_tokens == pytest.approx(320 / 3, abs=0.1)
    want_greedy = (step_ms(64) + 10 * step_ms(1) + 11 * 0.22) / 1000  # the 40-token prefill replays bucket 64
    want_lookahead = (step_ms(64) + 2 * step_ms(128) + step_ms(64) + 4 * 2.0) / 1000
    assert padded(40) == 64
    assert decode_seconds(greedy, 0.22) == pytest.approx(want_greedy)
    assert prediction.greedy_seconds == pytest.approx(want_greedy, abs=1e-3)
    assert prediction.speedup == pytest.approx(want_greedy / want_lookahead, abs=1e-3)


def test_no_prediction_without_step_sizes():
    assert predict([record("a", "greedy", []), record("a", "lookahead", [3, 4])]) is None
