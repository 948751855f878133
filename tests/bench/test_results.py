"""``bench.results``: the current-results page is the rendering of its JSON, and no row is stale (measured on a
preset that has changed since); rows come from ``bench heldout`` payloads and replace older ones."""

from __future__ import annotations

from bench.results import RESULTS_MD, load, merged, render, row_of, stale_rows
from bench.settings import preset_digest


def payload(dataset: str, speedup: float, digest: str) -> dict:
    """A minimal ``bench heldout --output`` payload."""
    methods = [
        {"method": "greedy", "speedup_vs_greedy": 1.0, "median_speedup_vs_greedy": 1.0, "tokens_per_step": 1.0},
        {"method": "lookahead", "speedup_vs_greedy": speedup, "median_speedup_vs_greedy": 1.5,
         "tokens_per_step": 2.25},
    ]
    stamp = {"command": "python -m bench heldout", "commit": "abc1234", "date": "2026-11-25", "preset": "cpu",
             "preset_digest": digest}
    config = {"dataset": dataset, "split": "heldout", "max_tokens": 256, "stamp": stamp,
              "environment": {"device": "cpu", "machine": "a CPU"}}
    return {"config": config, "summary": {"methods": methods, "prompts": 8, "identical": 8}}


def test_the_page_is_the_rendering_of_the_json():
    assert RESULTS_MD.read_text() == render(load()), "regenerate: python -m bench.results render"


def test_every_current_row_was_measured_on_todays_preset():
    rows = load()
    assert rows, "docs/results.json holds the current figures"
    assert stale_rows(rows) == [], "re-measure these rows (python -m bench heldout ... then bench.results add)"


def test_a_newer_run_replaces_its_row_and_a_changed_preset_is_stale():
    today = preset_digest("cpu")
    rows = merged([], [row_of(payload("humaneval", 1.8, today)), row_of(payload("chat", 1.2, today))])
    rows = merged(rows, [row_of(payload("humaneval", 1.9, today))])
    assert [(row["dataset"], row["speedup"]) for row in rows] == [("chat", 1.2), ("humaneval", 1.9)]
    assert stale_rows(rows) == []
    old = row_of(payload("mtbench", 1.3, "000000000000"))
    assert stale_rows([old]) == [f"cpu mtbench: preset cpu 000000000000, now {today}"]
    page = render(rows)
    assert "| humaneval heldout, 8 x 256 tokens | **1.90x** | 1.50x | 2.25 |" in page
    assert "Nothing measured on the current cuda preset yet." in page
