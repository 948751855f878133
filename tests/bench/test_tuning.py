"""``python -m bench tune``: the config file it writes, and how the server runs it (``--config``)."""

from __future__ import annotations

import pytest
import yaml

from bench import tuning
from bench.records import StepCost
from bench.tune import Candidate, TuneResult
from bench.tuning import preset_text
from decoding.params import LookaheadConfig
from server import cli, flags
from server.config import load_config


def result() -> TuneResult:
    best = LookaheadConfig(1, 5, 3, lazy_window=True, break_even=0.5)
    other = LookaheadConfig(2, 4, 2, lazy_window=True, break_even=0.5)
    candidates = [Candidate(other, 100, 80, 900.0, 1.1), Candidate(best, 100, 50, 800.0, 1.25)]
    return TuneResult([StepCost(1, 10.0, 11.0), StepCost(8, 16.0, 20.0)], candidates, best, 12.0, 10.0, 100, 5, 6)


def test_preset_text_is_a_valid_layer_with_what_was_measured():
    text = preset_text(result(), "cpu", "SmolLM2-135M-Instruct")
    assert "1.20x the greedy loop over 100 tokens" in text and "2.00 tokens/step" in text
    assert "identical to greedy on 5 of 6 prompts" in text
    assert yaml.safe_load(text) == {
        "lookahead": {"window_size": 1, "ngram_size": 5, "guess_set_size": 3, "lazy_window": True, "break_even": 0.5},
        "batch": {"step_cost": [[1, 1.0], [8, 1.6]]},
    }


def test_a_tuned_file_is_served_by_naming_it(tmp_path, monkeypatch):
    """The tuner's file changes nothing until ``--config`` names it; then it layers over the device preset."""
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    path = tmp_path / "tuned-cpu.yaml"
    path.write_text(preset_text(result(), "cpu", "m"))
    assert "--config <this file> (layered over configs/cpu.yaml)" in path.read_text()
    untouched = cli.build_config(cli.build_parser().parse_args(["serve"]))
    assert untouched == load_config(device_preset="cpu")
    tuned = cli.build_config(cli.build_parser().parse_args(["serve", "--config", str(path)]))
    assert (tuned.lookahead.window_size, tuned.lookahead.ngram_size, tuned.lookahead.guess_set_size) == (1, 5, 3)
    assert tuned.lookahead.break_even == 0.5 and tuned.batch.step_cost == [(1, 1.0), (8, 1.6)]
    assert tuned.lookahead.copy_length == untouched.lookahead.copy_length  # the preset's, kept
    flagged = cli.build_config(cli.build_parser().parse_args(["serve", "--config", str(path), "--window-size", "4"]))
    assert flagged.lookahead.window_size == 4


def test_tune_takes_the_servers_configuration(monkeypatch):
    """The tuner runs the model, device and copy steps that serve would, flags included."""
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    args = tuning.build_parser().parse_args(["--copy-length", "8", "--dtype", "float32"])
    config = flags.build_config(args)
    assert (config.lookahead.copy_length, config.dtype, config.threads) == (8, "float32", "auto")  # the CPU preset
    assert config.weight_layout == load_config(device_preset="cpu").weight_layout
    with pytest.raises(SystemExit):  # serve-only flags are not tune's
        tuning.build_parser().parse_args(["--port", "1"])


def test_the_server_command_points_to_the_moved_tuner(capsys):
    """``lookahead-server tune`` is no command any more: it says where the tuner went (the server imports no
    ``bench``)."""
    assert cli.main(["tune", "--max-tokens", "8"]) == 2
    assert "python -m bench tune" in capsys.readouterr().err
