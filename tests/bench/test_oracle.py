"""``python -m bench.oracle``: replaying greedy outputs against copy and memory candidates, and a whole run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import oracle
from bench.oracle import Source, replay, replay_all
from decoding.proposers.ngram_memory import NGramMemory
from tests.bench.helpers import fake_prompt_sets, save_tiny_model

NONE = Source("none", 0, 0)


def test_without_candidates_every_token_is_a_step():
    assert replay([1, 2], [3, 4, 5, 6], NONE) == 4
    assert replay([1, 2], [], NONE) == 0


def test_a_copy_commits_the_matching_prefix_plus_one():
    prompt = [7, 1, 2, 3, 4, 5, 9]
    output = [8, 1, 2, 3, 4, 6, 6]  # after "1", the prompt continues "2 3 4 5": "2 3 4" match, then 6 is new
    # steps: 8 (prefill) | 1 | 2 3 4 + 6 (the bonus token) | 6
    assert replay(prompt, output, Source("copy", 1, 0)) == 4
    # with a 2-gram match: "8 1" never occurred, so 1 and 2 come alone; then "1 2" matches: 8 | 1 | 2 | 3 4 + 6 | 6
    assert replay(prompt, output, Source("copy after a 2-gram", 1, 1)) == 5


def test_the_best_of_several_candidates_counts_and_a_copy_never_runs_past_the_output():
    prompt = [1, 5, 6, 1, 2, 3]  # two continuations of 1, neither after a matching context: the longer ranks first
    output = [9, 1, 2, 3]
    assert replay(prompt, output, Source("one", 1, 0)) == 4  # 9 | 1 | 2 (the copy "5 6 ..." fails) | 3
    assert replay(prompt, output, Source("two", 2, 0)) == 3  # 9 | 1 | 2 3 (the second copy, cut at the end)


def test_the_memory_holds_only_earlier_outputs():
    decodes = [([1, 2], [3, 4, 5, 6, 7]), ([9, 2], [3, 4, 5, 6, 7])]
    remembered = Source("memory", 0, 0, remembered=4)
    assert replay_all(decodes, remembered) == (10, 5 + 2)  # the second output is the first one again
    assert replay_all(decodes, NONE) == (10, 10)
    memory = NGramMemory(100)
    assert replay([9, 2], [3, 4, 5, 6, 7], remembered, memory) == 5  # an empty memory offers nothing


def test_a_run_prints_and_writes_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    fake_prompt_sets(tmp_path / "cache")
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "oracle.json"
    argv = ["--model", str(tmp_path / "model"), "--limit", "3", "--max-tokens", "12", "--output", str(out)]
    assert oracle.main(argv) == 0
    printed = capsys.readouterr().out
    assert "humaneval tune split, 3 prompts x 12 tokens" in printed
    payload = json.loads(out.read_text())
    rows = payload["sources"]
    assert [row["name"] for row in rows] == [source.name for source in oracle.SOURCES]
    assert len({row["tokens"] for row in rows}) == 1 and rows[0]["tokens"] > 0  # the same outputs for every source
    every = next(row for row in rows if row["copies"] == oracle.EVERY)
    assert all(every["steps"] <= row["steps"] for row in rows if not row["remembered"])  # the bound of copies
