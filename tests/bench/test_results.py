"""``bench.results``: the current-results page is the rendering of its JSON, and no row is stale (measured on a
preset that has changed since); rows come from ``bench heldout`` payloads and replace older ones."""

from __future__ import annotations

from bench.results import RESULTS_MD, load, merged, render, render_threads, row_of, stale_rows, threads_record
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


def test_the_threads_section_shows_each_method_per_count_and_the_step_cost_ratio():
    stamp = {"command": "python -m bench threads", "commit": "abc1234", "date": "2026-11-28", "preset": "cpu",
             "preset_digest": "d"}
    figures = [{"method": "greedy@1", "tokens_per_second": 50.0, "tokens_per_step": 1.0, "vs_greedy_1": None,
                "vs_llama_cpp": 2.0, "vs_greedy": None, "identical_to_greedy_1": "8/8"},
               {"method": "greedy@2", "tokens_per_second": 70.0, "tokens_per_step": 1.0, "vs_greedy_1": 1.4,
                "vs_llama_cpp": 1.8, "vs_greedy": None, "identical_to_greedy_1": "8/8"}]
    decodes = {"config": {"environment": {"machine": "a CPU"}, "dataset": "humaneval", "split": "heldout",
                          "max_tokens": 256, "stamp": stamp},
               "runs": [{"id": "a"}, {"id": "a"}, {"id": "b"}], "summary": figures}
    steps = {"config": {"counts": [1, 2], "stamp": stamp}, "step_cost": [{"k": 8, "1": 40.0, "2": 24.0}]}
    page = render_threads(threads_record(decodes, steps))
    assert "humaneval heldout, 2 x 256 tokens" in page
    assert "| greedy@2 | 70.0 | 1.00 | 1.40x | 1.80x | - | 8/8 |" in page
    assert "| 8 | 40.00 | 24.00 | 0.60x |" in page
