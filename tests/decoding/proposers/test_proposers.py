"""The proposer seam: a source defined here plugs into the lookahead step through the registry alone, its
drafts are counted per source, and greedy output stays the plain loop's with it, alone and batched."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from decoding.batch import BatchEngine, BatchPolicy
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers import PROPOSERS, Context, Gate, Outcome
from decoding.proposers.base import break_even, free
from decoding.proposers.copies import CopyProposer
from decoding.proposers.ngram_memory import NGramMemory
from decoding.proposers.pool import ContextIndex
from decoding.proposers.recycled import RecycledProposer
from decoding.step.stream import DecodeStream, StepCounts, generate_autoregressive
from tests.decoding.stubs import cycle_model

PROMPTS = [
    [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
    [42],
    [3, 3, 3, 3, 3, 3, 8, 3, 3],
]
GRID = list(itertools.product([1, 3], [2, 4], [0, 2]))


class Counting:
    """A toy source: guesses that the text counts up by one (mod ``period``), ``length`` tokens at a time; right
    on ``cycle_model``, mostly wrong on a random model. It keeps its own gate and remembers what it heard."""

    name = "counting"
    top_k = 0
    in_guess_set = True

    def __init__(self, standalone: bool, period: int = 8, length: int = 6) -> None:
        self.standalone, self.period, self.length = standalone, period, length
        self.gate = Gate(1.0)
        self.heard: list[Outcome] = []

    @property
    def expected(self) -> float:
        return self.gate.expected

    def propose(self, context: Context, budget: int) -> Sequence[tuple[int, ...]]:
        if budget <= 0:
            return ()
        return [tuple((context.last + k) % self.period for k in range(1, self.length + 1))]

    def feedback(self, context: Context, outcome: Outcome) -> None:
        self.heard.append(outcome)
        if outcome.reach is not None:
            self.gate.update(outcome.reach)


def with_counting(standalone: bool, made: list[Counting] | None = None) -> dict:
    """The default registry plus the toy source (each built source appended to ``made``)."""

    def build(config, context, inputs):
        source = Counting(standalone)
        if made is not None:
            made.append(source)
        return source

    return {**PROPOSERS, "counting": build}


def tokens_of(steps) -> list[int]:
    return [token for step in steps for token in step.token_ids]


@pytest.mark.parametrize("standalone", [True, False], ids=["standalone", "joins-window"])
@pytest.mark.parametrize("window_size, ngram_size, guess_set_size", GRID)
def test_a_new_source_keeps_greedy_output_over_the_grid(tiny_model, window_size, ngram_size, guess_set_size,
                                                        standalone):
    config = LookaheadConfig(window_size, ngram_size, guess_set_size, lazy_window=standalone)
    stop = StopCriteria(max_tokens=30)
    for prompt in PROMPTS:
        expected = tokens_of(generate_autoregressive(tiny_model, prompt, stop))
        stream = DecodeStream(tiny_model, prompt, stop, lookahead=config, proposers=with_counting(standalone))
        assert tokens_of(stream) == expected


@pytest.mark.parametrize("standalone", [True, False], ids=["standalone", "joins-window"])
def test_a_new_source_is_used_counted_and_hears_back(standalone):
    model = cycle_model(period=8)
    prompt = [5, 3, 0, 2]  # no n-gram of the prompt continues the count
    config = LookaheadConfig(1, 2, 1, lazy_window=standalone, prompt_pool=False, output_pool=False)
    stop = StopCriteria(max_tokens=40)
    made: list[Counting] = []
    steps = list(DecodeStream(model, prompt, stop, lookahead=config, proposers=with_counting(standalone, made)))
    plain = list(DecodeStream(model, prompt, stop, lookahead=config))
    assert tokens_of(steps) == tokens_of(plain) == [(3 + k) % 8 for k in range(40)]
    assert len(steps) < len(plain) / 3  # 6 guesses + 1 token a step where the window alone gets 1 or 2
    counts = sum((step.stats.counts() for step in steps), StepCounts())
    offered, accepted = counts.source("counting")
    assert accepted >= 30 and offered >= accepted and accepted <= counts.accepted
    (source,) = made
    assert len(source.heard) == len(steps) - 1  # every step after the prefill
    for step, outcome in zip(steps[1:], source.heard, strict=True):
        taken = StepCounts(sources=step.stats.sources).source("counting")[1]
        assert outcome.committed == step.stats.committed
        # what it heard is what it was credited, but for the last step, whose run max_tokens cut
        assert (outcome.reach or 0) == taken or (step.finish_reason == "length" and (outcome.reach or 0) > taken)


def test_a_new_source_keeps_greedy_output_batched(tiny_model):
    configs = [LookaheadConfig(2, 4, 2), LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1),
               LookaheadConfig(4, 3, 0), None]
    stop = StopCriteria(max_tokens=30)
    expected = [tokens_of(generate_autoregressive(tiny_model, prompt, stop)) for prompt in PROMPTS]
    for standalone in (True, False):
        engine = BatchEngine(tiny_model, BatchPolicy(max_step_tokens=24, prefill_chunk=4),
                             open_stream=functools.partial(DecodeStream, proposers=with_counting(standalone)))
        for index, (prompt, config) in enumerate(zip(PROMPTS, configs, strict=True)):
            engine.add(index, prompt, stop, SamplingParams(), config)
        outputs: dict[int, list[int]] = {index: [] for index in range(len(PROMPTS))}
        while engine.has_work:
            for request_id, step in engine.step():
                assert not isinstance(step, BaseException), step
                outputs[request_id].extend(step.token_ids)
        assert [outputs[index] for index in range(len(PROMPTS))] == expected


def test_drafts_longer_than_the_cache_has_room_for_are_cut_to_fit():
    """A source whose drafts run past the step's reserved room cannot overflow the cache: the step fits them."""
    model = cycle_model(period=8)
    config = LookaheadConfig(1, 2, 1, lazy_window=True, prompt_pool=False, output_pool=False)

    def build(config, context, inputs):
        return Counting(True, length=64)

    stop = StopCriteria(max_tokens=50)
    steps = list(DecodeStream(model, [5, 3, 0, 2], stop, lookahead=config, proposers={**PROPOSERS, "long": build}))
    assert tokens_of(steps) == [(3 + k) % 8 for k in range(50)]


@pytest.mark.parametrize("sources", [dict(runner_up=4), dict(recycled=4), dict(runner_up=3, recycled=8),
                                     dict(runner_up=2, recycled=2, window_chains=True, copy_length=8),
                                     dict(recycled=8, recycled_tree=24), dict(recycled=3, recycled_tree=40,
                                                                              copy_length=8, window_chains=True)],
                         ids=["runner-up", "recycled", "both", "with-chains-and-copies", "best-first-tree",
                              "best-first-tree-with-copies"])
@pytest.mark.parametrize("window_size, ngram_size, guess_set_size", GRID)
def test_runner_up_and_recycled_sources_keep_greedy_output(tiny_model, window_size, ngram_size, guess_set_size,
                                                           sources):
    config = LookaheadConfig(window_size, ngram_size, guess_set_size, **sources)
    stop = StopCriteria(max_tokens=30)
    for prompt in PROMPTS:
        expected = tokens_of(generate_autoregressive(tiny_model, prompt, stop))
        assert tokens_of(DecodeStream(tiny_model, prompt, stop, lookahead=config)) == expected


def test_recycled_successors_are_guessed_and_accepted_on_a_counting_stub():
    """The stub counts mod 8 and its second best is always 0: once a token's row was read, its successor is in
    the table; with no pool (G=0 keeps only the guesses' room) the recycled tree alone accepts guesses."""
    model = cycle_model(period=8)
    prompt = [5, 3, 0, 2]
    config = LookaheadConfig(1, 4, 4, prompt_pool=False, output_pool=False, recycled=2)
    stop = StopCriteria(max_tokens=40)
    steps = list(DecodeStream(model, prompt, stop, lookahead=config))
    plain = list(DecodeStream(model, prompt, stop, lookahead=LookaheadConfig(1, 4, 4, prompt_pool=False,
                                                                             output_pool=False)))
    assert tokens_of(steps) == tokens_of(plain) == [(3 + k) % 8 for k in range(40)]
    counts = sum((step.stats.counts() for step in steps), StepCounts())
    assert counts.source("recycled")[1] > 10
    assert len(steps) < len(plain)


def test_a_best_first_recycled_tree_reaches_past_n_minus_1_beside_a_full_guess_set():
    """On the counting stub the table's best successors are the text: a best-first tree follows them deeper than
    N-1 (steps accept more than N-1 guesses) and its paths do not take the pool's G slots (G=1 here)."""
    model = cycle_model(period=8)
    prompt = [5, 3, 0, 2]
    stop = StopCriteria(max_tokens=60)
    fixed = LookaheadConfig(1, 3, 1, recycled=2)
    deep = LookaheadConfig(1, 3, 1, recycled=2, recycled_tree=16)
    steps = {name: list(DecodeStream(model, prompt, stop, lookahead=config))
             for name, config in (("fixed", fixed), ("deep", deep))}
    assert tokens_of(steps["deep"]) == tokens_of(steps["fixed"]) == [(3 + k) % 8 for k in range(60)]
    assert max(step.stats.accepted for step in steps["deep"]) > deep.levels
    assert max(step.stats.accepted for step in steps["fixed"]) <= fixed.levels
    assert len(steps["deep"]) < len(steps["fixed"])


def test_recycled_rank_odds_learn_which_ranks_are_accepted():
    """Ranks whose successors the text takes gain odds; ranks it never takes lose theirs."""
    source = RecycledProposer(LookaheadConfig(1, 4, 2, recycled=2, recycled_tree=4), {1: (2, 3), 2: (4, 5)})
    context = Context([0, 1], 1, None, frozenset())
    before = (source.odds[0], source.odds[1])
    for _ in range(20):
        source.propose(context, budget=8)
        source.feedback(context, Outcome(3, accepted=(2, 4), reach=2))
    assert source.odds[0] > before[0] and source.odds[1] < before[1]


def test_runner_up_first_tokens_are_guessed_on_a_stub_whose_runner_up_is_the_next_token():
    """A stub whose logits rank t+1 first and t+2 second after token t: the row that chose ``last`` ranks the
    token after ``last`` second, so runner-up drafts start right."""
    class Skipping(cycle_model(period=16).__class__):
        def forward(self, input_ids, **kwargs):
            out = super().forward(input_ids, **kwargs)
            rows = out.logits
            following = torch.roll(rows, shifts=1, dims=-1) * 0.5  # t+2 at half the weight
            out.logits = rows + following
            return out

    model = Skipping(16, lambda token: (token + 1) % 16)
    prompt = [9, 4, 11, 0]
    config = LookaheadConfig(1, 3, 2, prompt_pool=False, output_pool=False, runner_up=2)
    stop = StopCriteria(max_tokens=30)
    steps = list(DecodeStream(model, prompt, stop, lookahead=config))
    assert tokens_of(steps) == [(1 + k) % 16 for k in range(30)]
    counts = sum((step.stats.counts() for step in steps), StepCounts())
    assert counts.source("runner_up")[1] >= 5
    without = list(DecodeStream(model, prompt, stop, lookahead=LookaheadConfig(1, 3, 2, prompt_pool=False,
                                                                               output_pool=False)))
    assert tokens_of(without) == tokens_of(steps) and len(steps) < len(without)


def test_an_engine_with_a_memory_shares_one_recycled_table_among_its_decodes(tiny_model):
    config = LookaheadConfig(3, 4, 4, recycled=4)
    stop = StopCriteria(max_tokens=24)
    engine = BatchEngine(tiny_model, memory=NGramMemory(1000))
    assert engine.successors == {}
    for index, prompt in enumerate(PROMPTS):
        engine.add(index, prompt, stop, SamplingParams(), config)
        tokens: list[int] = []
        while engine.has_work:
            for _, step in engine.step():
                tokens.extend(step.token_ids)
        assert tokens == tokens_of(generate_autoregressive(tiny_model, prompt, stop))
        assert engine.successors  # the first decode's rows are there for the next
    opted_out = DecodeStream(tiny_model, PROMPTS[0], stop, lookahead=replace(config, shared_memory=False),
                             successors=engine.successors)
    assert opted_out.successors is None  # a decode opted out of the memory keeps its own table
    assert BatchEngine(tiny_model).successors is None


# Pricing: what draft tokens cost, from the batch policy's step-cost curve (Context.price, step_price)

FLAT = BatchPolicy(step_cost=((1, 1.0), (4096, 1.0)))
STEEP = BatchPolicy(step_cost=((1, 1.0), (2, 10.0), (4096, 10_000.0)))  # no guess is worth a second token


def batched_tokens(model, prompt: list[int], stop: StopCriteria, config: LookaheadConfig | None,
                   policy: BatchPolicy) -> tuple[list[int], int]:
    """One decode through the engine under ``policy``: its tokens and how many forwards it took."""
    engine = BatchEngine(model, policy)
    engine.add(0, prompt, stop, SamplingParams(), config)
    tokens, forwards = [], 0
    while engine.has_work:
        forwards += 1
        for _, step in engine.step():
            assert not isinstance(step, BaseException), step
            tokens.extend(step.token_ids)
    return tokens, forwards


def copy_context(tokens: list[int]) -> Context:
    index = ContextIndex()
    index.extend(tokens, len(tokens))
    return Context(tokens, len(tokens), index, frozenset())


def test_a_copy_gate_pays_at_its_drafts_price_and_at_break_even_without_a_curve():
    config = LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1, break_even=1.0)
    context = copy_context([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])
    assert CopyProposer(config).propose(context, 4) == [(3, 4, 5, 6, 7, 8, 9, 10)]  # free: a new decode copies long
    assert CopyProposer(replace(config, break_even=6.0)).propose(context, 4) == ()  # 8 tokens expect 5.1 accepted
    context.price = lambda tokens: 1.5 * tokens  # even one token costs more accepted guesses than a copy expects
    assert CopyProposer(config).propose(context, 4) == ()
    assert break_even(config, context, 0) == 1.0 and break_even(config, context, 2) == 3.0


def test_copies_shorten_where_they_break_early_on_a_steep_curve_and_stay_long_where_they_hold():
    """On a curve where each draft token costs a quarter step, a decode whose copies were accepted one token deep
    verifies copies of one token, or two after a one-token copy accepted whole (two tokens for 1.25 steps pay; nine
    for 3 steps do not); one whose copies were accepted whole keeps copying 8; without a curve the length is the
    span whatever the history, gated at break_even."""
    config = LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1, break_even=2.0)
    context = copy_context([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])
    context.price = lambda tokens: 0.25 * tokens
    breaking, holding = CopyProposer(config), CopyProposer(config)
    for _ in range(6):
        breaking.propose(context, 4)
        breaking.feedback(context, Outcome(2, (3, 99), reach=1))
        holding.propose(context, 4)
        holding.feedback(context, Outcome(9, (3, 4, 5, 6, 7, 8, 9, 10), reach=8))
    short = breaking.propose(context, 4)
    assert short in ([(3,)], [(3, 4)]) and 0.5 < breaking.expected < 1.5, (short, breaking.expected)
    assert holding.propose(context, 4) == [(3, 4, 5, 6, 7, 8, 9, 10)] and holding.expected > 6.0
    context.price = free
    assert breaking.propose(context, 4) == ()  # 8 tokens expect < 2 accepted: below break_even without a curve
    assert CopyProposer(replace(config, break_even=0.0)).propose(context, 4) == [(3, 4, 5, 6, 7, 8, 9, 10)]


def test_a_recycled_tree_is_offered_while_its_mean_pays_for_its_nodes():
    """The tree keeps its node budget whatever the price; its gate (starting at 1 accepted guess) offers it when
    its 6 nodes are free, not when they cost 0.6 accepted guesses each."""
    table = {1: (2, 3), 2: (4, 5), 3: (6,), 4: (7,), 5: (8,)}
    config = LookaheadConfig(ngram_size=4, recycled=2, recycled_tree=6)
    context = Context([0, 1], 1, None, frozenset())
    assert RecycledProposer(config, table).propose(context, budget=8) == [(2, 4, 7), (2, 5), (3, 6)]
    context.price = lambda tokens: 0.6 * tokens
    source = RecycledProposer(config, table)
    assert not source.propose(context, budget=8) and not source.offered
    context.price = lambda tokens: 0.1 * tokens
    assert source.propose(context, budget=8) == [(2, 4, 7), (2, 5), (3, 6)]


@pytest.mark.parametrize("config", [
    LookaheadConfig(1, 3, 2, lazy_window=True, break_even=0.0, copy_length=8, copy_min_match=1),
    LookaheadConfig(4, 4, 4, copy_length=16, copy_candidates=4, copy_stretch=4, recycled=4, recycled_tree=32),
    LookaheadConfig(2, 3, 2, runner_up=2, recycled=3, window_chains=True),
], ids=["cpu-like", "cuda-like", "runner-up-and-recycled"])
@pytest.mark.parametrize("policy", [FLAT, BatchPolicy(), STEEP], ids=["flat", "default-curve", "steep"])
def test_priced_steps_keep_greedy_output(tiny_model, config, policy):
    stop = StopCriteria(max_tokens=30)
    for prompt in PROMPTS:
        expected = tokens_of(generate_autoregressive(tiny_model, prompt, stop))
        assert batched_tokens(tiny_model, prompt, stop, config, policy)[0] == expected


def test_a_steep_curve_leaves_only_probes_of_guesses_that_a_flat_one_verifies():
    """On the counting stub every guess is right: a flat curve verifies them at every step, a curve on which no
    guess pays for its token verifies them only on the gates' probes, so the same text takes many more forwards."""
    model = cycle_model(period=8)
    config = LookaheadConfig(1, 4, 2, lazy_window=True, break_even=0.0, copy_length=8, copy_min_match=1, recycled=2)
    stop = StopCriteria(max_tokens=60)
    flat, flat_forwards = batched_tokens(model, [5, 3, 0, 2], stop, config, FLAT)
    steep, steep_forwards = batched_tokens(model, [5, 3, 0, 2], stop, config, STEEP)
    assert flat == steep == [(3 + k) % 8 for k in range(60)]
    assert flat_forwards < 25 and steep_forwards > 2 * flat_forwards, (flat_forwards, steep_forwards)


def test_a_step_that_runs_its_window_anyway_prices_drafts_on_top_of_it():
    """Without a lazy window every step pays for the window's tokens, so a copy is priced at what it adds to that
    step (on STEEP, 9 tokens over the window's 4 cost 1.5 accepted guesses, not 28.5 over a one-token step): the
    counting stub's copies keep being verified."""
    model = cycle_model(period=8)
    config = LookaheadConfig(1, 4, 2, lazy_window=False, break_even=0.0, copy_length=8, copy_min_match=1)
    stop = StopCriteria(max_tokens=60)
    tokens, forwards = batched_tokens(model, [5, 3, 0, 2], stop, config, STEEP)
    lazy_tokens, lazy_forwards = batched_tokens(model, [5, 3, 0, 2], stop, replace(config, lazy_window=True), STEEP)
    assert tokens == lazy_tokens == [(3 + k) % 8 for k in range(60)]
    assert forwards < 20 and lazy_forwards > 2 * forwards, (forwards, lazy_forwards)


def _every_child_heap(table, last, odds, nodes):
    """The reference best-first tree: every child of a taken node pushed, keyed (-score, order pushed)."""
    import heapq

    from decoding.proposers.recycled import TREE_DEPTH
    heap, taken, order = [], {}, 0

    def push(path, score, token):
        nonlocal order
        if len(path) < TREE_DEPTH:
            for rank, child in enumerate(table.get(token, ())[: len(odds)]):
                heapq.heappush(heap, (-score * odds[rank], order, (*path, child), rank))
                order += 1

    push((), 1.0, last)
    while heap and len(taken) < nodes:
        negative, _, path, rank = heapq.heappop(heap)
        taken[path] = rank
        push(path, -negative, path[-1])
    return taken


@pytest.mark.parametrize("odds_kind", ["distinct", "tied", "nearly-tied"])
def test_the_best_first_tree_takes_the_nodes_of_a_heap_of_every_child_in_its_order(odds_kind):
    """Keeping one child per taken node in the heap takes the same nodes in the same order as pushing them all,
    ties included (equal odds, and odds one rounding apart out of rank order)."""
    import random

    from decoding.proposers.recycled import best_first
    rng = random.Random(7)
    for _ in range(300):
        vocab, k = rng.choice([4, 30]), rng.randint(1, 8)
        table = {token: tuple(rng.sample(range(vocab), min(rng.randint(1, k), vocab))) for token in range(vocab)
                 if rng.random() < 0.9}
        if odds_kind == "distinct":
            odds = [rng.random() for _ in range(k)]
        elif odds_kind == "tied":
            odds = [rng.choice([0.5, 0.25, 0.1]) for _ in range(k)]
        else:
            odds = [0.3 * (1 + rng.choice([0.0, 1e-16, -1e-16])) for _ in range(k)]
        nodes = rng.choice([1, 8, 128])
        expected = _every_child_heap(table, 0, odds, nodes)
        tree = best_first(table, 0, odds, nodes)
        assert list(zip(tree.paths, tree.ranks, strict=True)) == list(expected.items())
        inner = {path[:-1] for path in expected}
        assert tree.leaves == [path for path in expected if path not in inner]



def test_the_rank_odds_learn_from_every_node_whose_parent_the_text_took():
    """Walking down the accepted path counts the same tries and hits as checking every node of the tree: a node is
    a try of its rank when its parent (or ``last``) lies on the path, a hit when it lies there too."""
    import random

    from decoding.proposers.recycled import RankShape
    rng = random.Random(3)
    for _ in range(200):
        vocab, k = rng.choice([3, 6, 40]), rng.randint(1, 8)
        table = {token: tuple(rng.sample(range(vocab), min(rng.randint(1, k), vocab))) for token in range(vocab)
                 if rng.random() < 0.9}
        tree = RankShape.best([rng.random() for _ in range(k)], rng.choice([4, 32, 128])).walk(table, 0)
        accepted = tree.paths[rng.randrange(len(tree.paths))] if tree.paths and rng.random() < 0.8 else (
            tuple(rng.randrange(vocab) for _ in range(rng.randint(0, 4))))
        source = RecycledProposer(LookaheadConfig(1, 4, 2, recycled=k, recycled_tree=8), table)
        before = (list(source.odds.tries), list(source.odds.hits))
        source._learn(tree, accepted)
        tries, hits, on_path = list(before[0]), list(before[1]), []
        for path, rank, parent in zip(tree.paths, tree.ranks, tree.parents, strict=True):
            hit = False
            if parent < 0 or on_path[parent]:
                hit = len(path) <= len(accepted) and accepted[len(path) - 1] == path[-1]
                tries[rank] += 1
                hits[rank] += hit
            on_path.append(hit)
        assert (source.odds.tries, source.odds.hits) == (tries, hits)


def test_a_walked_rank_shape_is_the_best_first_tree_where_every_token_has_its_successors():
    """Over a table where every token has all its successors, walking the shape gives ``best_first``'s tree."""
    import random

    from decoding.proposers.recycled import RankShape, best_first
    rng = random.Random(5)
    for _ in range(100):
        k = rng.randint(1, 8)
        table = {token: tuple(rng.sample(range(60), k)) for token in range(60)}
        odds, nodes = [rng.random() for _ in range(k)], rng.choice([1, 8, 128])
        walked, expected = RankShape.best(odds, nodes).walk(table, 0), best_first(table, 0, odds, nodes)
        assert (walked.paths, walked.ranks, walked.parents, walked.leaves) == (
            expected.paths, expected.ranks, expected.parents, expected.leaves)
