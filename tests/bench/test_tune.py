"""The tuner (``bench.tune``): its prompts (tune splits only), cost interpolation, step policy, and a whole search
on a tiny model; ``python -m bench tune``: the config file it writes, and how the server runs it (``--config``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

import bench.tune as tune_module
from bench.datasets import DATASETS, load_split, split_indices
from bench.records import StepCost
from bench.tune import (
    TUNE_SETS,
    Candidate,
    TuneResult,
    cost_function,
    evaluate,
    monotone,
    preset_text,
    step_policy,
    trajectory,
    tune,
    tune_prompts,
)
from decoding.params import LookaheadConfig, StopCriteria
from server import cli, flags
from server.config_layers import load_config
from tests.bench.helpers import fake_prompt_sets


def test_the_tuner_sees_only_tune_split_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    fake_prompt_sets(tmp_path)
    expected = ["HumanEval/0", "HumanEval/1", "HumanEval/2", "chat/0", "chat/1", "chat/2"]
    assert [p.id for p in tune_prompts(3)] == expected  # what the tuner (`python -m bench tune`) has always taken
    heldout = {p.id for name in DATASETS for p in load_split(name, "heldout")}
    for per_set in (1, 6, 20, 1000):  # past the end of a tune split, it stops there
        ids = [p.id for p in tune_prompts(per_set)]
        assert ids and not set(ids) & heldout, per_set
        assert len(ids) == sum(min(per_set, len(split_indices(name, "tune"))) for name in TUNE_SETS)


def test_cost_function_interpolates_and_extrapolates():
    cost = cost_function([StepCost(1, 10.0, 12.0), StepCost(2, 15.0, 18.0), StepCost(8, 18.0, 25.0)])
    assert cost(1) == 10.0 and cost(2) == 15.0
    assert cost(5) == pytest.approx(16.5)
    assert cost(16) == pytest.approx(36.0)


@pytest.mark.parametrize(
    "costs, expected",
    [
        ({1: 70.0, 8: 105.0}, (True, 0.5)),
        ({1: 10.0, 8: 10.5}, (False, 0.0)),
        ({1: 10.0, 8: 50.0}, (True, 2.0)),
    ],
)
def test_step_policy_from_the_cost_ratio(costs, expected):
    assert step_policy(lambda k: costs[1] if k == 1 else costs[8]) == expected


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),
        ([3.0, 1.0, 2.0, 5.0], [2.0, 2.0, 2.0, 5.0]),
        ([23.4, 31.7, 32.6, 20.5, 20.7], [23.4, 26.375, 26.375, 26.375, 26.375]),  # a flat, noisy GPU curve
        ([5.0], [5.0]),
    ],
)
def test_monotone_pools_adjacent_violators(values, expected):
    assert monotone(values) == pytest.approx(expected)


def test_cost_function_never_falls_with_more_tokens():
    curve = [StepCost(k, ms, ms) for k, ms in [(1, 23.4), (2, 31.7), (4, 32.6), (8, 20.5), (16, 20.7), (32, 23.5)]]
    cost = cost_function(curve)
    values = [cost(k) for k in range(1, 65)]
    assert values == sorted(values) and cost(8) >= cost(1)


def test_evaluate_sums_the_trajectory(tiny_model):
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7], [3, 4, 3, 4, 3]]
    config = LookaheadConfig(2, 4, 3)
    stop = StopCriteria(20)
    steps = trajectory(tiny_model, prompts, config, stop)
    assert sum(committed for _, committed in steps) == 2 * (20 - 1)  # the prefill's token is excluded
    candidate = evaluate(tiny_model, prompts, config, stop, cost=lambda k: 1.0 if k == 1 else 2.0)
    assert candidate.tokens == 38 and candidate.steps == len(steps)
    assert candidate.predicted_ms == sum(1.0 if inputs == 1 else 2.0 for inputs, _ in steps)
    assert candidate.predicted_speedup == pytest.approx(38 / candidate.predicted_ms)


def test_tune_picks_the_best_predicted_setting_and_measures_it(tiny_model):
    lines = []
    prompts = [[1, 5, 7, 9, 5, 7, 9, 5, 7]]
    result = tune(tiny_model, prompts, frozenset(), 16, [(1, 3, 2), (3, 4, 3)], lines.append, break_even_scales=())
    assert len(result.candidates) == 2 and len(lines) == 3
    best = max(result.candidates, key=lambda candidate: candidate.predicted_speedup)
    assert result.best == best.config
    assert result.tokens == 16 and result.greedy_seconds > 0 and result.lookahead_seconds > 0
    assert (result.identical, result.prompts) == (1, 1)  # float32: lookahead reproduces greedy exactly


def test_tune_tries_the_leading_setting_at_lower_break_evens(tiny_model, monkeypatch):
    monkeypatch.setattr(tune_module, "step_policy", lambda cost: (True, 0.8))  # as on a CPU, whatever this one does
    result = tune(tiny_model, [[1, 5, 7, 9, 5, 7, 9, 5, 7]], frozenset(), 12, [(1, 3, 2), (2, 4, 3)])
    grid, extra = result.candidates[:2], result.candidates[2:]
    assert [candidate.config.break_even for candidate in grid] == [0.8, 0.8]
    leader = max(grid, key=lambda candidate: candidate.predicted_speedup).config
    assert [candidate.config for candidate in extra] == [replace(leader, break_even=b) for b in (0.4, 0.2, 0.0)]
    assert result.best == max(result.candidates, key=lambda candidate: candidate.predicted_speedup).config


def test_tune_evaluates_every_setting_with_the_given_copy_length(tiny_model):
    result = tune(tiny_model, [[1, 5, 7, 9, 5, 7, 9, 5, 7]], frozenset(), 12, [(1, 3, 2), (2, 4, 3)], copy_length=6)
    assert {candidate.config.copy_length for candidate in result.candidates} == {6}
    assert result.best.copy_length == 6 and (result.identical, result.prompts) == (1, 1)
    assert [row.k for row in result.step_cost][:2] == [1, 2]


def result() -> TuneResult:
    """A finished search, as ``python -m bench tune`` writes it."""
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
    args = tune_module.build_parser().parse_args(["--copy-length", "8", "--dtype", "float32"])
    config = flags.build_config(args)
    assert (config.lookahead.copy_length, config.dtype, config.threads) == (8, "float32", "auto")  # the CPU preset
    assert config.weight_layout == load_config(device_preset="cpu").weight_layout
    with pytest.raises(SystemExit):  # serve-only flags are not tune's
        tune_module.build_parser().parse_args(["--port", "1"])


def test_the_server_command_points_to_the_moved_tuner(capsys):
    """``lookahead-server tune`` is no command any more: it says where the tuner went (the server imports no
    ``bench``)."""
    assert cli.main(["tune", "--max-tokens", "8"]) == 2
    assert "python -m bench tune" in capsys.readouterr().err
