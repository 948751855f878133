"""The types a generation request takes on its way through the server, defined once.

Contract: an endpoint module (``server.chat``, ``server.completions``, ``server.responses``) turns its request into
an ``Asked`` (its prompts' ids and what only that endpoint decides: the requested length, logprobs, grammar,
prediction), ``server.serving.plan_choices`` turns that into one ``GenerationPlan`` per choice (the decoder's own
types, validated there), and the endpoint pairs them with its ``Renderer`` as a ``Prepared`` request: everything
decided once, off the event loop, before admission. The worker reports ``Output`` items, the last one with a
``Summary``; the renderer turns them into OpenAI's objects. Plain frozen dataclasses and one protocol: no
behaviour lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from decoding import Grammar, LookaheadConfig, SamplingParams, StepCounts, StopCriteria, TokenLogprob
from server.completion_objects import StepInfo


@dataclass(frozen=True)
class Asked:
    """What an endpoint decided about a generation request before the shared planning: its prompts' token ids
    (``prompt_param``: the field a 400 about them names), the completion length it asked for (None: the server's
    rule), the decoder's ``top_logprobs`` and ``prompt_logprobs`` (None: not asked), the grammar the output must
    match (compiled and checked) and the prediction's token ids (None: none sent)."""

    prompts: list[list[int]]
    prompt_param: str
    max_tokens: int | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    prediction: list[int] | None = None


@dataclass(frozen=True)
class GenerationPlan:
    """Everything the decoder needs for one request, in its own types, plus the stop strings (``prediction``:
    the predicted output's token ids, None when the request sent none; ``cache_prompt``: False keeps it out of
    the engine's prefix cache)."""

    prompt_ids: list[int]
    stop: StopCriteria
    sampling: SamplingParams
    lookahead: LookaheadConfig | None
    stop_strings: tuple[str, ...]
    prediction: tuple[int, ...] | None = None
    cache_prompt: bool = True


@dataclass(frozen=True)
class Summary:
    """A finished request: the ``usage`` and ``decoding`` numbers (``counts`` sums all its steps;
    ``prediction_tokens``: its prediction's length, None without one; ``seed``: the seed its sampled tokens were
    drawn with, None when greedy; ``cached_tokens``: prompt tokens whose KV came from the prefix cache)."""

    prompt_tokens: int
    counts: StepCounts
    lookahead: LookaheadConfig | None
    prediction_tokens: int | None = None
    seed: int | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class Output:
    """Text produced by one step; the last output of a request has ``finish_reason`` and ``summary``.

    ``counts`` covers the steps since the previous output: normally one step's, more when a step's text was
    held back (an incomplete character, a possible stop-string prefix, EOS), so outputs add up to the totals.
    ``logprobs`` (None unless the request asked for them) are those same tokens' logprobs, in order.
    ``prompt_logprobs`` (only on a job's first output, and only when the request asked for them): the logprobs
    of prompt tokens 1..P-1 (token 0 has none).
    """

    text: str
    finish_reason: str | None = None
    summary: Summary | None = None
    counts: StepCounts = StepCounts()
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class Renderer(Protocol):
    """Builds one endpoint's response and chunks; ``step`` objects are dropped unless ``include_steps``;
    ``logprobs`` (None: not asked for) are the tokens behind the text; ``index`` is the choice's."""

    include_usage: bool

    def response(self, choices: Sequence[tuple[str, Output]]) -> dict[str, Any]: ...

    def opening(self, index: int) -> str | None: ...

    def pending_echo(self, index: int) -> bool: ...

    def content(
        self, index: int, text: str, step: StepInfo | None = None,
        logprobs: Sequence[TokenLogprob] | None = None, prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> str | list[str]: ...

    def finish(self, index: int, reason: str, step: StepInfo | None = None) -> str | list[str]: ...

    def usage(self, summaries: Sequence[Summary]) -> str: ...


@dataclass(frozen=True)
class Prepared:
    """A generation request decided once: one ``GenerationPlan`` per choice and the renderer of its answer."""

    generations: list[GenerationPlan]
    renderer: Renderer
