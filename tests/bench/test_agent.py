"""The agent-loop workload: scenarios split like the other sets, each turn's prompt holds the earlier outputs, and
lookahead's turns equal the greedy loop's."""

from __future__ import annotations

import json
from pathlib import Path

from bench import agent, cli
from bench.datasets import SIZES, split_indices
from tests.bench.helpers import save_tiny_model


def test_the_scenarios_split_into_tune_and_heldout() -> None:
    tune, heldout = set(split_indices("agent", "tune")), set(split_indices("agent", "heldout"))
    assert tune and heldout and not tune & heldout
    assert tune | heldout == set(range(SIZES["agent"])) == set(range(len(agent.SCENARIOS)))
    assert all(len(scenario.edits) == agent.TURNS for scenario in agent.SCENARIOS)


def test_a_later_turn_reads_back_what_the_model_wrote() -> None:
    scenario = agent.SCENARIOS[0]
    message = agent.next_message(scenario, 1, "class Stack:\n    pass\n")
    assert "read_file(stack.py)" in message and "class Stack:\n    pass" in message and scenario.edits[1] in message


def test_the_workload_runs_every_turn_and_matches_greedy(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model")
    out = tmp_path / "agent.json"
    argv = ["agent", "--model", str(tmp_path / "model"), "--device", "cpu", "--dtype", "float32", "--limit", "2",
            "--max-tokens", "12", "--methods", "greedy,lookahead", "--memory-tokens", "2000", "--output", str(out)]
    assert cli.main(argv) == 0
    turns = json.loads(out.read_text())["turns"]
    assert [(turn["scenario"], turn["turn"]) for turn in turns] == [
        (name, turn) for name in ("stack.py", "greet.py") for turn in range(agent.TURNS)
    ]
    first, second = turns[0], turns[1]
    assert second["prompt_tokens"] > first["prompt_tokens"]  # the earlier reply, twice, and the tool results
    assert all(turn["counts"]["tokens"] == len(turn["output_ids"]) for turn in turns)
