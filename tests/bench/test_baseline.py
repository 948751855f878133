"""``--baseline REV``: an earlier commit's greedy and lookahead in a child process, against a real worktree of this
branch's HEAD (the same code, so base greedy must be greedy token for token) on a saved tiny model."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import baseline, cli, heldout
from bench.records import RunRecord
from decoding.params import StopCriteria
from tests.bench.helpers import save_tiny_model

EOS = 2


def record(prompt_id: str, method: str, output: list[int], steps: int, seconds: float) -> RunRecord:
    return RunRecord(prompt_id, method, len(output), steps, seconds, output)


def test_base_methods_need_a_commit_and_a_bad_revision_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = heldout.build_parser()
    for argv, message in (
        (["--methods", "greedy,lookahead,base_greedy"], "base_greedy need --baseline REV"),
        (["--baseline", "HEAD"], "add one to --methods"),
        (["--methods", "lookahead,base_lookahead", "--baseline", "no-such-rev"], "'no-such-rev' is not a commit"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            heldout.parse(parser, ["--device", "cpu", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    resolved = heldout.parse(parser, ["--device", "cpu", "--methods", "lookahead,base_greedy", "--baseline", "HEAD"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert resolved.args.baseline_commit == head
    with pytest.raises(SystemExit):  # python -m bench takes the flag too
        cli.parse(cli.build_parser(), ["--device", "cpu", "--methods", "base_greedy", "--baseline", "nope"])


def test_a_folder_that_is_not_the_commit_s_checkout_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    commit = baseline.resolve_commit("HEAD")
    (tmp_path / "baselines" / commit[: baseline.SHORT]).mkdir(parents=True)
    with pytest.raises(baseline.BaselineError, match="is not a checkout of"):
        baseline.checkout(commit)


def test_the_comparison_gives_speedups_over_the_commit_and_which_outputs_agree() -> None:
    runs = [
        record("a", "greedy", [1, 2, 3], 3, 1.0),
        record("a", "lookahead", [1, 2, 3], 2, 0.5),
        record("a", "base_greedy", [1, 2, 4], 3, 2.0),
        record("a", "base_lookahead", [1, 2, 4], 2, 1.5),
        record("b", "greedy", [5], 1, 1.0),
        record("b", "lookahead", [5], 1, 1.0),
        record("b", "base_greedy", [5], 1, 1.0),
        record("b", "base_lookahead", [5, 6], 1, 1.5),
    ]
    first, second = baseline.comparison_rows(runs)
    assert first == ["a", "2", "1.50", "0.50x", "0.67x", "3.00x", "no@2", "yes"]
    assert second[-2:] == ["yes", "no@1"]
    text, summary = baseline.comparison(runs, {"commit": "f" * 40})
    assert summary["greedy_vs_base_greedy"] == 1.5 and summary["lookahead_vs_base_lookahead"] == 2.0
    assert summary["lookahead_vs_base_lookahead_median"] == pytest.approx(2.25)  # of 3.0 and 1.5 (total: 3.0 s / 1.5 s)
    assert (summary["base_greedy_identical_to_greedy"], summary["base_lookahead_identical_to_base_greedy"]) == (1, 1)
    assert "lookahead vs ffffffffffff's: 2.00x (median 2.25x)" in text


# --- a real worktree of HEAD, on a tiny model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """HEAD's full hash and a tiny model folder, with ``$LOOKAHEAD_CACHE`` in a temporary folder; the worktree
    made there is removed afterwards."""
    root = tmp_path_factory.mktemp("baseline")
    save_tiny_model(root / "model")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOOKAHEAD_CACHE", str(root / "cache"))
        commit = baseline.resolve_commit("HEAD")
        yield commit, root / "model"
        folder = root / "cache" / "baselines" / commit[: baseline.SHORT]
        if folder.exists():
            subprocess.run(["git", "-C", str(baseline.repository()), "worktree", "remove", "--force", str(folder)],
                           check=True)


def test_the_child_answers_over_its_pipes_and_says_what_failed(head: tuple[str, Path]) -> None:
    commit, model = head
    child = baseline.BaselineChild.start(commit, ["--model", str(model), "--device", "cpu", "--threads", "1"])
    try:
        assert child.ready["ready"] and child.ready["preset"] == "cpu" and "window_size" in child.ready["lookahead"]
        stop = StopCriteria(8, frozenset({EOS}))
        greedy = child.decode("greedy", [5, 9, 11, 5, 9, 11, 5, 9], stop)
        lookahead = child.runner("base_lookahead")(None, [5, 9, 11, 5, 9, 11, 5, 9], stop)
        assert 1 <= len(greedy.output_ids) <= 8 and lookahead.output_ids == greedy.output_ids
        assert greedy.steps is not None and lookahead.steps is not None and lookahead.steps <= greedy.steps
        assert greedy.seconds is not None and greedy.seconds > 0
        child.reset()  # no memory: nothing to put back, still answered
        with pytest.raises(baseline.BaselineError, match="KeyError: 'beam'"):
            child.decode("beam", [5, 9], stop)
        assert child.decode("greedy", [5, 9, 11, 5, 9, 11, 5, 9], stop).output_ids == greedy.output_ids
    finally:
        child.close()
    assert child.process.returncode == 0


def test_heldout_runs_head_as_its_own_baseline_interleaved(
    head: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commit, model = head
    out = tmp_path / "heldout.json"
    argv = ["heldout", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--threads", "1",
            "--dataset", "chat", "--limit", "2", "--max-tokens", "8", "--baseline", "HEAD", "--output", str(out),
            "--methods", "greedy,lookahead,base_greedy,base_lookahead"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"baseline: commit {commit[: baseline.SHORT]} (HEAD) in a child process" in printed
    assert "per prompt, against HEAD" in printed
    payload = json.loads(out.read_text())
    assert [run["method"] for run in payload["runs"][4:8]] == ["lookahead", "base_greedy", "base_lookahead", "greedy"]
    summary = payload["summary"]["baseline"]
    assert summary["commit"] == commit and payload["config"]["baseline"]["commit"] == commit
    assert summary["base_greedy_identical_to_greedy"] == 2 and summary["base_lookahead_identical_to_base_greedy"] == 2
    assert summary["greedy_vs_base_greedy"] > 0 and summary["lookahead_vs_base_lookahead"] > 0
    assert all(run["seconds"] > 0 for run in payload["runs"])
    folder = model.parent / "cache" / "baselines" / commit[: baseline.SHORT]  # outside the repository
    assert baseline.checkout(commit) == folder and (folder / "bench" / "heldout.py").is_file()  # made, then reused
    assert subprocess.run(["git", "-C", str(folder), "status", "--porcelain"], capture_output=True, text=True,
                          check=True).stdout == ""
