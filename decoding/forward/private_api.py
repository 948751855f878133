"""Every private or internal torch / transformers API that ``decoding`` relies on, in one registry.

Contract: ``PRIVATE_APIS`` names each API (dotted path), the ``decoding`` module that uses it, why, and a
``check`` that is true when the installed libraries still provide it (``applies`` is false where the using
code has a fallback on this build, e.g. torch without oneDNN). ``missing()`` returns the entries that apply
and fail their check; tests/decoding/forward/test_private_api.py fails naming each. ``TESTED_VERSIONS`` are the
library versions the registry was last verified against. A check proves presence (and, where cheap, the
signature); what the API does is pinned by the using module's own tests (named in ``why``).

Public APIs are not listed: ``model(...)`` with ``position_ids`` / a 4-D mask / ``logits_to_keep``,
``get_text_config``, ``torch.nn.functional.scaled_dot_product_attention``, ``torch.nn.attention.sdpa_kernel``.

When an upgrade removes one of these, the check names it; fix the using module and update its entry here.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

TESTED_VERSIONS = {"torch": "2.13.0", "transformers": "5.23.0"}


@dataclass(frozen=True)
class PrivateApi:
    """One private / internal API: its dotted name, the module using it, why, and how to check it exists."""

    name: str
    used_by: str
    why: str
    check: Callable[[], bool]
    applies: Callable[[], bool] = lambda: True


def _resolve(path: str) -> object:
    """The object at a dotted ``path``: the longest importable module prefix, then attributes.

    Raises ``AttributeError`` or ``ImportError`` when any part is missing.
    """
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(f"no module in {path!r}")


def exists(path: str) -> Callable[[], bool]:
    """A check that ``path`` resolves (``torch.ops`` namespaces resolve lazily, so this loads the op)."""

    def check() -> bool:
        try:
            _resolve(path)
        except (AttributeError, ImportError, RuntimeError):
            return False
        return True

    return check


def has_members(path: str, members: tuple[str, ...]) -> Callable[[], bool]:
    """A check that the class or module at ``path`` has every attribute in ``members``."""

    def check() -> bool:
        return exists(path)() and all(hasattr(_resolve(path), member) for member in members)

    return check


def _accepts(path: str, parameter: str) -> Callable[[], bool]:
    """A check that the callable at ``path`` takes ``parameter`` (``**kwargs`` when ``parameter`` is ``"**"``)."""

    def check() -> bool:
        if not exists(path)():
            return False
        parameters = inspect.signature(_resolve(path)).parameters.values()
        if parameter == "**":
            return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        return any(p.name == parameter for p in parameters)

    return check


def _config_has_internal_attention() -> bool:
    """Configs carry ``_attn_implementation_internal`` (the field behind ``_attn_implementation``)."""
    from transformers import PretrainedConfig

    return hasattr(PretrainedConfig(), "_attn_implementation_internal")


def _llama_layout() -> bool:
    """A tiny LLaMA built by transformers has the module layout ``decoding.forward.lean`` steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoding.forward import lean

    torch.manual_seed(0)
    sizes = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return lean.supports(LlamaForCausalLM(LlamaConfig(**sizes, num_key_value_heads=1)))


def _mkldnn() -> bool:
    import torch

    return torch.backends.mkldnn.is_available()


def _fbgemm() -> bool:
    import torch

    return "fbgemm" in torch.backends.quantized.supported_engines


_SLOT_LAYER_HOOKS = ("lazy_initialization", "update", "get_seq_length", "get_mask_sizes", "get_max_length", "crop")

def _own_op(name: str) -> Callable[[], bool]:
    """A check that our op ``torch.ops.lookahead.<name>`` is defined once ``decoding.weights.native`` is imported."""

    def check() -> bool:
        importlib.import_module("decoding.weights.native")
        return exists(f"torch.ops.lookahead.{name}")()

    return check


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(
        "torch._dynamo.mark_dynamic",
        "decoding.forward.static_fused",
        "holds a fused class's attended length, sequences and tokens symbolic, so one compile serves every bucket of "
        "the class (tests/decoding/forward/test_static_fused.py: no recompile over a batched decode)",
        exists("torch._dynamo.mark_dynamic"),
    ),
    PrivateApi(
        "torch._dynamo.maybe_mark_dynamic",
        "decoding.forward.compiled",
        "marks a graph input's token count dynamic so one graph serves every step size (python -m bench compile, "
        "not the serving path; tests/decoding/forward/test_compiled.py)",
        exists("torch._dynamo.maybe_mark_dynamic"),
    ),
    PrivateApi(
        "torch.ops.lookahead.panel_gemm",
        "decoding.forward.compiled",
        "our own op (decoding.weights.native's float32 panel product), listed because the scan cannot tell it from "
        "torch's",
        _own_op("panel_gemm"),
    ),
    PrivateApi(
        "torch.ops.lookahead.quant_gemm",
        "decoding.forward.compiled",
        "our own op (decoding.weights.native's quantized panel product), listed because the scan cannot tell it from "
        "torch's",
        _own_op("quant_gemm"),
    ),
    PrivateApi(
        "torch.ops.aten._fused_rms_norm",
        "decoding.forward.static_forward",
        "the static step's RMSNorm in one op (F.rms_norm falls back to six; tests/decoding/forward/test_static.py)",
        exists("torch.ops.aten._fused_rms_norm"),
    ),
    PrivateApi(
        "torch.ops.mkldnn._reorder_linear_weight",
        "decoding.weights.linears",
        "PackedFloat32 without the panel kernel reorders each weight once into oneDNN's blocked layout "
        "(tests/decoding/weights/test_native.py)",
        exists("torch.ops.mkldnn._reorder_linear_weight"),
        _mkldnn,
    ),
    PrivateApi(
        "torch.ops.mkldnn._linear_pointwise",
        "decoding.weights.linears",
        "PackedFloat32's product on the blocked weight without the panel kernel "
        "(tests/decoding/weights/test_native.py)",
        exists("torch.ops.mkldnn._linear_pointwise"),
        _mkldnn,
    ),
    PrivateApi(
        "torch._make_per_channel_quantized_tensor",
        "decoding.weights.quantize",
        "builds the int8 per-output-channel weight that fbgemm packs (tests/decoding/weights/test_quantize.py)",
        exists("torch._make_per_channel_quantized_tensor"),
        _fbgemm,
    ),
    PrivateApi(
        "torch.ops.quantized.linear_prepack",
        "decoding.weights.quantize",
        "packs the int8 weight for fbgemm (tests/decoding/weights/test_quantize.py)",
        exists("torch.ops.quantized.linear_prepack"),
        _fbgemm,
    ),
    PrivateApi(
        "torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32",
        "decoding.weights.quantize",
        "the int8 x int8 product with float32 output (tests/decoding/weights/test_quantize.py)",
        exists("torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32"),
        _fbgemm,
    ),
    PrivateApi(
        "transformers.PretrainedConfig._attn_implementation_internal",
        "decoding.forward.packed",
        "selects the packed attention function for one forward and restores the previous one",
        _config_has_internal_attention,
    ),
    PrivateApi(
        "transformers.AttentionInterface.register",
        "decoding.forward.packed",
        "registers 'lookahead_packed', called as (module, query, key, value, attention_mask, scaling=, "
        "dropout=, **kwargs) (tests/decoding/forward/test_packed.py)",
        has_members("transformers.AttentionInterface", ("register",)),
    ),
    PrivateApi(
        "transformers.models.llama.modeling_llama.LlamaAttention.forward(**kwargs)",
        "decoding.forward.packed",
        "the model's forward hands unknown keywords (packed=) down to the attention function",
        _accepts("transformers.models.llama.modeling_llama.LlamaAttention.forward", "**"),
    ),
    PrivateApi(
        "transformers.masking_utils",
        "decoding.forward.packed",
        "its mask builders pass a ready 4-D attention_mask through untouched (the public forward's path; "
        "tests/decoding/forward/test_packed.py)",
        exists("transformers.masking_utils.create_causal_mask"),
    ),
    PrivateApi(
        "transformers.cache_utils.DynamicLayer",
        "decoding.forward.kv_cache",
        "_SlotLayer subclasses it and overrides " + ", ".join(_SLOT_LAYER_HOOKS) + "; sets keys, values, "
        "is_initialized, dtype, device (tests/decoding/step/test_stream.py)",
        has_members("transformers.cache_utils.DynamicLayer", _SLOT_LAYER_HOOKS),
    ),
    PrivateApi(
        "transformers.cache_utils.Cache(layers=...)",
        "decoding.forward.kv_cache",
        "SlotCache hands its own layer objects to the Cache constructor",
        _accepts("transformers.cache_utils.Cache.__init__", "layers"),
    ),
    PrivateApi(
        "LLaMA module layout (model.model.embed_tokens/rotary_emb/layers/norm, layer.self_attn.q_proj..., mlp.act_fn)",
        "decoding.forward.lean",
        "the lean step calls the model's own modules in its forward's order (tests/decoding/forward/test_lean.py)",
        _llama_layout,
    ),
)


def missing() -> list[PrivateApi]:
    """The registered APIs that apply to this build and are not provided by the installed libraries."""
    return [api for api in PRIVATE_APIS if api.applies() and not api.check()]
