"""The lookahead step: drafts from the proposers -> token tree -> fit to the budget -> verify -> KV commit -> feedback.

Contract: ``LookaheadStep`` plans and finishes the steps of one lookahead decode after its prefill. It knows no
candidate source: each step (``propose(cost)``, ``cost`` the batch policy's step-cost curve or None) it asks the
standalone proposers (``decoding.proposers``: copies, the shared memory, the prediction), then, unless a lazy-window
step verifies those alone, the others (the Jacobi window's pool, ...) for drafts, each proposer told the price of more
tokens at that point of the step (``Context.price``: ``decoding.step.drafts.step_price`` of what the step holds so far,
free without a curve), cuts every draft before the first token a grammar forbids, merges them into one token tree beside
the Jacobi window's rows (``decoding.proposers.window.step_layout``), shrinks that to the batch's token budget
(candidates last first, then the window: a verification-only step, then a plain one), verifies the tree (and the
window's own chains, with ``window_chains``) against the model's choices (``decoding.step.verify``), commits the
accepted run (``SequenceState.accept``), keeps the KV of the committed path (``SlotCache.commit``), feeds the window its
new row, and tells every proposer what happened (``Outcome``: how far its verified drafts reached). Greedy output equals
the plain loop's whatever the drafts; a sampled step is the same walk over the sampled rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import torch

from decoding.forward.choice import RowIds, greedy_ids, top_ids
from decoding.forward.slices import Slice
from decoding.params import LookaheadConfig, SamplingParams
from decoding.proposers import COPY, MEMORY, POOL, PREDICTION, Context, Draft, JacobiProposer, Outcome, Proposer
from decoding.proposers.base import common_prefix
from decoding.proposers.window import step_layout, window_chains, window_logit_row
from decoding.step.drafts import Gathered, Shape, gather
from decoding.step.logits import adjust_logits, needs_adjusting
from decoding.step.sampling import SampledRows, row_chooser
from decoding.step.steps import (
    Finisher,
    Proposal,
    SequenceState,
    Step,
    StepStats,
    finish_one_token,
    one_token_slice,
    step_logprobs,
)
from decoding.step.tree import TokenTree
from decoding.step.verify import ChosenRows, Verdict, verify_constrained, verify_greedy, verify_tree


@dataclass(frozen=True)
class _Chains:
    """The window's causal chains a step verifies beside its tree: each as window indices and as tokens."""

    indices: tuple[tuple[int, ...], ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()


PLAIN = Shape(False)  # a step that verifies nothing: one token, no window (one shape: its empty tree built once)


class LookaheadStep:
    """Steps of one lookahead decode (module contract); ``proposers`` must hold one ``JacobiProposer``."""

    def __init__(self, sequence: SequenceState, sampling: SamplingParams, config: LookaheadConfig,
                 context: Context, proposers: Sequence[Proposer]) -> None:
        self.sequence, self.sampling, self.config, self.context = sequence, sampling, config, context
        self.proposers = list(proposers)
        self.jacobi = next(proposer for proposer in self.proposers if isinstance(proposer, JacobiProposer))
        self.top_k = max(proposer.top_k for proposer in self.proposers)  # top tokens per row to hand back (0: none)
        self._standalone = [proposer for proposer in self.proposers if proposer.standalone]
        self._others = [proposer for proposer in self.proposers if not proposer.standalone]
        self._wanted = PLAIN

    def propose(self, cost: Callable[[int], float] | None = None) -> Proposal:
        """Gather this step's drafts, priced on ``cost`` (a forward's relative cost by input tokens; None: drafts
        are free and the gates' ``break_even`` alone decides), and decide whether to verify them; say how many
        tokens that takes."""
        config = self.config
        base = 1 if config.lazy_window else 1 + self.jacobi.window_tokens  # a step that is not lazy runs the window
        drafts = self._gather(True, None, cost, base, Gathered())
        copied = len(drafts)
        if copied and config.lazy_window:
            copies = self._wanted = drafts.shape(False)
            return Proposal(1 + len(copies.tree), copies.gain, copies.gain < config.break_even, smallest=2)
        self._gather(False, config.guess_set_size, cost, base, drafts)
        window = len(drafts) > copied or self.jacobi.wants_window
        if not window and not len(drafts):
            self._wanted = PLAIN
            return Proposal(1)
        shape = self._wanted = drafts.shape(window)
        tokens = (self.jacobi.window_tokens if window else 1) + len(shape.tree)
        if not shape.candidates:
            return Proposal(tokens)
        smallest = 2 if copied else 1 + config.levels
        return Proposal(tokens, shape.gain, shape.gain < config.break_even, smallest=smallest)

    def plan(self, budget: int) -> tuple[Slice, Finisher]:
        """The proposed step, shrunk to ``budget`` tokens and to the room left in the cache (a source's drafts can
        never overflow it)."""
        cache = self.sequence.cache
        shape = self._fit(self._wanted, min(budget, cache.capacity - cache.length))
        if not shape.window and not shape.candidates:
            return one_token_slice(self.sequence, self.top_k), self._finish_plain
        sequence, last, position = self.sequence, self.sequence.tokens[-1], len(self.sequence.tokens) - 1
        if shape.window:
            width, levels = self.config.window_size, len(self.jacobi.window.rows)
            tokens = self.jacobi.window.input_tokens(last)
        else:
            width, levels, tokens = 1, 1, [last]
        tree = shape.tree
        chains = _chains(self.config, self.sampling, sequence, tokens, width, levels) if shape.window else _Chains()
        layout = step_layout(width, levels, tree.parents, bool(chains.indices))
        tokens += tree.tokens
        positions = [position + offset for offset in layout.offset_values]
        slice_ = Slice(tokens, None, None, None, sequence.cache, layout.parents, positions, layout.row_values,
                       visibility=lambda: layout.visible, top_k=self.top_k)
        row_tokens = [tokens[index] for index in layout.row_values[: 1 + width + len(tree)]]
        return slice_, lambda logits, argmax: self._finish(logits, argmax, shape, width, levels, position, chains,
                                                           row_tokens)

    def _gather(self, standalone: bool, limit: int | None, cost: Callable[[int], float] | None, base: int,
                into: Gathered) -> Gathered:
        """The drafts of the standalone proposers or of the others, after those ``into`` holds
        (``decoding.step.drafts.gather``)."""
        proposers = self._standalone if standalone else self._others
        return gather(proposers, self.context, self.sequence.constraint, self.config.copy_candidates, limit, cost,
                      base, into)

    def _fit(self, shape: Shape, budget: int) -> Shape:
        """Drop candidates (last first), then the window, until the step holds at most ``budget`` tokens; when
        not even the first candidate fits whole, it is shortened to the room left."""
        window_tokens = self.jacobi.window_tokens if shape.window else 1
        tree = shape.tree
        if window_tokens + len(tree) <= budget:
            return shape
        if shape.window and shape.candidates and window_tokens + len(shape.candidates[0]) <= budget:
            return shape.keep(_fitting(tree, budget - window_tokens))
        count = _fitting(tree, budget - 1)
        if count or not shape.candidates or budget < 2:
            return shape.keep(count, window=False)
        return Shape(False, (shape.candidates[0][: budget - 1],), shape.sources[:1], shape.offered, shape.gain)

    def _finish_plain(self, logits: torch.Tensor, argmax: Sequence[int] | None = None) -> Step:
        """A plain one-token step: the window only re-aligns."""
        last = self.sequence.tokens[-1]
        step = finish_one_token(self.sequence, self.sampling, logits, argmax)
        self.jacobi.skip(step.stats.committed)
        self._tell(Outcome(step.stats.committed, **_top(logits, argmax, self.top_k, [last], [0])), {})
        return step

    def _finish(self, logits: torch.Tensor, argmax: Sequence[int] | None, shape: Shape, width: int, levels: int,
                position: int, chains: _Chains, row_tokens: Sequence[int]) -> Step:
        """Verify the tree (and the window's chains), commit, fix up the KV cache, feed the window and the
        proposers."""
        sequence, tree, in_tree = self.sequence, shape.tree, len(shape.candidates)
        last, window_tokens = sequence.tokens[-1], levels * width

        def candidate_row(candidate: int, k: int) -> int:
            if candidate < in_tree:
                return 1 + width + tree.path(candidate)[k]
            return window_logit_row(chains.indices[candidate - in_tree][k], width, levels, len(tree))

        verified = [*shape.candidates, *chains.tokens]
        scores = _adjust(logits, self.sampling, sequence, tree, width)
        predicted = _chosen(self.sampling, sequence, scores, argmax if scores is logits else None, tree, width, levels)
        verdict = _verify(self.sampling, sequence, scores, predicted, tree, chains.tokens, candidate_row, width)
        committed = sequence.accept(verdict.tokens)
        slots: Sequence[int] = ()
        if verdict.candidate is not None:
            slots = ([window_tokens + node for node in tree.path(verdict.candidate)] if verdict.candidate < in_tree
                     else chains.indices[verdict.candidate - in_tree])
        _commit_cache(sequence, position, slots, len(committed))
        if shape.window:
            if isinstance(predicted, SampledRows):
                predicted.prefetch(range(1, 1 + width))
            stops = sequence.stop.stop_token_ids
            new_row = [self.jacobi.window.filler() if token in stops else token
                       for token in (predicted[row] for row in range(1, 1 + width))]
            self.jacobi.advance(last, new_row, len(committed))
        else:
            self.jacobi.skip(len(committed))
        accepted_run = tuple(verdict.tokens[: verdict.num_accepted])
        rows = [0] + ([candidate_row(verdict.candidate, k) for k in range(verdict.num_accepted)]
                      if verdict.candidate is not None else [])
        reach = _reach(shape.offered, verified, [*shape.sources, *[POOL] * len(chains.tokens)], accepted_run,
                       tree.index if not chains.tokens else None)
        self._tell(Outcome(len(committed), accepted_run, **_top(logits, argmax, self.top_k, row_tokens, rows)), reach)
        accepted, depth = min(verdict.num_accepted, len(committed)), max(map(len, verified), default=0)
        stats = StepStats(window_tokens + len(tree), len(committed), depth, accepted,
                          tuple(k < accepted for k in range(depth)), **_exclusive(reach, accepted),
                          sources=tuple((name, offered, min(far, accepted)) for name, (offered, far) in
                                        sorted(reach.items())))
        return Step(committed, stats, sequence.finish_reason,
                    step_logprobs(logits, rows, sequence.chosen(committed), self.sampling),
                    stop_token=sequence.stop_token)

    def _tell(self, outcome: Outcome, reach: dict[str, tuple[int, int]]) -> None:
        """Index the new output (when it is a source), then hand each proposer the outcome with its own reach."""
        if self.config.output_pool and self.config.rank_by_context:
            self.context.index.extend(self.sequence.tokens, len(self.sequence.tokens) - 1)
        for proposer in self.proposers:
            far = reach.get(proposer.name)
            own = None if far is None else far[1]
            heard = outcome if own == outcome.reach else Outcome(outcome.committed, outcome.accepted, own,
                                                                 outcome.successors, outcome.runners_up)
            proposer.feedback(self.context, heard)


def _top(logits: torch.Tensor, ids: Sequence[int] | None, k: int, row_tokens: Sequence[int],
         path: Sequence[int]) -> dict[str, tuple]:
    """``Outcome``'s ``successors`` (each read row's input token and top-``k`` next tokens) and ``runners_up`` (the
    top-k of ``path[-1]``, the row that chose the new ``last``), when a proposer asks for them (``k`` > 0): from
    ``ids`` when the forward read them with its argmax (``RowIds``), else off the logits."""
    if not k:
        return {}
    k = min(k, logits.shape[-1])
    last_row = path[-1]  # a window chain's row lies past the tree's
    top = ids.top(k) if isinstance(ids, RowIds) else None
    if top is not None:
        successors, runners_up = top[: len(row_tokens)], top[last_row]
    else:
        successors = list(map(tuple, top_ids(logits[: len(row_tokens)], k)))
        runners_up = (successors[last_row] if last_row < len(successors)  # else read it on its own
                      else tuple(top_ids(logits[last_row : last_row + 1], k)[0]))
    return {"successors": tuple(zip(row_tokens, successors, strict=True)), "runners_up": runners_up}


def _chains(config: LookaheadConfig, sampling: SamplingParams, sequence: SequenceState, tokens: Sequence[int],
            width: int, levels: int) -> _Chains:
    """The window's causal chains (``decoding.proposers.window.window_chains``) over this step's window ``tokens``, when
    ``window_chains`` is on and the step verifies greedily with unadjusted logits (no grammar, no logit
    processors: the chains' rows are read as they are, and sampling verification needs candidates that agree
    on a prefix to read the same rows)."""
    if not config.window_chains or not sampling.greedy or sequence.constraint is not None \
            or needs_adjusting(sampling, sequence.stop, sequence.generated):
        return _Chains()
    indices = window_chains(width, levels)
    return _Chains(indices, tuple(tuple(tokens[index] for index in chain) for chain in indices))


def _chosen(sampling: SamplingParams, sequence: SequenceState, scores: torch.Tensor, argmax: Sequence[int] | None,
            tree: TokenTree, width: int, levels: int) -> ChosenRows:
    """The token the plain loop would choose at each row of a step: the argmax ids (``argmax`` when the
    forward gave them for these very scores), or, when sampling, each row's sample at the output index it
    predicts: ``last``'s row the next index, a tree node's its depth past that, bottom window row column j's
    ``levels + j - 1`` past it (the window then converges on the sampled text, as on the greedy one)."""
    if sampling.greedy:
        return list(argmax) if argmax is not None else greedy_ids(scores)
    first = sequence.generated
    indices = {0: first}
    indices.update({1 + column: first + levels + column - 1 for column in range(width)})
    indices.update({1 + width + node: first + depth for node, depth in enumerate(tree.depths)})
    return SampledRows(scores, sampling, sequence.seed, indices)


def _verify(sampling: SamplingParams, sequence: SequenceState, logits: torch.Tensor, predicted: ChosenRows,
            tree: TokenTree, chains: Sequence[Draft], candidate_row: Callable[[int, int], int], width: int) -> Verdict:
    """The greedy walk over the chosen rows: down the tree (``verify_tree``), then along the window's ``chains``
    (candidates after the tree's: one wins only when it accepts more); under a grammar, the walk over every
    candidate that masks each row it reaches."""
    constraint = sequence.constraint
    if constraint is not None:
        choose = row_chooser(sampling, sequence.seed, sequence.generated)
        return verify_constrained(logits, [*tree.candidates, *chains], candidate_row, constraint, choose)
    verdict = verify_tree(predicted, tree, lambda node: 1 + width + node)
    if chains:
        first = len(tree.candidates)
        chained = verify_greedy(predicted, chains, lambda chain, k: candidate_row(first + chain, k))
        if chained.num_accepted > verdict.num_accepted:
            return Verdict(first + chained.candidate, chained.num_accepted, chained.tokens)
    return verdict


def _adjust(logits: torch.Tensor, sampling: SamplingParams, sequence: SequenceState, tree: TokenTree,
            width: int) -> torch.Tensor:
    """``logits`` with ``last``'s row (0) and every tree node's row (``1 + width + node``) adjusted after the
    committed tokens plus the node's path (``decoding.step.logits``); the window's rows (guesses only) as they
    are. The same tensor when nothing adjusts logits."""
    if not needs_adjusting(sampling, sequence.stop, sequence.generated):
        return logits
    rows = [0, *(1 + width + node for node in range(len(tree)))]
    scores = logits.float().clone()
    scores[rows] = adjust_logits(logits[rows], sampling, sequence.stop, sequence.tokens, sequence.prompt_length,
                                 [(), *tree.node_paths()])
    return scores


def _commit_cache(sequence: SequenceState, position: int, slots: Sequence[int], committed: int) -> None:
    """KV fix-up: keep the old prefix, ``last`` and the winning candidate's tokens that stay committed.

    The cache must hold every committed token except the new ``last``: that is the old ``last`` (slot
    ``position``) when at least one token was committed, plus the winning candidate's first committed-1
    tokens, whose step slots (offsets from ``position``: tree nodes or window tokens) are ``slots``.
    """
    sources: list[int] = [position] if committed >= 1 else []
    sources.extend(position + slot for slot in slots[: max(0, committed - 1)])
    sequence.cache.commit(position, sources)


def _fitting(tree: TokenTree, room: int) -> int:
    """How many leading candidates of ``tree`` fit, merged into one token tree, in ``room`` tokens."""
    return bisect.bisect_right(tree.prefix_sizes(), room)


def _reach(offered: Sequence[tuple[str, Sequence[Draft]]], verified: Sequence[Draft], sources: Sequence[str],
           accepted: Sequence[int], prefixes: Container[Draft] | None = None) -> dict[str, tuple[int, int]]:
    """Per source with a verified draft: ``(offered, reach)``, the longest of its drafts that were verified (its
    own, or merged into another's as a prefix of it) and how many of the ``accepted`` tokens they proposed.
    ``prefixes``: every prefix of the ``verified`` drafts (their token tree's ``index``), made here when None.

    >>> _reach([("copy", [(1, 2)]), ("memory", [(1,)])], [(1, 2), (5, 6)], ["copy", "pool"], [1, 2, 3])
    {'copy': (2, 2), 'pool': (2, 0), 'memory': (1, 1)}
    """
    runs: dict[str, list[Sequence[int]]] = {}
    own: dict[str, set[int]] = {}  # the ids of each source's verified drafts: offered again, they need no lookup
    for draft, source in zip(verified, sources, strict=True):
        runs.setdefault(source, []).append(draft)
        own.setdefault(source, set()).add(id(draft))
    if prefixes is None:
        prefixes = {tuple(draft[:end]) for draft in verified for end in range(1, len(draft) + 1)}
    for source, drafts in offered:
        verified_ids = own.get(source, ())
        merged = [draft for draft in drafts if id(draft) not in verified_ids and draft in prefixes]
        if merged:
            runs.setdefault(source, []).extend(merged)
    return {source: (max(map(len, drafts)), _deepest(drafts, accepted)) for source, drafts in runs.items() if drafts}


def _deepest(drafts: Sequence[Draft], accepted: Sequence[int]) -> int:
    """The most leading tokens any of ``drafts`` shares with ``accepted`` (a draft no longer than the best so far,
    or missing its first token, as most do, is not compared).

    >>> _deepest([(1, 2), (1, 3, 4), (5,)], [1, 3, 7])
    2
    """
    best, most = 0, len(accepted)
    first = accepted[0] if accepted else None
    for draft in drafts:
        if len(draft) > best and draft[0] == first:
            best = max(best, common_prefix(draft, accepted))
            if best == most:
                break
    return best


def _exclusive(reach: dict[str, tuple[int, int]], accepted: int) -> dict[str, int]:
    """``memory_accepted`` and ``prediction_accepted``: the accepted guesses the shared memory, then the
    prediction, proposed beyond what the step's other drafts did."""
    far = {source: value[1] for source, value in reach.items()}
    others = max(far.get(COPY, 0), far.get(POOL, 0))
    memory = min(accepted, max(0, far.get(MEMORY, 0) - others))
    prediction = min(accepted, max(0, far.get(PREDICTION, 0) - max(others, far.get(MEMORY, 0))))
    return {"memory_accepted": memory, "prediction_accepted": prediction}
