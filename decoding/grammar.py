"""Grammar-constrained decoding: what a request's output must match, and the per-decode state that enforces it.

Contract:
- ``Grammar`` (defined in ``decoding.params``, which imports no torch) is plain data that crosses the
  server/decoding boundary: ``kind`` ``"json_schema"`` (``source``
  a JSON schema as text; ``{"type": "object"}`` for any JSON object), ``"lark"`` (llguidance's Lark dialect,
  which may embed ``%json {...}`` schemas) or ``"regex"``. A schema's JSON allows bounded whitespace only
  (``JSON_WHITESPACE``).
- ``GrammarCompiler(tokenizer, vocab_size)`` is built once per loaded model. ``check(grammar)`` raises
  ``GrammarError`` with a readable message when the grammar cannot be used (a bad schema, an unsupported
  keyword, a syntax error); ``constraint(grammar)`` returns a fresh ``Constraint`` for one decode.
- ``Constraint`` follows the committed output: ``consume(tokens)`` after each commit. ``mask(scores)`` sets
  every token the grammar forbids next to ``-inf`` (once the grammar is complete only EOS stays allowed);
  ``valid_prefix(tokens)`` says how many of a guess's tokens the grammar allows from the current state, without
  moving it; ``advance(token)`` / ``retreat(count)`` move it along a path being verified and back.
- A grammar's ``numbers`` (``NumberBounds``) bound the digits of JSON numbers on top of llguidance's masks
  (which cannot count digits): the constraint follows the output's JSON lexical state (in a string or not, in
  which part of a number and how many digits so far) token by token, and forbids a token that would take a
  number past a bound. Where a bound cannot be met (a schema's minimum needs more digits) it gives way.

Masks come from llguidance (see ``docs/design.md``, "Structured output"): no dependencies, a compile of about 2 ms
per schema and a median of about 80 us per mask, unpacked (``python -m bench.structured``, this project's 2-core
CPU, a JSON schema over the 49152-token SmolLM2 vocabulary), and ``validate_tokens`` / ``rollback``, which is
what multi-token verification needs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from decoding.errors import GrammarError
from decoding.params import ANY_JSON_OBJECT, JSON_WHITESPACE, Grammar, NumberBounds

__all__ = ["ANY_JSON_OBJECT", "Constraint", "ConstraintViolation", "Grammar", "GrammarCompiler", "GrammarError"]

COMPILED_GRAMMARS = 64  # compiled grammars a compiler keeps (a check, then its request's constraint, reuse one)
DIGITS = frozenset("0123456789")
# A JSON number's part the output is in (NONE: not in a number), as ``_lex`` follows it.
NONE, INTEGER, FRACTION, EXPONENT = range(4)
# The output's JSON lexical state: (in a string, right after a backslash in it, number part, digits in that part).
LexState = tuple[bool, bool, int, int]
START: LexState = (False, False, NONE, 0)


def _lex(state: LexState, text: str, bounds: NumberBounds) -> tuple[LexState, bool]:
    """The state after ``text`` and whether no number in it went past ``bounds`` (an exponent counts against
    ``integer_digits``). Characters outside strings that are not part of a number end it.

    >>> _lex(START, '{"a": -12.5', NumberBounds(2, 2))
    ((False, False, 2, 1), True)
    >>> _lex(START, '{"a1234": 123', NumberBounds(2, 2))[1]
    False
    """
    in_string, escaped, part, digits = state
    within = True
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char in DIGITS:
            part, digits = (part or INTEGER), digits + 1
            limit = bounds.fraction_digits if part == FRACTION else bounds.integer_digits
            within = within and not (limit and digits > limit)
        elif char == "-" and part == NONE:
            part, digits = INTEGER, 0
        elif char == "." and part == INTEGER:
            part, digits = FRACTION, 0
        elif char in "eE" and part in (INTEGER, FRACTION):
            part, digits = EXPONENT, 0
        elif not (char in "+-" and part == EXPONENT):
            part, digits = NONE, 0
            in_string = char == '"'
    return (in_string, escaped, part, digits), within


class Lexicon:
    """Each token's text and which tokens can touch a number: those with a digit, and those that close a string
    and have a digit after the quote (built once per vocabulary)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self.digit = torch.tensor([any(char in DIGITS for char in text) for text in self.texts], dtype=torch.bool)
        self.leaves_string = torch.tensor(
            ['"' in text and any(char in DIGITS for char in text.split('"', 1)[1]) for text in self.texts],
            dtype=torch.bool,
        )

class GrammarCompiler:
    """Turns ``Grammar`` values into constraints over one tokenizer's vocabulary (module contract)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._matchers: dict[Grammar, Any] = {}  # compiled grammars, least recently used first
        self._lock = threading.Lock()  # checks run on request threads, constraints on the worker's

    @functools.cached_property
    def _lexicon(self) -> Lexicon:
        """Every token's text, for grammars that bound numbers (built on the first such grammar)."""
        texts = self._hf_tokenizer.batch_decode([[token] for token in range(len(self._hf_tokenizer))])
        return Lexicon([*texts, *[""] * (self.vocab_size - len(texts))][: self.vocab_size])

    @functools.cached_property
    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on the first grammar (about half a second), so a server
        that never gets one never pays for it."""
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)

    def check(self, grammar: Grammar) -> None:
        """Raise ``GrammarError`` when ``grammar`` cannot be compiled. The compiled grammar is kept (the last
        ``COMPILED_GRAMMARS``), so the decode's ``constraint`` that follows the check does not compile it again."""
        self._compiled(grammar)

    def constraint(self, grammar: Grammar) -> Constraint:
        """A fresh constraint at the start of the output (a copy of the compiled grammar's matcher);
        ``GrammarError`` when the grammar does not compile."""
        matcher = self._compiled(grammar).deep_copy()
        numbers = grammar.numbers if grammar.numbers is not None and any(vars(grammar.numbers).values()) else None
        return Constraint(matcher, self.vocab_size, self._tokenizer.eos_token, numbers,
                          self._lexicon if numbers is not None else None)

    def _compiled(self, grammar: Grammar) -> Any:
        """The matcher of ``grammar`` at the start of the output, compiled once and kept (least recently used
        dropped first); ``GrammarError`` when the grammar does not compile. Never advanced: callers copy it."""
        import llguidance

        with self._lock:
            matcher = self._matchers.pop(grammar, None)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._tokenizer, self._serialised(grammar), log_level=0)
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
        with self._lock:
            self._matchers[grammar] = matcher  # most recently used last
            while len(self._matchers) > COMPILED_GRAMMARS:
                self._matchers.pop(next(iter(self._matchers)))
        return matcher

    @staticmethod
    def _serialised(grammar: Grammar) -> str:
        """llguidance's grammar text for ``grammar``; ``GrammarError`` when a schema is not JSON."""
        import llguidance

        if grammar.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    grammar.source, defaults={"whitespace_pattern": JSON_WHITESPACE}
                )
            except ValueError as error:
                raise GrammarError(f"the schema is not a JSON object: {error}") from error
        if grammar.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(grammar.source)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


class ConstraintViolation(RuntimeError):
    """A token the grammar forbids was moved past: an engine bug (every chosen token is masked), never bad input,
    so it is not a ``DecodingError`` and a server answers it as an internal error."""


class Constraint:
    """One decode's position in its grammar (module contract).

    The end of the output (``eos``, allowed once the grammar is complete) is tracked here and never handed to the
    matcher: llguidance's rollback does not undo a consumed EOS correctly (rolling back over it leaves the matcher
    in a state that refuses the tokens it had accepted), and a verified path may end with EOS before the walk
    retreats. After ``eos`` nothing more is allowed. With ``numbers`` (and the ``lexicon`` of the vocabulary) the
    JSON lexical state after each move is kept on a stack, so ``retreat`` restores it.
    """

    def __init__(
        self, matcher: Any, vocab_size: int, eos: int, numbers: NumberBounds | None = None,
        lexicon: Lexicon | None = None,
    ) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos
        self._ended = False
        self.numbers = numbers if lexicon is not None else None
        self._lexicon = lexicon
        self._states: list[LexState] = [START]

    def allowed(self) -> torch.Tensor:
        """Boolean ``[vocab_size]``: the tokens the grammar allows next (CPU)."""
        if self._ended:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        packed = numpy.frombuffer(self._matcher.compute_bitmask(), dtype=numpy.uint8)
        bits = numpy.unpackbits(packed, bitorder="little")[: self.vocab_size]  # bit i of byte j: token 8j + i
        allowed = torch.from_numpy(bits.astype(bool))
        if self.numbers is not None:
            self._bound_numbers(allowed)
        return allowed

    def _bound_numbers(self, allowed: torch.Tensor) -> None:
        """Clear, in place, the allowed tokens that would take a number past ``numbers`` (none when that would
        leave nothing allowed: the grammar needs the digits)."""
        state, lexicon = self._states[-1], self._lexicon
        touching = allowed & (lexicon.leaves_string if state[0] and not state[1] else lexicon.digit)
        over = [token for token in touching.nonzero().flatten().tolist()
                if not _lex(state, lexicon.texts[token], self.numbers)[1]]
        if over and len(over) < int(allowed.sum()):
            allowed[over] = False

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[vocab]`` (any width >= the grammar's vocabulary) with forbidden tokens at ``-inf``."""
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        allowed[: self.vocab_size] = self.allowed()
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (the state does not move)."""
        if self._ended or not tokens:
            return 0
        tokens = list(tokens)
        end = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
        valid = int(self._matcher.validate_tokens(tokens[:end]))
        if self.numbers is None:
            return valid
        state = self._states[-1]
        for index, token in enumerate(tokens[:valid]):
            state, within = _lex(state, self._lexicon.texts[token] if token != self.eos else "", self.numbers)
            if not within:
                return index
        return valid

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (llguidance's jump-forward tokens: a JSON key, a
        closing bracket), each allowed in turn; none once the output ended. The state does not move."""
        if self._ended or limit <= 0:
            return []
        tokens = [int(token) for token in self._matcher.compute_ff_tokens()][:limit]
        return tokens[: self.valid_prefix(tokens)]

    def advance(self, token: int) -> None:
        """Move past ``token``; ``ConstraintViolation`` when the grammar forbids it."""
        if token == self.eos and not self._ended and self._matcher.is_accepting():
            self._ended = True
        elif self._ended or not self._matcher.consume_token(token):
            raise ConstraintViolation(f"token {token} is not allowed here: {self._matcher.get_error()}")
        if self.numbers is not None:
            text = "" if token == self.eos else self._lexicon.texts[token]
            self._states.append(_lex(self._states[-1], text, self.numbers)[0])

    def consume(self, tokens: Sequence[int]) -> None:
        """Move past each of ``tokens`` (a commit)."""
        for token in tokens:
            self.advance(token)

    def retreat(self, count: int) -> None:
        """Undo the last ``count`` moves."""
        if self.numbers is not None and count:
            del self._states[-count:]
        if count and self._ended:
            self._ended = False
            count -= 1
        if count:
            self._matcher.rollback(count)

    @property
    def complete(self) -> bool:
        """True once the output so far is a whole sentence of the grammar."""
        return self._ended or bool(self._matcher.is_accepting())
