"""Text on both sides of the decoder: chat templates in, incremental detokenization and stop strings out.

Contract:
- ``TextCodec`` wraps the Hugging Face tokenizer and deals only in lists of ints and strings; it renders chats
  with the tokenizer's template or the one ``read_chat_template`` read at start-up. Encoding (the
  request threads) and decoding (the worker thread's detokenization) never share a lock or a tokenizer:
  decoding uses a private copy of the tokenizer under its own lock, because an encode may reconfigure the
  shared Rust tokenizer (``no_truncation`` / ``no_padding`` take it mutably, and a concurrent decode would
  then fail with "Already borrowed"); so a long encode never holds up the detokenization of other requests.
- ``IncrementalDetokenizer`` turns token ids, fed one at a time, into text pieces whose concatenation equals
  ``decode(all ids)``; a piece never ends inside a multi-byte character (text ending in U+FFFD is held back
  until the character completes, or until ``flush``).
- ``StopMatcher`` cuts text at the first stop string, matching across piece boundaries: it holds back any
  tail that could still become a stop string and never returns the stop string itself.
- ``TextStream`` combines both per request and reports how many tokens were kept; streaming and
  non-streaming responses concatenate the same pieces, so their text is identical by construction.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from server.config import ConfigError

REPLACEMENT_CHARACTER = "\ufffd"
ROLE_ALIASES = {"developer": "system"}


class TemplateError(ValueError):
    """The tokenizer cannot render the conversation (no chat template, or the template rejected it)."""


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation is rendered: a generation prompt after it, or its last (assistant) message continued
    (no end-of-turn after it); ``variables`` are extra template variables (``chat_template_kwargs``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = field(default_factory=dict)


def read_chat_template(path: str) -> str:
    """The Jinja chat template in ``path``; ``ConfigError`` (a start-up failure) when it cannot be read or parsed."""
    try:
        template = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the chat template {path}: {exc}") from None
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template {path} is not valid Jinja (line {exc.lineno}): {exc.message}") from None
    if not template.strip():
        raise ConfigError(f"the chat template {path} is empty")
    return template


def settable_variables(template: str, tokenizer: Any) -> frozenset[str]:
    """The variables of ``template`` a request may set through ``chat_template_kwargs``: every variable the
    template reads, less those the renderer sets itself (``messages``, ``add_generation_prompt``, the special
    tokens, ``apply_chat_template``'s own parameters).

    >>> sorted(settable_variables("{% if think %}{{ bos_token }}{% endif %}{{ messages[0].content }}", None))
    ['think']
    """
    return frozenset(template_reads(template) - reserved_variables(tokenizer))


def template_reads(template: str) -> frozenset[str]:
    """Every variable ``template`` reads (a template that reads ``tools`` renders tools itself).

    >>> sorted(template_reads("{% for t in tools %}{{ t }}{% endfor %}{{ messages }}"))
    ['messages', 'tools']
    """
    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def reserved_variables(tokenizer: Any) -> frozenset[str]:
    """The template variables the renderer sets itself, which ``chat_template_kwargs`` may not override:
    ``messages``, ``tools`` and the like, the special tokens and ``apply_chat_template``'s own parameters.

    >>> {"messages", "bos_token"} <= reserved_variables(None)
    True
    """
    reserved = {"messages", "tools", "documents", "raise_exception", "strftime_now"}
    reserved |= set(getattr(tokenizer, "special_tokens_map", None) or {}) | {"bos_token", "eos_token"}
    render = getattr(tokenizer, "apply_chat_template", None)
    if render is not None:
        reserved |= set(inspect.signature(render).parameters)
    return frozenset(reserved)


class TextCodec:
    """Thread-safe encode/decode on top of a Hugging Face tokenizer; encode and decode never wait on each other.

    ``decode`` runs on ``copy.deepcopy(tokenizer)`` (made once, here), each side under its own lock.
    ``chat_template`` replaces the tokenizer's own template (``--chat-template``).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # encoding
        self._detokenizer = copy.deepcopy(tokenizer)
        self._decode_lock = threading.Lock()
        own = getattr(tokenizer, "chat_template", None)
        self._chat_template: str | None = chat_template or (own if isinstance(own, str) else None)
        template = self._chat_template or ""
        self.template_variables = settable_variables(template, tokenizer) if template else frozenset()
        self.native_tools = bool(template) and "tools" in template_reads(template)  # else: server.tools' format
        self.reserved_variables = reserved_variables(tokenizer)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def info(self) -> dict[str, Any]:
        """What vLLM's ``/tokenizer_info`` tells a client that tokenizes through the server (lm-evaluation-harness'
        remote tokenizer): the tokenizer's class, its special tokens and the chat template in use."""
        tokenizer = self._tokenizer
        specials = ("bos_token", "eos_token", "pad_token", "unk_token")
        return {
            "tokenizer_class": type(tokenizer).__name__,
            **{name: getattr(tokenizer, name, None) for name in specials},
            "add_bos_token": getattr(tokenizer, "add_bos_token", None),
            "chat_template": self._chat_template,
        }

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], options: ChatTemplateOptions = ChatTemplateOptions(),
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render ``[{"role", "content", ...}]`` (and ``tools``, when given) with the chat template as ``options``
        say and tokenize it.

        ``developer`` becomes ``system``; other message keys (``tool_calls``, ``tool_call_id``) go to the template
        as they are. Raises ``TemplateError`` when the model has no chat template or the template rejects the
        conversation.
        """
        conversation = [{**m, "role": ROLE_ALIASES.get(m["role"], m["role"])} for m in messages]
        if tools is not None:
            options = ChatTemplateOptions(options.add_generation_prompt, options.continue_final_message,
                                          {**options.variables, "tools": list(tools)})
        if not self._chat_template:
            raise TemplateError("this model has no chat template; use /v1/completions or --chat-template")
        with self._lock:
            try:
                text = self._tokenizer.apply_chat_template(
                    conversation, chat_template=self._chat_template, tokenize=False,
                    add_generation_prompt=options.add_generation_prompt,
                    continue_final_message=options.continue_final_message, **options.variables,
                )
            except Exception as exc:  # jinja raises TemplateError subclasses with the template's own message
                raise TemplateError(f"the chat template rejected the messages: {exc}") from exc
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize a raw prompt (special tokens such as BOS added as the tokenizer does by default, unless
        ``add_special_tokens`` is false)."""
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids to text, special tokens skipped."""
        with self._decode_lock:
            return self._detokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (logprobs name every token, ``<|im_end|>`` too); a
        token holding part of a multi-byte character decodes to U+FFFD."""
        with self._decode_lock:
            return self._detokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Stable text pieces from a growing token list, in O(1) decode work per token.

    It decodes a short window ``ids[prefix:]`` and emits what extends ``decode(ids[prefix:read])``; ``prefix``
    and ``read`` move forward only when the text is stable. Example with a tokenizer where "é" is split into
    two byte tokens 101 and 102: ``add(100) -> "caf"``, ``add(101) -> ""`` (would end in U+FFFD),
    ``add(102) -> "é"``.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (maybe empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return everything still held back (an incomplete character comes out as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHARACTER) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class StopMatcher:
    """Cut streamed text at the first stop string.

    ``feed`` returns ``(safe_text, matched)``. With stops ``["###"]``: ``feed("a#") -> ("a", False)`` (the
    ``#`` might start a stop), ``feed("#x") -> ("##x", False)``, ``feed("##") -> ("", False)`` ... and once
    ``###`` appears, the text before it comes out with ``matched=True``.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return the part that can no longer be (the start of) a stop string, and a match flag."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [index for index in (buffer.find(stop) for stop in self._stops) if index >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        keep = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release the held-back tail (the generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of some stop string."""
        longest = min(len(buffer), max(len(stop) for stop in self._stops) - 1)
        for length in range(longest, 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0


@dataclass(frozen=True)
class TextDelta:
    """What one decoding step adds: text safe to send, tokens kept (cut after a stop string), stop flag."""

    text: str
    tokens: int
    stopped: bool


class TextStream:
    """Per-request text pipeline: token ids in, text pieces out, cut at stop strings."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(decode)
        self._matcher = StopMatcher(stops)
        self.stopped = False

    def feed(self, token_ids: Sequence[int]) -> TextDelta:
        """Consume one step's tokens in order; stop at the token that completes a stop string."""
        if self.stopped:
            return TextDelta("", 0, True)
        pieces: list[str] = []
        for count, token_id in enumerate(token_ids, start=1):
            text, matched = self._matcher.feed(self._detokenizer.add(token_id))
            pieces.append(text)
            if matched:
                self.stopped = True
                return TextDelta("".join(pieces), count, True)
        return TextDelta("".join(pieces), len(token_ids), False)

    def finish(self) -> str:
        """The held-back text at the end of a generation (nothing after a stop string matched)."""
        if self.stopped:
            return ""
        text, matched = self._matcher.feed(self._detokenizer.flush())
        if matched:
            self.stopped = True
            return text
        return text + self._matcher.flush()
