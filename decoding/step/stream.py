"""The decoders: a plain autoregressive loop and lookahead decoding, as step streams that can be batched.

Contract: token ids in, token ids out (no tokenizer here). ``generate_autoregressive`` and
``generate_lookahead`` take a causal LM, the prompt ids, ``StopCriteria`` and ``SamplingParams`` (validated
at once: typed errors, no forward pass) and return a ``DecodeStream``, an iterator of one ``Step`` per
forward pass: the tokens that pass committed (never a stop token, never past ``max_tokens``) and its
statistics (``StepStats``; ``StepStats.counts`` turns them into the ``StepCounts`` record that callers sum).
When ``SamplingParams.top_logprobs`` is set, each step also carries its tokens' logprobs (``Step.logprobs``,
read off the raw logits rows that predicted them: equal to the autoregressive loop's, to float tolerance).
When ``SamplingParams.prompt_logprobs`` is set, the prefill reads every prompt row and its steps carry the
prompt tokens' logprobs (``Step.prompt_logprobs``, prompt chunks of at most ``PROMPT_LOGPROBS_CHUNK`` tokens);
``StopCriteria.max_tokens == 0`` prefills only and commits nothing.
The last step carries ``finish_reason`` "stop" or "length". ``close()`` cancels the decode and
frees its cache. With greedy sampling both produce exactly the same tokens; with sampling lookahead
preserves the output distribution. The same stream can instead be stepped inside a batch
(``decoding.batch.BatchEngine``): its steps then share forward passes with other streams, and its greedy
tokens stay the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from decoding.errors import ContextLengthError, EmptyPromptError, InvalidParameterError
from decoding.forward.kv_cache import KVPool, new_cache
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.grammar import Constraint
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria, draw_seed
from decoding.proposers import (
    PREDICTION_COPY_LENGTH,
    PROPOSERS,
    Context,
    Factory,
    Inputs,
    build_proposers,
    extra_step_tokens,
    prediction_copy_length,
)
from decoding.proposers.ngram_memory import NGramMemory
from decoding.proposers.pool import ContextIndex
from decoding.step.logprobs import TokenLogprob, token_logprobs
from decoding.step.lookahead import LookaheadStep
from decoding.step.prefix_cache import PrefixHit
from decoding.step.steps import (
    Finisher,
    PlainStep,
    Proposal,
    SequenceState,
    Step,
    StepCounts,
    StepStats,
    choose,
    step_logprobs,
)
from decoding.weights.loading import context_length

__all__ = [
    "MEMORY_PROMPT_TAIL", "PREDICTION_COPY_LENGTH", "PROMPT_LOGPROBS_CHUNK", "UNBOUNDED", "DecodeStream", "Proposal",
    "Step", "StepCounts", "StepStats", "generate_autoregressive", "generate_lookahead",
    "prediction_copy_length", "validate_request",
]


def validate_request(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams,
    lookahead: LookaheadConfig | None = None,
) -> None:
    """Raise ``InvalidParameterError`` (or a subclass) if the request cannot be decoded; run no forward pass."""
    stop.validate()
    sampling.validate()
    if lookahead is not None:
        lookahead.validate()
    if len(prompt_ids) == 0:
        raise EmptyPromptError()
    limit = context_length(model)
    if len(prompt_ids) + stop.max_tokens > limit:
        raise ContextLengthError(len(prompt_ids), stop.max_tokens, limit)


UNBOUNDED = 1 << 30
MEMORY_PROMPT_TAIL = 16  # prompt tokens stored before a completion in the shared memory, to match its start
PROMPT_LOGPROBS_CHUNK = 256  # the most prompt tokens per prefill forward when every row's logits are read

class DecodeStream:
    """One decode in progress: an iterator of ``Step`` (each ``next`` runs one forward of this stream alone)
    that can also take part in a batched forward through ``propose`` / ``plan`` / ``finish``.

    Protocol of one step: ``propose()`` (what it wants), ``plan(budget)`` (the ``Slice`` it will run, at most
    ``budget`` tokens, at least one), a forward pass over that slice (alone or packed with others), then
    ``finish(logits)`` with that slice's logits, which returns the ``Step``. Prefill runs in chunks when the
    budget is smaller than the prompt; a chunk that does not reach the prompt's end yields an empty ``Step``
    with ``stats.prefill`` set. A greedy stream commits the same tokens whatever its budgets were. A lookahead
    stream given a shared ``memory`` (and not opted out by ``LookaheadConfig.shared_memory``) draws candidates
    from it and, once finished, adds the end of its prompt and its output to it. A lookahead stream given a
    ``prediction`` (token ids the client expects the output to resemble: OpenAI's predicted outputs) keeps it
    as a private ``NGramMemory`` document whose continuations join its copy candidates
    (``decoding.proposers.prediction``); a prediction changes how fast a decode runs, never its greedy output.
    Without lookahead it is ignored. A lookahead stream's candidate sources are built from ``proposers``
    (``decoding.proposers.PROPOSERS`` by default: a registry of source name -> factory) once its prefill ends, and
    its steps are ``decoding.step.lookahead.LookaheadStep``'s. ``successors``: a recycled-logits table shared with the
    engine's other decodes (``decoding.proposers.recycled``); like the memory, a decode opted out of the shared
    memory keeps its own.
    A stream whose ``sampling.grammar`` is set takes that grammar's ``constraint`` (``decoding.grammar``): every
    token it chooses or verifies is masked by it, and guesses it forbids are cut before they are offered, so
    constrained lookahead commits exactly what the constrained autoregressive loop does.
    A stream given a ``prefix`` (a ``decoding.step.prefix_cache.PrefixHit`` of fewer tokens than its prompt) copies
    those keys and values into its cache at once and prefills only the rest of its prompt; its first step reports
    them (``Step.cached_tokens``), and a lookahead stream starts from the hit's copy index when it has one (equal to
    the one it would build). Ignored when ``sampling.prompt_logprobs`` is set (every prompt row must be read).
    ``prefix_state()``, once the stream finished, is what a prefix cache keeps of it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
        memory: NGramMemory | None = None,
        prediction: Sequence[int] | None = None,
        constraint: Constraint | None = None,
        pool: KVPool | None = None,
        proposers: dict[str, Factory] | None = None,
        successors: dict[int, tuple[int, ...]] | None = None,
        prefix: PrefixHit | None = None,
    ) -> None:
        validate_request(model, prompt_ids, stop, sampling, lookahead)
        if (sampling.grammar is None) != (constraint is None):
            raise InvalidParameterError("grammar", "a grammar needs its constraint (GrammarCompiler.constraint), "
                                        "and a constraint its grammar")
        self.prediction = list(prediction or ()) if lookahead is not None else []
        step_tokens = lookahead.step_tokens + extra_step_tokens(lookahead, self.prediction) if lookahead else 1
        self.proposers = PROPOSERS if proposers is None else proposers
        self.successors = successors if lookahead is not None and lookahead.shared_memory else None
        self.model = model
        self.sampling = sampling
        self.lookahead = lookahead
        self.memory = memory if lookahead is not None and lookahead.shared_memory else None
        capacity = len(prompt_ids) + stop.max_tokens + step_tokens
        cache = pool.acquire(capacity) if pool is not None else None
        self.pool = pool if cache is not None else None
        self.sequence = SequenceState(
            list(prompt_ids), len(prompt_ids), stop, cache or new_cache(model, capacity), constraint=constraint
        )
        if not sampling.greedy:
            self.sequence.seed = sampling.seed if sampling.seed is not None else draw_seed()
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self._prefix_index: ContextIndex | None = None
        if prefix is not None and sampling.prompt_logprobs is None and 0 < prefix.tokens < len(prompt_ids):
            self.sequence.cache.load_prefix(prefix.kv)
            self.cached_tokens, self._prefix_index = prefix.tokens, prefix.index
        self._unreported_cached = self.cached_tokens
        self.completed = False  # the last step returned with a finish reason
        self._policy: PlainStep | LookaheadStep | None = None
        self._planned: Finisher | None = None
        self._started = 0.0
        self.closed = False

    @property
    def seed(self) -> int | None:
        """The seed that decides a sampled decode's tokens (``sampling.seed``, or one drawn at start when it was
        None: pass it back to replay the output); None for a greedy decode."""
        return None if self.sampling.greedy else self.sequence.seed

    @property
    def finished(self) -> bool:
        """True once the last step (with a finish reason) was returned, or after ``close``."""
        return self.closed or self.sequence.finish_reason is not None

    def __iter__(self) -> DecodeStream:
        return self

    @torch.inference_mode()
    def __next__(self) -> Step:
        if self.finished:
            raise StopIteration
        self.propose()
        logits = forward_packed(self.model, [self.plan(UNBOUNDED)])
        return self.finish(logits[0])

    def close(self) -> None:
        """End the decode early (or after its last step) and free its cache."""
        self.closed = True
        self._planned = None
        if self.pool is not None and self.sequence.cache is not None:
            self.pool.release(self.sequence.cache)
        self.sequence.cache = None

    def propose(self, cost: Callable[[int], float] | None = None) -> Proposal:
        """What the next step wants; call once per step, before ``plan``. ``cost``: a forward's relative cost by
        input tokens (``BatchPolicy.cost``), which prices a lookahead step's drafts (None: they are free, and the
        gates' ``break_even`` alone decides)."""
        remaining = self.sequence.prompt_length - self.sequence.cache.length
        if remaining > 0:
            if self.sampling.prompt_logprobs is not None:  # every row's logits: bound the chunk's memory
                remaining = min(remaining, PROMPT_LOGPROBS_CHUNK)
            return Proposal(remaining, prefill=True)
        return self._policy.propose(cost)

    def plan(self, budget: int) -> Slice:
        """The slice of the next forward, using at most ``budget`` (>= 1) input tokens."""
        self._started = time.perf_counter()
        if self.sequence.prompt_length > self.sequence.cache.length:
            slice_, self._planned = self._plan_prefill(max(budget, 1))
        else:
            slice_, self._planned = self._policy.plan(max(budget, 1))
        return slice_

    def finish(self, logits: torch.Tensor, argmax: Sequence[int] | None = None) -> Step:
        """Consume the planned slice's logits: verify, commit, and return the step. ``argmax`` (optional): each
        logits row's argmax id, as a static step returns them; greedy choices then read them, not the logits."""
        planned, self._planned = self._planned, None
        if planned is None:
            raise RuntimeError("finish() without a planned step")
        step = planned(logits, argmax)
        if step.finish_reason is not None and self.memory is not None and self.sequence.generated:
            self.memory.add(self.sequence.tokens[max(0, self.sequence.prompt_length - MEMORY_PROMPT_TAIL) :])
        self.completed = step.finish_reason is not None
        cached, self._unreported_cached = self._unreported_cached, 0  # reported once, on the first step
        return step.timed(time.perf_counter() - self._started, cached)

    def prefix_state(self) -> tuple[list[int], ContextIndex | None] | None:
        """What a prefix cache may keep of this finished stream (call before ``close``): the tokens its cache holds
        KV of (every committed token but ``last``), and its copy index (None without one); None while it has not
        completed (a failed or cancelled stream leaves nothing)."""
        cache = self.sequence.cache
        if not self.completed or self.closed or cache is None:
            return None
        context = getattr(self._policy, "context", None)
        return self.sequence.tokens[: cache.length], None if context is None else context.index

    def _plan_prefill(self, budget: int) -> tuple[Slice, Finisher]:
        """The next prompt chunk; the chunk reaching the prompt's end reads the first token off its last row
        (unless ``max_tokens`` is 0: then the decode ends there). With ``prompt_logprobs`` every row is read."""
        sequence, every_row = self.sequence, self.sampling.prompt_logprobs is not None
        start = sequence.cache.length
        end = min(sequence.prompt_length, start + (min(budget, PROMPT_LOGPROBS_CHUNK) if every_row else budget))
        last_chunk = end == sequence.prompt_length
        rows = range(end - start) if every_row else ([end - start - 1] if last_chunk else [])
        slice_ = Slice(sequence.tokens[start:end], None, None, None, sequence.cache, host_positions=range(start, end),
                       host_rows=rows)

        def finish(logits: torch.Tensor, argmax: Sequence[int] | None) -> Step:
            prompt = _prompt_logprobs(logits, sequence.tokens[: sequence.prompt_length], start, end, self.sampling)
            if not last_chunk:
                stats = StepStats(end - start, 0, prefill=True)
                return Step([], stats, logprobs=step_logprobs(logits, [], [], self.sampling), prompt_logprobs=prompt)
            if sequence.stop.max_tokens == 0:
                sequence.finish_reason = "length"
                return Step([], StepStats(end - start, 0, prefill=True), "length",
                            step_logprobs(logits, [], [], self.sampling), prompt)
            row = logits.shape[0] - 1
            chosen = choose(logits[row], self.sampling, sequence, None if argmax is None else argmax[row])
            committed = sequence.accept([chosen])
            if sequence.finish_reason is None:
                self._policy = PlainStep(sequence, self.sampling) if self.lookahead is None else self._lookahead()
            return Step(committed, StepStats(end - start, len(committed), prefill=True), sequence.finish_reason,
                        step_logprobs(logits, [row], sequence.chosen(committed), self.sampling), prompt,
                        sequence.stop_token)

        return slice_, finish

    def _lookahead(self) -> LookaheadStep:
        """The lookahead steps that follow the prefill: the decode's context, its proposers, the step."""
        sequence, config = self.sequence, self.lookahead
        index = ContextIndex()
        if config.prompt_pool and config.rank_by_context:
            if self._prefix_index is not None:  # the cached prefix's index: the same positions, not rebuilt
                index = self._prefix_index
            index.extend(sequence.tokens, sequence.prompt_length)
        self._prefix_index = None
        index.skip_to(sequence.prompt_length)
        context = Context(sequence.tokens, sequence.prompt_length, index, sequence.stop.stop_token_ids)
        inputs = Inputs(self.memory, self.prediction, sequence.constraint, self.successors)
        proposers = build_proposers(config, context, inputs, self.proposers)
        return LookaheadStep(sequence, self.sampling, config, context, proposers)


def _prompt_logprobs(
    logits: torch.Tensor, prompt: Sequence[int], start: int, end: int, sampling: SamplingParams
) -> list[TokenLogprob] | None:
    """The logprobs of the prompt tokens that a prefill chunk over positions ``[start, end)`` predicts (None
    unless asked for): row r (position ``start + r``) predicts prompt token ``start + r + 1``.

    Example: a 5-token prompt in chunks [0, 3) and [3, 5): the first chunk's rows 0-2 give tokens 1-3, the
    second's row 0 token 4 (its row 1 predicts the first generated token, not a prompt token).
    """
    if sampling.prompt_logprobs is None:
        return None
    last = min(end, len(prompt) - 1)  # the last prompt token this chunk predicts
    return token_logprobs(logits, range(last - start), prompt[start + 1 : last + 1], sampling.prompt_logprobs)


def generate_autoregressive(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams = SamplingParams(),
    constraint: Constraint | None = None,
) -> DecodeStream:
    """Plain decoding with a KV cache: one token per forward pass. The greedy reference. ``constraint``: the
    grammar's, when ``sampling.grammar`` is set."""
    return DecodeStream(model, prompt_ids, stop, sampling, constraint=constraint)


def generate_lookahead(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams = SamplingParams(),
    lookahead: LookaheadConfig = LookaheadConfig(),
    constraint: Constraint | None = None,
) -> DecodeStream:
    """Lookahead decoding: each forward pass runs the Jacobi window and verifies pool candidates. ``constraint``:
    the grammar's, when ``sampling.grammar`` is set."""
    return DecodeStream(model, prompt_ids, stop, sampling, lookahead, constraint=constraint)

