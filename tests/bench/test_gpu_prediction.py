"""The GPU prediction of a held-out run: each forward priced on the step curve plus host work per step."""

from __future__ import annotations

import pytest

from bench.gpu_prediction import (
    H100_GRAPH_MS,
    H200_STEP_MS,
    HOST_MS,
    PLAIN_HOST_MS,
    STEP_MS,
    decode_seconds,
    padded,
    predict,
    predicted_wall,
    relative_curve,
    step_ms,
)
from bench.records import RunRecord
from decoding.step.steps import StepStats


def record(prompt: str, method: str, sizes: list[int], prefill: int = 1) -> RunRecord:
    return RunRecord(prompt, method, new_tokens=10, steps=len(sizes), seconds=1.0, output_ids=[1] * 10,
                     step_tokens=sizes, prefill_steps=prefill)


def test_the_curve_is_the_measured_points_and_linear_between():
    assert STEP_MS is H200_STEP_MS
    for curve in (H200_STEP_MS, H100_GRAPH_MS):
        assert [step_ms(tokens, curve) for tokens, _ in curve] == [ms for _, ms in curve]
    assert step_ms(20) == pytest.approx(4.61 + 4 * 0.049 / 16)
    assert step_ms(20, H100_GRAPH_MS) == pytest.approx(4.46)
    assert step_ms(1024) > step_ms(512) > step_ms(128)


def test_the_relative_curve_is_what_the_calibration_would_measure():
    curve = relative_curve()
    assert curve[0] == (1, 1.0) and [tokens for tokens, _ in curve] == [tokens for tokens, _ in H200_STEP_MS]
    costs = [cost for _, cost in curve]
    assert costs == sorted(costs) and curve[2] == (4, 1.24)  # 4 tokens took less than 2 that day
    assert dict(curve)[384] == pytest.approx(2.74, abs=0.002)  # the server's measured point


def test_a_predicted_wall_prices_the_bucket_and_the_host_work_of_its_kind_of_step():
    assert predicted_wall(StepStats(340, 3), 9.9) == pytest.approx((10.01 + HOST_MS["lookahead"]) / 1000)  # bucket 384
    assert predicted_wall(StepStats(1, 1)) == pytest.approx((3.654 + PLAIN_HOST_MS) / 1000)


def test_a_prediction_prices_every_forward_and_leaves_the_prefill_out_of_the_step_size():
    greedy = record("a", "greedy", [40] + [1] * 10)
    lookahead = record("a", "lookahead", [40, 128, 128, 64])
    prediction = predict([greedy, lookahead, record("b", "greedy", [5, 1])])  # b has no lookahead: left out
    assert prediction.mean_step_tokens == pytest.approx(320 / 3, abs=0.1)
    host = HOST_MS["greedy"]
    want_greedy = (step_ms(64) + 10 * step_ms(1) + 11 * host) / 1000  # the 40-token prefill replays bucket 64
    want_lookahead = (step_ms(64) + 2 * step_ms(128) + step_ms(64) + 4 * HOST_MS["lookahead"]) / 1000
    assert padded(40) == 64
    assert decode_seconds(greedy, host) == pytest.approx(want_greedy)
    assert prediction.greedy_seconds == pytest.approx(want_greedy, abs=1e-3)
    assert prediction.speedup == pytest.approx(want_greedy / want_lookahead, abs=1e-3)


def test_a_lookahead_decodes_one_token_steps_cost_a_plain_steps_host_work():
    rested = record("a", "lookahead", [40, 128, 1, 1, 64])
    want = (step_ms(64) + step_ms(128) + 2 * step_ms(1) + step_ms(64) + 3 * 2.0 + 2 * PLAIN_HOST_MS) / 1000
    assert decode_seconds(rested, 2.0, PLAIN_HOST_MS) == pytest.approx(want)
    assert decode_seconds(record("a", "lookahead", [1, 1]), 2.0, 0.0) == pytest.approx((2 * step_ms(1) + 2.0) / 1000)


def test_no_prediction_without_step_sizes():
    assert predict([record("a", "greedy", []), record("a", "lookahead", [3, 4])]) is None
