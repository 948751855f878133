"""A LLaMA built from a GGUF file with its quantized weights kept as they are: a tiny GGUF written here (Q4_0,
Q4_1, Q8_0 and float16 tensors, q/k rows permuted as llama.cpp stores them) runs the same logits as transformers'
model over gguf's de-quantized weights (each quantized linear's input rounded to 8 bits as the kernel rounds it),
lookahead == greedy on it, and the weights choice resolves as documented."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.decoder import check_linear_options, gguf_refusal, resolve_weights
from decoding.errors import InvalidParameterError, ModelLoadError
from decoding.params import LookaheadConfig, StopCriteria
from decoding.step.stream import generate_autoregressive, generate_lookahead
from decoding.weights import native
from decoding.weights.gguf_model import build_gguf_model, read_tensors, rope_order
from decoding.weights.linears import FusedLinear, KernelLinear, PackedFloat32
from decoding.weights.quant_panels import PanelEmbedding, QuantKernel, rounded

gguf = pytest.importorskip("gguf")
needs_kernel = pytest.mark.skipif(native.panel_gemm() is None, reason="needs the native kernel")

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
# Each tensor's GGUF type, per test model: all of one format, and a mix with a float16 tensor that runs de-quantized.
LAYOUTS = {
    "Q4_0": dict.fromkeys(NAMES.values(), "Q4_0"),
    "Q4_1": dict.fromkeys(NAMES.values(), "Q4_1"),
    "Q8_0": dict.fromkeys(NAMES.values(), "Q8_0"),
    "mixed": {**dict.fromkeys(NAMES.values(), "Q4_1"), "attn_v": "Q8_0", "ffn_down": "F16"},
}
PROMPTS = [[1, 5, 7, 9, 5, 7, 9, 5, 7, 3, 2, 5, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [42]]


def llama_cpp_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a query or key weight (convert_hf_to_gguf.py), the inverse of ``rope_order``."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def encode(writer, name: str, weight: np.ndarray, type_name: str) -> np.ndarray:
    """Add ``weight`` to ``writer`` in ``type_name``; return what a reader de-quantizes it to."""
    kind = gguf.GGMLQuantizationType[type_name]
    data = weight.astype(np.float16) if type_name == "F16" else gguf.quantize(weight, kind)
    writer.add_tensor(name, data, raw_dtype=kind)
    return gguf.dequantize(data, kind).reshape(weight.shape).astype(np.float32)


def write_tiny_gguf(path, layout: dict[str, str], seed: int = 0) -> tuple[LlamaConfig, LlamaForCausalLM]:
    """A tiny random LLaMA written to ``path`` as GGUF (embedding Q8_0, norms float32, linears as ``layout``
    says); returns its config and transformers' model over the de-quantized weights (the reference)."""
    config = LlamaConfig(**SIZES)
    torch.manual_seed(seed)
    reference = LlamaForCausalLM(config).eval()
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    writer = gguf.GGUFWriter(str(path), "llama")
    decoder = reference.model
    with torch.no_grad():
        decoder.embed_tokens.weight.normal_()  # a tied table of unit scale, as real models have
        for layer in decoder.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
        stored = encode(writer, "token_embd.weight", decoder.embed_tokens.weight.numpy(), "Q8_0")
        decoder.embed_tokens.weight.copy_(torch.from_numpy(stored))
        writer.add_tensor("output_norm.weight", decoder.norm.weight.numpy())
        for index, layer in enumerate(decoder.layers):
            writer.add_tensor(f"blk.{index}.attn_norm.weight", layer.input_layernorm.weight.numpy())
            writer.add_tensor(f"blk.{index}.ffn_norm.weight", layer.post_attention_layernorm.weight.numpy())
            for module_name, gguf_name in NAMES.items():
                block = layer.self_attn if gguf_name.startswith("attn") else layer.mlp
                linear = getattr(block, module_name)
                weight = linear.weight.numpy()
                if gguf_name in heads:
                    weight = llama_cpp_order(weight, heads[gguf_name])
                values = encode(writer, f"blk.{index}.{gguf_name}.weight", weight, layout[gguf_name])
                if gguf_name in heads:
                    values = values[rope_order(values.shape[0], heads[gguf_name]).numpy()]
                linear.weight.copy_(torch.from_numpy(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, reference


def quantized_kernel(module: nn.Module) -> bool:
    """Whether ``module`` (one of our model's linears) runs through the quantized kernel."""
    kernel = module._fused.kernel if isinstance(module, FusedLinear) else getattr(module, "kernel", None)
    return isinstance(kernel, QuantKernel)


def round_inputs_where_quantized(model: nn.Module, reference: nn.Module) -> None:
    """Make each of ``reference``'s linears whose twin in ``model`` runs through the quantized kernel take its input
    rounded as that kernel rounds it (``quant_panels.rounded``, llama.cpp's 8-bit activations); a linear that runs
    de-quantized in float32 keeps its input."""
    modules = dict(model.named_modules())
    for name, linear in reference.named_modules():
        if isinstance(linear, nn.Linear) and quantized_kernel(modules[name]):
            linear.register_forward_pre_hook(lambda _, inputs: (rounded(inputs[0]),))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def tiny_pair(request, tmp_path_factory):
    """(our model from the tiny GGUF, transformers' model over its de-quantized weights, each linear's input
    rounded where ours runs quantized), per layout."""
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    config, reference = write_tiny_gguf(path, LAYOUTS[request.param])
    model = build_gguf_model(path, config, native.panel_gemm())
    round_inputs_where_quantized(model, reference)
    return model, reference


def test_rope_order_undoes_llama_cpps_permutation():
    weight = np.arange(24 * 3).reshape(24, 3)
    for heads in (1, 2, 3):
        permuted = llama_cpp_order(weight, heads)
        assert np.array_equal(permuted[rope_order(24, heads).numpy()], weight)


@needs_kernel
def test_every_linear_runs_on_one_packed_copy_and_the_embedding_shares_the_heads(tiny_pair):
    model, _ = tiny_pair
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(module, FusedLinear) for module in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert isinstance(mlp.gate_proj, FusedLinear) and isinstance(attention.o_proj, KernelLinear)
    assert not any(isinstance(module, (nn.Linear, nn.Embedding)) for module in model.modules())
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, PanelEmbedding) and embedding.kernel is head.kernel
    assert isinstance(head.kernel, QuantKernel) and head.kernel.format.name == "Q8_0"
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())  # the norms


@needs_kernel
def test_a_float16_tensor_runs_de_quantized(tmp_path):
    path = tmp_path / "mixed.gguf"
    config, _ = write_tiny_gguf(path, LAYOUTS["mixed"])
    model = build_gguf_model(path, config, native.panel_gemm())
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.kernel, PackedFloat32)
    assert isinstance(layer.self_attn.q_proj._fused.kernel, PackedFloat32)  # q/k Q4_1 with v Q8_0: one float32
    assert isinstance(layer.mlp.gate_proj._fused.kernel, QuantKernel)


@needs_kernel
def test_logits_equal_transformers_over_the_de_quantized_weights(tiny_pair):
    model, reference = tiny_pair
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize(
    "config",
    [LookaheadConfig(1, 4, 3, lazy_window=True, copy_length=16), LookaheadConfig(2, 4, 4), LookaheadConfig(7, 5, 7),
     LookaheadConfig(3, 3, 2, copy_length=8, window_chains=True)],
    ids=["cpu-preset", "2-4-4", "7-5-7", "3-3-2-chains"],
)
def test_lookahead_equals_greedy_on_quantized_weights(tiny_pair, config):
    model, _ = tiny_pair
    stop = StopCriteria(max_tokens=40)
    for prompt in PROMPTS:
        greedy = [t for step in generate_autoregressive(model, prompt, stop) for t in step.token_ids]
        ahead = [t for step in generate_lookahead(model, prompt, stop, lookahead=config) for t in step.token_ids]
        assert ahead == greedy, prompt


@needs_kernel
def test_another_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_tensors(path)[0] == "gpt2"
    with pytest.raises(ModelLoadError, match="LLaMA"):
        build_gguf_model(path, LlamaConfig(**SIZES), native.panel_gemm())


def test_the_weights_choice_resolves_as_documented(monkeypatch):
    assert resolve_weights("float32", "default", "cpu", "float32") == "float32"
    assert resolve_weights("auto", "/some/model/dir", "cpu", "auto") == "float32"
    assert resolve_weights("auto", "default", "cpu", "auto", quantize="int8") == "float32"
    assert resolve_weights("auto", "default", "cpu", "bfloat16") == "float32"
    with pytest.raises(InvalidParameterError, match="not a GGUF file") as caught:
        resolve_weights("gguf", "/some/model/dir", "cpu", "auto")
    assert caught.value.param == "weights"
    with pytest.raises(InvalidParameterError, match="weights must be one of"):
        check_linear_options("none", "auto", "int4")
    with pytest.raises(InvalidParameterError, match="as they are"):
        check_linear_options("int8", "auto", "gguf")
    monkeypatch.setattr(native, "panel_gemm", lambda: None)
    assert "native kernel" in gguf_refusal("model.gguf", "cpu", "auto")
    assert resolve_weights("auto", "default", "cpu", "auto") == "float32"
    monkeypatch.undo()
    if native.panel_gemm() is not None:
        assert resolve_weights("auto", "default", "cpu", "auto") == "gguf"
        assert resolve_weights("auto", "model.gguf", "cpu", "float32") == "gguf"
