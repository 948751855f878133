"""The benchmark's arithmetic and printing: totals, speedups, identical counts, tables and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from bench import report
from bench.records import RunRecord

# --- summary arithmetic -------------------------------------------------------------------------------------


def _run(prompt: str, method: str, tokens: list[int], steps: int | None, seconds: float) -> RunRecord:
    return RunRecord(prompt, method, len(tokens), steps, seconds, tokens)


HAND_MADE = [
    _run("p1", "greedy", [1, 2, 3, 4], 4, 2.0),
    _run("p1", "lookahead", [1, 2, 3, 4], 2, 1.0),
    _run("p1", "generate", [1, 2, 3, 4], 4, 2.0),
    _run("p2", "lookahead", [5, 6, 7, 9, 9, 9], 2, 4.0),
    _run("p2", "generate", [5, 6, 7, 8, 8, 8], 6, 2.0),
    _run("p2", "greedy", [5, 6, 7, 8, 8, 8], 6, 4.0),
    _run("p1", "prompt_lookup", [1, 2, 3], None, 0.5),
]


def test_summary_totals_speedups_and_identical_counts() -> None:
    summaries = {s.method: s for s in report.summarize(HAND_MADE)}
    assert list(summaries) == ["greedy", "lookahead", "generate", "prompt_lookup"]
    lookahead = summaries["lookahead"]
    assert (lookahead.prompts, lookahead.new_tokens, lookahead.steps) == (2, 10, 4)
    assert lookahead.seconds == pytest.approx(5.0)
    assert lookahead.tokens_per_step == pytest.approx(2.5)
    assert lookahead.tokens_per_second == pytest.approx(2.0)
    assert lookahead.speedup_vs_greedy == pytest.approx(6.0 / 5.0)  # totals, not the mean of ratios
    assert lookahead.median_speedup_vs_greedy == pytest.approx((2.0 + 1.0) / 2)
    assert lookahead.speedup_vs_generate == pytest.approx(4.0 / 5.0)
    assert lookahead.median_speedup_vs_generate == pytest.approx((2.0 + 0.5) / 2)
    assert lookahead.identical_to_greedy == 1
    greedy = summaries["greedy"]
    assert greedy.speedup_vs_greedy == pytest.approx(1.0) and greedy.identical_to_greedy == 2
    assert greedy.speedup_vs_generate == pytest.approx(4.0 / 6.0)
    assert summaries["generate"].identical_to_greedy == 2


def test_median_speedup_is_the_median_of_per_prompt_ratios() -> None:
    baseline = {p: _run(p, "greedy", [1], 1, seconds) for p, seconds in (("a", 1.0), ("b", 3.0), ("c", 8.0))}
    runs = {p: _run(p, "lookahead", [1], 1, 1.0) for p in ("a", "b", "c", "d")}
    assert report.median_speedup(baseline, runs) == pytest.approx(3.0)  # ratios 1, 3, 8; "d" has no baseline
    assert report.speedup(baseline, runs) == pytest.approx(12.0 / 3.0)


def test_summary_of_a_method_without_step_counts_or_baselines() -> None:
    lookup = {s.method: s for s in report.summarize(HAND_MADE)}["prompt_lookup"]
    assert lookup.steps is None and lookup.tokens_per_step is None
    assert lookup.speedup_vs_greedy == pytest.approx(2.0 / 0.5)  # only over p1, the prompt it ran
    alone = report.summarize([_run("p1", "lookahead", [1], 1, 1.0)])[0]
    assert alone.speedup_vs_greedy is None and alone.speedup_vs_generate is None
    assert alone.identical_to_greedy is None


def test_prompt_rows_mark_identical_and_first_divergence() -> None:
    rows = {(row[0], row[1]): row for row in report.prompt_rows(HAND_MADE)}
    assert [key for key in rows][:4] == [
        ("p1", "greedy"),
        ("p1", "lookahead"),
        ("p1", "generate"),
        ("p1", "prompt_lookup"),
    ]
    assert rows["p1", "greedy"][-1] == "ref"
    assert rows["p1", "lookahead"][2:] == ["4", "2", "2.00", "4.0", "2.00x", "2.00x", "yes"]
    assert rows["p2", "lookahead"][-1] == "no@3"
    assert rows["p1", "prompt_lookup"][3] == "-" and rows["p1", "prompt_lookup"][-1] == "no@3"


@pytest.mark.parametrize(
    "reference, output, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 2, 4], 2),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3], [1], 1),
        ([], [], None),
    ],
)
def test_first_difference(reference: list[int], output: list[int], expected: int | None) -> None:
    assert report.first_difference(reference, output) == expected


def test_json_keeps_each_run_on_one_line_and_round_trips() -> None:
    payload = {"config": {"a": 1}, "runs": [asdict(run) for run in HAND_MADE[:2]], "summary": {}}
    text = report.to_json(payload)
    assert json.loads(text) == payload
    assert sum(1 for line in text.splitlines() if '"output_ids"' in line) == 2


def test_format_table_aligns_columns() -> None:
    table = report.format_table(["name", "n"], [["a", "1"], ["bbb", "22"]], left=1)
    assert table.splitlines() == ["name   n", "----  --", "a      1", "bbb   22"]
