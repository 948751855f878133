"""The facade the server uses: one loaded model, decode calls in, step generators out.

Contract: ``Decoder.decode`` validates every argument before any forward pass and returns a generator of
``Step`` (see ``decoding.engine``); ``lookahead=None`` selects plain autoregressive decoding. Only the thread
that owns the device may iterate the generators. Everything crossing this boundary is plain Python data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from decoding.engine import Step, context_length, generate_autoregressive, generate_lookahead, validate_request
from decoding.errors import InvalidParameterError
from decoding.loading import LoadedModel, load_model
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.quantize import quantize_int8


def configure_threads(num_threads: int) -> None:
    """Set torch's intra-op thread count (``0`` keeps torch's default). On a 2-core CPU, 1 is the stable choice."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)


@dataclass
class Decoder:
    """A loaded model and the decode entry point."""

    loaded: LoadedModel

    @classmethod
    def load(cls, model: str, device: str = "auto", dtype: str = "auto", quantize: str = "none") -> Decoder:
        """Load ``model`` (default model name, local directory or hub id); raises ``ModelLoadError``.

        ``quantize="int8"`` applies ``decoding.quantize.quantize_int8`` (float32 on the CPU only; raises
        ``InvalidParameterError`` otherwise): greedy output is then exact with respect to the quantized model.
        """
        if quantize not in ("none", "int8"):
            raise InvalidParameterError("quantize", f"quantize must be 'none' or 'int8', got {quantize!r}")
        loaded = load_model(model, device, dtype)
        if quantize == "int8":
            quantize_int8(loaded.model)
        return cls(loaded)

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (token ids <-> text, chat template)."""
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        """Maximum prompt + generated tokens."""
        return context_length(self.loaded.model)

    @property
    def device(self) -> str:
        return str(self.loaded.device)

    @property
    def dtype(self) -> str:
        return str(self.loaded.dtype).removeprefix("torch.")

    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation: the generation config's EOS ids and the tokenizer's EOS id."""
        ids: set[int] = set()
        configured = getattr(self.loaded.model.generation_config, "eos_token_id", None)
        ids.update(_as_ids(configured))
        ids.update(_as_ids(self.loaded.tokenizer.eos_token_id))
        return frozenset(ids)

    def decode(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
    ) -> Iterator[Step]:
        """Validate, then return the lazy step generator (lookahead when ``lookahead`` is given).

        Raises ``InvalidParameterError`` (and subclasses) here, synchronously, on bad arguments; the
        generator runs its first forward pass (the prefill) on the first ``next``.
        """
        validate_request(self.loaded.model, prompt_ids, stop, sampling, lookahead)
        if lookahead is None:
            return generate_autoregressive(self.loaded.model, prompt_ids, stop, sampling)
        return generate_lookahead(self.loaded.model, prompt_ids, stop, sampling, lookahead)


def _as_ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(item) for item in value]
