"""The batch's policy: token budgets go where lookahead pays, prefill is chunked, static-step buckets hold, and the
step-cost curve interpolates (``decoding.batch_policy``)."""

from __future__ import annotations

from decoding.batch_policy import BatchPolicy, allocate
from decoding.step.stream import Proposal


def test_allocation_grants_lookahead_only_where_it_pays():
    flat = BatchPolicy(max_step_tokens=64, step_cost=((1, 1.0), (64, 1.0)))
    steep = BatchPolicy(max_step_tokens=64, step_cost=((1, 1.0), (64, 64.0)))
    proposals = [Proposal(10, gain=2.0), Proposal(10, gain=0.1), Proposal(1)]
    assert allocate(proposals, flat) == [10, 10, 1]
    assert allocate(proposals, steep) == [1, 1, 1]
    assert allocate([Proposal(10, gain=0.0, probe=True), Proposal(1)], steep) == [10, 1]
    assert allocate([Proposal(40, gain=3.0), Proposal(40, gain=2.0)], flat) == [40, 1]  # the budget is shared
    shared = [Proposal(40, gain=3.0, smallest=5), Proposal(40, gain=2.0, smallest=5)]
    assert allocate(shared, flat) == [40, 5]  # what is left still buys the second stream one candidate
    costly = BatchPolicy(max_step_tokens=64, step_cost=((1, 1.0), (2, 1.3), (16, 2.0), (64, 5.0)))
    assert allocate([Proposal(16, gain=1.0, smallest=5), Proposal(1), Proposal(1)], costly) == [5, 1, 1]


def test_allocation_chunks_prefill_and_keeps_decoders_running():
    policy = BatchPolicy(max_step_tokens=64, prefill_chunk=16)
    assert allocate([Proposal(100, prefill=True), Proposal(1), Proposal(30, prefill=True)], policy) == [16, 1, 0]
    assert allocate([Proposal(10, prefill=True), Proposal(30, prefill=True)], policy) == [10, 6]
    assert allocate([Proposal(20, prefill=True), Proposal(30, prefill=True), Proposal(1)], policy) == [16, 0, 1]
    assert allocate([Proposal(500, prefill=True)], policy) == [500]  # alone: no one to stall


def test_with_a_static_step_no_step_leaves_the_buckets():
    """The CUDA preset's graphs price steps on the curve of their replays: a step fitting no bucket would run
    eagerly (4-5x a replay on an H200). At 8 streams a lookahead step of ~340 tokens did (HumanEval at 8
    concurrent streams ran at 0.18x one stream's throughput, 2026-11-28): no more."""
    graphs = BatchPolicy(max_step_tokens=1024, prefill_chunk=512, static_step="graphs",
                         step_cost=((1, 1.0), (1024, 1.0)))
    wide = [Proposal(340, gain=5.0, smallest=20)] + [Proposal(1)] * 7
    assert allocate(wide, graphs) == [20] + [1] * 7  # 8 x 384 fits no bucket; 8 x 32 does
    assert allocate(wide, BatchPolicy(max_step_tokens=1024, step_cost=((1, 1.0), (1024, 1.0)))) == [340] + [1] * 7
    assert allocate([Proposal(340, gain=5.0, smallest=200)] + [Proposal(1)] * 7, graphs) == [1] * 8
    assert allocate([Proposal(340, gain=5.0), Proposal(1)], graphs) == [340, 1]  # 2 x 384 does fit
    prefill = allocate([Proposal(2000, prefill=True)] + [Proposal(1)] * 7, graphs)
    assert prefill == [128] + [1] * 7 and graphs.fits(prefill)
    assert allocate([Proposal(2000, prefill=True)], graphs) == [2000]  # alone: the whole prompt, eagerly


def test_step_cost_curve_interpolates_and_extrapolates():
    policy = BatchPolicy(step_cost=((1, 1.0), (9, 2.0), (17, 4.0)))
    assert policy.cost(1) == 1.0 and policy.cost(5) == 1.5 and policy.cost(13) == 3.0 and policy.cost(25) == 6.0
