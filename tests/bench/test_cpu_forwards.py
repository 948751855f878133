"""``bench.cpu_forwards`` (``python -m bench compile``): the report states the compile cost, each forward's ms per
token, each forward's ratio to the lean step's and the exactness counts; bad arguments exit with status 2."""

from __future__ import annotations

import pytest

from bench import cpu_forwards


def test_the_report_gives_compile_cost_speeds_ratios_and_exactness():
    figures = {
        "compile": {"seconds": 95.0, "graphs": 6, "recompiles": 3, "cold": True},
        "speed": {"dataset": "humaneval", "prompts": 2, "max_tokens": 64,
                  "ms_per_token": {"lean greedy": 26.0, "lean lookahead": 20.0, "compiled greedy": 13.0,
                                   "compiled lookahead": 15.0},
                  "cpu_ms_per_token": {"lean greedy": 25.0, "lean lookahead": 19.0, "compiled greedy": 12.5,
                                       "compiled lookahead": 14.0},
                  "cpu_ratio": {"compiled greedy": 0.5, "compiled lookahead": 0.74},
                  "lookahead_identical_to_greedy": {"lean": 2, "compiled": 2},
                  "identical_to_lean": {"lean": 2, "compiled": 1}},
    }
    text = cpu_forwards.report(figures)
    assert "compile: 95.0 s (fresh inductor cache), 6 graphs, 3 recompiles" in text
    assert "greedy: compiled / lean = 0.500x time, 0.500x CPU" in text
    assert "lookahead: compiled / lean = 0.750x time, 0.740x CPU" in text
    assert "lean greedy            26.00 ms/token,   25.00 ms of CPU" in text
    assert "{'lean': 2, 'compiled': 2} of 2" in text
    assert "outputs == the lean step's (both methods) on {'lean': 2, 'compiled': 1} of 2" in text


@pytest.mark.parametrize("argv", [["--limit", "0"], ["--forwards", "fused"], ["--forwards", "lean,jit"],
                                  ["--forwards", "lean,lean"]])
def test_bad_arguments_exit_with_status_2(argv):
    with pytest.raises(SystemExit) as caught:
        cpu_forwards.main(argv)
    assert caught.value.code == 2
