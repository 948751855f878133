"""The benchmark's command line end to end on a saved tiny model: tables, JSON, partial files, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import cli, measure
from server.config_layers import load_config
from tests.bench.helpers import save_tiny_model

ALL_METHODS = "greedy,lookahead,generate,prompt_lookup"


def test_main_end_to_end_on_a_saved_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "w10 w11 w12 w10 w11 w12 w10"})
        + "\n"
        + json.dumps({"id": "chat", "messages": [{"role": "user", "content": "w20 w21 w22"}]})
        + "\n"
    )
    out = tmp_path / "bench.json"
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--limit", "0", "--max-tokens", "16"]
    argv += ["--window-size", "2", "--ngram-size", "3", "--guess-set-size", "2", "--methods", ALL_METHODS]
    argv += ["--device", "cpu", "--dtype", "float32", "--threads", "0", "--json", str(out)]
    threads = torch.get_num_threads()
    assert cli.main(argv) == 0
    assert torch.get_num_threads() == threads
    printed = capsys.readouterr().out
    assert printed.startswith("settings (server preset cpu unless marked [flag]):\n")  # printed before loading
    assert "window_size=2 [flag]" in printed and "threads=0 [flag]" in printed
    assert "W=2 N=3 G=2" in printed and "per prompt" in printed and "total" in printed
    payload = json.loads(out.read_text())
    assert "partial" not in payload  # the finished benchmark replaced the partial file
    runs = payload["runs"]
    assert len(runs) == 2 * 4
    assert {run["id"] for run in runs} == {"prompts/1", "chat"}
    assert set(runs[0]) >= {"id", "method", "new_tokens", "steps", "seconds", "output_ids"}
    summary = {s["method"]: s for s in payload["summary"]["methods"]}
    assert summary["lookahead"]["identical_to_greedy"] == 2
    assert summary["greedy"]["new_tokens"] == sum(r["new_tokens"] for r in runs if r["method"] == "greedy")
    assert payload["config"]["lookahead"]["window_size"] == 2


def test_a_cut_off_benchmark_leaves_its_runs_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w11 w12 w10"}) + "\n" + json.dumps({"prompt": "w20 w21"}) + "\n")
    timed = measure.time_run
    calls = []

    def interrupted_after_three(*args, **kwargs):
        calls.append(args)
        if len(calls) == 4:
            raise KeyboardInterrupt  # a time limit's kill, as far as the file is concerned
        return timed(*args, **kwargs)

    monkeypatch.setattr(measure, "time_run", interrupted_after_three)
    out = tmp_path / "bench.json"
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--limit", "0", "--max-tokens", "8"]
    argv += ["--methods", "greedy,lookahead", "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)
    payload = json.loads(out.read_text())
    assert payload["partial"] is True and len(payload["runs"]) == 3
    assert [run["method"] for run in payload["runs"]] == ["greedy", "lookahead", "lookahead"]
    # no flag: the server's CPU preset, as `lookahead-server --device cpu` runs
    assert payload["config"]["lookahead"]["window_size"] == load_config(device_preset="cpu").lookahead.window_size


def test_preset_names_whose_lookahead_settings_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--preset cuda`` on a CPU: the CUDA preset's step settings and batch policy, the model loaded as the CPU's."""
    save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w11 w12 w10 w11 w12 w10"}) + "\n")
    out = tmp_path / "bench.json"
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--max-tokens", "8", "--warmup", "0"]
    argv += ["--methods", "greedy,lookahead", "--device", "cpu", "--preset", "cuda", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "lookahead and batch: server preset cuda, model: server preset cpu" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    cuda = load_config(device_preset="cuda").lookahead
    assert payload["config"]["lookahead"]["window_size"] == cuda.window_size
    assert payload["config"]["stamp"]["preset"] == "cuda"
    summary = {s["method"]: s for s in payload["summary"]["methods"]}
    assert summary["lookahead"]["identical_to_greedy"] == 1


def test_main_rejects_bad_arguments_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--methods", "greedy,beam", "--model", "/nonexistent"])
    with pytest.raises(SystemExit):
        cli.main(["--ngram-size", "1", "--model", "/nonexistent"])
    assert "ngram_size" in capsys.readouterr().err


def test_main_reports_a_bad_prompt_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": 1}\n')
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--device", "cpu", "--threads", "0"]
    assert cli.main(argv) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_step_cost_runs_the_sizes_given_by_ks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "cost.json"
    argv = ["--model", str(tmp_path / "model"), "--device", "cpu", "--dtype", "float32", "--step-cost"]
    assert cli.main([*argv, "--ks", "1,3,40", "--context", "8", "--repeats", "1", "--json", str(out)]) == 0
    assert [row["k"] for row in json.loads(out.read_text())["step_cost"]] == [1, 3, 40]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--ks", "1,0"])
    assert "--ks" in capsys.readouterr().err


def test_every_server_step_setting_is_a_flag_and_reaches_the_decoder() -> None:
    """A lookahead knob is declared in ``decoding.params`` and ``server.config`` only: the benchmark's flags and
    its ``LookaheadConfig`` follow from ``LOOKAHEAD_STEP_FIELDS``, so a new step setting needs no edit here."""
    from dataclasses import fields

    from decoding.params import LookaheadConfig
    from server.config import LOOKAHEAD_STEP_FIELDS, LookaheadSettings

    assert set(LOOKAHEAD_STEP_FIELDS) == {field.name for field in fields(LookaheadConfig)} & set(
        LookaheadSettings.model_fields)
    assert {"window_size", "break_even", "copy_length", "lazy_window", "window_chains"} <= set(LOOKAHEAD_STEP_FIELDS)
    parser = cli.build_parser()
    defaults = vars(parser.parse_args([]))
    assert all(defaults[name] is None for name in LOOKAHEAD_STEP_FIELDS)  # each one the server's unless flagged
    config = LookaheadSettings()
    argv = []
    for name in LOOKAHEAD_STEP_FIELDS:
        value = getattr(config, name)
        flag = "--" + name.replace("_", "-")
        argv += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    args = parser.parse_args(argv)
    args.no_prompt_pool = args.no_output_pool = args.no_align_window = False
    decoder = cli.lookahead_config(args)
    assert {name: getattr(decoder, name) for name in LOOKAHEAD_STEP_FIELDS} == {
        name: getattr(config, name) for name in LOOKAHEAD_STEP_FIELDS}


def test_the_bench_prices_drafts_on_the_curve_it_measures_where_the_preset_asks(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model")
    resolved = cli.parse(cli.build_parser(), ["--model", str(tmp_path / "model"), "--device", "cpu", "--threads", "1"])
    loaded, _ = cli.start(resolved)
    assert resolved.policy.measure_step_cost  # the CPU preset measures its curve, as the server does at start
    measured = cli.calibrated(resolved, loaded)
    assert measured.policy.step_cost != resolved.policy.step_cost
    assert [tokens for tokens, _ in measured.policy.step_cost] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert measured.policy.step_cost[0] == (1, 1.0)
    off = cli.replace(resolved, policy=cli.replace(resolved.policy, measure_step_cost=False))
    assert cli.calibrated(off, loaded) is off
