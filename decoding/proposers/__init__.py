"""Candidate sources for lookahead steps, one module each, and the registry that builds a decode's set.

Contract: ``PROPOSERS`` maps each source's name to its factory, in the order their drafts are merged (standalone
sources' drafts first, in this order, then the others'); a factory takes the decode's ``LookaheadConfig``, its
``Context`` and ``Inputs`` (the shared memory, the request's prediction) and returns the proposer, or None where
its config entry is off or its input absent. ``build_proposers`` runs them all; the Jacobi window's proposer
(``pool``) is always built, since the step's lookahead branch is its window. ``extra_step_tokens`` is the input
tokens a step may need beyond ``LookaheadConfig.step_tokens`` (a prediction's copies), for the cache's size.

Adding a source: one module with a class that meets ``Proposer`` (``decoding.proposers.base``), one entry here,
and one ``LookaheadConfig`` field (on or off, and its size) when it needs one. The step never changes.

The proposers room sits below the step room (``decoding.step``, which asks it for drafts) and above the forward and
weights rooms; its modules import one another, the rooms below and the top-level ground (``decoding.params``,
``decoding.errors``, ``decoding.grammar``), nothing above (``tests/test_layering.py``).

Modules:

- the seam, ``base``: ``Proposer``, ``Context``, ``Draft``, ``Outcome`` and the gate that decides when a source pays;
- the sources, one module each, in the registry's order: ``jump`` (the tokens a grammar forces), ``copies`` (the
  context's own continuations), ``memory`` (the shared n-gram memory's), ``prediction`` (the request's predicted
  output's), ``recycled`` (the top next tokens of the rows steps read, recycled), ``jacobi`` (``pool``: the Jacobi
  window and its n-gram pool), ``runner_up`` (the next-best tokens of the row that chose ``last``);
- what the sources read: ``window`` (the 2-D Jacobi window, and the layout of a lookahead step around it), ``pool``
  (``NGramPool``, the window's n-grams keyed by the token before them; ``ContextIndex``, where each token occurs in
  the text so far), ``ngram_memory`` (``NGramMemory``: the server-wide memory of recent completions and corpora, its
  usage, and its file).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decoding.grammar import Constraint
from decoding.params import LookaheadConfig
from decoding.proposers.base import Context, Draft, Gate, Outcome, Proposer, Span
from decoding.proposers.copies import COPY, CopyProposer
from decoding.proposers.jacobi import POOL, JacobiProposer
from decoding.proposers.jump import JUMP, JumpProposer
from decoding.proposers.memory import MEMORY, MemoryProposer
from decoding.proposers.ngram_memory import NGramMemory
from decoding.proposers.prediction import (
    PREDICTION,
    PREDICTION_COPY_LENGTH,
    PredictionProposer,
    prediction_copy_length,
)
from decoding.proposers.recycled import RECYCLED, RecycledProposer
from decoding.proposers.runner_up import RUNNER_UP, RunnerUpProposer

__all__ = [
    "COPY", "JUMP", "MEMORY", "POOL", "PREDICTION", "PREDICTION_COPY_LENGTH", "PROPOSERS", "RECYCLED", "RUNNER_UP",
    "Context", "Draft", "Gate", "Inputs", "JacobiProposer", "Outcome", "Proposer", "Span", "build_proposers",
    "extra_step_tokens", "prediction_copy_length",
]


@dataclass(frozen=True)
class Inputs:
    """What a decode hands its sources beside its context: the shared ``memory`` (None: off or opted out), the
    request's ``prediction`` (token ids; None or empty: none), its grammar's ``constraint`` (None: none) and a
    ``successors`` table the recycled source shares with the engine's other decodes (None: its own)."""

    memory: NGramMemory | None = None
    prediction: Sequence[int] | None = None
    constraint: Constraint | None = None
    successors: dict[int, tuple[int, ...]] | None = None


Factory = Callable[[LookaheadConfig, Context, Inputs], "Proposer | None"]

PROPOSERS: dict[str, Factory] = {
    JUMP: lambda config, context, inputs: (
        JumpProposer(config, inputs.constraint) if config.jump_forward and inputs.constraint is not None else None),
    COPY: lambda config, context, inputs: (
        CopyProposer(config) if config.copy_length and config.rank_by_context else None),
    MEMORY: lambda config, context, inputs: (
        MemoryProposer(config, inputs.memory) if inputs.memory is not None else None),
    PREDICTION: lambda config, context, inputs: (
        PredictionProposer(config, inputs.prediction) if inputs.prediction else None),
    RECYCLED: lambda config, context, inputs: (
        RecycledProposer(config, inputs.successors) if config.recycled else None),
    POOL: lambda config, context, inputs: JacobiProposer(config, context),
    RUNNER_UP: lambda config, context, inputs: RunnerUpProposer(config) if config.runner_up else None,
}


def build_proposers(
    config: LookaheadConfig, context: Context, inputs: Inputs, registry: dict[str, Factory] | None = None
) -> list[Proposer]:
    """The decode's proposers, in ``registry``'s order (``PROPOSERS`` by default), those whose factory returned
    None left out; a registry without ``pool`` gets the Jacobi window's proposer last."""
    registry = PROPOSERS if registry is None else registry
    built = [factory(config, context, inputs) for factory in registry.values()]
    proposers = [proposer for proposer in built if proposer is not None]
    if not any(isinstance(proposer, JacobiProposer) for proposer in proposers):
        proposers.append(JacobiProposer(config, context))
    return proposers


def extra_step_tokens(config: LookaheadConfig, prediction: Sequence[int] | None) -> int:
    """Input tokens a step may take beyond ``config.step_tokens``: a prediction's copies and their root."""
    return config.copy_candidates * prediction_copy_length(config) + 1 if prediction else 0
