"""The tree attention op (``decoding.forward.tree_attention``): chosen where a GPU would take its kernel, the static
step through it gives the packed forward's logits and lookahead == greedy, and its Triton kernel (through Triton's
interpreter, in a subprocess) matches the reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from decoding.batch import BatchEngine
from decoding.forward import tree_attention
from decoding.forward.kv_cache import KVPool
from decoding.forward.slices import Slice
from decoding.forward.static import TOKEN_BUCKETS, StaticStep
from decoding.forward.static_forward import prepare_weights
from tests.conftest import tiny_llama
from tests.decoding.forward.test_static import CUDA_PRESET, GRID, decode
from tests.decoding.forward.test_static_cuda_path import assert_gives_the_packed_forward
from tests.decoding.test_batch import PROMPTS

ROOT = Path(__file__).resolve().parents[3]
WIDE_HEADS = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)  # heads of 16: the kernel takes them


def wide_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**WIDE_HEADS)).eval()


def wide_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**WIDE_HEADS, use_sliding_window=False)).eval()


def test_cudas_path_takes_the_op_where_a_gpu_would_take_the_kernel():
    assert prepare_weights(wide_llama(), "cuda").tree_kernel
    assert not prepare_weights(wide_llama(), "cpu").tree_kernel  # the CPU's own path keeps its attention
    assert not prepare_weights(tiny_llama(), "cuda").tree_kernel  # heads of 8: too narrow for tl.dot
    weights = prepare_weights(wide_llama(), "cuda")
    assert not weights.fold_groups and weights.layers[0].qkv.shape[1] == (4 + 2 * 2) * 16  # no rotate-half columns


@pytest.mark.parametrize("make", [wide_llama, wide_qwen2], ids=["llama", "qwen2"])
def test_the_static_step_through_the_op_gives_the_packed_forward(make):
    model, reference = make(), make()
    runner = StaticStep(model, KVPool(model, 2, 64, scratch_tokens=64), "graphs")
    assert runner.weights.tree_kernel
    assert_gives_the_packed_forward(runner, reference)


@pytest.mark.parametrize("config", [GRID[1], GRID[3], CUDA_PRESET], ids=["4-4-4", "copies", "cuda-preset"])
@pytest.mark.parametrize("make", [wide_llama, wide_qwen2], ids=["llama", "qwen2"])
def test_lookahead_equals_greedy_through_the_op(make, config):
    model = make()
    runner = StaticStep(model, KVPool(model, 4, 512, scratch_tokens=256), "graphs")
    with torch.inference_mode():
        greedy = decode(BatchEngine(model, static=runner), PROMPTS, [None] * len(PROMPTS), 24)
        assert decode(BatchEngine(model, static=runner), PROMPTS, [config] * len(PROMPTS), 24) == greedy


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_triton_kernel_matches_the_reference_under_the_interpreter():
    """The kernels on the CPU through Triton's interpreter (chosen when Triton is imported, hence a subprocess): a
    grid of shapes and every token bucket against the references, then greedy decodes with them in every layer."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.decoding.forward.tree_triton_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MISMATCH" not in done.stdout and done.stdout.count("same tokens as greedy") == 2, done.stdout
    assert done.stdout.count("bucket ") == len(TOKEN_BUCKETS) + 1, done.stdout  # every token bucket, and a batch


def test_the_reference_sees_each_tokens_ancestors_and_the_prefix_only():
    """One sequence, no grouped heads, values that name their slot: each output row is the mean-free mix of exactly
    the slots the token sees, so zero scores (queries of zeros) average them."""
    states = torch.zeros(3, 3 * 16)  # one q, k and v head of 16; q = k = 0: every seen slot scores the same
    states[:, 32:] = torch.tensor([[100.0], [200.0], [300.0]])  # step token i's value: (i + 1) * 100
    rotation = torch.stack((torch.ones(3, 16), torch.zeros(3, 16)), dim=1)
    cache = torch.zeros(1, 2, 8, 16)
    cache[0, 1, :2] = torch.tensor([[10.0], [20.0]])  # two cached slots, values 10 and 20
    parents = torch.tensor([[-1, 0, -1]])  # token 1's parent is token 0; token 2 stands alone
    reach = tree_attention.reference_reach(parents)
    assert reach.tolist() == [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    output = tree_attention.reference(states, rotation, cache, reach, torch.tensor([2]), torch.tensor([0]), 1, 1.0)
    means = output[:, 0].tolist()
    assert means == pytest.approx([(10 + 20 + 100) / 3, (10 + 20 + 100 + 200) / 4, (10 + 20 + 300) / 3])
    assert cache[0, 1, 2:5, 0].tolist() == [100.0, 200.0, 300.0]  # the step's values written after the prefix


def test_a_kernel_that_fails_leaves_the_reference_serving(monkeypatch, caplog):
    from tests.decoding.forward.tree_triton_check import random_case

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(tree_attention, "triton_available", lambda: True)
    monkeypatch.setattr(tree_attention, "_interpreting", lambda: True)
    monkeypatch.setattr(tree_attention, "launch", broken)
    monkeypatch.setattr(tree_attention, "_kernel_failed", False)
    (states, rotation, cache, *rest), _ = random_case(1, 4, 2, 1, 16, [3], torch.device("cpu"))
    expected = tree_attention.reference(states, rotation, cache.clone(), *rest)
    for _ in range(2):
        output = tree_attention.tree_attention(states, rotation, cache, *rest)
        torch.testing.assert_close(output, expected)
    assert tree_attention._kernel_failed
    assert sum("tree attention kernel failed" in record.message for record in caplog.records) == 1


@pytest.mark.parametrize("tokens", [1, 100])
def test_the_cuda_paths_eager_forward_is_ten_ops_a_layer(tokens):
    """What ``"graphs"`` captures on a GPU (the forward run eagerly): with the ops, ~10.5 ATen ops a layer, views
    included (774 without them, at one token), whatever the step's size."""
    from bench.counters import OpCounter
    from bench.probe import tiny_deep_llama
    from decoding.forward.static_forward import static_forward

    model = tiny_deep_llama()
    runner = StaticStep(model, KVPool(model, 1, 300, scratch_tokens=256), "graphs")
    cache = runner.pool.acquire(300)
    step = Slice(list(range(tokens)), torch.arange(tokens), None, torch.arange(tokens), cache)
    bucket = runner.bucket([step])
    compiled = runner._compiled(bucket)
    with torch.inference_mode(), OpCounter() as counter:
        static_forward(runner.weights, runner._views(bucket.attended), compiled.inputs, bucket.sequences,
                       bucket.tokens)
    assert counter.ops["lookahead.tree_attention.default"] == 30 and counter.ops["lookahead.tree_reach.default"] == 1
    assert 30 * 10 <= sum(counter.ops.values()) <= 30 * 11 + 10, counter.ops


def test_the_fused_step_through_the_op_gives_the_packed_forward():
    """Inductor's compile of the forward around the op (its mutation of the pool re-placed in the compiled code):
    the keys and values the op writes are there for the next step, as in the plain forward."""
    model, reference = wide_llama(), wide_llama()
    runner = StaticStep(model, KVPool(model, 2, 64, scratch_tokens=64), "fused")
    assert runner.weights.tree_kernel
    assert_gives_the_packed_forward(runner, reference)
    assert runner.fused is not None and runner.fused.compiles >= 1
