"""``lookahead-server tune``'s preset file, and the config layer that applies it."""

from __future__ import annotations

import yaml

from bench.measure import StepCost
from bench.tune import Candidate, TuneResult
from decoding.params import LookaheadConfig
from server import config as config_module
from server.tuning import preset_text


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


def test_a_tuned_preset_overrides_the_device_preset(tmp_path, monkeypatch):
    (tmp_path / "default.yaml").write_text("lookahead:\n  window_size: 2\n")
    (tmp_path / "cpu.yaml").write_text("device: cpu\nlookahead:\n  window_size: 3\n  ngram_size: 4\n")
    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    assert config_module.load_config(device_preset="cpu").lookahead.window_size == 3
    (tmp_path / "tuned-cpu.yaml").write_text(preset_text(result(), "cpu", "m"))
    tuned = config_module.load_config(device_preset="cpu").lookahead
    assert (tuned.window_size, tuned.ngram_size, tuned.guess_set_size, tuned.break_even) == (1, 5, 3, 0.5)
    assert config_module.load_config(device_preset="cpu").batch.step_cost == [(1, 1.0), (8, 1.6)]
    assert config_module.load_config(device_preset="cuda").lookahead.window_size == 2
    flagged = config_module.load_config(overrides={"lookahead": {"window_size": 4}}, device_preset="cpu")
    assert flagged.lookahead.window_size == 4
