"""The facade the server uses: one loaded model, its continuous batch, and single decodes.

Contract: ``Decoder.batch_engine(policy, memory_tokens, memory_file, memory_corpus)`` gives the server its
``BatchEngine`` (``decoding.batch``): requests added by id, all of them stepped in one forward per ``step``, cancelled
by id, sharing one n-gram memory of recent completions (``decoding.proposers.ngram_memory``) when ``memory_tokens`` > 0,
started from ``memory_file`` when it holds one, then the text files of ``memory_corpus`` (``load_corpus``);
``Decoder.save_memory`` writes it back. ``Decoder.validate`` is the one check of a request's decoding parameters
(``InvalidParameterError`` naming the parameter, no forward pass); the engine runs the same check. ``Decoder.decode``
validates and returns one decode's generator of ``Step`` (see ``decoding.step.stream``), for callers that decode alone
(benchmarks, tests); ``lookahead=None`` selects plain autoregressive decoding. Only the thread that owns the device may
step the engine or iterate the generators. Everything crossing this boundary is plain Python data.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from decoding.batch import BatchEngine, BatchPolicy
from decoding.calibration import calibrated
from decoding.errors import InvalidParameterError
from decoding.forward.static import StaticStep, build_static_step, warm_buckets
from decoding.grammar import Constraint, Grammar, GrammarCompiler
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.proposers.ngram_memory import (
    MemoryFileError,
    NGramMemory,
    corpus_documents,
    load_memory,
    save_memory,
    vocabulary_id,
)
from decoding.step.stream import Step, generate_autoregressive, generate_lookahead, validate_request
from decoding.weights import native
from decoding.weights.cores import resolve_threads
from decoding.weights.gguf_model import load_gguf_model
from decoding.weights.linears import is_float32_cpu, pack_float32, packed_float32_available
from decoding.weights.loading import (
    LoadedModel,
    context_length,
    is_gguf_model,
    load_model,
    resolve_device,
    resolve_dtype,
)
from decoding.weights.quantize import quantize_int8

QUANTIZE = ("none", "int8")
log = logging.getLogger(__name__)
WEIGHT_LAYOUTS = ("auto", "packed", "torch")
WEIGHTS = ("auto", "gguf", "float32")


def release_free_memory() -> None:
    """Return the C heap's free pages to the operating system (glibc's ``malloc_trim``; a no-op elsewhere): after a
    load, the freed temporaries would otherwise stay resident (about 15 MiB for the default GGUF model)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


TORCH_DEFAULT_THREADS = torch.get_num_threads()  # torch's own count, before any configure_threads


def configure_threads(num_threads: int | str, native_model: bool | None = None) -> int:
    """Give the CPU work ``num_threads`` threads: a count, ``"auto"`` (``decoding.weights.cores.usable_cores``: the
    physical cores this process may use), or ``0`` (torch's default count, ``TORCH_DEFAULT_THREADS``). Returns
    the count. Raises ``ValueError`` on any other value.

    Where the native kernels run the model's steps (``native_model``; None: wherever they can run,
    ``decoding.weights.native.available``, asked without building them), their pool takes the threads and torch
    keeps one: the products, norms and attention of every step are native, and torch's OpenMP workers, which spin
    for milliseconds after each parallel region, would take the cores from the pool's workers (on the 2-core Xeon a
    one-token step at two threads gained nothing with torch at two, 1.3x with torch at one, and a 512-token
    prefill ran 1.25x faster). Elsewhere (``native_steps``: torch's linears, int8, a GPU) torch gets the count.
    """
    count = resolve_threads(num_threads)
    if count <= 0:
        count = TORCH_DEFAULT_THREADS
    native.set_threads(count)
    torch.set_num_threads(1 if (native.available() if native_model is None else native_model) else count)
    return count


def native_steps(quantize: str = "none", weight_layout: str = "auto", device: str = "auto") -> bool:
    """Whether a model loaded with these options steps on the native kernels: on the CPU, without int8 or torch's
    own linears, where the kernels can run (``decoding.weights.native.available``)."""
    if quantize != "none" or weight_layout == "torch" or resolve_device(device).type != "cpu":
        return False
    return native.available()


def check_linear_options(quantize: str, weight_layout: str, weights: str = "auto") -> None:
    """Raise ``InvalidParameterError`` on an unknown ``quantize``, ``weight_layout`` or ``weights``, on int8 with
    ``"packed"``, and on ``weights="gguf"`` with int8 or the ``"torch"`` layout."""
    if weights not in WEIGHTS:
        raise InvalidParameterError("weights", f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "gguf" and (quantize != "none" or weight_layout == "torch"):
        raise InvalidParameterError("weights", "GGUF weights run as they are: drop quantize / weight_layout torch")
    if quantize not in QUANTIZE:
        raise InvalidParameterError("quantize", f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if weight_layout not in WEIGHT_LAYOUTS:
        message = f"weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got {weight_layout!r}"
        raise InvalidParameterError("weight_layout", message)
    if quantize == "int8" and weight_layout == "packed":
        raise InvalidParameterError("weight_layout", "int8 weights have their own layout; drop weight_layout=packed")


def prepare_linears(model: PreTrainedModel, quantize: str = "none", weight_layout: str = "auto") -> str:
    """Swap ``model``'s linear layers in place as asked; return what runs them: ``"int8"``, ``"packed"`` or
    ``"torch"`` (``nn.Linear`` as loaded).

    ``quantize="int8"``: ``decoding.weights.quantize.quantize_int8`` (greedy output is then exact with respect to the
    quantized model). ``weight_layout="packed"``: ``decoding.weights.linears.pack_float32``; ``"auto"`` packs a float32
    CPU model when this torch build has oneDNN and no quantization is asked, and leaves any other model alone.
    Raises ``InvalidParameterError`` on unknown values, on int8 with ``"packed"``, and where the model is not
    float32 on the CPU for either.
    """
    check_linear_options(quantize, weight_layout)
    if quantize == "int8":
        quantize_int8(model)
        return "int8"
    fits = is_float32_cpu(model) and packed_float32_available()
    if weight_layout == "packed" or (weight_layout == "auto" and fits):
        pack_float32(model)
        return "packed"
    return "torch"


def gguf_refusal(
    model: str, device: str, dtype: str, quantize: str = "none", weight_layout: str = "auto"
) -> str | None:
    """Why ``model`` cannot run from its GGUF weights as they are here (``decoding.weights.gguf_model``); None when it
    can: a GGUF model on the CPU in float32, no int8, not the ``"torch"`` layout, and the native kernel built."""
    if not is_gguf_model(model):
        return f"{model!r} is not a GGUF file"
    torch_device = resolve_device(device)
    if torch_device.type != "cpu" or resolve_dtype(dtype, torch_device) != torch.float32:
        return "GGUF weights run on the CPU in float32"
    if quantize != "none" or weight_layout == "torch":
        return "GGUF weights run as they are, without quantize or weight_layout torch"
    if native.panel_gemm() is None:
        return "GGUF weights need the native kernel (an x86-64 CPU with AVX2, FMA and F16C, and a C++ compiler)"
    return None


def resolve_weights(weights: str, model: str, device: str, dtype: str, quantize: str = "none",
                    weight_layout: str = "auto") -> str:
    """``"gguf"`` or ``"float32"``: what ``weights`` (``auto``, ``gguf``, ``float32``) gives for this model and
    setup; ``auto`` takes the GGUF weights wherever ``gguf_refusal`` has nothing against them. Raises
    ``InvalidParameterError`` (``weights``) for ``gguf`` where they cannot run."""
    check_linear_options(quantize, weight_layout, weights)
    if weights == "float32":
        return "float32"
    refusal = gguf_refusal(model, device, dtype, quantize, weight_layout)
    if refusal is not None and weights == "gguf":
        raise InvalidParameterError("weights", refusal)
    return "float32" if refusal is not None else "gguf"


def load_prepared(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    weight_layout: str = "auto",
    weights: str = "auto",
) -> tuple[LoadedModel, str]:
    """``model`` loaded and what runs its linear layers: ``"gguf"`` (its GGUF weights as they are, where
    ``resolve_weights`` says so), else as ``prepare_linears`` reports. Raises ``ModelLoadError``, or
    ``InvalidParameterError`` on bad options before loading anything."""
    if resolve_weights(weights, model, device, dtype, quantize, weight_layout) == "gguf":
        return load_gguf_model(model, native.panel_gemm()), "gguf"
    loaded = load_model(model, device, dtype)
    return loaded, prepare_linears(loaded.model, quantize, weight_layout)


@dataclass
class Decoder:
    """A loaded model, what runs its linear layers (see ``prepare_linears``) and the decode entry point."""

    loaded: LoadedModel
    linears: str = "torch"

    @classmethod
    def load(
        cls,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        quantize: str = "none",
        weight_layout: str = "auto",
        weights: str = "auto",
    ) -> Decoder:
        """Load ``model`` (default model name, local directory, GGUF file or hub id): from its GGUF weights as they
        are where ``resolve_weights`` says so (``linears`` is then ``"gguf"``), else in ``dtype`` with its linear
        layers prepared by ``prepare_linears``. Raises ``ModelLoadError``, or ``InvalidParameterError`` on bad
        ``quantize`` / ``weight_layout`` / ``weights`` before loading anything. The loader's freed temporaries
        (de-quantized and repacked tensors) go back to the operating system (``release_free_memory``)."""
        decoder = cls(*load_prepared(model, device, dtype, quantize, weight_layout, weights))
        release_free_memory()
        return decoder

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

    def validate(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
    ) -> None:
        """Raise ``InvalidParameterError`` (and subclasses) naming the parameter if the request cannot be decoded.

        Safe from any thread: it reads only the model's config.
        """
        validate_request(self.loaded.model, prompt_ids, stop, sampling, lookahead)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this model's vocabulary (cheap: its vocabulary tables wait for a grammar)."""
        vocab_size = int(self.loaded.model.config.get_text_config(decoder=True).vocab_size)
        return GrammarCompiler(self.loaded.tokenizer, vocab_size)

    def check_grammar(self, grammar: Grammar) -> None:
        """Raise ``decoding.grammar.GrammarError`` (a readable message) when ``grammar`` cannot be used."""
        self.grammars.check(grammar)

    def constraint(self, sampling: SamplingParams) -> Constraint | None:
        """A fresh constraint for ``sampling.grammar`` (None without one)."""
        return None if sampling.grammar is None else self.grammars.constraint(sampling.grammar)

    @functools.cached_property
    def vocabulary_id(self) -> str:
        """The id of this tokenizer's vocabulary that memory files are saved under
        (``decoding.proposers.ngram_memory``)."""
        return vocabulary_id(self.loaded.tokenizer.get_vocab())

    def batch_engine(
        self, policy: BatchPolicy | None = None, memory_tokens: int = 0, memory_file: str | None = None,
        memory_corpus: Sequence[str] = (),
    ) -> BatchEngine:
        """A new, empty continuous batch over this model that spends each forward's tokens as ``policy`` says
        (``BatchPolicy()`` when None), with a server-wide ``NGramMemory(memory_tokens)`` shared by its decodes
        (none when ``memory_tokens`` is 0; each decode's ``LookaheadConfig.shared_memory`` opts it out). With a
        ``memory_file`` that exists, the memory starts with the documents saved there (``save_memory``); one
        that cannot be used (another vocabulary, unreadable) is logged as a warning and the memory starts empty.
        Then each text file of ``memory_corpus`` is added to the memory (``load_corpus``). With
        ``policy.static_step`` other than ``"off"``, steps that fit a bucket run through a static step
        (``static_step``). With ``policy.measure_step_cost``, the engine's policy prices steps on the curve
        measured here, after the static step is built (``decoding.calibration``; a few seconds on a CPU)."""
        policy = policy or BatchPolicy()
        static = self.static_step(policy) if policy.static_step != "off" else None
        if static is None:
            policy = replace(policy, static_step="off")
        if policy.measure_step_cost:
            policy = calibrated(self.loaded.model, policy, static)
        memory = NGramMemory(memory_tokens) if memory_tokens > 0 else None
        if memory is not None and memory_file is not None and Path(memory_file).exists():
            try:
                count = load_memory(memory, memory_file, self.vocabulary_id)
                log.info("n-gram memory: %d documents (%d tokens) from %s", count, len(memory), memory_file)
            except MemoryFileError as error:
                log.warning("n-gram memory starts empty: %s", error)
        if memory is not None and memory_corpus:
            documents = self.load_corpus(memory, memory_corpus)
            log.info("n-gram memory: %d corpus documents added, %d tokens held", documents, len(memory))
        return BatchEngine(self.loaded.model, policy, memory=memory, grammars=self.grammars, static=static)

    def static_step(self, policy: BatchPolicy) -> StaticStep | None:
        """The static step ``policy`` asks for, over a KV pool of ``policy.static_sequences`` rows of the model's
        context length (plus the largest lookahead step), with its common buckets built (in ``"graphs"`` and
        ``"fused"`` modes: captured, the latter's one-sequence classes compiled) now; None, with a warning, for a
        model it cannot run. Off CUDA those two modes rehearse the capture (``decoding.forward.static``)."""
        static = build_static_step(self.loaded.model, policy.static_step, policy.static_sequences)
        if static is None:
            return None
        buckets = warm_buckets(static)
        seconds = static.warm_up(buckets)
        log.info("static step (%s): %d buckets ready in %.1f s, KV pool of %d x %d slots", static.mode, len(buckets),
                 seconds, policy.static_sequences, static.pool.row_capacity)
        return static

    def load_corpus(self, memory: NGramMemory, paths: Sequence[str]) -> int:
        """Add each UTF-8 text file of ``paths`` to ``memory``, tokenized without special tokens, as documents of at
        most ``CORPUS_DOCUMENT_TOKENS`` tokens (the memory's bound holds: the oldest documents are evicted); a file
        that cannot be read is logged as a warning and skipped. Returns the documents added. A corpus loaded at
        every start is added again after a memory file's documents (it then appears twice until evicted)."""
        added = 0
        for path in paths:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                log.warning("n-gram memory: corpus file %s skipped: %s", path, error)
                continue
            for document in corpus_documents(self.loaded.tokenizer(text, add_special_tokens=False).input_ids):
                memory.add(document)
                added += 1
        return added

    def save_memory(self, engine: BatchEngine, memory_file: str) -> int | None:
        """Write ``engine``'s n-gram memory to ``memory_file`` (None, nothing written, when it has none); return
        the documents written. Call it when no thread steps ``engine`` (at shutdown). Raises ``OSError``."""
        if engine.memory is None:
            return None
        return save_memory(engine.memory, memory_file, self.vocabulary_id)

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
        constraint = self.constraint(sampling)
        if lookahead is None:
            return generate_autoregressive(self.loaded.model, prompt_ids, stop, sampling, constraint)
        return generate_lookahead(self.loaded.model, prompt_ids, stop, sampling, lookahead, constraint)


def _as_ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(item) for item in value]
