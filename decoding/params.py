"""Decoding parameters: what to generate, how to pick tokens, and the lookahead window.

Contract: the three dataclasses are immutable plain data that cross the server/decoding boundary.
``validate()`` raises ``InvalidParameterError`` naming the offending field; the generators call it, so a
caller can never start a decode with parameters out of range.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from decoding.errors import InvalidParameterError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the embedded default model (decoding.weights.loading fetches it)

# The one definition of every lookahead integer's range, [low, high]: ``LookaheadConfig.validate`` checks it,
# and the server's config schema, CLI flags, OpenAPI document and request validation derive theirs from it.
LOOKAHEAD_BOUNDS: dict[str, tuple[int, int]] = {
    "window_size": (1, 64),
    "ngram_size": (2, 16),
    "guess_set_size": (0, 64),
    "copy_length": (0, 64),
    "copy_min_match": (0, 8),
    "copy_candidates": (1, 8),
    "copy_stretch": (1, 8),
    "recycled_tree": (0, 256),
}
MAX_STEP_TOKENS = 1024
MAX_TOP_TOKENS = 16  # the most top tokens per row a source may keep (``LookaheadConfig.runner_up``, ``recycled``)
MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's chat limit)


GrammarKind = Literal["json_schema", "lark", "regex"]
# Whitespace a JSON schema's grammar allows between tokens: none, one space, or a newline and up to 20 spaces or
# tabs of indentation (llama.cpp's JSON grammars bound it the same way), so a model cannot loop on whitespace.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


@dataclass(frozen=True)
class NumberBounds:
    """The most digits a JSON number of a grammar's output may have: ``integer_digits`` before the point (and in
    an exponent), ``fraction_digits`` after it; 0 leaves that part unbounded. The defaults are llama.cpp's JSON
    grammars' (16 and 16), so a model cannot spin a number until ``max_tokens``."""

    integer_digits: int = 16
    fraction_digits: int = 16

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` for a negative bound."""
        _check_range("integer_digits", self.integer_digits, 0, 1 << 20)
        _check_range("fraction_digits", self.fraction_digits, 0, 1 << 20)


LLAMA_CPP_NUMBERS = NumberBounds()  # the default bounds: llama.cpp's


@dataclass(frozen=True)
class Grammar:
    """What the output must match: ``kind`` ``"json_schema"`` (``source`` a JSON schema as text), ``"lark"``
    (llguidance's Lark dialect) or ``"regex"``; enforced by ``decoding.grammar``. ``source`` is text, so the
    value is hashable. ``numbers`` (None: unbounded) bounds the digits of every JSON number in the output (outside
    JSON strings): give it to grammars whose output is JSON, or JSON between tags."""

    kind: GrammarKind
    source: str
    numbers: NumberBounds | None = None

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool, numbers: NumberBounds | None = LLAMA_CPP_NUMBERS) -> Grammar:
        """The grammar of JSON documents matching ``schema`` (a JSON schema as a Python value), numbers bounded
        as llama.cpp bounds them unless ``numbers`` says otherwise."""
        return Grammar("json_schema", json.dumps(schema), numbers)


ANY_JSON_OBJECT = Grammar.json_schema({"type": "object"})


@dataclass(frozen=True)
class SamplingParams:
    """Token choice. ``temperature == 0`` means greedy (argmax); ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    disable them; ``top_p == 0`` keeps only the most likely token.

    Logit adjustments (``decoding.step.logits``), applied at every chosen or verified position before the argmax or
    the warp, each neutral by default: ``repetition_penalty`` (> 0; HF/vLLM: logits of tokens in the prompt or
    the output so far are divided by it when positive, multiplied when negative), ``frequency_penalty`` and
    ``presence_penalty`` (OpenAI's, in [-2, 2]: minus ``frequency * count + presence * (count > 0)`` over the
    generated tokens' counts) and ``logit_bias`` ((token id, bias) pairs, bias in [-100, 100], added).
    ``min_p`` (in [0, 1]) drops tokens whose probability after temperature is below ``min_p`` times the best's.

    ``top_logprobs`` (None: no logprobs; 0..``MAX_TOP_LOGPROBS``) asks every ``Step`` for the committed tokens'
    logprobs under the raw model logits plus that many alternatives each (``decoding.step.logprobs``); it never
    changes which tokens are chosen.

    ``grammar`` (None: unconstrained) restricts every chosen or verified token to what the grammar allows next
    (``decoding.grammar``); it is applied after the logit adjustments, before the argmax or the warp.

    ``prompt_logprobs`` (None: not computed; 0..``MAX_TOP_LOGPROBS``) asks the prefill for the logprob of every
    prompt token after the first (read off the raw logits row of the position before it, chunk by chunk) plus
    that many alternatives each, in ``Step.prompt_logprobs``; without it the prefill reads one row only.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty or a logit bias changes the logits (all neutral: no work at all)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` if a field is out of range."""
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidParameterError("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_k < 0:
            raise InvalidParameterError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if self.top_logprobs is not None:
            _check_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise InvalidParameterError(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidParameterError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
            _check_float("logit_bias", bias, -100.0, 100.0)


@dataclass(frozen=True)
class StopCriteria:
    """When to stop: after ``max_tokens`` new tokens, or at any token in ``stop_token_ids`` (EOS included).

    A stop token ends the generation with reason ``"stop"`` and is not emitted. ``min_tokens`` (0..max_tokens):
    the stop tokens' logits are masked at every position before that many tokens were generated, so none
    can be chosen there. (To ignore EOS, leave it out of ``stop_token_ids``.) ``max_tokens == 0`` decodes
    nothing: the prompt is prefilled (for ``SamplingParams.prompt_logprobs``) and the decode ends with "length".
    """

    max_tokens: int
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    min_tokens: int = 0

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` if ``max_tokens`` is negative or ``min_tokens`` out of range."""
        if self.max_tokens < 0:
            raise InvalidParameterError("max_tokens", f"max_tokens must be >= 0, got {self.max_tokens}")
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)


@dataclass(frozen=True)
class LookaheadConfig:
    """The lookahead window and pool.

    - ``window_size`` (W >= 1): columns of the Jacobi window.
    - ``ngram_size`` (N >= 2): n-gram length; the window has N-1 rows and one step commits at most N tokens.
    - ``guess_set_size`` (G >= 0): candidates kept per key in the pool, and verified per step.
    - ``prompt_pool`` / ``output_pool``: also seed the pool with n-grams of the prompt / the generated text.
    - ``align_window``: after a step that commits ``a`` tokens, shift the window left by ``a - 1`` columns so
      each guess stays at its position (else it always shifts by one column, as the reference does).
    - ``lazy_window``: run the Jacobi window only on steps that also verify candidates; a step whose
      ``last`` has no candidate in the pool is a plain one-token step. Pays where any multi-token forward
      costs much more than a one-token one (CPUs: ~1.5x already at 2 tokens), not on GPUs.
    - ``rank_by_context``: take prompt/output n-grams from a position index of the text, best matching
      preceding context first (prompt-lookup style), instead of the pool's most recently inserted ones.
    - ``break_even``: accepted guesses per verifying step below which verifying loses to a plain one-token
      step (the multi-token step's cost ratio minus one: ~0.5 on a 2-core CPU, ~0 on a GPU). While a
      sequence's running mean of accepted guesses is below it, steps are plain one-token steps, with verifying
      probes that back off (after ``PROBE_INTERVAL`` steps, then twice the previous wait, up to
      ``MAX_PROBE_INTERVAL``). ``0`` never falls back. It is a floor: stepped under a batch policy, each
      source's drafts must also pay their price on the step-cost curve (``decoding.proposers.base.break_even``);
      copies, whose length follows the curve, are priced on it alone when there is one.
      Greedy output is unchanged.
    - ``copy_length`` (0 = off, needs ``rank_by_context``): when the last ``copy_min_match`` tokens of the text
      also precede an earlier occurrence of ``last``, the step verifies that occurrence's continuation, up to
      ``copy_length`` tokens (prompt-lookup style): copying text such as code can then commit many more than N
      tokens in one step. With ``lazy_window`` a copy step verifies its copies alone (no window, no pool
      candidates); without it they join the window's step, all candidates merged into one token tree. A copy
      is cut to the length that commits the most tokens per unit of step cost, by how far the decode's copies
      have been accepted (``decoding.proposers.survival``; the whole ``copy_length`` where tokens are nearly free,
      as on a GPU), and copy steps are taken while the tokens they expect to accept reach their price on the
      step-cost curve (``break_even`` without a curve), else on probes that back off.
    - ``copy_candidates`` (1..8): continuations of different earlier occurrences a copy step verifies at once
      (best matches first; the shared memory adds up to as many of its own).
    - ``copy_stretch`` (1..8, 1 = off): how far a run of whole copies may stretch the copies. After a copy step
      accepts its longest copy whole, the next copy step's best copy (and the shared memory's best) reaches twice
      as far, up to ``copy_stretch * copy_length`` tokens; a copy step that accepts less starts again at
      ``copy_length``. Text being copied verbatim (a repetition loop, a quoted block, a remembered answer) then
      commits up to that many tokens a step, while the other copies stay at ``copy_length``.
    - ``copy_min_match`` (0..8): tokens before ``last`` that must match an earlier context for a copy step
      (1 is prompt lookup's 2-gram match, 0 its 1-gram fallback: any earlier occurrence of ``last``). Among
      matching occurrences a stronger match (up to 5) wins first.
    - ``window_chains``: also verify the Jacobi window's own causal chains (column j: row 0's guesses 1..j, then
      column j's lower rows), read off logit rows the window computes anyway: more accepted tokens for no extra
      input token, at the cost of ``(N-2)·W`` more logit rows (the LM head's share of a step, which a GPU does
      not notice and a CPU does). Greedy steps with unadjusted logits only.
    - ``shared_memory``: draw candidates from, and add this decode's output to, the engine's server-wide n-gram
      memory (``decoding.proposers.ngram_memory.NGramMemory``) when the engine has one; False opts this decode out of
      both.
    - ``runner_up`` (0..``MAX_TOP_TOKENS``, 0 = off): the ``decoding.proposers.runner_up`` source: the tokens the
      model ranked best at the row that chose ``last`` are guessed as the token after it (LogitSpec), each
      continued from the context; this many of them.
    - ``recycled`` (0..``MAX_TOP_TOKENS``, 0 = off): the ``decoding.proposers.recycled`` source: every row a step
      reads leaves its input token's top ``recycled`` next tokens in a table, and a tree of them grown from
      ``last`` is guessed (Token Recycling).
    - ``recycled_tree`` (0..256): the recycled tree's shape. 0: ``recycled`` children of ``last``, 2 under each,
      then 1, down to N-1 tokens. n > 0: the n nodes likeliest to be accepted, grown best first by each successor
      rank's measured odds, up to ``decoding.proposers.recycled.TREE_DEPTH`` tokens deep (past N-1). Either way
      its root-to-leaf paths are guesses within G, ahead of the pool's.
    - ``jump_forward``: the ``decoding.proposers.jump`` source: with a grammar, the tokens it forces next (a JSON
      key, closing brackets) are offered as a guess.
    """

    window_size: int = 5
    ngram_size: int = 4
    guess_set_size: int = 5
    prompt_pool: bool = True
    output_pool: bool = True
    align_window: bool = True
    lazy_window: bool = False
    break_even: float = 0.0
    rank_by_context: bool = True
    copy_length: int = 0
    copy_min_match: int = 5
    copy_candidates: int = 1
    copy_stretch: int = 1
    window_chains: bool = False
    shared_memory: bool = True
    runner_up: int = 0
    recycled: int = 0
    recycled_tree: int = 0
    jump_forward: bool = True

    @property
    def levels(self) -> int:
        """Rows of the window: N - 1."""
        return self.ngram_size - 1

    @property
    def step_tokens(self) -> int:
        """Input tokens of the largest step: (N-1)·(W+G), plus ``recycled_tree`` (with ``recycled``), plus up to
        2·copy_candidates copies of copy_length (the context's and the shared memory's), the best of each stretched
        to ``copy_stretch`` times that."""
        copies = 2 * (self.copy_candidates + self.copy_stretch - 1) * self.copy_length
        tree = self.recycled_tree if self.recycled else 0  # a best-first tree's paths may reach past N-1 tokens
        return self.levels * (self.window_size + self.guess_set_size) + tree + copies + (1 if copies else 0)

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` if W, N or G is out of range or the step would be absurdly large."""
        for name, (low, high) in LOOKAHEAD_BOUNDS.items():
            _check_range(name, getattr(self, name), low, high)
        _check_range("runner_up", self.runner_up, 0, MAX_TOP_TOKENS)
        _check_range("recycled", self.recycled, 0, MAX_TOP_TOKENS)
        if not math.isfinite(self.break_even) or not 0.0 <= self.break_even <= self.levels:
            raise InvalidParameterError("break_even", f"break_even must be in [0, N-1], got {self.break_even}")
        if self.step_tokens > MAX_STEP_TOKENS:
            raise InvalidParameterError(
                "lookahead",
                f"{self.step_tokens} input tokens per step ((N-1)*(W+G) and copies) exceeds {MAX_STEP_TOKENS}",
            )


def draw_seed() -> int:
    """A fresh random int64 seed, for a sampled decode whose request gave none (reported, so it can be replayed)."""
    return random.SystemRandom().randrange(-(1 << 63), 1 << 63)


def _check_range(name: str, value: int, low: int, high: int) -> None:
    """Raise ``InvalidParameterError`` unless ``value`` is an int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidParameterError(name, f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_float(name: str, value: float, low: float, high: float) -> None:
    """Raise ``InvalidParameterError`` unless ``value`` is a finite number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise InvalidParameterError(name, f"{name} must be in [{low:g}, {high:g}], got {value!r}")
