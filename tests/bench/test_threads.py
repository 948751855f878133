"""``python -m bench threads``: thread counts parsed, the summary's ratios, and a whole run on a saved tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import cli, threads
from bench.measure import RunRecord
from decoding.weights import native
from decoding.weights.cores import usable_cores
from tests.bench.helpers import save_tiny_model


def test_counts_are_distinct_and_auto_resolves_here() -> None:
    assert threads.parse_counts("1,2") == [1, 2]
    assert threads.parse_counts("auto") == [usable_cores()]
    for bad in ("", "0", "1,1", "x"):
        with pytest.raises(ValueError):
            threads.parse_counts(bad)


def test_the_summary_compares_each_pair_with_greedy_and_llama_cpp_at_its_count() -> None:
    runs = [
        RunRecord("a", "greedy@1", 4, 4, 2.0, [1, 2, 3, 4]),
        RunRecord("a", "llama_cpp@1", 4, 5, 4.0, [1, 2, 3, 5]),
        RunRecord("a", "greedy@2", 4, 4, 1.0, [1, 2, 3, 4]),
        RunRecord("a", "lookahead@2", 4, 2, 0.5, [1, 2, 3, 4]),
        RunRecord("a", "llama_cpp@2", 4, 5, 2.0, [1, 2, 3, 5]),
    ]
    rows, figures = threads.summary_rows(runs)
    by_method = {figure["method"]: figure for figure in figures}
    assert by_method["greedy@2"]["vs_greedy_1"] == 2.0 and by_method["greedy@2"]["vs_llama_cpp"] == 2.0
    assert by_method["lookahead@2"]["vs_greedy"] == 2.0 and by_method["lookahead@2"]["vs_llama_cpp"] == 4.0
    assert by_method["lookahead@2"]["tokens_per_step"] == 2.0
    assert by_method["llama_cpp@1"]["identical_to_greedy_1"] == "0/1"
    assert by_method["greedy@1"]["vs_greedy_1"] is None and [row[0] for row in rows][0] == "greedy@1"


def test_a_whole_run_at_one_and_two_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "threads.json"
    argv = ["threads", "--model", str(tmp_path / "model"), "--device", "cpu", "--dtype", "float32", "--warmup", "0",
            "--dataset", "chat", "--limit", "1", "--max-tokens", "8", "--methods", "greedy,lookahead",
            "--output", str(out)]
    torch_threads = torch.get_num_threads()
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(torch_threads)
    assert "greedy@2" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert sorted(run["method"] for run in payload["runs"]) == ["greedy@1", "greedy@2", "lookahead@1", "lookahead@2"]
    assert all(figure["identical_to_greedy_1"] == "1/1" for figure in payload["summary"])
    assert native.threads() == 1  # put back
