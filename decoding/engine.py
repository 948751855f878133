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

import bisect
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from decoding.errors import ContextLengthError, EmptyPromptError, InvalidParameterError
from decoding.grammar import Constraint
from decoding.kv_cache import KVPool, SlotCache, new_cache
from decoding.logits import adjust_logits, needs_adjusting
from decoding.logprobs import TokenLogprob, token_logprobs
from decoding.memory import NGramMemory
from decoding.packed import Slice, forward_packed
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria, draw_seed
from decoding.pool import ContextIndex, NGramPool, covered
from decoding.sampling import SampledRows, row_chooser, sample_rows
from decoding.tree import TokenTree
from decoding.verify import ChosenRows, Verdict, verify_constrained, verify_greedy
from decoding.window import Window, context_filler, step_layout, window_chains, window_logit_row


@dataclass(frozen=True)
class StepStats:
    """What one forward pass did.

    ``offered`` counts guessed tokens offered for verification (N-1 when at least one candidate was
    verified, else 0), ``accepted`` those accepted, ``accepted_per_position[k]`` whether guessed position
    k+1 was accepted, ``memory_accepted`` how many accepted guesses came from the shared n-gram memory,
    ``prediction_accepted`` how many came from the request's prediction (beyond what every other source proposed).
    """

    input_tokens: int
    committed: int
    offered: int = 0
    accepted: int = 0
    accepted_per_position: tuple[bool, ...] = ()
    seconds: float = 0.0
    prefill: bool = False
    memory_accepted: int = 0
    prediction_accepted: int = 0

    def counts(self, kept: int | None = None) -> StepCounts:
        """This step's counts when only its first ``kept`` tokens are kept (all committed ones by default).

        Accepted guesses beyond the kept tokens are not counted. Example: a step that committed 3 tokens,
        2 of them accepted guesses (``accepted_per_position=(True, True, False)``, N=4), with ``kept=1`` (a stop
        string ended the text after its first token) counts ``tokens=1, steps=1, offered=3, accepted=1,
        accepted_per_position=(1, 0, 0)``.
        """
        kept = self.committed if kept is None else kept
        accepted = min(self.accepted, kept)
        positions = tuple(int(flag and k < accepted) for k, flag in enumerate(self.accepted_per_position))
        return StepCounts(kept, 1 if kept > 0 else 0, self.offered, accepted, positions,
                          min(self.memory_accepted, accepted), min(self.prediction_accepted, accepted))


@dataclass(frozen=True)
class StepCounts:
    """The one record of output counts: of one step (``StepStats.counts``), or a sum of steps (``+``, ``-``).

    ``tokens``: tokens kept; ``steps``: steps that kept at least one token (prefill included); ``offered``:
    guessed tokens offered for verification; ``accepted``: guessed tokens accepted and kept;
    ``accepted_per_position[k]``: how many of those were at guessed position k+1; ``memory_accepted``: how many
    of the accepted came from the engine's shared n-gram memory; ``prediction_accepted``: from the request's
    prediction (predicted outputs).
    """

    tokens: int = 0
    steps: int = 0
    offered: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()
    memory_accepted: int = 0
    prediction_accepted: int = 0

    def __add__(self, other: StepCounts) -> StepCounts:
        return self._combine(other, 1)

    def __sub__(self, other: StepCounts) -> StepCounts:
        return self._combine(other, -1)

    def _combine(self, other: StepCounts, sign: int) -> StepCounts:
        """Field-wise ``self + sign * other``; positions missing on one side count as 0."""
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + (0,) * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + (0,) * (width - len(other.accepted_per_position))
        return StepCounts(
            self.tokens + sign * other.tokens,
            self.steps + sign * other.steps,
            self.offered + sign * other.offered,
            self.accepted + sign * other.accepted,
            tuple(a + sign * b for a, b in zip(mine, theirs, strict=True)),
            self.memory_accepted + sign * other.memory_accepted,
            self.prediction_accepted + sign * other.prediction_accepted,
        )


@dataclass(frozen=True)
class Step:
    """One forward pass's output: new token ids, stats, and why decoding ended (None while it goes on).

    ``stop_token``: the stop token (EOS, or the grammar's end) the model chose where this step ended the decode
    with "stop"; it is never in ``token_ids``, but evaluation tools count it and want its logprob.
    ``logprobs`` (only when ``SamplingParams.top_logprobs`` is set, else None) is aligned with ``token_ids``, plus
    one last entry for ``stop_token`` when there is one.
    ``prompt_logprobs`` (only when ``SamplingParams.prompt_logprobs`` is set, else None): on a prefill step, the
    logprobs of the prompt tokens its chunk's rows predicted, in order; prompt token 0 has none, so a whole
    prefill's steps together carry tokens 1..P-1.
    """

    token_ids: list[int]
    stats: StepStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_token: int | None = None


@dataclass
class _Sequence:
    """Committed tokens of one decode; ``tokens[-1]`` is ``last`` and the cache holds all tokens before it.
    ``constraint`` (with a grammar) has consumed every committed output token; its end (EOS) stops the decode
    even where EOS is not a stop token (``ignore_eos``): nothing can follow it. ``seed`` (a sampled decode's)
    decides the token at each output index (``decoding.sampling``)."""

    tokens: list[int]
    prompt_length: int
    stop: StopCriteria
    cache: SlotCache
    seed: int = 0
    finish_reason: str | None = field(default=None)
    constraint: Constraint | None = None
    stop_token: int | None = None  # the stop token that ended the decode, once one did

    def chosen(self, committed: list[int]) -> list[int]:
        """What the model chose in the run ``accept`` just took: ``committed``, then the stop token if it ended
        the decode (the tokens whose logprobs a step reports)."""
        return committed if self.stop_token is None else [*committed, self.stop_token]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    def accept(self, run: Sequence[int]) -> list[int]:
        """Commit ``run`` token by token until a stop token or ``max_tokens``; return what was committed."""
        committed: list[int] = []
        ended = self.constraint.eos if self.constraint is not None else None
        for token in run:
            if token in self.stop.stop_token_ids or token == ended:
                self.finish_reason, self.stop_token = "stop", token
                break
            committed.append(token)
            self.tokens.append(token)
            if self.generated >= self.stop.max_tokens:
                self.finish_reason = "length"
                break
        if self.constraint is not None:
            self.constraint.consume(committed)
        return committed


def context_length(model: PreTrainedModel) -> int:
    """The model's maximum number of positions (prompt + generated tokens)."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", 2048))


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
PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 64
ACCEPT_SMOOTHING = 0.3
PREDICTION_COPY_LENGTH = 32  # the fewest tokens a prediction's copy proposes (see prediction_copy_length)
PROMPT_LOGPROBS_CHUNK = 256  # the most prompt tokens per prefill forward when every row's logits are read


# Finishes a planned step: (the slice's logits, their rows' argmax ids when the forward returned them) -> Step.
_Finisher = Callable[[torch.Tensor, "Sequence[int] | None"], "Step"]


@dataclass(frozen=True)
class Proposal:
    """What a stream would like its next forward to hold, for a batch to size it.

    ``tokens`` is the step it wants (the remaining prompt while prefilling); ``gain`` the tokens it expects to
    commit beyond the one a plain step commits (its running mean of accepted guesses when it verifies);
    ``probe`` marks a verifying step taken only to re-measure acceptance; ``prefill`` a prompt chunk;
    ``smallest`` the tokens of the smallest step that still verifies a candidate (0: none).
    """

    tokens: int
    gain: float = 0.0
    probe: bool = False
    prefill: bool = False
    smallest: int = 0


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
    as a private ``NGramMemory`` document whose continuations join its copy candidates (see ``_Lookahead``);
    a prediction changes how fast a decode runs, never its greedy output. Without lookahead it is ignored.
    A stream whose ``sampling.grammar`` is set takes that grammar's ``constraint`` (``decoding.grammar``): every
    token it chooses or verifies is masked by it, and guesses it forbids are cut before they are offered, so
    constrained lookahead commits exactly what the constrained autoregressive loop does.
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
    ) -> None:
        validate_request(model, prompt_ids, stop, sampling, lookahead)
        if (sampling.grammar is None) != (constraint is None):
            raise InvalidParameterError("grammar", "a grammar needs its constraint (GrammarCompiler.constraint), "
                                        "and a constraint its grammar")
        self.prediction = _prediction_memory(prediction) if lookahead is not None else None
        step_tokens = lookahead.step_tokens if lookahead is not None else 1
        if self.prediction is not None:
            step_tokens += lookahead.copy_candidates * prediction_copy_length(lookahead) + 1
        self.model = model
        self.sampling = sampling
        self.lookahead = lookahead
        self.memory = memory if lookahead is not None and lookahead.shared_memory else None
        capacity = len(prompt_ids) + stop.max_tokens + step_tokens
        cache = pool.acquire(capacity) if pool is not None else None
        self.pool = pool if cache is not None else None
        self.sequence = _Sequence(
            list(prompt_ids), len(prompt_ids), stop, cache or new_cache(model, capacity), constraint=constraint
        )
        if not sampling.greedy:
            self.sequence.seed = sampling.seed if sampling.seed is not None else draw_seed()
        self._policy: _Plain | _Lookahead | None = None
        self._planned: _Finisher | None = None
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

    def propose(self) -> Proposal:
        """What the next step wants; call once per step, before ``plan``."""
        remaining = self.sequence.prompt_length - self.sequence.cache.length
        if remaining > 0:
            if self.sampling.prompt_logprobs is not None:  # every row's logits: bound the chunk's memory
                remaining = min(remaining, PROMPT_LOGPROBS_CHUNK)
            return Proposal(remaining, prefill=True)
        return self._policy.propose()

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
        return replace(step, stats=replace(step.stats, seconds=time.perf_counter() - self._started))

    def _plan_prefill(self, budget: int) -> tuple[Slice, _Finisher]:
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
                return Step([], stats, logprobs=_logprobs(logits, [], [], self.sampling), prompt_logprobs=prompt)
            if sequence.stop.max_tokens == 0:
                sequence.finish_reason = "length"
                return Step([], StepStats(end - start, 0, prefill=True), "length",
                            _logprobs(logits, [], [], self.sampling), prompt)
            row = logits.shape[0] - 1
            chosen = _choose(logits[row], self.sampling, sequence, None if argmax is None else argmax[row])
            committed = sequence.accept([chosen])
            if sequence.finish_reason is None:
                self._policy = (
                    _Plain(sequence, self.sampling)
                    if self.lookahead is None
                    else _Lookahead(self.model, sequence, self.sampling, self.lookahead, self.memory, self.prediction)
                )
            return Step(committed, StepStats(end - start, len(committed), prefill=True), sequence.finish_reason,
                        _logprobs(logits, [row], sequence.chosen(committed), self.sampling), prompt,
                        sequence.stop_token)

        return slice_, finish


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


def _prediction_memory(prediction: Sequence[int] | None) -> NGramMemory | None:
    """A private memory holding ``prediction`` as its one document (None for no or an empty prediction)."""
    if not prediction:
        return None
    memory = NGramMemory(max_tokens=len(prediction))
    memory.add(prediction)
    return memory


def prediction_copy_length(lookahead: LookaheadConfig) -> int:
    """Tokens a prediction's copy proposes: at least ``PREDICTION_COPY_LENGTH``, even when copy steps are off
    (``copy_length`` 0), so a prediction is used whenever lookahead is on, and reaches past the context's copies
    of the same text (a prediction is usually in the prompt too)."""
    return max(lookahead.copy_length, PREDICTION_COPY_LENGTH)


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


def _choose(logits: torch.Tensor, sampling: SamplingParams, sequence: _Sequence, argmax: int | None = None) -> int:
    """Pick the token after ``sequence`` from ``[vocab]`` logits (adjusted, ``decoding.logits``): argmax when
    greedy, else a sample. ``argmax``, when given, is the raw row's argmax: greedy with nothing to adjust takes
    it as it is (no read of the logits)."""
    plain = sampling.greedy and sequence.constraint is None
    if argmax is not None and plain and not needs_adjusting(sampling, sequence.stop, sequence.generated):
        return argmax
    scores = _adjusted(logits.unsqueeze(0), sampling, sequence, [()])[0]
    if sequence.constraint is not None:
        scores = sequence.constraint.mask(scores)
    if sampling.greedy:
        return int(scores.argmax())
    return sample_rows(scores.unsqueeze(0), sampling, sequence.seed, [sequence.generated])[0]


def _adjusted(
    logits: torch.Tensor, sampling: SamplingParams, sequence: _Sequence, paths: Sequence[Sequence[int]]
) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with row r adjusted after ``sequence.tokens + paths[r]``; the same tensor,
    untouched, when no setting adjusts logits."""
    if not needs_adjusting(sampling, sequence.stop, sequence.generated):
        return logits
    return adjust_logits(logits, sampling, sequence.stop, sequence.tokens, sequence.prompt_length, paths)


def _one_token_slice(sequence: _Sequence) -> Slice:
    """A plain step's slice: ``last`` alone at its position, its logits read."""
    position = len(sequence.tokens) - 1
    return Slice([sequence.tokens[-1]], None, None, None, sequence.cache, (-1,), (position,), (0,))


def _finish_one_token(
    sequence: _Sequence, sampling: SamplingParams, logits: torch.Tensor, argmax: Sequence[int] | None = None
) -> Step:
    """Commit one token from a plain step's logits (or stop), leaving ``last``'s KV in the cache."""
    committed = sequence.accept([_choose(logits[0], sampling, sequence, None if argmax is None else argmax[0])])
    if not committed:
        sequence.cache.commit(len(sequence.tokens) - 1, [])
    return Step(committed, StepStats(1, len(committed)), sequence.finish_reason,
                _logprobs(logits, [0], sequence.chosen(committed), sampling), stop_token=sequence.stop_token)


def _logprobs(
    logits: torch.Tensor, rows: Sequence[int], committed: list[int], sampling: SamplingParams
) -> list[TokenLogprob] | None:
    """The committed tokens' logprobs when the request asked for them (``rows[i]`` predicted token i), else None."""
    if sampling.top_logprobs is None:
        return None
    return token_logprobs(logits, rows, committed, sampling.top_logprobs)




class _Plain:
    """Autoregressive steps: one token in, one token out."""

    def __init__(self, sequence: _Sequence, sampling: SamplingParams) -> None:
        self.sequence = sequence
        self.sampling = sampling

    def propose(self) -> Proposal:
        return Proposal(1)

    def plan(self, budget: int) -> tuple[Slice, _Finisher]:
        return _one_token_slice(self.sequence), functools.partial(_finish_one_token, self.sequence, self.sampling)


class _Gate:
    """A running mean of the guesses a kind of step accepts, and whether taking such a step pays.

    ``pays(break_even)`` is True while the mean is at least ``break_even``; below it, for a probe that
    re-measures: after ``PROBE_INTERVAL`` calls, then after twice as many calls as the previous wait, up to
    ``MAX_PROBE_INTERVAL``, so text that never repeats pays for fewer and fewer probes. The wait starts over
    at ``PROBE_INTERVAL`` once the mean is back at ``break_even``. ``update`` folds in a step's accepted guesses.
    """

    def __init__(self, start: float) -> None:
        self.expected = start
        self.since_probe = 0
        self.interval = PROBE_INTERVAL

    def pays(self, break_even: float) -> bool:
        if self.expected >= break_even:
            self.since_probe, self.interval = 0, PROBE_INTERVAL
            return True
        self.since_probe += 1
        if self.since_probe < self.interval:
            return False
        self.since_probe = 0
        self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
        return True

    def update(self, accepted: int) -> None:
        self.expected += ACCEPT_SMOOTHING * (accepted - self.expected)


class _Span:
    """How far the best copy of a copy step reaches: ``base`` tokens, doubled (up to ``limit``) after each copy
    step that accepted a whole copy of the current length, back to ``base`` after one that accepted less.

    >>> span = _Span(16, 64)
    >>> lengths = []
    >>> for copied in (16, 32, 64, 64, 40):
    ...     span.update(copied)
    ...     lengths.append(span.length)
    >>> lengths
    [32, 64, 64, 64, 16]
    """

    def __init__(self, base: int, limit: int) -> None:
        self.base = base
        self.limit = max(base, limit)
        self.length = base

    def update(self, copied: int) -> None:
        self.length = min(2 * self.length, self.limit) if copied >= self.length else self.base


@dataclass(frozen=True)
class _Chains:
    """The window's causal chains a step verifies beside its tree: each as window indices and as tokens."""

    indices: tuple[tuple[int, ...], ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class _Shape:
    """The shape a lookahead step takes: the window (or not) and the candidates it verifies, best first, with
    each one's source (``COPY``, ``MEMORY``, ``PREDICTION`` or ``POOL``); ``copy`` marks a copy step (gated by
    ``copying``)."""

    window: bool
    candidates: tuple[tuple[int, ...], ...] = ()
    sources: tuple[str, ...] = ()
    copy: bool = False

    @functools.cached_property
    def tree(self) -> TokenTree:
        """The candidates merged into one token tree (built once per shape)."""
        return TokenTree.build(self.candidates)

    def keep(self, count: int, window: bool | None = None) -> _Shape:
        """The same step with only its first ``count`` candidates (and the window when ``window`` says so)."""
        window = self.window if window is None else window
        return _Shape(window, self.candidates[:count], self.sources[:count], self.copy)


COPY, MEMORY, PREDICTION, POOL = "copy", "memory", "prediction", "pool"


class _Lookahead:
    """Window, pool and acceptance estimate of one lookahead decode; plans and finishes its steps.

    A step runs at most N-1 window rows and a token tree of candidates (``decoding.tree``); it shrinks to
    fit the budget (candidates first, then the window: a verification-only step, then a plain one-token
    step), and falls back to a plain step when no candidate is found and the window is lazy, or while
    verifying does not pay (``break_even``). With ``copy_length``, a step whose context matches an earlier one
    also verifies copied continuations (see ``LookaheadConfig``), shortened to fit the budget. With a shared
    ``memory`` (``decoding.memory.NGramMemory``), its continuations join the copies (or, without copy steps,
    the pool's candidates). With a ``prediction`` (a private ``NGramMemory`` of the request's predicted
    output), its continuations (``prediction_copy_length`` tokens, matching at least
    ``max(1, copy_min_match)`` tokens) join the copies too, even when copy steps are otherwise off.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        sequence: _Sequence,
        sampling: SamplingParams,
        lookahead: LookaheadConfig,
        memory: NGramMemory | None = None,
        prediction: NGramMemory | None = None,
    ) -> None:
        self.sequence = sequence
        self.sampling = sampling
        self.config = lookahead
        self.memory = memory
        self.prediction = prediction
        filler = context_filler(sequence.tokens, exclude=sequence.stop.stop_token_ids)
        self.window = Window(lookahead.window_size, lookahead.levels, filler)
        self.pool = NGramPool(lookahead.levels, lookahead.guess_set_size)
        self.context = ContextIndex()
        self.scanned = 0
        if lookahead.prompt_pool and lookahead.rank_by_context:
            self.context.extend(sequence.tokens, sequence.prompt_length)
        elif lookahead.prompt_pool:
            self.scanned = self.pool.add_sequence(sequence.tokens[: sequence.prompt_length])
        self.context.skip_to(sequence.prompt_length)
        self.scanned = max(self.scanned, sequence.prompt_length - lookahead.levels)
        self.verifying = _Gate(float(lookahead.levels))
        self.copying = _Gate(float(lookahead.copy_length))
        self.copy_span = _Span(lookahead.copy_length, lookahead.copy_stretch * lookahead.copy_length)
        self.predicting = _Gate(float(prediction_copy_length(lookahead)))  # the prediction's copies, gated apart
        self._wanted = _Shape(False)

    def propose(self) -> Proposal:
        """Find this step's candidates and decide whether to verify them; say how many tokens that takes."""
        config = self.config
        copies = self._allowed(self._copies())
        if copies.candidates and config.lazy_window:
            self._wanted = copies
            gain = self._copy_gain(copies)
            return Proposal(1 + len(copies.tree), gain, gain < config.break_even, smallest=2)
        paying = self.verifying.pays(config.break_even)
        found = self._allowed(self._candidates()) if paying else _Shape(False)
        window = bool(found.candidates) or (paying and not config.lazy_window)
        shape = _Shape(window, copies.candidates + found.candidates, copies.sources + found.sources,
                       copy=bool(copies.candidates))
        self._wanted = shape
        if not window and not shape.candidates:
            return Proposal(1)
        window_tokens = len(self.window.rows) * config.window_size if window else 1
        tokens = window_tokens + len(shape.tree)
        if not shape.candidates:
            return Proposal(tokens)
        gains = [self._copy_gain(copies)] if copies.candidates else []
        gains += [self.verifying.expected] if found.candidates else []
        probe = max(gains) < config.break_even
        smallest = 2 if copies.candidates else 1 + config.levels
        return Proposal(tokens, max(gains), probe, smallest=smallest)

    def plan(self, budget: int) -> tuple[Slice, _Finisher]:
        """The proposed step, shrunk to ``budget`` tokens."""
        shape = self._fit(self._wanted, budget)
        if not shape.window and not shape.candidates:
            return _one_token_slice(self.sequence), self._finish_plain
        sequence, config = self.sequence, self.config
        last, position = sequence.tokens[-1], len(sequence.tokens) - 1
        if shape.window:
            width, levels, tokens = config.window_size, len(self.window.rows), self.window.input_tokens(last)
        else:
            width, levels, tokens = 1, 1, [last]
        tree = shape.tree
        chains = self._chains(tokens, width, levels) if shape.window else _Chains()
        layout = step_layout(width, levels, tree.parents, bool(chains.indices))
        tokens += tree.tokens
        positions = [position + offset for offset in layout.offset_values]
        slice_ = Slice(tokens, None, None, None, sequence.cache, layout.parents, positions, layout.row_values,
                       visibility=lambda: layout.visible)
        return slice_, lambda logits, argmax: self._finish(logits, argmax, shape, tree, width, levels, position, chains)

    def _fit(self, shape: _Shape, budget: int) -> _Shape:
        """Drop candidates (last first), then the window, until the step holds at most ``budget`` tokens; when
        not even the first candidate fits whole, it is shortened to the room left."""
        window_tokens = len(self.window.rows) * self.config.window_size if shape.window else 1
        tree = shape.tree
        if window_tokens + len(tree) <= budget:
            return shape
        if shape.window and shape.candidates and window_tokens + len(shape.candidates[0]) <= budget:
            return shape.keep(_fitting(tree, budget - window_tokens))
        count = _fitting(tree, budget - 1)
        if count or not shape.candidates or budget < 2:
            return shape.keep(count, window=False)
        first = shape.candidates[0][: budget - 1]
        return _Shape(False, (first,), shape.sources[:1], shape.copy)

    def _finish_plain(self, logits: torch.Tensor, argmax: Sequence[int] | None = None) -> Step:
        """A plain one-token step: the window only re-aligns."""
        step = _finish_one_token(self.sequence, self.sampling, logits, argmax)
        self.window.skip(step.stats.committed, self.config.align_window)
        self._scan_output()
        return step

    def _finish(
        self, logits: torch.Tensor, argmax: Sequence[int] | None, shape: _Shape, tree: TokenTree, width: int,
        levels: int, position: int, chains: _Chains,
    ) -> Step:
        """Verify the candidates (the tree's, then the window's chains), commit, fix up the KV cache, and feed
        the window's new n-grams to the pool."""
        sequence, config, candidates = self.sequence, self.config, shape.candidates
        last = sequence.tokens[-1]
        in_tree = len(candidates)
        window_tokens = levels * width

        def candidate_slots(candidate: int) -> Sequence[int]:
            """The step slots (offsets from ``last``'s) of the candidate's tokens."""
            if candidate < in_tree:
                return [window_tokens + node for node in tree.paths[candidate]]
            return chains.indices[candidate - in_tree]

        def candidate_row(candidate: int, k: int) -> int:
            if candidate < in_tree:
                return 1 + width + tree.paths[candidate][k]
            return window_logit_row(chains.indices[candidate - in_tree][k], width, levels, len(tree))

        verified = [*candidates, *chains.tokens]
        scores = self._adjust(logits, tree, width)
        predicted = self._chosen(scores, argmax if scores is logits else None, tree, width, levels)
        verdict = self._verify(scores, predicted, verified, candidate_row)
        committed = sequence.accept(verdict.tokens)
        slots = candidate_slots(verdict.candidate) if verdict.candidate is not None else ()
        self._commit_cache(position, slots, len(committed))
        if shape.window:
            if isinstance(predicted, SampledRows):
                predicted.prefetch(range(1, 1 + width))
            new_row = self._clean_row([predicted[row] for row in range(1, 1 + width)])
            self.pool.add_chains(self.window.ngrams(last, new_row))
            self.window.advance(new_row, len(committed), config.align_window)
        else:
            self.window.skip(len(committed), config.align_window)
        self._scan_output()
        accepted = min(verdict.num_accepted, len(committed))
        sources = [*shape.sources, *[POOL] * len(chains.tokens)]
        reach = _reach_by_source(verified, sources, verdict.tokens[: verdict.num_accepted])
        if COPY in reach or MEMORY in reach:
            copied = max(reach.get(COPY, 0), reach.get(MEMORY, 0))
            self.copying.update(copied)
            self.copy_span.update(copied)
        if PREDICTION in reach:
            self.predicting.update(reach[PREDICTION])
        if POOL in reach:
            self.verifying.update(reach[POOL])
        others = max(reach.get(COPY, 0), reach.get(POOL, 0))
        depth = max(map(len, verified), default=0)
        stats = StepStats(
            input_tokens=window_tokens + len(tree),
            committed=len(committed),
            offered=depth,
            accepted=accepted,
            accepted_per_position=tuple(k < accepted for k in range(depth)),
            memory_accepted=min(accepted, max(0, reach.get(MEMORY, 0) - others)),
            prediction_accepted=min(accepted, max(0, reach.get(PREDICTION, 0) - max(others, reach.get(MEMORY, 0)))),
        )
        rows = [0]
        if verdict.candidate is not None:
            rows += [candidate_row(verdict.candidate, k) for k in range(verdict.num_accepted)]
        return Step(committed, stats, sequence.finish_reason,
                    _logprobs(logits, rows, sequence.chosen(committed), self.sampling), stop_token=sequence.stop_token)

    def _chains(self, tokens: Sequence[int], width: int, levels: int) -> _Chains:
        """The window's causal chains (``decoding.window.window_chains``) over this step's window ``tokens``, when
        ``window_chains`` is on and the step verifies greedily with unadjusted logits (no grammar, no logit
        processors: the chains' rows are read as they are, and sampling verification needs candidates that agree
        on a prefix to read the same rows)."""
        sequence = self.sequence
        if not self.config.window_chains or not self.sampling.greedy or sequence.constraint is not None \
                or needs_adjusting(self.sampling, sequence.stop, sequence.generated):
            return _Chains()
        indices = window_chains(width, levels)
        return _Chains(indices, tuple(tuple(tokens[index] for index in chain) for chain in indices))

    def _adjust(self, logits: torch.Tensor, tree: TokenTree, width: int) -> torch.Tensor:
        """``logits`` with ``last``'s row (0) and every tree node's row (``1 + width + node``) adjusted after the
        committed tokens plus the node's path (``decoding.logits``); the window's rows (guesses only) as they
        are. The same tensor when nothing adjusts logits."""
        sequence = self.sequence
        if not needs_adjusting(self.sampling, sequence.stop, sequence.generated):
            return logits
        rows = [0, *(1 + width + node for node in range(len(tree)))]
        scores = logits.float().clone()
        scores[rows] = adjust_logits(
            logits[rows], self.sampling, sequence.stop, sequence.tokens, sequence.prompt_length,
            [(), *tree.node_paths()],
        )
        return scores

    def _candidates(self) -> _Shape:
        """Up to G n-grams to verify after ``last``: copied continuations ranked by context match, then the
        shared memory's when there are no copy steps to take them, then the pool's (Jacobi, and prompt/output
        n-grams when not ranked by context)."""
        config, tokens, limit = self.config, self.sequence.tokens, self.config.guess_set_size
        found = self.context.candidates(tokens, config.levels, limit) if config.rank_by_context else []
        sources = [POOL] * len(found)
        if self.memory is not None and not config.copy_length:
            for candidate in self.memory.candidates(tokens, config.levels, limit, config.copy_min_match):
                if len(found) < limit and candidate not in found:
                    found.append(candidate)
                    sources.append(MEMORY)
        for candidate in self.pool.candidates(tokens[-1], limit):
            if len(found) == limit:
                break
            if candidate not in found:
                found.append(candidate)
                sources.append(POOL)
        return _Shape(True, tuple(found), tuple(sources))

    def _scan_output(self) -> None:
        """Index (or insert the n-grams of) newly committed tokens, when the output is a candidate source."""
        if not self.config.output_pool:
            return
        if self.config.rank_by_context:
            self.context.extend(self.sequence.tokens, len(self.sequence.tokens) - 1)
        else:
            self.scanned = self.pool.add_sequence(self.sequence.tokens, self.scanned)

    def _allowed(self, shape: _Shape) -> _Shape:
        """``shape`` with each candidate cut before the first token the grammar forbids (candidates left empty,
        or covered by an earlier one, dropped); ``shape`` itself when the decode has no grammar."""
        constraint = self.sequence.constraint
        if constraint is None or not shape.candidates:
            return shape
        kept: list[tuple[int, ...]] = []
        sources: list[str] = []
        for candidate, source in zip(shape.candidates, shape.sources, strict=True):
            allowed = candidate[: constraint.valid_prefix(candidate)]
            if allowed and not covered(allowed, kept):
                kept.append(allowed)
                sources.append(source)
        return _Shape(shape.window, tuple(kept), tuple(sources), shape.copy and bool(kept))

    def _copies(self) -> _Shape:
        """This step's copied continuations (``copy_candidates`` from the context, as many from the shared
        memory; each source's best one ``copy_span.length`` tokens long, the others ``copy_length``), when copy
        steps are on, some match and copying pays (its running mean of accepted tokens is at least
        ``break_even``, else a backed-off probe among copy opportunities, see ``_Gate``); then as many from the
        prediction, when one was given, some match and its own gate (``predicting``) says it pays."""
        config, tokens = self.config, self.sequence.tokens
        copies: list[tuple[int, ...]] = []
        sources: list[str] = []
        if config.copy_length and config.rank_by_context:
            span = self.copy_span.length
            found = self.context.best_copies(tokens, span, config.copy_min_match, config.copy_candidates)
            copies = _stretched(found, config.copy_length)
            sources = [COPY] * len(copies)
            if self.memory is not None:
                remembered = self.memory.candidates(tokens, span, config.copy_candidates, config.copy_min_match)
                _add_new(copies, sources, _stretched(remembered, config.copy_length), MEMORY)
        if copies and not self.copying.pays(config.break_even):
            copies, sources = [], []
        if self.prediction is not None:
            predicted = self.prediction.candidates(
                tokens, prediction_copy_length(config), config.copy_candidates, max(1, config.copy_min_match)
            )
            if predicted and self.predicting.pays(config.break_even):
                _add_new(copies, sources, predicted, PREDICTION)
        if not copies:
            return _Shape(False)
        return _Shape(False, tuple(copies), tuple(sources), copy=True)

    def _copy_gain(self, copies: _Shape) -> float:
        """The tokens a copy step of ``copies`` is expected to accept: the best running mean among the gates of
        its candidates' sources (``predicting`` for the prediction's, ``copying`` for the others)."""
        gains = [self.predicting.expected if source == PREDICTION else self.copying.expected
                 for source in copies.sources]
        return max(gains, default=self.copying.expected)

    def _chosen(
        self, scores: torch.Tensor, argmax: Sequence[int] | None, tree: TokenTree, width: int, levels: int
    ) -> ChosenRows:
        """The token the plain loop would choose at each row of a step: the argmax ids (``argmax`` when the
        forward gave them for these very scores), or, when sampling, each row's sample at the output index it
        predicts: ``last``'s row the next index, a tree node's its depth past that, bottom window row column j's
        ``levels + j - 1`` past it (the window then converges on the sampled text, as on the greedy one)."""
        if self.sampling.greedy:
            return list(argmax) if argmax is not None else scores.argmax(dim=-1).tolist()
        first = self.sequence.generated
        indices = {0: first}
        indices.update({1 + column: first + levels + column - 1 for column in range(width)})
        indices.update({1 + width + node: first + depth for node, depth in enumerate(tree.depths)})
        return SampledRows(scores, self.sampling, self.sequence.seed, indices)

    def _verify(
        self,
        logits: torch.Tensor,
        predicted: ChosenRows,
        candidates: list[tuple[int, ...]],
        candidate_row: Callable[[int, int], int],
    ) -> Verdict:
        constraint = self.sequence.constraint
        if constraint is not None:
            choose = row_chooser(self.sampling, self.sequence.seed, self.sequence.generated)
            return verify_constrained(logits, candidates, candidate_row, constraint, choose)
        return verify_greedy(predicted, candidates, candidate_row)

    def _commit_cache(self, position: int, slots: Sequence[int], committed: int) -> None:
        """KV fix-up: keep the old prefix, ``last`` and the winning candidate's tokens that stay committed.

        The cache must hold every committed token except the new ``last``: that is the old ``last`` (slot
        ``position``) when at least one token was committed, plus the winning candidate's first committed-1
        tokens, whose step slots (offsets from ``position``: tree nodes or window tokens) are ``slots``.
        """
        sources: list[int] = []
        if committed >= 1:
            sources.append(position)
        sources.extend(position + slot for slot in slots[: max(0, committed - 1)])
        self.sequence.cache.commit(position, sources)

    def _clean_row(self, row: list[int]) -> list[int]:
        """Replace stop tokens (EOS) in a new window row: they must never stay in the window."""
        stops = self.sequence.stop.stop_token_ids
        return [self.window.filler() if token in stops else token for token in row]


def _add_new(
    copies: list[tuple[int, ...]], sources: list[str], found: Sequence[tuple[int, ...]], source: str
) -> None:
    """Append each of ``found`` (labelled ``source``) that is not a prefix of a copy already in ``copies``."""
    for copy in found:
        if not covered(copy, copies):
            copies.append(copy)
            sources.append(source)


def _stretched(found: Sequence[tuple[int, ...]], length: int) -> list[tuple[int, ...]]:
    """``found`` (best first) with every continuation but the first cut to ``length`` tokens; one that its cut
    leaves a prefix of a continuation kept before it is dropped.

    >>> _stretched([(1, 2, 3, 4), (5, 6, 7), (1, 2, 8)], 2)
    [(1, 2, 3, 4), (5, 6)]
    """
    kept: list[tuple[int, ...]] = []
    for index, continuation in enumerate(found):
        cut = continuation if index == 0 else continuation[:length]
        if not covered(cut, kept):
            kept.append(cut)
    return kept


def _fitting(tree: TokenTree, room: int) -> int:
    """How many leading candidates of ``tree`` fit, merged into one token tree, in ``room`` tokens."""
    return bisect.bisect_right(tree.prefix_sizes(), room)


def _reach_by_source(
    candidates: Sequence[Sequence[int]], sources: Sequence[str], accepted: Sequence[int]
) -> dict[str, int]:
    """For each source with a candidate in ``candidates`` (labelled by ``sources``), how many of the ``accepted``
    tokens its best candidate proposed (its longest common prefix with them)."""
    reach: dict[str, int] = {}
    for candidate, source in zip(candidates, sources, strict=True):
        common = 0
        while common < min(len(candidate), len(accepted)) and candidate[common] == accepted[common]:
            common += 1
        reach[source] = max(reach.get(source, 0), common)
    return reach
