"""Typed errors raised by the decoding package.

Contract: every error a caller can provoke with bad arguments is a ``DecodingError``; the server maps these
to HTTP statuses in one place and never inspects messages.
"""

from __future__ import annotations


class DecodingError(Exception):
    """Base class of every error the decoding package raises on purpose."""


class InvalidParameterError(DecodingError, ValueError):
    """A decoding parameter is out of range (W/N/G, temperature, top_p, max_tokens, ...).

    ``param`` names the offending parameter so callers can report it.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarError(InvalidParameterError):
    """A grammar that cannot be compiled (``decoding.grammar``); the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__("grammar", message)


class EmptyPromptError(InvalidParameterError):
    """The prompt has no tokens."""

    def __init__(self) -> None:
        super().__init__("prompt", "the prompt is empty: at least one token is required")


class ContextLengthError(InvalidParameterError):
    """The prompt (plus the requested new tokens) does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        super().__init__(
            "max_tokens" if prompt_tokens < context_length else "prompt",
            f"this model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} "
            f"tokens and {max_tokens} new tokens were requested",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class ModelLoadError(DecodingError, RuntimeError):
    """The model or its tokenizer could not be found, fetched or loaded."""
