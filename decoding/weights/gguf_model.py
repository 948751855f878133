"""A LLaMA model built from a GGUF file with its quantized weights kept as they are: one copy of each, in panels.

Contract: ``load_gguf_model(spec, gemm)`` loads a GGUF model (``decoding.weights.loading.is_gguf_model``) this way, with
its tokenizer and generation config (``decoding.weights.loading.gguf_files``), as a ``LoadedModel`` on the CPU in
float32. ``build_gguf_model(path, config, gemm)`` returns a float32 CPU ``LlamaForCausalLM`` in eval mode whose weights
come from the GGUF file ``path`` without any float32 copy of a quantized tensor: every linear layer of the decoder is a
kernel module (``decoding.weights.linears``) over the tensor's blocks packed once into the native kernel's panels
(``decoding.weights.quant_panels``; q/k/v and gate/up fused as ``decoding.weights.linears`` fuses them), the norms are
the file's float32 vectors, and a tied token embedding is read from the output projection's panels (``PanelEmbedding``):
the embedding and the LM head share one copy. Tensors in another GGUF type (float16, k-quants) are de-quantized by gguf
and run as ``PackedFloat32``. ``config`` is the model's transformers config (``model_type`` "llama"); ``ModelLoadError``
when the file lacks a tensor the config needs or holds another architecture. The query and key rows are un-permuted as
transformers' GGUF loader does (llama.cpp stores them interleaved for its rotary embedding); rows move whole, so their
blocks survive.

The model runs the same forward as transformers' ``LlamaForCausalLM`` (its own modules: attention, rotary, norms,
MLP activation), only the products change. It cannot be saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from decoding.errors import ModelLoadError
from decoding.params import DEFAULT_MODEL
from decoding.weights.linears import KernelLinear, PackedFloat32, install_fused
from decoding.weights.loading import LoadedModel, gguf_files
from decoding.weights.native import PanelGemm
from decoding.weights.quant_panels import FORMATS, PanelEmbedding, QuantizedWeight, QuantKernel

ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GROUPS = {"self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)), "mlp": (("gate_proj", "up_proj"), ("down_proj",))}
SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor: its type's name, shape [rows, columns] (torch order) and data (raw blocks, or floats)."""

    type_name: str
    rows: int
    columns: int
    data: np.ndarray

    def quantized(self) -> QuantizedWeight | None:
        """The tensor as ``QuantizedWeight`` (a copy of its blocks) when the kernel reads its type; else None."""
        if self.type_name not in FORMATS:
            return None
        raw = torch.from_numpy(np.array(self.data, dtype=np.uint8).reshape(self.rows, -1))
        return QuantizedWeight(FORMATS[self.type_name], raw, self.columns)

    def floats(self) -> torch.Tensor:
        """The tensor de-quantized to float32, [rows, columns] (or [columns] for a vector)."""
        values = gguf.dequantize(np.asarray(self.data), gguf.GGMLQuantizationType[self.type_name])
        shape = (self.rows, self.columns) if self.rows > 1 else (self.columns,)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a copy: the file may close


def read_tensors(path: Path) -> tuple[str, dict[str, Tensor]]:
    """The GGUF file's architecture and tensors by name (their data memory-mapped: read before the file closes)."""
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    tensors = {}
    for tensor in reader.tensors:
        shape = [int(size) for size in tensor.shape]  # GGUF order: columns first
        columns, rows = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        tensors[tensor.name] = Tensor(tensor.tensor_type.name, rows, columns, tensor.data)
    return architecture, tensors


def rope_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that un-permutes a GGUF query or key weight of ``rows`` rows over ``heads`` heads
    (transformers' ``_reverse_permute_weights``): in each head, llama.cpp's rows (i, a) for i < dim / 2, a < 2 are
    taken as (a, i).

    >>> rope_order(8, 1).tolist()
    [0, 2, 4, 6, 1, 3, 5, 7]
    """
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def load_gguf_model(spec: str, gemm: PanelGemm) -> LoadedModel:
    """``spec``'s model from its GGUF weights as they are, with its tokenizer (module contract). Raises
    ``ModelLoadError``."""
    path, directory = gguf_files(spec)
    try:
        config = AutoConfig.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        generation = GenerationConfig.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load model {spec!r}: {error}") from error
    model = build_gguf_model(path, config, gemm)
    model.generation_config = generation
    name = DEFAULT_MODEL if spec in (DEFAULT_MODEL, "default") else path.name
    return LoadedModel(model, tokenizer, name, str(path), torch.device("cpu"), torch.float32)


def build_gguf_model(path: Path, config: PretrainedConfig, gemm: PanelGemm) -> PreTrainedModel:
    """The model of ``path`` with quantized linears over one packed copy of each weight (module contract)."""
    architecture, tensors = read_tensors(path)
    if architecture not in SUPPORTED_ARCHITECTURES or config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF weights run LLaMA models; {path.name} holds {architecture!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ModelLoadError(f"GGUF weights run LLaMA models without biases; {path.name} has some")
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    builder = _Builder(tensors, config, gemm)
    decoder = model.model
    decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
    decoder.norm.weight = builder.vector("output_norm.weight")
    for index, layer in enumerate(decoder.layers):
        builder.layer(layer, index)
    head_kernel = builder.kernel(["token_embd.weight"])
    decoder.embed_tokens = _embedding(head_kernel, tensors["token_embd.weight"])
    if "output.weight" in tensors:
        head_kernel = builder.kernel(["output.weight"])
    model.lm_head = KernelLinear(head_kernel, config.hidden_size, config.vocab_size)
    meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if meta:
        raise ModelLoadError(f"{path.name} left {', '.join(meta[:3])} unset")
    return model.eval()


def _embedding(kernel: object, tensor: Tensor) -> nn.Module:
    """The token embedding: read from the head's panels when they are quantized, else a float32 table."""
    if isinstance(kernel, QuantKernel):
        return PanelEmbedding(kernel)
    return nn.Embedding.from_pretrained(tensor.floats(), freeze=True)


class _Builder:
    """Makes one model's kernels and norms from its GGUF tensors."""

    def __init__(self, tensors: dict[str, Tensor], config: PretrainedConfig, gemm: PanelGemm) -> None:
        self.tensors, self.gemm = tensors, gemm
        heads = config.num_attention_heads
        self.heads = {"attn_q": heads, "attn_k": getattr(config, "num_key_value_heads", None) or heads}

    def tensor(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise ModelLoadError(f"the GGUF file has no tensor {name!r}")
        return self.tensors[name]

    def vector(self, name: str) -> nn.Parameter:
        """A float32 vector (a norm's weight) as a frozen parameter."""
        return nn.Parameter(self.tensor(name).floats().reshape(-1), requires_grad=False)

    def kernel(self, names: list[str]) -> QuantKernel | PackedFloat32:
        """One kernel over the tensors ``names`` stacked by rows (q/k rows un-permuted): quantized panels when
        all are of one type the kernel reads, else ``PackedFloat32`` over their float32 values."""
        tensors = [self.tensor(name) for name in names]
        quantized = [tensor.quantized() for tensor in tensors]
        if all(weight is not None for weight in quantized) and len({t.type_name for t in tensors}) == 1:
            parts = [self._ordered(name, weight) for name, weight in zip(names, quantized, strict=True)]
            return QuantKernel(QuantizedWeight.stacked(parts), self.gemm)
        floats = [self._ordered(name, tensor.floats()) for name, tensor in zip(names, tensors, strict=True)]
        return PackedFloat32(torch.cat(floats), None)

    def _ordered(self, name: str, weight):
        """``weight`` with its rows un-permuted when ``name`` is a query or key weight."""
        kind = name.split(".")[-2]
        if kind not in self.heads:
            return weight
        order = rope_order(weight.rows if isinstance(weight, QuantizedWeight) else weight.shape[0], self.heads[kind])
        return weight.permuted(order) if isinstance(weight, QuantizedWeight) else weight[order]

    def layer(self, layer: nn.Module, index: int) -> None:
        """Fill decoder layer ``index``: its norms and its projections' kernels."""
        for module_name, gguf_name in NORMS.items():
            getattr(layer, module_name).weight = self.vector(f"blk.{index}.{gguf_name}.weight")
        for block_name, groups in GROUPS.items():
            block = getattr(layer, block_name)
            names = {**ATTENTION, **MLP}
            for group in groups:
                tensors = [f"blk.{index}.{names[member]}.weight" for member in group]
                kernel = self.kernel(tensors)
                widths = [self.tensor(name).rows for name in tensors]
                columns = self.tensor(tensors[0]).columns
                if len(group) == 1:
                    setattr(block, group[0], KernelLinear(kernel, columns, widths[0]))
                else:
                    install_fused(block, group, kernel, columns, widths)
