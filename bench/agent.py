"""``python -m bench agent``: an agent-loop workload, each turn's prompt holding the earlier turns' outputs and tool
results (an agent editing a file, then re-reading it), counted in steps with lookahead and the memory on.

Contract: ``SCENARIOS`` (the one definition; ``bench.datasets.SPLITS["agent"]`` cuts them into ``tune`` and
``heldout``) are small files with three edit instructions each. A scenario is one conversation of ``TURNS`` turns:
the first user turn shows the file and asks for the first edit, the model's reply (the whole file, greedy) is
"written" and becomes the tool result of a ``read_file`` call the next user turn carries with the next instruction,
so every later prompt holds the model's earlier outputs twice (its reply and the file read back), as coding agents'
traces do (SuffixDecoding measures such traces). ``run_scenario`` drives one conversation through a
``BatchEngine`` (the server's decode loop) and returns each turn's ``StepCounts`` and output; ``main`` runs the
split's scenarios with one shared ``NGramMemory`` (``--memory-tokens``, 0: none), lookahead at ``--preset``'s
settings, optionally against the greedy loop (``--methods greedy,lookahead``: every turn's output must be the
same, or the run fails), and prints per-turn and total tokens, steps and tokens per step (``--output`` writes
JSON). Tool results are pure functions of the model's outputs, so a run is deterministic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from bench.cli import PRESETS, add_lookahead_flags, add_model_flags, lookahead_config, start
from bench.conversation import EARLY_STEPS, Timing, side_by_side
from bench.datasets import SPLIT_NAMES, PromptSpec, encode_prompt, split_indices
from bench.settings import SERVER_MEMORY_TOKENS, resolve
from bench.workload import serve
from decoding.batch import BatchEngine, BatchPolicy
from decoding.decoder import Decoder
from decoding.params import LookaheadConfig, StopCriteria
from decoding.proposers.ngram_memory import NGramMemory
from decoding.step.stream import StepCounts

TURNS = 3
MAX_TOKENS = 192
SYSTEM = ("You are a coding agent. You edit files by replying with the complete new content of the file, and "
          "nothing else. The tool read_file shows a file's current content.")


@dataclass(frozen=True)
class Scenario:
    """One file and the edits asked of it, in order."""

    name: str
    content: str
    edits: tuple[str, ...]


SCENARIOS = (
    Scenario("stack.py", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
             "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
             ("add a method peek that returns the top item without removing it",
              "add a method is_empty that returns True when the stack has no items",
              "add a docstring to every method")),
    Scenario("greet.py", "def greet(name):\n    return 'Hello, ' + name\n\n\nif __name__ == '__main__':\n"
             "    print(greet('world'))\n",
             ("make greet take an optional greeting argument that defaults to 'Hello'",
              "use an f-string in greet", "add a function farewell(name) that returns 'Goodbye, ' + name")),
    Scenario("stats.py", "def mean(values):\n    return sum(values) / len(values)\n\n\ndef maximum(values):\n"
             "    best = values[0]\n    for value in values:\n        if value > best:\n            best = value\n"
             "    return best\n",
             ("add a function minimum(values) written like maximum", "make mean return 0.0 for an empty list",
              "add type hints to every function")),
    Scenario("config.json", '{\n  "name": "demo",\n  "version": 1,\n  "debug": false,\n  "port": 8080\n}\n',
             ("set debug to true", "add a key \"host\" with the value \"localhost\"", "change the port to 9090")),
    Scenario("todo.md", "# Todo\n\n- [ ] write the report\n- [ ] call the bank\n- [ ] buy milk\n",
             ("mark 'buy milk' as done", "add an item 'book the dentist'", "sort the open items alphabetically")),
    Scenario("counter.py", "count = 0\n\n\ndef increment():\n    global count\n    count += 1\n    return count\n",
             ("add a function reset() that sets count back to 0", "add a function decrement()",
              "replace the global variable with a class Counter holding count")),
    Scenario("shapes.py", "import math\n\n\ndef circle_area(radius):\n    return math.pi * radius ** 2\n\n\n"
             "def square_area(side):\n    return side * side\n",
             ("add a function rectangle_area(width, height)", "add a function circle_perimeter(radius)",
              "add a docstring to every function")),
    Scenario("user.py", "class User:\n    def __init__(self, name, email):\n        self.name = name\n"
             "        self.email = email\n",
             ("add a method __repr__", "add an age argument with a default of 0",
              "add a method is_adult that returns True from 18 on")),
    Scenario("notes.txt", "Meeting notes\n\nAttendees: Ana, Ben\nTopics: budget, hiring\nNext meeting: Monday\n",
             ("add Chen to the attendees", "add a topic 'office move'", "change the next meeting to Tuesday")),
    Scenario("fizz.py", "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n"
             "            print('FizzBuzz')\n        elif i % 3 == 0:\n            print('Fizz')\n"
             "        elif i % 5 == 0:\n            print('Buzz')\n        else:\n            print(i)\n",
             ("make fizzbuzz return a list of strings instead of printing", "add a docstring to fizzbuzz",
              "add a main block that prints fizzbuzz(15)")),
)


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: its prompt length, output, and step counts."""

    scenario: str
    turn: int
    prompt_tokens: int
    output_ids: list[int]
    counts: StepCounts


def first_message(scenario: Scenario) -> str:
    """The first user turn: the file and the first edit."""
    return (f"Here is {scenario.name}:\n```\n{scenario.content}```\nEdit it: {scenario.edits[0]}. "
            "Reply with the whole new file.")


def next_message(scenario: Scenario, turn: int, written: str) -> str:
    """User turn ``turn`` (1-based past the first): the tool results of writing and reading the file back (the
    model's last reply), then the next edit."""
    return (f"Tool write_file({scenario.name}): ok.\nTool read_file({scenario.name}):\n```\n{written.strip()}\n```\n"
            f"Now edit it again: {scenario.edits[turn]}. Reply with the whole new file.")


def run_scenario(engine: BatchEngine, tokenizer, scenario: Scenario, config: LookaheadConfig | None,
                 stop_ids: frozenset[int], max_tokens: int = MAX_TOKENS) -> list[Turn]:
    """Drive one conversation of ``TURNS`` turns through ``engine`` (greedy; lookahead unless ``config`` is None)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_message(scenario)}]
    turns = []
    for turn in range(TURNS):
        prompt = encode_prompt(tokenizer, PromptSpec(f"{scenario.name}/{turn}", messages=tuple(messages)))
        served = serve(engine, prompt, StopCriteria(max_tokens, stop_ids), config)
        output = served.tokens
        turns.append(Turn(scenario.name, turn, len(prompt), output, served.counts))
        reply = tokenizer.decode(output, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        if turn + 1 < TURNS:
            messages.append({"role": "user", "content": next_message(scenario, turn + 1, reply)})
    return turns


def build_parser() -> argparse.ArgumentParser:
    """``python -m bench agent``'s flags."""
    parser = argparse.ArgumentParser(prog="python -m bench agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=SPLIT_NAMES, default="tune")
    parser.add_argument("--limit", type=int, default=0, help="first N scenarios of the split (0: all)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--methods", default="lookahead", help="lookahead, or greedy,lookahead (checks equality)")
    parser.add_argument("--memory-tokens", type=int, default=SERVER_MEMORY_TOKENS, help="shared memory (0: none)")
    parser.add_argument("--preset", choices=PRESETS, help="whose lookahead settings and batch policy (this device's)")
    parser.add_argument("--output", metavar="PATH", help="write the turns and totals as JSON")
    parser.add_argument("--prefix-cache", type=int, metavar="TOKENS",
                        help="instead: each turn side by side with a prefix cache of TOKENS (its copy index restored, "
                        "or not) and without; wall time per turn and the first steps' tokens per step")
    add_lookahead_flags(parser)
    add_model_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; 0 when every turn ran (and, with greedy, equalled it), 1 otherwise."""
    parser = build_parser()
    args = parser.parse_args(argv)
    resolved = resolve(args, args.preset)
    config = lookahead_config(resolved.args)
    methods = args.methods.split(",")
    loaded, _ = start(resolved)
    stop_ids = frozenset(Decoder(loaded).eos_token_ids())
    indices = split_indices("agent", args.split)
    chosen = [SCENARIOS[index] for index in (indices if not args.limit else indices[: args.limit])]
    if args.prefix_cache:
        return compare_prefix_cache(loaded, resolved.policy, chosen, config, stop_ids, args)
    memory = NGramMemory(args.memory_tokens) if args.memory_tokens else None
    engine = BatchEngine(loaded.model, resolved.policy, memory=memory)
    plain = BatchEngine(loaded.model, resolved.policy)
    turns: list[Turn] = []
    same = True
    for scenario in chosen:
        ran = run_scenario(engine, loaded.tokenizer, scenario, config, stop_ids, args.max_tokens)
        if "greedy" in methods:
            reference = run_scenario(plain, loaded.tokenizer, scenario, None, stop_ids, args.max_tokens)
            same &= [turn.output_ids for turn in ran] == [turn.output_ids for turn in reference]
        for turn in ran:
            print(f"{turn.scenario} turn {turn.turn}: prompt {turn.prompt_tokens}, {turn.counts.tokens} tokens, "
                  f"{turn.counts.steps} steps, {turn.counts.tokens / max(turn.counts.steps, 1):.2f} tok/step",
                  file=sys.stderr, flush=True)
        turns.extend(ran)
    total = sum((turn.counts for turn in turns), StepCounts())
    print(f"agent {args.split}: {len(chosen)} scenarios x {TURNS} turns, {total.tokens} tokens, {total.steps} steps, "
          f"{total.tokens / max(total.steps, 1):.2f} tokens/step; sources {dict((s[0], s[1:]) for s in total.sources)}"
          + ("; outputs identical to greedy" if "greedy" in methods and same else ""))
    if "greedy" in methods and not same:
        print("outputs differ from greedy", file=sys.stderr)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as sink:
            json.dump({"config": asdict(config), "turns": [asdict(turn) for turn in turns],
                       "total": asdict(total)}, sink)
    return 0 if same else 1


def compare_prefix_cache(loaded, policy: BatchPolicy, chosen: Sequence[Scenario], config: LookaheadConfig,
                         stop_ids: frozenset[int], args: argparse.Namespace) -> int:
    """``--prefix-cache``: every scenario through three engines turn by turn (``bench.conversation.side_by_side``),
    each with its own shared memory: the prefix cache with its copy index restored (``guesses``), without it
    (``kv``), and none (``off``). Prints per turn the median wall time of each and the tokens per step of the first
    ``EARLY_STEPS`` steps after the prefill; 0 when every output agreed."""
    variants = {"guesses": (args.prefix_cache, True), "kv": (args.prefix_cache, False), "off": (0, True)}
    engines = {}
    for name, (tokens, restore) in variants.items():
        memory = NGramMemory(args.memory_tokens) if args.memory_tokens else None
        engines[name] = BatchEngine(loaded.model, replace(policy, prefix_cache_tokens=tokens), memory=memory)
        if engines[name].prefix_cache is not None:
            engines[name].prefix_cache.restore_index = restore
    stop = StopCriteria(args.max_tokens, stop_ids)
    runs: dict[str, list[list[Timing]]] = {name: [] for name in engines}
    same = True
    for scenario in chosen:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_message(scenario)}]
        timings, agreed = side_by_side(engines, loaded.tokenizer, messages,
                                       lambda turn, reply, s=scenario: next_message(s, turn, reply), TURNS, stop,
                                       config)
        same &= agreed
        for name, turns in timings.items():
            runs[name].append(turns)
    report = {}
    for name, scenario_runs in runs.items():
        report[name] = [{"seconds": statistics.median(run[turn].seconds for run in scenario_runs),
                         "first_token": statistics.median(run[turn].first_token for run in scenario_runs),
                         "cached_tokens": sum(run[turn].cached_tokens for run in scenario_runs),
                         "early_tokens_per_step": sum(run[turn].early_tokens for run in scenario_runs)
                         / max(1, sum(run[turn].early_steps for run in scenario_runs))}
                        for turn in range(TURNS)]
        report[name + "_total_seconds"] = sum(t.seconds for run in scenario_runs for t in run)
    for turn in range(TURNS):
        print(f"turn {turn + 1}: " + "; ".join(
            f"{name} {report[name][turn]['seconds']:.2f} s (first token {report[name][turn]['first_token']:.3f} s, "
            f"reused {report[name][turn]['cached_tokens']}, first {EARLY_STEPS} steps "
            f"{report[name][turn]['early_tokens_per_step']:.2f} tok/step)" for name in engines))
    print(f"agent {args.split}, {len(chosen)} scenarios: wall " + ", ".join(
        f"{name} {report[name + '_total_seconds']:.1f} s" for name in engines)
        + f"; off / guesses {report['off_total_seconds'] / report['guesses_total_seconds']:.2f}x"
        + ("" if same else "; OUTPUTS DIFFER"))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as sink:
            json.dump(report, sink, indent=1)
    return 0 if same else 1
