"""What a decode step is: its records, the decode's committed state, and the plain one-token step.

Contract: ``Step`` (one forward pass's tokens, ``StepStats`` and finish reason) is what every decode stream
yields; ``StepStats.counts`` turns a step into the ``StepCounts`` record that callers sum; ``Proposal`` is what a
stream asks of a batch. ``SequenceState`` holds one decode's committed tokens, stop criteria, cache and grammar
constraint, and ``accept`` is the one place tokens are committed (token by token, up to a stop). ``PlainStep`` is
the autoregressive step (one token in, one token out), and its helpers (``choose``, ``one_token_slice``,
``finish_one_token``, ``step_logprobs``) serve the lookahead step too. Per-source counts (``StepStats.sources``)
name each candidate source (``decoding.proposers``) with the guessed tokens it offered and had accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decoding.forward.choice import greedy_id
from decoding.forward.kv_cache import SlotCache
from decoding.forward.slices import Slice
from decoding.grammar import Constraint
from decoding.params import SamplingParams, StopCriteria
from decoding.step.logits import adjust_logits, needs_adjusting
from decoding.step.logprobs import TokenLogprob, token_logprobs
from decoding.step.sampling import sample_rows


@dataclass(frozen=True)
class StepStats:
    """What one forward pass did.

    ``offered`` counts guessed tokens offered for verification (N-1 when at least one candidate was
    verified, else 0), ``accepted`` those accepted, ``accepted_per_position[k]`` whether guessed position
    k+1 was accepted, ``memory_accepted`` how many accepted guesses came from the shared n-gram memory,
    ``prediction_accepted`` how many came from the request's prediction (beyond what every other source proposed).
    ``sources``: per candidate source whose guesses this step verified, ``(name, offered, accepted)``: the longest
    of its verified guesses, and how many of the accepted guesses it proposed (sources overlap: a token two
    sources proposed counts for both). Sorted by name.
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
    sources: tuple[tuple[str, int, int], ...] = ()

    def counts(self, kept: int | None = None) -> StepCounts:
        """This step's counts when only its first ``kept`` tokens are kept (all committed ones by default).

        Accepted guesses beyond the kept tokens are not counted. Example: a step that committed 3 tokens,
        2 of them accepted guesses (``accepted_per_position=(True, True, False)``, N=4), with ``kept=1`` (a stop
        string ended the text after its first token) counts ``tokens=1, steps=1, offered=3, accepted=1,
        accepted_per_position=(1, 0, 0)``; each source's accepted guesses are cut the same way.
        """
        kept = self.committed if kept is None else kept
        accepted = min(self.accepted, kept)
        positions = tuple(int(flag and k < accepted) for k, flag in enumerate(self.accepted_per_position))
        sources = tuple((name, offered, min(taken, accepted)) for name, offered, taken in self.sources)
        return StepCounts(kept, 1 if kept > 0 else 0, self.offered, accepted, positions,
                          min(self.memory_accepted, accepted), min(self.prediction_accepted, accepted), sources)


@dataclass(frozen=True)
class StepCounts:
    """The one record of output counts: of one step (``StepStats.counts``), or a sum of steps (``+``, ``-``).

    ``tokens``: tokens kept; ``steps``: steps that kept at least one token (prefill included); ``offered``:
    guessed tokens offered for verification; ``accepted``: guessed tokens accepted and kept;
    ``accepted_per_position[k]``: how many of those were at guessed position k+1; ``memory_accepted``: how many
    of the accepted came from the engine's shared n-gram memory; ``prediction_accepted``: from the request's
    prediction (predicted outputs); ``sources``: ``(name, offered, accepted)`` guessed tokens per candidate source
    (``StepStats.sources``), sorted by name.
    """

    tokens: int = 0
    steps: int = 0
    offered: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()
    memory_accepted: int = 0
    prediction_accepted: int = 0
    sources: tuple[tuple[str, int, int], ...] = ()

    def source(self, name: str) -> tuple[int, int]:
        """``(offered, accepted)`` guessed tokens of the source ``name`` (0, 0 when it offered none)."""
        return next(((offered, accepted) for source, offered, accepted in self.sources if source == name), (0, 0))

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
            _combine_sources(self.sources, other.sources, sign),
        )


def _combine_sources(
    mine: tuple[tuple[str, int, int], ...], theirs: tuple[tuple[str, int, int], ...], sign: int
) -> tuple[tuple[str, int, int], ...]:
    """Per-source ``mine + sign * theirs``, sorted by name; a source missing on one side counts as (0, 0).

    >>> _combine_sources((("copy", 16, 5),), (("copy", 4, 1), ("pool", 4, 2)), 1)
    (('copy', 20, 6), ('pool', 4, 2))
    """
    totals = {name: [offered, accepted] for name, offered, accepted in mine}
    for name, offered, accepted in theirs:
        total = totals.setdefault(name, [0, 0])
        total[0] += sign * offered
        total[1] += sign * accepted
    return tuple((name, offered, accepted) for name, (offered, accepted) in sorted(totals.items()))


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
    ``cached_tokens``: on a decode's first step, the prompt tokens whose KV came from the prefix cache
    (``decoding.step.prefix_cache``) instead of a forward; 0 on every other step.
    """

    token_ids: list[int]
    stats: StepStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_token: int | None = None
    cached_tokens: int = 0

    def timed(self, seconds: float, cached_tokens: int | None = None) -> Step:
        """This step with ``stats.seconds`` set, and ``cached_tokens`` when given (``dataclasses.replace``'s result,
        without its generic walk).

        >>> Step([4], StepStats(1, 1)).timed(0.5).stats.seconds
        0.5
        """
        s = self.stats
        stats = StepStats(s.input_tokens, s.committed, s.offered, s.accepted, s.accepted_per_position, seconds,
                          s.prefill, s.memory_accepted, s.prediction_accepted, s.sources)
        return Step(self.token_ids, stats, self.finish_reason, self.logprobs, self.prompt_logprobs, self.stop_token,
                    self.cached_tokens if cached_tokens is None else cached_tokens)


@dataclass
class SequenceState:
    """Committed tokens of one decode; ``tokens[-1]`` is ``last`` and the cache holds all tokens before it.
    ``constraint`` (with a grammar) has consumed every committed output token; its end (EOS) stops the decode
    even where EOS is not a stop token (``ignore_eos``): nothing can follow it. ``seed`` (a sampled decode's)
    decides the token at each output index (``decoding.step.sampling``)."""

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


# Finishes a planned step: (the slice's logits, their rows' argmax ids when the forward returned them) -> Step.
Finisher = Callable[[torch.Tensor, "Sequence[int] | None"], "Step"]


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


def choose(logits: torch.Tensor, sampling: SamplingParams, sequence: SequenceState, argmax: int | None = None) -> int:
    """Pick the token after ``sequence`` from ``[vocab]`` logits (adjusted, ``decoding.step.logits``): argmax when
    greedy, else a sample. ``argmax``, when given, is the raw row's argmax: greedy with nothing to adjust takes
    it as it is (no read of the logits)."""
    plain = sampling.greedy and sequence.constraint is None
    if argmax is not None and plain and not needs_adjusting(sampling, sequence.stop, sequence.generated):
        return argmax
    scores = adjusted(logits.unsqueeze(0), sampling, sequence, [()])[0]
    if sequence.constraint is not None:
        scores = sequence.constraint.mask(scores)
    if sampling.greedy:
        return greedy_id(scores)
    return sample_rows(scores.unsqueeze(0), sampling, sequence.seed, [sequence.generated])[0]


def adjusted(
    logits: torch.Tensor, sampling: SamplingParams, sequence: SequenceState, paths: Sequence[Sequence[int]]
) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with row r adjusted after ``sequence.tokens + paths[r]``; the same tensor,
    untouched, when no setting adjusts logits."""
    if not needs_adjusting(sampling, sequence.stop, sequence.generated):
        return logits
    return adjust_logits(logits, sampling, sequence.stop, sequence.tokens, sequence.prompt_length, paths)


def one_token_slice(sequence: SequenceState, top_k: int = 0) -> Slice:
    """A plain step's slice: ``last`` alone at its position, its logits read (and ``top_k`` top ids with them)."""
    position = len(sequence.tokens) - 1
    return Slice([sequence.tokens[-1]], None, None, None, sequence.cache, (-1,), (position,), (0,), top_k=top_k)


def finish_one_token(
    sequence: SequenceState, sampling: SamplingParams, logits: torch.Tensor, argmax: Sequence[int] | None = None
) -> Step:
    """Commit one token from a plain step's logits (or stop), leaving ``last``'s KV in the cache."""
    committed = sequence.accept([choose(logits[0], sampling, sequence, None if argmax is None else argmax[0])])
    if not committed:
        sequence.cache.commit(len(sequence.tokens) - 1, [])
    return Step(committed, StepStats(1, len(committed)), sequence.finish_reason,
                step_logprobs(logits, [0], sequence.chosen(committed), sampling), stop_token=sequence.stop_token)


def step_logprobs(
    logits: torch.Tensor, rows: Sequence[int], committed: list[int], sampling: SamplingParams
) -> list[TokenLogprob] | None:
    """The committed tokens' logprobs when the request asked for them (``rows[i]`` predicted token i), else None."""
    if sampling.top_logprobs is None:
        return None
    return token_logprobs(logits, rows, committed, sampling.top_logprobs)


class PlainStep:
    """Autoregressive steps: one token in, one token out."""

    def __init__(self, sequence: SequenceState, sampling: SamplingParams) -> None:
        self.sequence = sequence
        self.sampling = sampling

    def propose(self, cost: Callable[[int], float] | None = None) -> Proposal:
        """One token, always (``cost`` is not needed)."""
        return Proposal(1)

    def plan(self, budget: int) -> tuple[Slice, Finisher]:
        """``last`` alone, whatever the budget."""
        return one_token_slice(self.sequence), functools.partial(finish_one_token, self.sequence, self.sampling)

