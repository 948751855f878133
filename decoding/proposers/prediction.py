"""The request's prediction as a candidate source (``prediction``): OpenAI's predicted outputs.

Contract: ``PredictionProposer`` keeps the token ids the client expects the output to resemble as a private
``decoding.proposers.ngram_memory.NGramMemory`` document and proposes up to ``copy_candidates`` of its continuations of
``last``, each ``prediction_copy_length`` tokens (at least ``PREDICTION_COPY_LENGTH``, even with copy steps off),
matched on at least ``max(1, copy_min_match)`` tokens; where that length's extra tokens over ``copy_length`` cost a
whole accepted token or more on the step's price (``Context.price``: a CPU), the copies start at ``copy_length`` and
double after each copy accepted whole, up to that length (``Span``). Standalone, gated by its own running mean, so a
wrong prediction stops being verified without turning the request's other sources off. Built only for a non-empty
prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, GatedCopies, Span
from decoding.proposers.ngram_memory import NGramMemory

PREDICTION = "prediction"
PREDICTION_COPY_LENGTH = 32  # the fewest tokens a prediction's copy proposes (see prediction_copy_length)


def prediction_copy_length(lookahead: LookaheadConfig) -> int:
    """Tokens a prediction's copy proposes: at least ``PREDICTION_COPY_LENGTH``, even when copy steps are off
    (``copy_length`` 0), so a prediction is used whenever lookahead is on, and reaches past the context's copies
    of the same text (a prediction is usually in the prompt too)."""
    return max(lookahead.copy_length, PREDICTION_COPY_LENGTH)


class PredictionProposer(GatedCopies):
    """Continuations from the request's predicted output (module contract)."""

    name = PREDICTION
    standalone = True
    in_guess_set = True
    top_k = 0

    def __init__(self, config: LookaheadConfig, prediction: Sequence[int]) -> None:
        full = prediction_copy_length(config)
        super().__init__(float(full), Span(config.copy_length or full, full))
        self.config = config
        self.memory = NGramMemory(max_tokens=len(prediction))
        self.memory.add(prediction)

    def propose(self, context: Context, budget: int) -> Sequence[Draft]:
        """The prediction's continuations of ``last``, while they pay (module contract)."""
        config = self.config
        full = prediction_copy_length(config)
        cheap = context.price(full) - context.price(self.span.base) < 1.0
        found = self.memory.candidates(context.tokens, full if cheap else self.span.length,
                                       min(budget, config.copy_candidates), max(1, config.copy_min_match))
        return self.gated(context, found)
