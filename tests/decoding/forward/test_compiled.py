"""The compiled CPU forward (``decoding.forward.compiled``) and the native kernels as torch ops: the graph functions,
run eagerly, compute the lean forward's logits bit for bit on tiny packed and GGUF models, lookahead == greedy through
them, the ops equal the kernels and have fake shapes; models it cannot run are refused. A real ``torch.compile``
takes minutes cold: that test runs only with ``LOOKAHEAD_TEST_COMPILE=1``."""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from decoding.forward import lean
from decoding.forward.compiled import CompiledForward
from decoding.forward.kv_cache import new_cache
from decoding.forward.packed import LEAN_FORWARD, forward_packed
from decoding.forward.slices import Slice
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from decoding.weights import native
from decoding.weights.gguf_model import build_gguf_model
from decoding.weights.linears import pack_float32
from tests.conftest import tiny_llama, tiny_qwen2
from tests.decoding.weights.test_gguf_model import LAYOUTS, write_tiny_gguf

needs_kernel = pytest.mark.skipif(native.panel_gemm() is None, reason="needs the native kernel")


def eager(function):
    return function


@pytest.fixture(scope="module", params=["llama-packed", "qwen2-packed", "gguf-Q4_1", "gguf-Q8_0"])
def model(request, tmp_path_factory):
    """Tiny models the compiled forward runs: float32 panels (LLaMA; Qwen2, with q/k/v biases) and GGUF blocks."""
    if native.panel_gemm() is None:
        pytest.skip("needs the native kernel")
    name = request.param
    if name.startswith("gguf"):
        path = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
        config, _ = write_tiny_gguf(path, LAYOUTS[name.split("-")[1]])
        return build_gguf_model(path, config, native.panel_gemm())
    return pack_float32(tiny_llama() if name.startswith("llama") else tiny_qwen2())


def step_logits(model, forward) -> list[torch.Tensor]:
    """A 5-token prefill, then a masked 4-token step and a one-token step on one cache, stepped by ``forward``
    (None: the lean forward); every row's logits."""
    setattr(model, LEAN_FORWARD, forward or lean.forward)  # set, so the fused step stands aside
    cache = new_cache(model, 32)
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    try:
        with torch.inference_mode():
            logits = forward_packed(model, [Slice([3, 9, 4, 1, 7], torch.arange(5), None, torch.arange(5), cache)])
            logits += forward_packed(model, [Slice([12, 13, 14, 15], torch.tensor([5, 6, 6, 7]), visible,
                                                   torch.arange(4), cache)])
            logits += forward_packed(model, [Slice([8], torch.tensor([9]), None, torch.arange(1), cache)])
    finally:
        model.__dict__.pop(LEAN_FORWARD, None)
    return logits


def test_the_graph_functions_run_eagerly_give_the_lean_forwards_logits_bit_for_bit(model):
    compiled = CompiledForward.build(model, compile=eager)
    assert compiled is not None
    for got, expected in zip(step_logits(model, compiled), step_logits(model, None), strict=True):
        assert torch.equal(got, expected)


def test_lookahead_equals_greedy_through_the_graph_functions(model):
    setattr(model, LEAN_FORWARD, CompiledForward.build(model, compile=eager))
    try:
        stop = StopCriteria(max_tokens=24)
        for prompt in ([1, 5, 7, 9, 5, 7, 9, 5, 7, 3], [42]):
            greedy = [t for step in generate_autoregressive(model, prompt, stop) for t in step.token_ids]
            lookahead = LookaheadConfig(1, 3, 2, copy_length=8)
            ahead = [t for step in generate_lookahead(model, prompt, stop, lookahead=lookahead) for t in step.token_ids]
            assert ahead == greedy
    finally:
        model.__dict__.pop(LEAN_FORWARD, None)


def test_models_it_cannot_run_are_refused():
    assert CompiledForward.build(tiny_llama(), compile=eager) is None  # transformers' nn.Linear, no native kernel
    assert CompiledForward.build(tiny_llama().to(torch.float64), compile=eager) is None


@needs_kernel
def test_the_ops_equal_the_kernels_and_have_fake_shapes(gemm):
    torch.manual_seed(0)
    rows, weight = torch.randn(3, 64), torch.randn(32, 64)
    panels = gemm.pack(weight)
    assert torch.equal(torch.ops.lookahead.panel_gemm(rows, panels), gemm(rows, panels))
    raw = torch.randint(0, 256, (32, 2 * 34), dtype=torch.uint8)
    raw.view(32, 2, 34)[..., :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # float16 scale 1.0 per block
    from decoding.weights.quant_panels import FORMATS, QuantizedWeight, QuantKernel

    kernel = QuantKernel(QuantizedWeight(FORMATS["Q8_0"], raw, 64), gemm)
    expected = kernel(rows)
    got = torch.ops.lookahead.quant_gemm(rows, kernel.panels, kernel.format.kind, kernel.lanes, 64)
    assert torch.equal(got, expected)
    with FakeTensorMode() as mode:
        fake_rows = mode.from_tensor(rows)
        assert torch.ops.lookahead.panel_gemm(fake_rows, mode.from_tensor(panels)).shape == (3, 32)
        shape = torch.ops.lookahead.quant_gemm(fake_rows, mode.from_tensor(kernel.panels), 2, kernel.lanes, 64).shape
        assert shape == (3, 32)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LOOKAHEAD_TEST_COMPILE") != "1", reason="compiles: LOOKAHEAD_TEST_COMPILE=1")
def test_torch_compile_keeps_lookahead_equal_to_greedy_and_the_logits_close(model):
    compiled = CompiledForward.build(model)
    for got, expected in zip(step_logits(model, compiled), step_logits(model, None), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    setattr(model, LEAN_FORWARD, compiled)
    try:
        stop, lookahead = StopCriteria(max_tokens=24), LookaheadConfig(1, 3, 2, copy_length=8)
        prompt = [1, 5, 7, 9, 5, 7, 9, 5, 7, 3]
        greedy = [t for step in generate_autoregressive(model, prompt, stop) for t in step.token_ids]
        assert [t for step in generate_lookahead(model, prompt, stop, lookahead=lookahead) for t in step.token_ids] \
            == greedy
    finally:
        model.__dict__.pop(LEAN_FORWARD, None)
