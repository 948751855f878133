"""The CUDA path of the static step, run on the CPU: the forward under CUDA's code path and attention output
layouts, every bucket a valid shape, every index checked on the host, and the capture's warm-ups rehearsed over
every bucket a server builds at start (what broke the first GPU server, 2026-11-27, caught here first)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.batch import BatchPolicy
from decoding.forward.kv_cache import KVPool, new_cache
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.forward.static import (
    SEQUENCE_BUCKETS,
    TOKEN_BUCKETS,
    Bucket,
    StaticInputError,
    StaticStep,
    build_static_step,
    check_inputs,
    input_bounds,
    warm_buckets,
)
from decoding.forward.static_inputs import check_slices
from decoding.params import MAX_STEP_TOKENS
from decoding.proposers.window import step_layout
from tests.conftest import TINY_SIZES, tiny_llama, tiny_qwen2

CPU_BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}


def long_tiny_llama() -> LlamaForCausalLM:
    """A tiny LLaMA with the default model's context (8192 positions): the same attended lengths and buckets."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_SIZES, "max_position_embeddings": 8192})).eval()


def cuda_preset_step(model, sequences: int = 4) -> StaticStep:
    """A static step in ``"graphs"`` mode over a pool shaped as the server builds it (``build_static_step``)."""
    capacity = model.config.max_position_embeddings + MAX_STEP_TOKENS
    return StaticStep(model, KVPool(model, sequences, capacity, scratch_tokens=TOKEN_BUCKETS[-1]), "graphs")


@pytest.mark.parametrize("backend", sorted(CPU_BACKENDS))
@pytest.mark.parametrize("mode", ["eager", "graphs"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_each_code_path_and_attention_layout_gives_the_packed_forward(make, mode, backend):
    model, reference = make(), make()
    runner = StaticStep(model, KVPool(model, 2, 64, scratch_tokens=64), mode)
    weights = runner.weights
    assert (weights.fold_groups, weights.cuda_layout) == ((True, True) if mode == "graphs" else (False, False))
    with sdpa_kernel([CPU_BACKENDS[backend]]):
        assert_gives_the_packed_forward(runner, reference)


def assert_gives_the_packed_forward(runner: StaticStep, reference) -> None:
    """A prompt, then a lookahead step sharing its forward, through ``runner`` and through ``forward_packed`` on
    ``reference`` (an identical model keeping its own layout): the same logits to float tolerance, the same argmax."""
    cache, own = runner.pool.acquire(60), new_cache(reference, 60)
    layout = step_layout(3, 2, (-1, 0, -1))
    with torch.inference_mode():
        for ids, step in (([3, 9, 4, 1, 7], None), ([5, 6, 7, 8, 9, 10, 12, 13, 14][: layout.num_tokens], layout)):
            slices = []
            for slice_cache in (cache, own):
                start = slice_cache.length
                if step is None:
                    slices.append(Slice(ids, torch.arange(start, start + len(ids)), None, torch.arange(len(ids)),
                                        slice_cache))
                else:
                    slices.append(Slice(ids, step.offsets + start, step.visible, step.logit_rows, slice_cache,
                                        step.parents))
            (logits,), (argmax,) = runner.run(slices[:1])
            (expected,) = forward_packed(reference, slices[1:])
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
            assert argmax == expected.argmax(dim=-1).tolist()


def test_the_rehearsed_attention_output_has_cudas_strides(monkeypatch):
    """Folded grouped heads: the rehearsed attention's output ``[B, kv, T * group, d]`` lies in memory as CUDA's
    kernels lay it (``[B, T * group, kv, d]``), so the output projection reads it as a view, as on CUDA."""
    from decoding.forward import static_forward as module

    seen = []
    original = module._attend

    def spy(*args, **kwargs):
        output = original(*args, **kwargs)
        seen.append((output.is_contiguous(), output.transpose(1, 2).is_contiguous()))
        return output

    monkeypatch.setattr(module, "_attend", spy)
    runner = StaticStep(tiny_llama(), KVPool(tiny_llama(), 1, 64, scratch_tokens=64), "graphs")
    assert runner.weights.kv_heads > 1 and runner.weights.fold_groups
    cache = runner.pool.acquire(60)
    with torch.inference_mode():
        runner.run([Slice([1, 2, 3], torch.arange(3), None, torch.arange(3), cache)])
    assert seen and all(strides == (False, True) for strides in seen)


def fake_slices(step: StaticStep, sequences: int, tokens: int, length: int) -> list[Slice]:
    """``sequences`` slices of ``tokens`` tokens each over pool rows whose caches hold ``length`` tokens."""
    slices = []
    for _ in range(sequences):
        cache = step.pool.acquire(step.pool.capacity)
        cache.advance(length)
        slices.append(Slice([1] * tokens, None, None, None, cache, host_positions=range(length, length + tokens),
                            host_rows=[tokens - 1]))
    return slices


def assert_valid(bucket: Bucket, step: StaticStep, slices: list[Slice]) -> None:
    """``bucket`` holds ``slices`` within the pool: every write lands in an attended slot of a real row."""
    assert bucket.tokens <= bucket.attended and bucket.attended in step.attended
    assert bucket.attended <= step.pool.row_capacity and bucket.tokens <= step.pool.row_capacity - step.pool.capacity
    assert len(slices) <= bucket.sequences <= step.pool.sequences and bucket.sequences in SEQUENCE_BUCKETS
    assert bucket.sequences * bucket.tokens <= step.max_bucket_tokens
    assert all(slice_.cache.length + bucket.tokens <= bucket.attended for slice_ in slices)


def test_every_bucket_a_step_can_pick_is_a_valid_shape():
    step = cuda_preset_step(long_tiny_llama(), sequences=8)
    picked = set()
    for sequences, tokens in itertools.product(range(1, step.pool.sequences + 1), sorted({*TOKEN_BUCKETS, 3, 95, 97})):
        for length in sorted({0, 1, 63, 64, 65, 511, 4000, step.pool.capacity - tokens}):
            slices = fake_slices(step, sequences, tokens, length)
            bucket = step.bucket(slices)
            if bucket is not None:
                assert_valid(bucket, step, slices)
                picked.add(bucket)
            for slice_ in slices:
                step.pool.release(slice_.cache)
    assert len(picked) > 100


def test_a_bucket_that_cannot_hold_its_tokens_is_never_built():
    with pytest.raises(ValueError, match="cannot hold its tokens"):
        Bucket(1, 96, 64)
    step = cuda_preset_step(long_tiny_llama())
    buckets = warm_buckets(step)
    assert Bucket(1, 512, 512) in buckets and Bucket(1, 64, 64) in buckets
    assert {bucket.tokens for bucket in buckets} == set(TOKEN_BUCKETS)
    assert all(bucket.tokens <= bucket.attended for bucket in buckets)


def test_the_server_start_rehearses_the_capture_of_every_warm_bucket():
    from decoding.decoder import Decoder
    from decoding.weights.loading import LoadedModel

    model = long_tiny_llama()
    decoder = Decoder(LoadedModel(model, None, "tiny", "", model.device, model.dtype), "torch")
    static = decoder.static_step(BatchPolicy(static_step="graphs", static_sequences=2))
    names = warm_buckets(static)
    assert static.rehearsal and static.captures == len(names) == len(static._buckets) == 53  # 13 x 5, less 12

    assert static.capture_failures == 0


def input_buffer(bucket: Bucket, **fields: list[int]) -> torch.Tensor:
    """A valid input buffer for ``bucket`` (one token per sequence chained, rows 0..), with ``fields`` replaced."""
    count = bucket.sequences * bucket.tokens
    values = {
        "token_ids": [1] * count, "positions": list(range(count)),
        "parents": [-1 if index % bucket.tokens == 0 else index % bucket.tokens - 1 for index in range(count)],
        "read_rows": list(range(count)),
        "lengths": [0] * bucket.sequences, "rows": [0] * bucket.sequences,
    }
    values.update(fields)
    return torch.tensor([value for field in values.values() for value in field])


@pytest.mark.parametrize(("field", "value"), [
    ("token_ids", [1, 64]), ("token_ids", [-1, 1]), ("read_rows", [0, 2]), ("read_rows", [-1, 0]),
    ("rows", [3]), ("parents", [-1, 1]), ("parents", [-2, 0]), ("lengths", [7]), ("lengths", [-1]),
])
def test_an_index_out_of_range_is_an_error_naming_the_bucket_and_field(field, value):
    bucket = Bucket(1, 2, 8)
    bounds = input_bounds(bucket, pool_rows=3, vocab=64)
    check_inputs(input_buffer(bucket), bucket, bounds)
    check_slices(input_buffer(bucket).tolist(), bucket, pool_rows=3, vocab=64)
    with pytest.raises(StaticInputError, match=rf"Bucket\(sequences=1, tokens=2, attended=8\): {field}\["):
        check_inputs(input_buffer(bucket, **{field: value}), bucket, bounds)
    with pytest.raises(StaticInputError, match=rf"Bucket\(sequences=1, tokens=2, attended=8\): {field}\["):
        check_slices(input_buffer(bucket, **{field: value}).tolist(), bucket, pool_rows=3, vocab=64)


def test_every_field_of_a_batched_bucket_is_named_where_it_fails():
    bucket = Bucket(4, 8, 64)
    bounds = input_bounds(bucket, pool_rows=5, vocab=64)
    check_inputs(input_buffer(bucket), bucket, bounds)
    rows = [0, 1, 2, 5]
    with pytest.raises(StaticInputError, match=r": rows\[3\] holds 5, outside \[0, 5\)"):
        check_inputs(input_buffer(bucket, rows=rows), bucket, bounds)
    read = [row if index != 17 else 32 for index, row in enumerate(range(32))]
    with pytest.raises(StaticInputError, match=r": read_rows\[17\] holds 32"):
        check_inputs(input_buffer(bucket, read_rows=read), bucket, bounds)


def test_a_step_with_a_bad_token_fails_on_the_host_before_its_forward():
    step = StaticStep(tiny_llama(), KVPool(tiny_llama(), 1, 64, scratch_tokens=64), "graphs")
    cache = step.pool.acquire(60)
    runs = step.runs
    with torch.inference_mode(), pytest.raises(StaticInputError, match=r"token_ids\[1\] holds 64"):
        step.run([Slice([1, 64], torch.arange(2), None, torch.arange(2), cache)])
    assert step.runs == runs and cache.length == 0


def test_a_failed_capture_falls_back_only_while_the_device_works(monkeypatch):
    step = StaticStep(tiny_llama(), KVPool(tiny_llama(), 1, 64, scratch_tokens=64), "graphs")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    step._fall_back(Bucket(1, 1, 64))
    assert (step.mode, step.capture_failures) == ("eager", 1)

    def broken(device=None):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    with pytest.raises(RuntimeError, match="unusable"):
        step._fall_back(Bucket(1, 2, 64))
    assert step.capture_failures == 1


def test_a_pool_commit_outside_its_row_is_an_error_on_the_host():
    pool = KVPool(tiny_llama(), 2, 32, scratch_tokens=8)
    pool.defer(0, 3, [5, 39])  # the last slot of a row: fine
    for row, keep, sources in ((3, 0, [1]), (-1, 0, [1]), (0, 4, [2]), (1, 0, [40])):
        with pytest.raises(IndexError, match="KV pool commit out of range"):
            pool.defer(row, keep, sources)
    assert len(pool._moves) == 1


def test_a_conversation_through_the_rehearsed_pool_keeps_its_prefix_between_turns():
    """A finished decode leaves its KV in the prefix cache from the engine's step, outside inference mode, through
    the pool's staged moves (what failed every request after the first on the GPU server, 2026-11-28: the staging
    buffer, made in inference mode, written outside it). Greedy turns decode the same as an eager engine's."""
    from decoding.batch import BatchEngine
    from decoding.params import LookaheadConfig, StopCriteria

    model = tiny_llama()
    static = StaticStep(model, KVPool(model, 2, 256, scratch_tokens=TOKEN_BUCKETS[-1]), mode="graphs")
    assert static.rehearsal and static.pool.staged
    cached_engine = BatchEngine(model, BatchPolicy(prefix_cache_tokens=4096, static_step="graphs"), static=static)
    eager_engine = BatchEngine(model)
    prompt = [1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2]
    cached_tokens = []
    for turn in range(3):
        outputs = []
        for engine in (cached_engine, eager_engine):
            engine.add(turn, list(prompt), StopCriteria(12), lookahead=LookaheadConfig(3, 3, 3))
            tokens, cached = [], 0
            while engine.has_work:
                for _, step in engine.step():
                    assert not isinstance(step, BaseException), step
                    tokens.extend(step.token_ids)
                    cached += step.cached_tokens
            outputs.append(tokens)
            if engine is cached_engine:
                cached_tokens.append(cached)
        assert outputs[0] == outputs[1]
        prompt += outputs[0] + [20 + turn, 21]
    assert cached_tokens[0] == 0 and all(cached > 0 for cached in cached_tokens[1:])
    assert static.runs > 0 and cached_engine.prefix_cache_stats().hits == 2


def test_eight_wide_lookahead_streams_stay_in_the_buckets():
    """Eight streams at the CUDA preset's window, priced on a flat curve as a GPU's graphs are: each lookahead
    step a stream wants alone (up to ~340 tokens) would make an 8 x 384 shape that fits no bucket, and on an H200
    such forwards ran eagerly at 0.18x one stream's throughput (2026-11-28). The batch keeps every forward in a
    bucket, and each stream decodes as it does alone."""
    from decoding.batch import BatchEngine
    from decoding.params import LookaheadConfig, StopCriteria

    model = tiny_llama()
    static = build_static_step(model, "graphs", 8)
    flat = ((1, 1.0), (1024, 1.0))
    engine = BatchEngine(model, BatchPolicy(max_step_tokens=1024, prefill_chunk=512, step_cost=flat,
                                            static_step="graphs", static_sequences=8), static=static)
    config = LookaheadConfig(16, 5, 32, copy_length=16, copy_min_match=0, copy_candidates=4, copy_stretch=4,
                             recycled=8, recycled_tree=128)  # configs/cuda.yaml's
    prompts = {index: [1 + index, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2] * 3 for index in range(8)}
    for index, prompt in prompts.items():
        engine.add(index, prompt, StopCriteria(48), lookahead=config)
    outputs: dict[int, list[int]] = {index: [] for index in prompts}
    widest = 0
    while engine.has_work:
        for index, step in engine.step():
            assert not isinstance(step, BaseException), step
            outputs[index].extend(step.token_ids)
            widest = max(widest, len(step.token_ids))
    assert static.eager == 0 and static.runs > 0
    alone = BatchEngine(model)
    for index, prompt in prompts.items():
        alone.add(index, prompt, StopCriteria(48))
        tokens = []
        while alone.has_work:
            tokens.extend(token for _, step in alone.step() for token in step.token_ids)
        assert tokens == outputs[index]


def test_a_failed_fused_capture_steps_down_to_graphs_then_to_eager(monkeypatch):
    """Each capture that fails on a working device steps the mode down (fused, graphs, eager) and the bucket still
    gets a forward: greedy ids equal the eager step's."""
    model = tiny_llama()
    step = StaticStep(model, KVPool(model, 1, 64, scratch_tokens=64), "fused", backend="eager")
    step.rehearsal = False  # take the capture's own path, as on CUDA
    tried = []

    def failing(call, compiled):
        tried.append(step.mode)
        raise RuntimeError("capture failed")

    monkeypatch.setattr(step, "_capture", failing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    eager = StaticStep(tiny_llama(), KVPool(tiny_llama(), 1, 64, scratch_tokens=64), "eager")
    with torch.inference_mode():
        ids = [static.run([Slice([1, 2, 3], torch.arange(3), None, torch.arange(3), static.pool.acquire(60))])[1][0]
               for static in (step, eager)]
    assert tried == ["fused", "graphs"] and (step.mode, step.capture_failures) == ("eager", 2)
    assert list(ids[0]) == list(ids[1])
