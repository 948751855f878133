"""The payoff guard: a decode whose verifying steps do not pay on the price rests (plain steps), longer after each
trial that fails, and tries again; one that pays is never rested; the measured wall curve replaces the calibrated
one once it knows both buckets. Greedy output never depends on it."""

from __future__ import annotations

import pytest

from decoding import batch
from decoding.batch import BatchEngine, BatchPolicy, engine_guard
from decoding.decoder import Decoder
from decoding.params import LookaheadConfig, StopCriteria
from decoding.payoff import PayoffGuard, WallCurve
from decoding.step.stream import StepStats, generate_autoregressive
from decoding.weights.loading import LoadedModel
from server.config import batch_policy
from server.config_layers import load_config
from tests.conftest import tiny_llama

VERIFY = 20  # input tokens of a verifying step in the unit tests, priced 2 against a one-token step


def price(tokens: int) -> float:
    return 2.0 if tokens > 1 else 1.0


def walk(guard: PayoffGuard, committed_per_verifying_step: int, steps: int, key: str = "decode") -> list[bool]:
    """Step a decode ``steps`` times: a plain one-token step while the guard rests it, else a verifying step that
    commits the given tokens; whether it rested at each step."""
    rested = []
    for _ in range(steps):
        resting = guard.resting(key)
        rested.append(resting)
        guard.record(key, StepStats(1, 1) if resting else StepStats(VERIFY, committed_per_verifying_step))
    return rested


def runs(flags: list[bool]) -> list[tuple[bool, int]]:
    """``flags`` as ``(value, length)`` runs."""
    found: list[tuple[bool, int]] = []
    for flag in flags:
        if found and found[-1][0] == flag:
            found[-1] = (flag, found[-1][1] + 1)
        else:
            found.append((flag, 1))
    return found


def test_a_decode_whose_steps_never_pay_rests_longer_after_each_failed_trial_up_to_the_cap():
    guard = PayoffGuard(price, trial=4, rest=4, max_rest=16, warmup=0)
    rested = walk(guard, committed_per_verifying_step=1, steps=4 + 4 + 4 + 8 + 4 + 16 + 4 + 16 + 4)
    assert runs(rested) == [(False, 4), (True, 4), (False, 4), (True, 8), (False, 4), (True, 16), (False, 4),
                            (True, 16), (False, 4)]  # each trial is 4 verifying steps, each rest 4, 8, 16, 16
    assert guard.rests("decode") == 5  # the last trial failed too: a fifth rest starts


def test_a_decode_that_pays_is_never_rested_and_one_that_pays_again_rests_short():
    paying = PayoffGuard(price, trial=4, every=4, rest=4, max_rest=16, warmup=0)
    assert not any(walk(paying, committed_per_verifying_step=2, steps=200))  # 2 tokens for a price of 2: even
    assert paying.efficiency("decode") == 1.0
    guard = PayoffGuard(price, trial=4, every=4, rest=4, max_rest=16, history=8, warmup=0)
    walk(guard, committed_per_verifying_step=1, steps=4 + 4 + 4 + 8)  # two failures: the next rest would be 16
    assert not any(walk(guard, committed_per_verifying_step=3, steps=4))  # a trial that pays: goes on
    assert runs(walk(guard, committed_per_verifying_step=1, steps=4 + 4 + 4 + 1)) == [(False, 8), (True, 4),
                                                                                      (False, 1)]
    # judged every 4 steps over the last 8: 4 failing steps after 4 paying ones still pay (16 tokens for 16), 8 do
    # not (8 for 16): a rest of 4, not 16 (the trial that paid reset it)


def test_a_slip_is_judged_over_the_history_not_the_last_window():
    guard = PayoffGuard(price, trial=4, every=4, rest=4, history=16, warmup=0)
    walk(guard, committed_per_verifying_step=3, steps=12)  # 36 tokens for a price of 24
    assert runs(walk(guard, committed_per_verifying_step=1, steps=12 + 1)) == [(False, 12), (True, 1)]
    # judged every 4 steps over the last 16: with 4 and 8 failing steps among them they still pay (40 and 32 tokens
    # for 32), with 12 they do not (24 for 32); judged over the last 4 alone, the first 4 failing steps rest it
    short = PayoffGuard(price, trial=4, every=4, rest=4, history=4, warmup=0)
    walk(short, committed_per_verifying_step=3, steps=12)
    assert runs(walk(short, committed_per_verifying_step=1, steps=4 + 1)) == [(False, 4), (True, 1)]


def test_a_later_decode_rests_as_long_as_the_last_one_would_have_from_its_second_rest():
    guard = PayoffGuard(price, trial=4, rest=4, max_rest=64, warmup=0)
    walk(guard, committed_per_verifying_step=1, steps=4 + 4 + 4 + 8 + 4 + 16, key="a")  # its next rest: 32
    guard.forget("a")
    assert runs(walk(guard, committed_per_verifying_step=1, steps=4 + 4 + 4 + 32 + 1, key="b")) == [
        (False, 4), (True, 4), (False, 4), (True, 32), (False, 1)]  # a slow start rests 4, then 32, not 8
    guard.forget("b")
    walk(guard, committed_per_verifying_step=3, steps=8, key="c")  # it pays: its next rest is back at 4
    guard.forget("c")
    assert runs(walk(guard, committed_per_verifying_step=1, steps=4 + 4 + 4 + 8, key="d")) == [
        (False, 4), (True, 4), (False, 4), (True, 8)]


def test_the_defaults_skip_the_warm_up_try_for_4_steps_and_judge_a_paying_decode_every_16():
    losing = PayoffGuard(price)
    assert runs(walk(losing, committed_per_verifying_step=1, steps=3 + 4 + 1)) == [(False, 3 + 4), (True, 1)]
    paying = PayoffGuard(price)
    assert not any(walk(paying, committed_per_verifying_step=3, steps=3 + 4))  # its trial pays
    assert runs(walk(paying, committed_per_verifying_step=1, steps=16 + 1)) == [(False, 16), (True, 1)]
    # 16 failing steps go by before the next judgement (then 28 tokens for 40 over the last 20: it rests)


def test_plain_steps_and_prefill_are_not_judged():
    guard = PayoffGuard(price, trial=2, rest=2)
    for stats in (StepStats(64, 0, prefill=True), *[StepStats(1, 1)] * 10):
        guard.record("decode", stats)
    assert not guard.resting("decode") and guard.efficiency("decode") is None
    for bad in (dict(rest=8, max_rest=4), dict(trial=8, history=4), dict(warmup=-1)):
        with pytest.raises(ValueError):
            PayoffGuard(price, **bad)


def test_the_wall_curve_prices_a_bucket_against_the_one_token_bucket_once_both_have_samples():
    wall = WallCurve(samples=4, min_samples=3)
    guard = PayoffGuard(price, bucket=lambda tokens: 32 if tokens <= 32 else 64, wall=wall)
    for seconds in (0.010, 0.011, 0.5):  # a graph capture's outlier: the median keeps it out
        guard.observe(StepStats(VERIFY, 3), seconds)
    assert guard.cost(VERIFY) == 2.0  # no one-token price yet: the curve's
    for seconds in (0.004, 0.004, 0.005):
        guard.observe(StepStats(1, 1), seconds)
    guard.observe(StepStats(1, 1, prefill=True), 1.0)  # a prefill's wall is not a plain step's
    assert guard.cost(VERIFY) == pytest.approx(0.011 / 0.004)
    assert guard.cost(40) == 2.0  # bucket 64 not measured: the curve's
    for seconds in (0.4, 0.4, 0.4, 0.4):  # the bucket keeps its last 4
        wall.add(32, seconds)
    assert guard.cost(VERIFY) == pytest.approx(100.0)


def test_a_first_paying_trial_rests_once_to_measure_the_one_token_step():
    guard = PayoffGuard(price, wall=WallCurve(min_samples=3), trial=4, warmup=0)
    assert runs(walk(guard, committed_per_verifying_step=3, steps=4 + 3 + 20)) == [(False, 4), (True, 3), (False, 20)]
    without_wall = PayoffGuard(price, trial=4, warmup=0)
    assert not any(walk(without_wall, committed_per_verifying_step=3, steps=27))


# --- in the engine: the tiny model, greedy output unchanged -------------------------------------------------------

PROMPT = [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7]
CONFIG = LookaheadConfig(4, 4, 4)  # a window every step (not lazy): a verifying step of 12+ tokens
FLAT = ((1, 1.0), (2, 1.0), (4096, 1.0))  # every step costs one: lookahead always pays
# A step of 2+ tokens costs 5 plain ones whatever its size: drafts' marginal price is nil, so the gates let the window
# run every step (as on a GPU), but no step commits more than N = 4 tokens: lookahead never pays.
NEVER = ((1, 1.0), (2, 5.0), (4096, 5.0))
# The same at 3: the tiny model's output soon loops and its steps then commit 4 tokens: they pay.
LATER = ((1, 1.0), (2, 3.0), (4096, 3.0))
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def greedy(model) -> list[int]:
    steps = generate_autoregressive(model, PROMPT, StopCriteria(MAX_TOKENS))
    return [token for step in steps for token in step.token_ids]


def decode(engine: BatchEngine, requests: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Run ``requests`` copies of the prompt through ``engine``: each one's tokens and its steps' input tokens."""
    for request in range(requests):
        engine.add(request, PROMPT, StopCriteria(MAX_TOKENS), lookahead=CONFIG)
    tokens: list[list[int]] = [[] for _ in range(requests)]
    sizes: list[list[int]] = [[] for _ in range(requests)]
    while engine.has_work:
        for request, step in engine.step():
            assert not isinstance(step, BaseException), step
            tokens[request].extend(step.token_ids)
            if not step.stats.prefill:
                sizes[request].append(step.stats.input_tokens)
    return tokens, sizes


def small_guard(policy: BatchPolicy) -> PayoffGuard:
    return PayoffGuard(policy.stream_cost, trial=4, every=4, rest=4, max_rest=16)


@pytest.mark.parametrize("requests", [1, 3])
def test_in_the_engine_a_stream_that_never_pays_rests_and_tries_again_with_greedy_output(model, greedy, requests):
    engine = BatchEngine(model, BatchPolicy(step_cost=NEVER), guard=small_guard)
    tokens, sizes = decode(engine, requests)
    assert tokens == [greedy] * requests
    for steps in sizes:
        plain = runs([size == 1 for size in steps])
        assert plain[-4:-1] == [(True, 16), (False, 4), (True, 16)]  # it tries again, and rests up to 16 steps
        if requests == 1:  # alone, it runs its window from the first step (in a batch, allocate grants a window
            # with no candidate only where it pays: those first steps are plain, the stream's own); its first
            # 3 verifying steps (the window's warm-up) and a trial of 4 go before the first judgement
            assert plain[:6] == [(False, 3 + 4), (True, 4), (False, 4), (True, 8), (False, 4), (True, 16)]
    assert engine.guard._watches == {}  # every finished stream forgotten


def test_in_the_engine_a_stream_rested_early_takes_lookahead_back_once_it_pays(model, greedy):
    engine = BatchEngine(model, BatchPolicy(step_cost=LATER), guard=small_guard)
    tokens, sizes = decode(engine)
    assert tokens == [greedy]
    plain = runs([size == 1 for size in sizes[0]])
    assert plain[0] == (False, 3 + 4) and plain[1][0] and plain[-1] == (False, plain[-1][1])  # rested, then back
    assert plain[-1][1] >= 16  # once its steps commit 4 tokens for 3, it is not rested again


def test_in_the_engine_a_stream_that_pays_is_never_rested(model, greedy):
    engine = BatchEngine(model, BatchPolicy(step_cost=FLAT), guard=small_guard)
    tokens, sizes = decode(engine)
    assert tokens == [greedy]
    assert 1 not in sizes[0]  # the window runs every step: no plain step
    unguarded = BatchEngine(model, BatchPolicy(step_cost=FLAT), guard=lambda policy: None)
    assert decode(unguarded) == (tokens, sizes)  # the guard changed nothing


def test_the_engine_keeps_a_guard_only_with_a_static_step_or_a_measured_curve(model):
    assert BatchEngine(model, BatchPolicy()).guard is None  # neither: no guard
    assert BatchEngine(model, BatchPolicy(measure_step_cost=True)).guard.wall is not None
    assert engine_guard(BatchPolicy(static_step="eager")).wall is None


@pytest.mark.parametrize("preset", ["cpu", "cuda"])
def test_both_presets_keep_a_guard_priced_on_wall_times(preset):
    guard = engine_guard(batch_policy(load_config(device_preset=preset)))
    assert guard is not None and guard.wall is not None


def test_the_servers_engine_builder_keeps_the_guard_on_the_curve_it_calibrated(model):
    decoder = Decoder(LoadedModel(model, None, "tiny", "", model.device, model.dtype), "torch")
    engine = decoder.batch_engine(BatchPolicy(max_step_tokens=32, measure_step_cost=True))
    assert engine.guard is not None and engine.guard.wall is not None
    assert engine.guard.curve == engine.policy.stream_cost  # the measured curve, not the preset's fallback


class FakeClock:
    """Seconds that pass only inside forwards: ``per_token`` a token over a fixed ``base``."""

    def __init__(self, base: float, per_token: float) -> None:
        self.now, self.base, self.per_token = 0.0, base, per_token

    def __call__(self) -> float:
        return self.now

    def forward(self, real):
        def timed(model, slices, static=None):
            self.now += self.base + self.per_token * sum(len(slice_.tokens) for slice_ in slices)
            return real(model, slices, static)
        return timed


@pytest.mark.parametrize("per_token, rests", [(0.0, False), (0.002, True)])
def test_the_engine_prices_steps_on_their_wall_time_when_it_measures_the_curve(model, greedy, monkeypatch, per_token,
                                                                                rests):
    """The curve is flat (lookahead always pays there) and measured: the wall decides. With a wall that grows with a
    step's tokens (16 tokens take (0.004 + 16 * 0.002) / (0.004 + 0.002) = 6 plain steps' time) the stream rests
    again after its measuring rest; with a flat one it never does."""
    clock = FakeClock(0.004, per_token)
    monkeypatch.setattr(batch, "start_forward", clock.forward(batch.start_forward))
    engine = BatchEngine(model, BatchPolicy(step_cost=FLAT, measure_step_cost=True), clock=clock)
    tokens, sizes = decode(engine)
    assert tokens == [greedy]
    plain = runs([size == 1 for size in sizes[0]])
    assert plain[:2] == [(False, 3 + 4), (True, 4)]  # the first trial pays on the curve: it rests 4 steps to measure
    assert (len(plain) > 3) == rests
    if rests:
        assert plain[2] == (False, 4)  # the next trial is priced on the wall, and fails
    assert engine.guard.wall.relative(1) == 1.0
    assert engine.guard.cost(16) == pytest.approx((0.004 + 16 * per_token) / (0.004 + per_token), rel=0.25)
