"""The static step: the same logits as the eager packed forward, lookahead == greedy through it, padding that
changes nothing, the KV pool's rows and deferred commits, one graph per bucket, no host sync inside it, and an
op count under its ceiling."""

from __future__ import annotations

import pytest
import torch

from bench.anatomy import tiny_deep_llama
from bench.counters import SyncCounter, count_aten_ops
from decoding.batch import BatchEngine, BatchPolicy, step_batch
from decoding.forward.choice import greedy_ids, top_ids
from decoding.forward.kv_cache import KVPool, new_cache
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.forward.static import Bucket, StaticStep, attended_lengths
from decoding.forward.static_forward import static_forward, supports
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers.window import step_layout
from decoding.step.stream import DecodeStream
from server.config import decoder_lookahead
from server.config_layers import load_config
from tests.conftest import tiny_llama, tiny_qwen2
from tests.decoding.test_batch import CONFIGS as BATCH_CONFIGS
from tests.decoding.test_batch import PROMPTS, tokens_of

GRID = [
    LookaheadConfig(2, 3, 2),
    LookaheadConfig(4, 4, 4),
    LookaheadConfig(7, 5, 7),
    LookaheadConfig(3, 4, 3, copy_length=12, copy_min_match=1, copy_candidates=3),
    LookaheadConfig(1, 5, 3, lazy_window=True, break_even=0.5, copy_length=10),
]
CUDA_PRESET = decoder_lookahead(load_config(device_preset="cuda").lookahead)
OP_CEILING = 700
ARCHITECTURES = {"llama": tiny_llama, "qwen2": tiny_qwen2}


def static_runner(model, sequences: int = 8, capacity: int = 1024, **options) -> StaticStep:
    return StaticStep(model, KVPool(model, sequences, capacity, scratch_tokens=256), **options)


def drain(engine: BatchEngine) -> dict:
    """Step ``engine`` until every decode in it has finished; each request's tokens by request id."""
    outputs: dict = {}
    steps = 0
    while engine.has_work:
        for request_id, step in engine.step():
            assert not isinstance(step, BaseException), step
            outputs.setdefault(request_id, []).extend(step.token_ids)
        steps += 1
        assert steps < 3000
    return outputs


def decode(engine: BatchEngine, prompts, configs, max_tokens: int = 40, sampling=SamplingParams()):
    """Each prompt's tokens, all added to ``engine`` at once and stepped together until they finish; ``sampling``
    is every prompt's, or a list of one per prompt."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    for index, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
        engine.add(index, prompt, StopCriteria(max_tokens), samplings[index], config)
    outputs = drain(engine)
    return [outputs.get(index, []) for index in range(len(prompts))]


def greedy_alone(model, prompt, max_tokens: int = 40) -> list[int]:
    return tokens_of(DecodeStream(model, prompt, StopCriteria(max_tokens)))


@pytest.fixture(params=sorted(ARCHITECTURES))
def pair(request):
    """A tiny model for the static step and an identical one that keeps its own layout, for the eager reference."""
    make = ARCHITECTURES[request.param]
    return make(), make()


def test_supports_the_lean_architectures(pair):
    assert supports(pair[0])


def test_real_rows_equal_the_packed_forward(pair):
    model, reference = pair
    runner = static_runner(model, sequences=4, capacity=64)
    caches = [runner.pool.acquire(60), runner.pool.acquire(40)]
    references = [new_cache(reference, 60), new_cache(reference, 40)]
    layout = step_layout(3, 2, (-1, 0, -1))
    plans = [
        ([[3, 9, 4, 1, 7, 11, 5], [2, 8]], [None, None]),  # prompts: causal
        ([[5, 6, 7, 8, 9, 10, 12, 13, 14][: layout.num_tokens], [4]], [layout, None]),  # a lookahead step + one
    ]
    with torch.inference_mode():
        for tokens, layouts in plans:
            ours, theirs = [], []
            for cache_list, out in ((caches, ours), (references, theirs)):
                for ids, step, cache in zip(tokens, layouts, cache_list, strict=True):
                    start = cache.length
                    if step is None:
                        out.append(Slice(ids, torch.arange(start, start + len(ids)), None, torch.arange(len(ids)),
                                         cache))
                    else:
                        out.append(Slice(ids, step.offsets + start, step.visible, step.logit_rows, cache, step.parents))
            logits, argmax = runner.run(ours)
            expected = forward_packed(reference, theirs)
            for got, want, ids in zip(logits, expected, argmax, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                assert ids == want.argmax(dim=-1).tolist()
    assert [cache.length for cache in caches] == [cache.length for cache in references]


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_the_top_ids_come_back_with_the_argmax_in_one_read(mode):
    """Each slice's rows' top ids, as many as it wants (``Slice.top_k``), read in the step's one read: those of
    ``top_ids`` on its logits; a slice wanting none, or more than the step computes, gets none."""
    model = tiny_llama()
    runner = static_runner(model, sequences=4, capacity=64, mode=mode, top_k=5)
    caches = [runner.pool.acquire(60) for _ in range(3)]
    with torch.inference_mode():
        runner.run([Slice([3, 9, 4, 1][: 2 + index], torch.arange(2 + index), None, torch.arange(1), cache)
                    for index, cache in enumerate(caches)])
        slices = [Slice([7, 1, 2], None, None, None, cache, host_positions=range(2 + index, 5 + index),
                        host_rows=range(3 - index), top_k=wanted)
                  for index, (cache, wanted) in enumerate(zip(caches, (5, 0, 3), strict=True))]
        with SyncCounter() as syncs:
            logits, ids = runner.run(slices)
        assert syncs.calls == ["tolist"]
    for rows, row_ids, wanted in zip(logits, ids, (5, 0, 3), strict=True):
        assert row_ids == greedy_ids(rows)
        assert (row_ids.top(wanted) if wanted else None) == (list(map(tuple, top_ids(rows, wanted))) if wanted
                                                              else None)
        assert row_ids.top(wanted + 1) is None


def test_padding_is_finite_and_does_not_touch_real_rows():
    model = tiny_llama()
    runner = static_runner(model, sequences=4, capacity=64)
    cache = runner.pool.acquire(60)
    prompt = Slice([3, 9, 4], torch.arange(3), None, torch.arange(3), cache)
    with torch.inference_mode():
        runner.run([prompt])
        step = Slice([7, 1], torch.tensor([3, 4]), None, torch.arange(2), cache)
        alone_bucket = runner.bucket([step])
        alone, _ = runner.run([step], Bucket(1, 8, alone_bucket.attended))
        cache.commit(3, [])  # drop the step: the next run is at the same position
        padded, _ = runner.run([step], Bucket(4, 8, alone_bucket.attended))  # three padding sequences
        compiled = runner._buckets[Bucket(4, 8, alone_bucket.attended)]
        everything = static_forward(runner.weights, runner._views(alone_bucket.attended), compiled.inputs, 4, 8)[0]
    torch.testing.assert_close(padded[0], alone[0], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(everything).all()


def test_a_step_outside_the_buckets_is_none():
    model = tiny_llama()
    runner = static_runner(model, sequences=2, capacity=32)
    cache, own = runner.pool.acquire(32), new_cache(model, 32)
    big = Slice(list(range(300)), torch.arange(300), None, torch.arange(1), cache)
    assert runner.bucket([big]) is None  # more tokens than any bucket
    assert runner.bucket([Slice([1], torch.arange(1), None, torch.arange(1), own)]) is None  # not a pool row
    assert runner.bucket([Slice([1], torch.arange(1), None, torch.arange(1), cache)]) == Bucket(1, 1, 64)


def config_id(config: LookaheadConfig) -> str:
    return f"{config.window_size}-{config.ngram_size}-{config.guess_set_size}"


@pytest.mark.parametrize("config", [*GRID, CUDA_PRESET], ids=config_id)
def test_lookahead_equals_greedy_through_the_static_step(pair, config):
    model, _ = pair
    runner = static_runner(model)
    expected = decode(BatchEngine(model, static=runner), PROMPTS, [None] * len(PROMPTS))
    assert expected == [greedy_alone(pair[1], prompt) for prompt in PROMPTS]  # static greedy == eager greedy
    greedy_runs = runner.runs
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert decode(BatchEngine(model, static=runner), [prompt], [config]) == [want]
    assert runner.pool.free == runner.pool.sequences  # every row released
    assert greedy_runs > 0 and runner.runs - greedy_runs > 2 * runner.eager  # mostly static, not vacuous


def test_seeded_sampling_through_the_static_step_equals_the_plain_loop(pair):
    """The static step's logits feed per-position sampling as the eager forward's do: batched lookahead streams at
    the CUDA preset commit each seed's plain-loop tokens."""
    model, reference = pair
    runner = static_runner(model)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed) for seed in range(len(PROMPTS))]
    alone = [tokens_of(DecodeStream(reference, prompt, StopCriteria(40), sampling))
             for prompt, sampling in zip(PROMPTS, seeded, strict=True)]
    policy = BatchPolicy(max_step_tokens=256, prefill_chunk=4)
    assert decode(BatchEngine(model, policy, static=runner), PROMPTS, [CUDA_PRESET] * len(PROMPTS), 40, seeded) == alone
    assert runner.runs > 10


def test_batched_streams_through_the_static_step_equal_each_alone(pair):
    model, reference = pair
    runner = static_runner(model)
    alone = [greedy_alone(reference, prompt) for prompt in PROMPTS]
    policy = BatchPolicy(max_step_tokens=64, prefill_chunk=4)
    assert decode(BatchEngine(model, policy, static=runner), PROMPTS, BATCH_CONFIGS) == alone
    assert runner.pool.free == runner.pool.sequences
    assert runner.runs > 10 and any(bucket.sequences > 1 for bucket in runner._buckets)


def test_pool_rows_are_acquired_released_and_bounded():
    model = tiny_llama()
    pool = KVPool(model, 2, 32, scratch_tokens=8)
    first, second = pool.acquire(32), pool.acquire(10)
    assert (first.pool_row, second.pool_row, pool.free) == (0, 1, 0)
    assert pool.acquire(4) is None  # every row taken
    pool.release(first)
    assert pool.acquire(33) is None  # longer than a row
    again = pool.acquire(16)
    assert again.pool_row == 0 and again.length == 0
    pool.release(new_cache(model, 4))  # not a pool row: ignored
    assert pool.free == 0


def test_deferred_commits_leave_the_cache_a_fresh_forward_would():
    """After lookahead steps through the static step, each pool row holds exactly the KV of one forward over the
    committed tokens (the deferred moves applied by ``flush``)."""
    model, reference = tiny_llama(), tiny_llama()
    runner = static_runner(model, sequences=2, capacity=128)
    stream = DecodeStream(model, PROMPTS[0], StopCriteria(30), lookahead=LookaheadConfig(4, 4, 4),
                          pool=runner.pool)
    multi = 0
    while not stream.finished:
        (step,) = step_batch([stream], BatchPolicy(), runner)
        multi += step.stats.committed > 1
        runner.pool.flush()
        committed = stream.sequence.tokens[:-1]
        fresh = new_cache(reference, len(committed) + 1)
        with torch.inference_mode():
            forward_packed(reference, [Slice(committed, torch.arange(len(committed)), None, torch.arange(1), fresh)])
        for layer, want in zip(stream.sequence.cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(layer.keys, want.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.values, want.values, rtol=1e-5, atol=1e-5)
    assert multi > 0  # some step committed several tokens, so some commit moved slots
    stream.close()
    assert runner.pool.free == 2


def test_one_graph_per_bucket_over_a_whole_lookahead_decode(monkeypatch):
    """``torch.compile(fullgraph=True, dynamic=False)`` of the static forward, with recompiles made errors, over a
    lookahead decode at the CUDA preset: every bucket the decode visits compiles exactly one graph."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    graphs: list[tuple] = []

    def counting(graph_module, example_inputs):
        graphs.append(tuple(tuple(tensor.shape) for tensor in example_inputs if isinstance(tensor, torch.Tensor)))
        return aot_eager(graph_module, example_inputs)

    model = tiny_llama()
    runner = static_runner(model, mode="compile", backend=counting)
    outputs = decode(BatchEngine(model, static=runner), PROMPTS[:2], [CUDA_PRESET, CUDA_PRESET], max_tokens=24)
    assert outputs == [greedy_alone(tiny_llama(), prompt, 24) for prompt in PROMPTS[:2]]
    assert len(runner._buckets) >= 3  # prefill, lookahead and batch shapes
    assert len(graphs) == len(runner._buckets)
    torch._dynamo.reset()


def test_no_host_sync_inside_the_static_forward():
    model = tiny_llama()
    runner = static_runner(model)
    cache = runner.pool.acquire(64)
    layout = step_layout(4, 3, (-1, 0, 1, -1))
    with torch.inference_mode():
        runner.run([Slice([1, 2, 3], torch.arange(3), None, torch.arange(1), cache)])
        step = Slice(list(range(layout.num_tokens)), layout.offsets + 3, layout.visible, layout.logit_rows, cache,
                     layout.parents)
        bucket = runner.bucket([step])
        compiled = runner.prepare([step], bucket)
        with SyncCounter() as syncs:
            static_forward(runner.weights, runner._views(bucket.attended), compiled.inputs, bucket.sequences,
                           bucket.tokens)
        assert syncs.count == 0, syncs.calls
        with SyncCounter() as syncs:  # the counter sees a sync where there is one
            compiled.inputs[:4].tolist()
        assert syncs.count == 1


@pytest.mark.parametrize("tokens", [1, 100])
def test_aten_ops_per_forward_at_most_the_ceiling(tokens):
    model = tiny_deep_llama()
    runner = static_runner(model, sequences=1, capacity=300)
    cache = runner.pool.acquire(300)
    step = Slice(list(range(tokens)), torch.arange(tokens), None, torch.arange(tokens), cache)
    bucket = runner.bucket([step])
    compiled = runner._compiled(bucket)
    with torch.inference_mode():
        ops = count_aten_ops(lambda: static_forward(runner.weights, runner._views(bucket.attended), compiled.inputs,
                                                    bucket.sequences, bucket.tokens))
    assert 30 * 20 <= ops <= OP_CEILING  # the floor: the count is of a real 30-layer forward


def test_attended_lengths_double_up_to_the_row():
    assert attended_lengths(64) == (64,)
    assert attended_lengths(1000) == (64, 128, 256, 512, 1000)


def test_the_decoder_builds_the_static_step_its_policy_names():
    from decoding.decoder import Decoder
    from decoding.weights.loading import LoadedModel

    model = tiny_llama()
    decoder = Decoder(LoadedModel(model, None, "tiny", "", model.device, model.dtype), "torch")
    assert decoder.batch_engine(BatchPolicy()).static is None
    engine = decoder.batch_engine(BatchPolicy(static_step="graphs", static_sequences=2))  # no CUDA: rehearsed
    static = engine.static
    assert (static.mode, static.rehearsal, static.pool.sequences, engine.policy.static_step) == ("graphs", True, 2,
                                                                                                  "graphs")
    assert len(static._buckets) > 10 and static.captures == len(static._buckets)  # every common bucket, at start
    engine.add("a", PROMPTS[0], StopCriteria(8), lookahead=LookaheadConfig(4, 4, 4))
    paths = []
    while engine.has_work:
        engine.step()
        paths.append(engine.last_forward)
    assert set(paths) == {"graph"} and static.replays == len(paths)  # the prompt too: it fits a bucket


def test_a_model_the_static_step_cannot_run_keeps_the_eager_path():
    from decoding.decoder import Decoder
    from decoding.weights.linears import pack_float32
    from decoding.weights.loading import LoadedModel

    model = pack_float32(tiny_llama())
    assert not supports(model)
    decoder = Decoder(LoadedModel(model, None, "tiny", "", model.device, model.dtype), "packed")
    engine = decoder.batch_engine(BatchPolicy(static_step="eager"))
    assert engine.static is None and engine.policy.static_step == "off"


def test_the_planner_prices_the_padded_bucket():
    eager, static = BatchPolicy(), BatchPolicy(static_step="graphs")
    assert eager.padded_tokens([1, 20, 1, 0]) == 22
    assert static.padded_tokens([1, 20, 1, 0]) == 4 * 32  # 3 sequences -> 4, 20 tokens -> 32
    assert static.padded_tokens([300]) == 384  # one sequence of 300 tokens -> the 384-token bucket
    assert static.padded_tokens([300, 300, 300]) == 900  # no bucket (4 x 384 > 1024): priced as it runs, eagerly
