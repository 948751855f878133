"""``python -m bench anatomy --held-out``: the default model's replayed host work on a held-out prompt."""

from __future__ import annotations

import json

import pytest

from bench import anatomy
from bench.held_out_host import held_out_rows, held_out_table

pytestmark = pytest.mark.real_model


def test_a_held_out_prompt_gives_each_streams_replayed_host_work():
    rows = held_out_rows(["chat"], max_tokens=8, replays=2)
    greedy, lookahead = rows["chat"]["greedy"], rows["chat"]["lookahead"]
    for row in (greedy, lookahead):
        assert set(row["host_ms_replayed"]) == {"chat/16"} and row["median_host_ms_replayed"] > 0
        assert row["tokens"] == 8
    assert greedy["median_step_tokens"] == 1 and greedy["steps"] == 7  # the prefill commits the first token
    assert lookahead["median_step_tokens"] > 16  # the CUDA preset's window (16 x 4) and its drafts
    assert "| chat | lookahead |" in "\n".join(held_out_table(rows))


def test_the_cli_writes_the_rows(tmp_path, monkeypatch):
    seen = {}

    def rows(datasets, preset):
        seen.update(datasets=datasets, preset=preset)
        return {"chat": {"greedy": {"host_ms_replayed": {"chat/16": 0.1}, "median_host_ms_replayed": 0.1,
                                    "steps": 8, "tokens": 8, "median_step_tokens": 1}}}

    monkeypatch.setattr("bench.held_out_host.held_out_rows", rows)
    out = tmp_path / "held.json"
    assert anatomy.main(["--held-out", "chat,mtbench", "--preset", "cuda", "--json", str(out)]) == 0
    assert seen == {"datasets": ["chat", "mtbench"], "preset": "cuda"}
    assert json.loads(out.read_text())["held_out"]["chat"]["greedy"]["steps"] == 8
