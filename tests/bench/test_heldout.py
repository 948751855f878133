"""``python -m bench heldout``: the per-prompt comparison, its arguments, and whole runs on a saved tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cli, heldout
from bench.gpu_prediction import predicted_wall, relative_curve
from bench.measure import own_wall
from bench.records import RunRecord
from decoding.batch import engine_guard
from decoding.decoder import Decoder
from decoding.proposers.ngram_memory import NGramMemory, load_memory
from server.config_layers import load_config
from tests.bench.helpers import fake_prompt_sets, save_tiny_model


def record(prompt_id: str, method: str, output: list[int], steps: int, seconds: float) -> RunRecord:
    return RunRecord(prompt_id, method, len(output), steps, seconds, output)


def test_compare_gives_steps_speedups_and_identity_per_prompt() -> None:
    runs = [
        record("a", "greedy", [1, 2, 3, 4], 5, 2.0),
        record("a", "lookahead", [1, 2, 3, 4], 2, 1.0),
        record("a", "prompt_lookup", [1, 2, 3, 4], 3, 4.0),
        record("b", "lookahead", [7, 8], 3, 1.0),
        record("b", "prompt_lookup", [7, 8], 2, 2.0),
        record("b", "greedy", [7, 9], 3, 1.0),
    ]
    first, second = heldout.compare(runs)
    assert (first.id, first.tokens, first.lookahead_steps, first.prompt_lookup_steps) == ("a", 4, 2, 3)
    assert (first.lookahead_tokens_per_step, first.prompt_lookup_tokens_per_step) == (2.0, pytest.approx(4 / 3))
    assert (first.lookahead_speedup, first.prompt_lookup_speedup, first.identical) == (2.0, 0.5, True)
    assert (second.identical, second.first_difference) == (False, 1)  # both left greedy's output at token 1
    assert heldout.steps_wins([first, second]) == (1, 2)
    assert heldout.prompt_rows([second])[0][-1] == "no@1"


def test_without_greedy_lookahead_is_the_reference_and_there_are_no_speedups() -> None:
    (row,) = heldout.compare([record("a", "lookahead", [1, 2], 1, 1.0), record("a", "prompt_lookup", [1, 2], 1, 1.0)])
    assert row.identical and row.lookahead_speedup is None and row.prompt_lookup_speedup is None
    assert heldout.steps_wins([row]) == (1, 1)


def test_arguments_default_by_dataset_and_reject_other_methods(capsys: pytest.CaptureFixture[str]) -> None:
    parser = heldout.build_parser()
    assert heldout.parse(parser, ["--device", "cpu"]).args.max_tokens == 256
    assert heldout.parse(parser, ["--device", "cpu", "--dataset", "alpacaeval"]).args.max_tokens == 192
    resolved = heldout.parse(parser, ["--device", "cpu", "--preset", "cuda", "--methods", "lookahead,prompt_lookup"])
    assert resolved.args.window_size == load_config(device_preset="cuda").lookahead.window_size
    for methods in ("greedy,generate", "greedy,prompt_lookup"):
        with pytest.raises(SystemExit):
            heldout.parse(parser, ["--methods", methods])
    assert "lookahead" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        heldout.parse(parser, ["--dataset", "mt-bench"])
    assert heldout.parse(parser, ["--device", "cpu", "--memory-file", "m.gz"]).args.memory_tokens == 200_000


def test_the_payoff_guard_is_the_servers_priced_on_this_devices_steps_unless_asked_otherwise() -> None:
    """The server's guard (``engine_guard``) priced on each step's own seconds where the preset is the device's; on
    the curve alone for the CUDA preset on a CPU; on the simulated GPU's walls with ``--simulate-gpu``; or none."""
    parser = heldout.build_parser()

    def settings(*flags: str) -> tuple:
        return heldout.payoff_settings(heldout.parse(parser, ["--device", "cpu", *flags]), "cpu")

    resolved, guard, wall = settings()
    assert guard is engine_guard and wall is own_wall and guard(resolved.policy).wall is not None  # the CPU preset's
    resolved, guard, wall = settings("--preset", "cuda")
    assert guard is engine_guard and wall is None
    resolved, guard, wall = settings("--preset", "cuda", "--simulate-gpu")
    assert wall is predicted_wall and resolved.policy.step_cost == relative_curve()
    assert settings("--payoff-guard", "curve")[2] is None
    _, guard, wall = settings("--payoff-guard", "off")
    assert guard(resolved.policy) is None and wall is None
    with pytest.raises(SystemExit):
        heldout.parse(parser, ["--device", "cpu", "--simulate-gpu"])  # the CPU preset: no GPU to simulate


def tiny_argv(model: Path, *flags: str) -> list[str]:
    return ["heldout", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--warmup", "0", *flags]


def test_heldout_runs_the_held_out_prompts_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "heldout.json"
    flags = ["--dataset", "chat", "--limit", "2", "--max-tokens", "12", "--window-size", "2", "--ngram-size", "3"]
    assert cli.main(tiny_argv(tmp_path / "model", *flags, "--guess-set-size", "2", "--output", str(out))) == 0
    printed = capsys.readouterr().out
    assert "chat heldout split, preset cpu" in printed and "per prompt" in printed
    assert "lookahead's output identical to greedy's on 2 of 2" in printed
    assert "lookahead took <= prompt lookup's steps on" in printed
    payload = json.loads(out.read_text())
    assert [row["id"] for row in payload["prompts"]] == ["chat/16", "chat/17"]  # the held-out split, in order
    assert all(row["identical"] for row in payload["prompts"])  # float32: lookahead and prompt lookup are exact
    assert sorted(run["method"] for run in payload["runs"]) == sorted(heldout.DEFAULT_HELDOUT_METHODS.split(",") * 2)
    summary = {s["method"]: s for s in payload["summary"]["methods"]}
    assert summary["lookahead"]["identical_to_greedy"] == 2 and payload["summary"]["identical"] == 2
    assert payload["config"]["lookahead"]["window_size"] == 2


def test_heldout_with_a_shared_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "heldout.json"
    flags = ["--dataset", "chat", "--limit", "2", "--max-tokens", "12", "--memory-tokens", "4096"]
    flags += ["--methods", "greedy,lookahead", "--output", str(out), "--warmup", "1"]
    assert cli.main(tiny_argv(tmp_path / "model", *flags)) == 0
    assert "shared memory of 4096 tokens" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["config"]["memory_tokens"] == 4096
    assert all(row["identical"] for row in payload["prompts"])


def test_heldout_starts_the_memory_from_a_file_that_bench_memory_wrote_from_the_tune_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_tiny_model(tmp_path / "model")
    path = tmp_path / "memory.json.gz"
    build = ["memory", "--dataset", "chat", "--limit", "3", "--max-tokens", "12", "--model", str(tmp_path / "model")]
    assert cli.main([*build, "--output", str(path)]) == 0
    assert "chat: 3 prompts" in capsys.readouterr().out
    restored = NGramMemory(10_000)
    assert load_memory(restored, path, Decoder.load(str(tmp_path / "model"), "cpu", "float32").vocabulary_id) == 3
    out = tmp_path / "heldout.json"
    flags = ["--dataset", "chat", "--limit", "2", "--max-tokens", "12", "--memory-file", str(path)]
    flags += ["--methods", "greedy,lookahead", "--output", str(out), "--warmup", "1"]
    assert cli.main(tiny_argv(tmp_path / "model", *flags)) == 0
    assert f"starting with 3 documents of {path}" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert (payload["config"]["memory_tokens"], payload["config"]["memory_file"]) == (200_000, str(path))
    assert all(row["identical"] for row in payload["prompts"])
    (tmp_path / "foreign.gz").write_bytes(b"no")
    assert cli.main(tiny_argv(tmp_path / "model", *flags[:6], "--memory-file", str(tmp_path / "foreign.gz"))) == 2
    assert "cannot read the memory file" in capsys.readouterr().err


def test_bench_memory_takes_tune_splits_only(capsys: pytest.CaptureFixture[str]) -> None:
    bad = (["--dataset", "mtbench"], ["--dataset", "chat"], ["--dataset", "chat", "--limit", "-1", "--output", "x"])
    for argv in bad:
        with pytest.raises(SystemExit):
            cli.main(["memory", *argv])
    assert "--split" not in capsys.readouterr().err


def test_the_cuda_preset_counts_steps_on_a_cpu_without_greedy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    fake_prompt_sets(tmp_path / "cache")
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "heldout.json"
    flags = ["--dataset", "alpacaeval", "--limit", "2", "--max-tokens", "10", "--preset", "cuda"]
    flags += ["--methods", "lookahead,prompt_lookup", "--output", str(out)]
    assert cli.main(tiny_argv(tmp_path / "model", *flags)) == 0
    assert "lookahead and batch: server preset cuda, model: server preset cpu" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert [row["id"] for row in payload["prompts"]] == ["alpacaeval/1", "alpacaeval/3"]
    cuda = load_config(device_preset="cuda")
    assert payload["config"]["lookahead"]["window_size"] == cuda.lookahead.window_size
    assert payload["config"]["batch"]["max_step_tokens"] == cuda.batch.max_step_tokens
    assert all(row["lookahead_speedup"] is None and row["identical"] for row in payload["prompts"])
    assert payload["summary"]["lookahead_steps_at_most_prompt_lookup"] is not None
