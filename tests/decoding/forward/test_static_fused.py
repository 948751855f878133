"""The fused static step: one compile per class of buckets (sequences, tokens and attended length symbolic, no
recompile over a whole batched lookahead decode: every compile reaches the counting backend), greedy output unchanged
through it on LLaMA and Qwen2, and the forward inductor writes equal to the plain one."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.debugging import aot_eager

from decoding.batch import BatchEngine
from decoding.forward.kv_cache import KVPool
from decoding.forward.slices import Slice
from decoding.forward.static import StaticStep
from decoding.forward.static_forward import static_forward
from decoding.forward.static_fused import TOKEN_CLASSES, token_class
from decoding.params import LookaheadConfig
from tests.conftest import tiny_llama, tiny_qwen2
from tests.decoding.forward.test_static import CUDA_PRESET, decode, greedy_alone
from tests.decoding.test_batch import PROMPTS

ARCHITECTURES = {"llama": tiny_llama, "qwen2": tiny_qwen2}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """No compiled graph outlives a test."""
    yield
    torch._dynamo.reset()


def counting_backend(graphs: list, compiler=aot_eager):
    """``compiler`` (``aot_eager``: the trace inductor gets, run by ATen) recording each graph's input shapes: a
    recompile is one more graph."""

    def backend(graph_module, example_inputs):
        graphs.append([tuple(tensor.shape) for tensor in example_inputs if isinstance(tensor, torch.Tensor)])
        return compiler(graph_module, example_inputs)

    return backend


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_a_batched_lookahead_decode_compiles_once_per_class_and_stays_greedy(architecture):
    """Three streams at the CUDA preset and one small window, through the rehearsed fused step: every bucket they
    visit (one sequence and several, a token and many, several attended lengths) runs a class's one compile."""
    make = ARCHITECTURES[architecture]
    graphs: list = []
    model = make()
    runner = StaticStep(model, KVPool(model, 4, 600, scratch_tokens=512), "fused", backend=counting_backend(graphs))
    configs = [CUDA_PRESET, CUDA_PRESET, LookaheadConfig(2, 3, 2)]
    outputs = decode(BatchEngine(model, static=runner), PROMPTS[:3], configs, max_tokens=40)
    assert outputs == [greedy_alone(make(), prompt, 40) for prompt in PROMPTS[:3]]
    classes = {(bucket.sequences > 1, token_class(bucket.tokens)) for bucket in runner._buckets}
    assert runner.fused.compiles == len(graphs) == len(classes) < len(runner._buckets)
    assert len({bucket.attended for bucket in runner._buckets}) > 1  # the attended length varied under one compile
    assert runner.stats().mode == "fused (rehearsed)"


def test_token_classes_cover_every_token_bucket():
    from decoding.forward.static import TOKEN_BUCKETS

    assert {token_class(tokens) for tokens in TOKEN_BUCKETS} == set(TOKEN_CLASSES)
    with pytest.raises(ValueError, match="longer than"):
        token_class(TOKEN_CLASSES[-1] + 1)


def test_the_forward_inductor_writes_equals_the_plain_forward():
    """Inductor itself (C++ kernels on the CPU), one class, three buckets of it: logits within float rounding of
    the plain forward's, the same argmax and top ids."""
    from torch._inductor.compile_fx import compile_fx

    graphs: list = []
    model = tiny_llama()
    runner = StaticStep(model, KVPool(model, 1, 300, scratch_tokens=64), "fused",
                        backend=counting_backend(graphs, compile_fx))
    cache = runner.pool.acquire(300)
    with torch.inference_mode():
        runner.run([Slice(list(range(1, 7)), torch.arange(6), None, torch.arange(1), cache)])  # T=8: class 8
        for tokens in (5, 3):  # class 8 again: the same compile
            parents = tuple(range(-1, tokens - 1))
            step = Slice(list(range(7, 7 + tokens)), torch.arange(cache.length, cache.length + tokens),
                         torch.ones(tokens, tokens, dtype=torch.bool).tril_(), torch.arange(tokens), cache, parents)
            bucket = runner.bucket([step])
            compiled = runner.prepare([step], bucket)
            plain = static_forward(runner.weights, runner._views(bucket.attended), compiled.inputs, 1, bucket.tokens,
                                   top_k=runner.top_k)
            logits, ids = runner.launch(compiled)
            torch.testing.assert_close(logits.view(plain[0].shape), plain[0], rtol=1e-5, atol=1e-5)
            assert torch.equal(ids[:, :2], plain[1][:, :2])
            runner.collect([step], logits, ids)
    assert runner.fused.compiles == len(graphs) == 1
