"""The responses and chunks of chat and text completions: OpenAI's objects built from a request's outputs.

Contract: a ``Renderer`` (``ChatRenderer``, ``CompletionRenderer``; ``server.responses`` has its own) turns the
``Output`` items of a request's choices into the whole response (``response``) or its stream's chunks
(``opening``, ``content``, ``finish``, ``usage``), with logprobs named by each token's own text (``-inf`` reported
as ``LOWEST_LOGPROB``); a chat reply read for tool calls under its plan (``server.tools``). ``usage_of``,
``decoding_of`` and ``step_of`` are the one reading of the counts the worker summed (``usage``, the ``decoding``
and ``step`` extensions); ``echo_prompts`` the prompts completions' ``echo`` puts first.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from decoding import (
    TokenLogprob,
)
from server import tool_calls, tools
from server.completion_objects import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatTokenLogprob,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionTokensDetails,
    DecodingInfo,
    DeltaMessage,
    DeltaToolCall,
    PromptTokensDetails,
    ReplyMessage,
    SourceInfo,
    StepInfo,
    TopLogprob,
    Usage,
    chunk_json,
)
from server.plans import Output, Summary
from server.protocol import CompletionRequest
from server.text import TextCodec

LOWEST_LOGPROB = -9999.0  # what a logprob of -inf is reported as (JSON has no infinity; OpenAI's floor)


@dataclass(frozen=True)
class EchoPrompt:
    """What ``echo`` puts before a choice: its prompt's text and token ids."""

    text: str
    token_ids: tuple[int, ...]


def echo_prompts(codec: TextCodec, request: CompletionRequest, prompts: Sequence[Sequence[int]]) -> list[EchoPrompt]:
    """Each prompt as echo returns it: the string sent, or the text of the token ids sent (special tokens
    skipped, as in completions)."""
    texts = request.prompt_list()
    return [EchoPrompt(text if isinstance(text, str) else codec.decode(ids), tuple(ids))
            for text, ids in zip(texts, prompts, strict=True)]


def usage_of(summaries: Sequence[Summary], n: int = 1) -> Usage:
    """OpenAI's ``usage`` over a response's choices (``n`` per prompt, in choice order): each prompt's tokens
    counted once, completion tokens summed; with a prediction, the accepted tokens and the rest of each choice's
    prediction as rejected."""
    prompt_tokens = sum(summary.prompt_tokens for summary in summaries[::n])
    cached_tokens = sum(max(summary.cached_tokens for summary in summaries[start : start + n])
                        for start in range(0, len(summaries), n))
    completion_tokens = sum(summary.counts.tokens for summary in summaries)
    details = None
    if summaries[0].prediction_tokens is not None:
        accepted = [summary.counts.prediction_accepted for summary in summaries]
        details = CompletionTokensDetails(
            accepted_prediction_tokens=sum(accepted),
            rejected_prediction_tokens=sum(max(0, (summary.prediction_tokens or 0) - taken)
                                           for summary, taken in zip(summaries, accepted, strict=True)),
        )
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=details,
    )


def decoding_of(summaries: Sequence[Summary]) -> DecodingInfo:
    """The ``decoding`` extension object: the choices' counts summed."""
    lookahead = summaries[0].lookahead
    counts = sum((summary.counts for summary in summaries[1:]), summaries[0].counts)
    return DecodingInfo(
        method="lookahead" if lookahead is not None else "autoregressive",
        steps=counts.steps,
        tokens_per_step=round(counts.tokens / counts.steps, 4) if counts.steps else 0.0,
        accepted_tokens=counts.accepted,
        offered_tokens=counts.offered,
        window_size=lookahead.window_size if lookahead else None,
        ngram_size=lookahead.ngram_size if lookahead else None,
        guess_set_size=lookahead.guess_set_size if lookahead else None,
        seed=summaries[0].seed,
        sources={name: SourceInfo(offered_tokens=offered, accepted_tokens=accepted)
                 for name, offered, accepted in counts.sources},
    )


def step_of(output: Output) -> StepInfo:
    """The ``step`` extension object of the chunk that carries ``output``'s text."""
    counts = output.counts
    return StepInfo(tokens=counts.tokens, accepted=counts.accepted, offered=counts.offered)


class _Identity:
    """The id, creation time and model name shared by every chunk of one response; ``token_text`` names a token
    id in logprobs (``TextCodec.token_text``; its decimal id when not given); ``n`` choices per prompt."""

    id_prefix = ""
    chunk_type: type[ChatCompletionChunk] | type[CompletionChunk]

    def __init__(
        self, model: str, include_usage: bool, include_steps: bool = False,
        token_text: Callable[[int], str] | None = None, fingerprint: str | None = None, n: int = 1,
    ) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.include_steps = include_steps
        self.token_text = token_text or str
        self.n = n

    def _chunk(
        self, choices: list[Any], summaries: Sequence[Summary] | None = None, step: StepInfo | None = None
    ) -> str:
        """One SSE ``data`` payload of this response's chunk type (usage only on the usage chunk)."""
        chunk = self.chunk_type(
            id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint, choices=choices
        )
        if summaries is not None:
            chunk.usage, chunk.decoding = usage_of(summaries, self.n), decoding_of(summaries)
        if self.include_steps:
            chunk.step = step
        return chunk_json(chunk, self.include_usage)

    def pending_echo(self, index: int) -> bool:
        """True while choice ``index`` still owes its echoed prompt (its next chunk must carry it)."""
        return False

    def usage(self, summaries: Sequence[Summary]) -> str:
        return self._chunk([], summaries)


class ChatRenderer(_Identity):
    """``chat.completion`` and ``chat.completion.chunk`` objects; with ``use_tools``, each choice's reply is read
    for tool calls (``server.tool_calls``): a stream sends one chunk per content piece or ``delta.tool_calls``
    entry, the step's logprobs and ``step`` on its first chunk (an empty delta carries logprobs when a step sends
    nothing else; its ``step`` counts then wait for the next chunk)."""

    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk
    _plan: tools.ToolPlan | None = None

    def use_tools(self, plan: tools.ToolPlan | None) -> None:
        """Read the replies for tool calls under ``plan`` (None: plain text)."""
        self._plan = plan
        self._tools: dict[int, tool_calls.ToolStream] = {}
        self._held: dict[int, StepInfo | None] = {}  # per choice: counts of steps that sent no chunk yet

    def _message(self, text: str, last: Output) -> ChatChoice:
        """One whole choice (its tool calls read when ``use_tools`` gave a plan)."""
        message, reason = ReplyMessage(content=text), last.finish_reason
        if self._plan is not None:
            content, calls = tool_calls.reply(self._plan, text)
            message = ReplyMessage(content=content, tool_calls=calls)
            reason = tool_calls.finish_reason(reason, len(calls or []))
        return ChatChoice(message=message, logprobs=self._logprobs(last.logprobs), finish_reason=reason)

    def response(self, choices: Sequence[tuple[str, Output]]) -> dict[str, Any]:
        summaries = _summaries(choices)
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[self._message(text, last).model_copy(update={"index": index})
                     for index, (text, last) in enumerate(choices)],
            usage=usage_of(summaries, self.n),
            decoding=decoding_of(summaries),
        ).model_dump(mode="json")

    def opening(self, index: int) -> str | None:
        return self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

    def content(
        self, index: int, text: str, step: StepInfo | None = None,
        logprobs: Sequence[TokenLogprob] | None = None, prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> str | list[str]:
        if self._plan is not None:
            return self._pieces(index, self._stream(index).feed(text), step, logprobs)
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=self._logprobs(logprobs))
        return self._chunk([choice], step=step)

    def _stream(self, index: int) -> tool_calls.ToolStream:
        assert self._plan is not None
        return self._tools.setdefault(index, tool_calls.ToolStream(self._plan))

    def _pieces(
        self, index: int, pieces: Sequence[str | DeltaToolCall], step: StepInfo | None,
        logprobs: Sequence[TokenLogprob] | None,
    ) -> list[str]:
        """One chunk per content piece or tool call delta of choice ``index`` (class docstring)."""
        deltas = [DeltaMessage(content=piece) if isinstance(piece, str) else DeltaMessage(tool_calls=[piece])
                  for piece in pieces]
        if not deltas and logprobs is None:
            self._held[index] = _added(self._held.get(index), step)
            return []
        step = _added(self._held.pop(index, None), step)
        chunks = []
        for position, delta in enumerate(deltas or [DeltaMessage()]):
            first = position == 0
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(logprobs) if first else None)
            chunks.append(self._chunk([choice], step=step if first else None))
        return chunks

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> ChoiceLogprobs | None:
        """OpenAI's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` for these tokens."""
        if logprobs is None:
            return None
        content = [
            ChatTokenLogprob(**_top_logprob(self.token_text, entry.token_id, entry.logprob).model_dump(),
                             top_logprobs=[_top_logprob(self.token_text, *pair) for pair in entry.top])
            for entry in logprobs
        ]
        return ChoiceLogprobs(content=content)

    def finish(self, index: int, reason: str, step: StepInfo | None = None) -> str | list[str]:
        if self._plan is None:
            return self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason)], step=step)
        stream = self._stream(index)
        chunks = self._pieces(index, stream.close(), None, None)
        reason, step = tool_calls.finish_reason(reason, stream.calls), _added(self._held.pop(index, None), step)
        return [*chunks, self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason)],
                                     step=step)]


def _added(first: StepInfo | None, second: StepInfo | None) -> StepInfo | None:
    """The counts of both (either may be None)."""
    if first is None or second is None:
        return first or second
    return StepInfo(tokens=first.tokens + second.tokens, accepted=first.accepted + second.accepted,
                    offered=first.offered + second.offered)


class CompletionRenderer(_Identity):
    """``text_completion`` objects, whole and chunked; with ``echo`` (one ``EchoPrompt`` per prompt) each
    choice's text and logprobs start with its prompt's."""

    id_prefix = "cmpl-"
    chunk_type = CompletionChunk

    def __init__(
        self, model: str, include_usage: bool, include_steps: bool = False,
        token_text: Callable[[int], str] | None = None, fingerprint: str | None = None, n: int = 1,
        echo: Sequence[EchoPrompt] | None = None,
    ) -> None:
        super().__init__(model, include_usage, include_steps, token_text, fingerprint, n)
        self.echo = echo
        self._echoed: set[int] = set()  # choices whose prompt went out already
        self._offsets: dict[int, int] = {}  # per choice: characters of token text rendered so far

    def response(self, choices: Sequence[tuple[str, Output]]) -> dict[str, Any]:
        summaries = _summaries(choices)
        rendered = []
        for index, (text, last) in enumerate(choices):
            prefix, prompt_logprobs = self._echo(index, last.logprobs is not None, last.prompt_logprobs)
            rendered.append(CompletionChoice(
                index=index, text=prefix + text, finish_reason=last.finish_reason,
                logprobs=self._logprobs(index, last.logprobs, prompt_logprobs),
            ))
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=rendered,
            usage=usage_of(summaries, self.n),
            decoding=decoding_of(summaries),
        ).model_dump(mode="json")

    def opening(self, index: int) -> str | None:
        return None

    def pending_echo(self, index: int) -> bool:
        return self.echo is not None and index not in self._echoed

    def content(
        self, index: int, text: str, step: StepInfo | None = None,
        logprobs: Sequence[TokenLogprob] | None = None, prompt_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> str:
        prefix, prompt = self._echo(index, logprobs is not None, prompt_logprobs)
        choice = CompletionChoice(index=index, text=prefix + text, logprobs=self._logprobs(index, logprobs, prompt))
        return self._chunk([choice], step=step)

    def _echo(
        self, index: int, with_logprobs: bool, prompt_logprobs: Sequence[TokenLogprob] | None
    ) -> tuple[str, list[tuple[int, TokenLogprob | None]] | None]:
        """The prompt text choice ``index`` still owes (once) and its tokens as (id, logprob entry or None for
        the first token), the latter only with logprobs."""
        if not self.pending_echo(index):
            return "", None
        self._echoed.add(index)
        assert self.echo is not None
        prompt = self.echo[index // self.n]
        if not with_logprobs:
            return prompt.text, None
        entries = list(prompt_logprobs or ())
        first: list[TokenLogprob | None] = [None] * (len(prompt.token_ids) - len(entries))
        return prompt.text, list(zip(prompt.token_ids, first + entries, strict=True))

    def _logprobs(
        self, index: int, logprobs: Sequence[TokenLogprob] | None,
        prompt: list[tuple[int, TokenLogprob | None]] | None = None,
    ) -> CompletionLogprobs | None:
        """The legacy shape for these tokens (after the echoed prompt's, if any); ``text_offset`` counts
        characters of token texts from the start of the choice (it runs on across a stream's chunks)."""
        if logprobs is None:
            return None
        entries: list[tuple[int, TokenLogprob | None]] = list(prompt or [])
        entries += [(entry.token_id, entry) for entry in logprobs]
        texts = [self.token_text(token) for token, _ in entries]
        offsets = []
        for text in texts:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(text)
        return CompletionLogprobs(
            tokens=texts,
            token_logprobs=[None if entry is None else _reported(entry.logprob) for _, entry in entries],
            top_logprobs=[None if entry is None else
                          {self.token_text(token): _reported(value) for token, value in entry.top}
                          for _, entry in entries],
            text_offset=offsets,
        )

    def finish(self, index: int, reason: str, step: StepInfo | None = None) -> str:
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)], step=step)


def _summaries(choices: Sequence[tuple[str, Output]]) -> list[Summary]:
    """Each finished choice's summary."""
    summaries = [last.summary for _, last in choices]
    assert all(summary is not None for summary in summaries)
    return summaries  # type: ignore[return-value]


def _reported(logprob: float) -> float:
    """A logprob as JSON can carry it (-inf becomes ``LOWEST_LOGPROB``)."""
    return max(logprob, LOWEST_LOGPROB)


def _top_logprob(token_text: Callable[[int], str], token_id: int, logprob: float) -> TopLogprob:
    """One token's ``{token, logprob, bytes}``: its text and that text's UTF-8 bytes."""
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=_reported(logprob), bytes=list(text.encode("utf-8")))
