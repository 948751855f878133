"""The decoders: a plain autoregressive loop and lookahead decoding, both as step generators.

Contract: token ids in, token ids out (no tokenizer here). ``generate_autoregressive`` and
``generate_lookahead`` take a causal LM, the prompt ids, ``StopCriteria`` and ``SamplingParams`` and yield
one ``Step`` per forward pass: the tokens that pass committed (never a stop token, never past
``max_tokens``) and its statistics. The last step carries ``finish_reason`` "stop" or "length". Closing the
generator early cancels the decode and frees its cache. With greedy sampling both produce exactly the same
tokens; with sampling lookahead preserves the output distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from decoding.errors import ContextLengthError, EmptyPromptError
from decoding.kv_cache import SlotCache, new_cache
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.pool import ContextIndex, NGramPool
from decoding.verify import Verdict, sample, verify_greedy, verify_sampling, warp
from decoding.window import StepLayout, Window, context_filler, step_layout


@dataclass(frozen=True)
class StepStats:
    """What one forward pass did.

    ``offered`` counts guessed tokens offered for verification (N-1 when at least one candidate was
    verified, else 0), ``accepted`` those accepted, ``accepted_per_position[k]`` whether guessed position
    k+1 was accepted.
    """

    input_tokens: int
    committed: int
    offered: int = 0
    accepted: int = 0
    accepted_per_position: tuple[bool, ...] = ()
    seconds: float = 0.0
    prefill: bool = False


@dataclass(frozen=True)
class Step:
    """One forward pass's output: new token ids, stats, and why decoding ended (None while it goes on)."""

    token_ids: list[int]
    stats: StepStats
    finish_reason: str | None = None


@dataclass
class _Sequence:
    """Committed tokens of one decode; ``tokens[-1]`` is ``last`` and the cache holds all tokens before it."""

    tokens: list[int]
    prompt_length: int
    stop: StopCriteria
    cache: SlotCache
    generator: torch.Generator | None = None
    finish_reason: str | None = field(default=None)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    def accept(self, run: Sequence[int]) -> list[int]:
        """Commit ``run`` token by token until a stop token or ``max_tokens``; return what was committed."""
        committed: list[int] = []
        for token in run:
            if token in self.stop.stop_token_ids:
                self.finish_reason = "stop"
                break
            committed.append(token)
            self.tokens.append(token)
            if self.generated >= self.stop.max_tokens:
                self.finish_reason = "length"
                break
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


def _start(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams,
    step_tokens: int,
) -> _Sequence:
    """Validate arguments and allocate the sequence's cache."""
    validate_request(model, prompt_ids, stop, sampling)
    cache = new_cache(model, len(prompt_ids) + stop.max_tokens + step_tokens)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
    return _Sequence(list(prompt_ids), len(prompt_ids), stop, cache, generator)


def _choose(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from ``[vocab]`` logits: argmax when greedy, else a sample."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample(warp(logits.unsqueeze(0), sampling)[0].cpu(), generator)


@torch.inference_mode()
def _prefill(model: PreTrainedModel, sequence: _Sequence, sampling: SamplingParams) -> Step:
    """Run the prompt through the model, committing the first new token."""
    started = time.perf_counter()
    device = model.device
    input_ids = torch.tensor([sequence.tokens], device=device)
    logits = model(input_ids=input_ids, past_key_values=sequence.cache, use_cache=True, logits_to_keep=1).logits
    token = _choose(logits[0, -1], sampling, sequence.generator)
    committed = sequence.accept([token])
    stats = StepStats(input_ids.shape[1], len(committed), seconds=time.perf_counter() - started, prefill=True)
    return Step(committed, stats, sequence.finish_reason)


@torch.inference_mode()
def generate_autoregressive(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams = SamplingParams(),
) -> Iterator[Step]:
    """Plain decoding with a KV cache: one token per forward pass. The greedy reference."""
    sequence = _start(model, prompt_ids, stop, sampling, step_tokens=1)
    step = _prefill(model, sequence, sampling)
    yield step
    while sequence.finish_reason is None:
        yield _single_step(model, sequence, sampling)


def _single_step(model: PreTrainedModel, sequence: _Sequence, sampling: SamplingParams) -> Step:
    """One plain forward over ``last``: commit one token (or stop), leaving ``last``'s KV in the cache."""
    started = time.perf_counter()
    device = model.device
    position = len(sequence.tokens) - 1
    input_ids = torch.tensor([[sequence.tokens[-1]]], device=device)
    position_ids = torch.tensor([[position]], device=device)
    logits = model(
        input_ids=input_ids, position_ids=position_ids, past_key_values=sequence.cache, use_cache=True
    ).logits
    committed = sequence.accept([_choose(logits[0, -1], sampling, sequence.generator)])
    if not committed:
        sequence.cache.commit(position, [])
    stats = StepStats(1, len(committed), seconds=time.perf_counter() - started)
    return Step(committed, stats, sequence.finish_reason)


@torch.inference_mode()
def generate_lookahead(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams = SamplingParams(),
    lookahead: LookaheadConfig = LookaheadConfig(),
) -> Iterator[Step]:
    """Lookahead decoding: each forward pass runs the Jacobi window and verifies pool candidates."""
    lookahead.validate()
    sequence = _start(model, prompt_ids, stop, sampling, step_tokens=lookahead.step_tokens)
    yield _prefill(model, sequence, sampling)
    if sequence.finish_reason is not None:
        return
    decoder = _LookaheadState(model, sequence, sampling, lookahead)
    while sequence.finish_reason is None:
        yield decoder.step()


PROBE_INTERVAL = 8
ACCEPT_SMOOTHING = 0.3


class _LookaheadState:
    """Window, pool and buffers of one lookahead decode; ``step()`` runs one forward pass."""

    def __init__(
        self, model: PreTrainedModel, sequence: _Sequence, sampling: SamplingParams, lookahead: LookaheadConfig
    ) -> None:
        self.model = model
        self.sequence = sequence
        self.sampling = sampling
        self.config = lookahead
        self.device = model.device
        self.mask_min = torch.finfo(model.dtype).min
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
        self.expected_accept = float(lookahead.levels)
        self.steps_since_probe = 0

    def step(self) -> Step:
        """One forward pass: build the input, run the model, verify, commit, update window and pool."""
        started = time.perf_counter()
        sequence, config = self.sequence, self.config
        last = sequence.tokens[-1]
        position = len(sequence.tokens) - 1
        candidates = self._candidates()
        paying = self._verifying_pays()
        candidates = candidates if paying else []
        if not candidates and (config.lazy_window or not paying):
            return self._single_step()
        width, levels, tokens = config.window_size, len(self.window.rows), self.window.input_tokens(last)
        layout = step_layout(width, levels, len(candidates), config.levels)
        tokens += [token for candidate in candidates for token in candidate]
        logits = self._forward(tokens, layout, position)

        def candidate_row(candidate: int, k: int) -> int:
            return 1 + width + candidate * config.levels + k

        predicted = logits.argmax(dim=-1).tolist()
        verdict = self._verify(logits, predicted, candidates, candidate_row)
        committed = sequence.accept(verdict.tokens)
        self._commit_cache(position, levels * width, verdict, len(committed))
        new_row = self._clean_row(predicted[1 : 1 + width])
        for key, ngram in self.window.ngrams(last, new_row):
            self.pool.add(key, ngram)
        self.window.advance(new_row, len(committed), config.align_window)
        self._scan_output()
        accepted = min(verdict.num_accepted, len(committed))
        if candidates:
            self.expected_accept += ACCEPT_SMOOTHING * (verdict.num_accepted - self.expected_accept)
        stats = StepStats(
            input_tokens=len(tokens),
            committed=len(committed),
            offered=config.levels if candidates else 0,
            accepted=accepted,
            accepted_per_position=tuple(k < accepted for k in range(config.levels)) if candidates else (),
            seconds=time.perf_counter() - started,
        )
        return Step(committed, stats, sequence.finish_reason)

    def _single_step(self) -> Step:
        """A plain one-token step (no candidate worth verifying): the window only re-aligns."""
        step = _single_step(self.model, self.sequence, self.sampling)
        self.window.skip(step.stats.committed, self.config.align_window)
        self._scan_output()
        return step

    def _candidates(self) -> list[tuple[int, ...]]:
        """Up to G n-grams to verify after ``last``: copied continuations ranked by context match, then the
        pool's (Jacobi, and prompt/output n-grams when not ranked by context)."""
        config, tokens = self.config, self.sequence.tokens
        found = self.context.candidates(tokens, config.levels, config.guess_set_size) if config.rank_by_context else []
        for candidate in self.pool.candidates(tokens[-1], config.guess_set_size):
            if len(found) == config.guess_set_size:
                break
            if candidate not in found:
                found.append(candidate)
        return found

    def _scan_output(self) -> None:
        """Index (or insert the n-grams of) newly committed tokens, when the output is a candidate source."""
        if not self.config.output_pool:
            return
        if self.config.rank_by_context:
            self.context.extend(self.sequence.tokens, len(self.sequence.tokens) - 1)
        else:
            self.scanned = self.pool.add_sequence(self.sequence.tokens, self.scanned)

    def _verifying_pays(self) -> bool:
        """False while this sequence's mean accepted guesses is below ``break_even`` (except for a probe)."""
        if self.expected_accept >= self.config.break_even:
            return True
        self.steps_since_probe += 1
        if self.steps_since_probe < PROBE_INTERVAL:
            return False
        self.steps_since_probe = 0
        return True

    def _forward(self, tokens: list[int], layout: StepLayout, position: int) -> torch.Tensor:
        """Run the model over the step's tokens; return the kept logits ``[rows, vocab]``."""
        device, past = self.device, self.sequence.cache.length
        count = len(tokens)
        mask = torch.zeros((1, 1, count, past + count), dtype=self.model.dtype)
        mask[0, 0, :, past:].masked_fill_(~layout.visible, self.mask_min)
        output = self.model(
            input_ids=torch.tensor([tokens], device=device),
            position_ids=(layout.offsets + position).unsqueeze(0).to(device),
            attention_mask=mask.to(device),
            past_key_values=self.sequence.cache,
            use_cache=True,
            logits_to_keep=layout.logit_rows.to(device),
        )
        return output.logits[0]

    def _verify(
        self,
        logits: torch.Tensor,
        predicted: list[int],
        candidates: list[tuple[int, ...]],
        candidate_row,
    ) -> Verdict:
        if self.sampling.greedy:
            return verify_greedy(predicted, candidates, candidate_row)
        probs = warp(logits, self.sampling).cpu()
        return verify_sampling(probs, candidates, candidate_row, self.sequence.generator)

    def _commit_cache(self, position: int, window_tokens: int, verdict: Verdict, committed: int) -> None:
        """KV fix-up: keep the old prefix, ``last`` and the accepted candidate tokens that stay committed.

        The cache must hold every committed token except the new ``last``: that is the old ``last`` (slot
        ``position``) when at least one token was committed, plus candidate tokens 1..committed-1.
        """
        sources: list[int] = []
        if committed >= 1:
            sources.append(position)
        if verdict.candidate is not None and committed >= 2:
            start = position + window_tokens + verdict.candidate * self.config.levels
            sources.extend(range(start, start + committed - 1))
        self.sequence.cache.commit(position, sources)

    def _clean_row(self, row: list[int]) -> list[int]:
        """Replace stop tokens (EOS) in a new window row: they must never stay in the window."""
        stops = self.sequence.stop.stop_token_ids
        return [self.window.filler() if token in stops else token for token in row]
