"""The server's one typed configuration: every configurable value is defined once, here, with its bounds.

Contract:
- ``ServerConfig`` is the one definition of each value: its default, its bounds and what it means. The CLI
  flags (``server.flags.config_flags``), the reference page ``docs/configuration.md``
  (``server.config_reference``), the OpenAPI limits and the per-request validation (``lookahead_bounds``) derive
  from it, walking it with ``fields``. The lookahead defaults and bounds come from ``decoding.params``
  (``LookaheadConfig``, ``LOOKAHEAD_BOUNDS``), where the decoder checks them.
- A lookahead knob is declared twice and exposed everywhere from there: a field of ``LookaheadConfig`` (with its
  bounds) and of ``LookaheadSettings`` (with its meaning) is a step setting (``LOOKAHEAD_STEP_FIELDS``): the server
  runs it (``decoder_lookahead``), the benchmark and the tuner take it as a flag (``bench.cli``, from
  ``config_flags``) and the config reference lists it. Named in ``REQUEST_LOOKAHEAD`` with a ``max_<name>``
  setting, a request may set it too (``server.protocol.LookaheadRequest``, the OpenAPI document, within
  ``lookahead_bounds``).
- ``decoder_lookahead`` and ``batch_policy`` are the one conversion of the settings into the decoder's types.
- Where the values come from is ``server.config_layers``: field defaults < the device preset
  ``configs/<cpu|cuda>.yaml`` < the ``--config`` file < flags (``load_config``, ``resolve``); unknown keys are an
  error there. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from annotated_types import Ge
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from decoding.params import DEFAULT_MODEL, LOOKAHEAD_BOUNDS, MAX_TOP_TOKENS, LookaheadConfig, NumberBounds
from decoding.weights.cores import AUTO

if TYPE_CHECKING:  # decoding.batch loads torch: imported where it is used
    from decoding.batch import BatchPolicy

_LIBRARY = LookaheadConfig()  # the decoder's own defaults: the server's unless a preset says otherwise


class ConfigError(ValueError):
    """A configuration file or flag is invalid; the message says which and why."""


def _lookahead_field(name: str, description: str) -> Any:
    """A lookahead integer: the decoder's default and bounds (``decoding.params``), with its meaning."""
    low, high = LOOKAHEAD_BOUNDS[name]
    return Field(getattr(_LIBRARY, name), ge=low, le=high, description=description)


def _maximum_field(name: str, default: int) -> Any:
    """The largest ``name`` a request may ask for, itself within the decoder's bounds."""
    low, high = LOOKAHEAD_BOUNDS[name]
    return Field(default, ge=low, le=high, description=f"largest {name} a request may ask for (larger -> 400)")


REQUEST_LOOKAHEAD = ("window_size", "ngram_size", "guess_set_size")  # what a request may set, each within max_<name>


class LookaheadSettings(BaseModel):
    """Lookahead defaults (used when a request leaves a value out), the step policy and the per-request maxima."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True, description="decode with lookahead unless a request sends lookahead.enabled false",
        json_schema_extra={"flag": "--lookahead"},
    )
    window_size: int = _lookahead_field("window_size", "W: Jacobi window columns")
    ngram_size: int = _lookahead_field("ngram_size", "N: n-gram size (a step commits up to N tokens)")
    guess_set_size: int = _lookahead_field("guess_set_size", "G: candidate n-grams verified per step")
    max_window_size: int = _maximum_field("window_size", 16)
    max_ngram_size: int = _maximum_field("ngram_size", 8)
    max_guess_set_size: int = _maximum_field("guess_set_size", 16)
    lazy_window: bool = Field(
        _LIBRARY.lazy_window, description="plain one-token steps when the pool has no candidate for the last token"
    )
    break_even: float = Field(
        _LIBRARY.break_even, ge=0.0,
        description="accepted guesses per verifying step below which a request falls back to one-token steps: "
        "a floor under each source's price on the step-cost curve (capped at N-1)",
    )
    copy_length: int = _lookahead_field(
        "copy_length", "copy steps: verify up to this many tokens copied from a matching context (0: off)"
    )
    copy_min_match: int = _lookahead_field(
        "copy_min_match",
        "copy steps: tokens before the last one that must match the earlier context (1: a 2-gram, 0: any)",
    )
    copy_candidates: int = _lookahead_field(
        "copy_candidates", "copy steps: continuations of different earlier occurrences verified at once (a token tree)"
    )
    copy_stretch: int = _lookahead_field(
        "copy_stretch",
        "copy steps: after a copy accepted whole, the next best copy reaches twice as far, up to this many times "
        "copy_length (1: off)",
    )
    window_chains: bool = Field(
        _LIBRARY.window_chains,
        description="also verify the Jacobi window's own columns as candidates (more logit rows, no more input "
        "tokens; greedy requests without logit processors)",
    )
    memory_corpus: list[str] = Field(
        default_factory=list,
        description="text files added to the n-gram memory at start (a codebase, documents), tokenized, in documents "
        "of at most 4096 tokens; bounded by memory_tokens (the oldest go first); an unreadable file is skipped with "
        "a warning",
    )
    runner_up: int = Field(
        _LIBRARY.runner_up, ge=0, le=MAX_TOP_TOKENS,
        description="runner-up tokens: the model's next-best tokens at the row that chose the last token, each "
        "continued from the context, offered as guesses (0: off)",
    )
    recycled: int = Field(
        _LIBRARY.recycled, ge=0, le=MAX_TOP_TOKENS,
        description="recycled logits: each token's top next tokens, kept from the rows every step reads, offered as a "
        "tree from the last token (0: off)",
    )
    recycled_tree: int = _lookahead_field(
        "recycled_tree",
        "recycled logits' tree: this many nodes grown best first by each rank's measured acceptance, deeper than "
        "N-1 (0: the recycled successors, 2 under each, then 1, down to N-1 tokens)",
    )
    jump_forward: bool = Field(
        _LIBRARY.jump_forward, description="with a grammar, offer the tokens it forces next as a guess",
    )
    memory_tokens: int = Field(
        200_000, ge=0, le=10_000_000,
        description="server-wide n-gram memory: tokens of recent completions (all requests) offered as candidates "
        "to every request (0: off; ~110 bytes each; a request opts out with lookahead.shared_memory false)",
    )
    max_corpus_tokens: int = Field(
        100_000, ge=1,
        description="POST /v1/memory/corpus: the most tokens one call may add to the n-gram memory (more -> 400)",
    )
    memory_file: str | None = Field(
        None,
        description="keep the n-gram memory across restarts: loaded from this file at start when it exists (a file "
        "of another tokenizer is skipped with a warning), written there at shutdown (gzipped JSON of token ids)",
    )

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> LookaheadSettings:
        for name in REQUEST_LOOKAHEAD:
            if getattr(self, name) > getattr(self, f"max_{name}"):
                raise ValueError(f"lookahead.{name} = {getattr(self, name)} exceeds lookahead.max_{name}")
        return self


# The decoder's knobs the server does not expose, each with why. Every other field of ``LookaheadConfig`` is a
# ``LookaheadSettings`` field of the same name (a test fails on a new decoder field that is neither).
DECODER_ONLY = {
    "prompt_pool": "an ablation of the algorithm (the pool without the prompt's n-grams): benchmarks and tests",
    "output_pool": "an ablation of the algorithm (the pool without the output's n-grams): benchmarks and tests",
    "align_window": "an ablation (the reference's one-column window shift): benchmarks and tests",
    "rank_by_context": "an ablation (the pool's most recent n-grams instead of the best context match); copy "
    "steps need it on",
    "shared_memory": "per request (lookahead.shared_memory in a request's body); the server-wide switch is "
    "memory_tokens (0: no memory)",
}

# The lookahead step settings: the fields of the decoder's ``LookaheadConfig`` that ``LookaheadSettings`` also has
# (module contract: a knob is declared once, there and here).
_DECODER_FIELDS = {field.name for field in dataclasses.fields(LookaheadConfig)}
LOOKAHEAD_STEP_FIELDS = tuple(name for name in LookaheadSettings.model_fields if name in _DECODER_FIELDS)


class BatchSettings(BaseModel):
    """How the worker batches the running requests' steps into one forward pass (see ``decoding.batch``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_step_tokens: int = Field(128, ge=1, description="input tokens of one forward, all requests together")
    prefill_chunk: int = Field(128, ge=1, description="prompt tokens per forward while other requests decode")
    static_step: Literal["off", "eager", "compile", "graphs", "fused"] = Field(
        "off", description="run steps that fit a bucket through the static step (decoding/forward/static.py): "
        "fused captures the forward compiled by inductor (a few fused kernels a layer) as CUDA graphs, graphs "
        "captures the plain forward, compile uses torch.compile per bucket, eager the same ops as is; off: every "
        "step eager",
    )
    step_cost: list[tuple[int, float]] | None = Field(
        None, description="[[tokens, relative cost], ...] of one forward, as measured by `python -m bench tune`; "
        "null: decoding's built-in CPU curve; with measure_step_cost, the fallback",
    )
    measure_step_cost: bool = Field(
        False, description="at start, time one stream's forward of 1 to max_step_tokens tokens on this device "
        "(wall clock, its host work included) and price drafts on that curve instead of step_cost "
        "(decoding/calibration.py; the lookahead_step_cost metric and the start's log show it)",
    )
    payoff_guard: bool = Field(
        True, description="a request whose guesses commit fewer tokens than plain steps would at their price takes "
        "plain one-token steps a while, then tries again (decoding/payoff.py; on with static_step or "
        "measure_step_cost); false: every request keeps its lookahead",
    )
    overlap_steps: bool | None = Field(
        None, description="deliver each step's results (text, metrics, streams) while the device runs the next "
        "step (server/worker.py): on a GPU that host work leaves the step's critical path; on a CPU, whose forward "
        "runs on the host, it only delays each token by a step. null: on where the device is CUDA",
    )
    prefix_cache_tokens: int = Field(
        4096, ge=0, le=10_000_000,
        description="prefix cache: tokens of finished requests' KV kept (least recently used first out) so that a "
        "prompt starting the same way (the next turn of a conversation) prefills only the rest (0: off; the "
        "default model's float32 KV takes 46 KB a token; a request opts out with cache_prompt false)",
    )

    @model_validator(mode="after")
    def _curve_ascends(self) -> BatchSettings:
        if self.step_cost is not None:
            tokens = [point[0] for point in self.step_cost]
            if len(tokens) < 2 or tokens != sorted(set(tokens)) or tokens[0] < 1:
                raise ValueError("batch.step_cost needs >= 2 points with distinct ascending token counts >= 1")
            if any(cost <= 0 for _, cost in self.step_cost):
                raise ValueError("batch.step_cost costs must be positive")
        return self


class ServerConfig(BaseModel):
    """Everything the server needs to start; handed down explicitly, never read from globals."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="port (0: any free port)")
    model: str = Field(DEFAULT_MODEL, description="the embedded default model, a local model directory or a hub id")
    served_model_name: str | None = Field(None, description="the name clients send as 'model' (default: "
                                          "the model's last path part)")
    chat_template: str | None = Field(None, description="a Jinja chat template file replacing the model's own "
                                      "(read at start-up)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' on /v1/* "
                                "(or set $LOOKAHEAD_API_KEY)", json_schema_extra={"secret": True})
    api_keys_file: str | None = Field(None, description="accept any key in this file (one per line, # comments)")
    protect_health: bool = Field(False, description="with keys: /health requires one too")
    protect_metrics: bool = Field(False, description="with keys: /metrics requires one too")
    allowed_origins: list[str] = Field(
        default_factory=list, description="CORS: browser origins allowed to call the server (e.g. "
        "http://localhost:3000; * for any); empty: no CORS headers at all",
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (auto: CUDA when available); picks the "
                        "preset configs/<cpu|cuda>.yaml")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights' dtype (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    quantize: Literal["none", "int8"] = Field(
        "none", description="int8: int8 weights with per-row activation scales (float32 CPU only)"
    )
    weight_layout: Literal["auto", "packed", "torch"] = Field(
        "auto", description="packed: float32 linears laid out for the CPU's kernels (auto: on a float32 CPU)"
    )
    weights: Literal["auto", "gguf", "float32"] = Field(
        "auto", description="gguf: a GGUF model's quantized weights as they are, one copy (auto: for a GGUF model, "
        "the default included, on the CPU in float32 where the native kernel builds); float32: de-quantized"
    )
    threads: Annotated[int, Ge(0)] | Literal["auto"] = Field(
        AUTO, description="threads of the native kernels' pool (torch keeps one beside it), or of torch's intra-op "
        "work where the native kernels do not run (auto: the physical cores this process may use, affinity and "
        "cgroup quota respected; 0: torch's default count)",
    )
    max_running: int = Field(16, ge=1, description="requests decoding at once (their steps share each forward)")
    max_queue: int = Field(32, ge=0, description="requests waiting for a running slot; more -> 429")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request gives none "
                                    "(clamped to what fits the context)")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies -> 413")
    max_stop_strings: int = Field(16, ge=1, le=1024, description="stop strings a request may send; more -> 400")
    max_n: int = Field(8, ge=1, le=128, description="choices per prompt (n) a request may ask for; more -> 400 "
                       "(each choice is a sequence of its own in the running slots and the queue)")
    drain_grace_seconds: float = Field(30.0, ge=0, description="on SIGTERM, finish in-flight work this long, "
                                       "then cancel")
    max_stored_responses: int = Field(1024, ge=0, description="/v1/responses kept in memory for "
                                      "previous_response_id and GET /v1/responses/{id}, the least recently stored "
                                      "evicted first (0: none; a restart forgets them)")
    json_integer_digits: int = Field(
        16, ge=0, le=1 << 20, description="structured output and tool calls: the most digits of a JSON number's "
        "integer part (and of its exponent), as llama.cpp's JSON grammars (0: unbounded)",
    )
    json_fraction_digits: int = Field(
        16, ge=0, le=1 << 20, description="structured output and tool calls: the most digits after a JSON number's "
        "point, as llama.cpp's JSON grammars (0: unbounded)",
    )
    warmup: bool = Field(True, description="run one tiny decode before /health reports ready")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    lookahead: LookaheadSettings = LookaheadSettings()
    batch: BatchSettings = BatchSettings()

    @model_validator(mode="after")
    def _one_weight_format(self) -> ServerConfig:
        if self.quantize == "int8" and self.weight_layout == "packed":
            raise ValueError("quantize int8 has its own weight layout: use weight_layout auto (or torch) with it")
        if self.weights == "gguf" and (self.quantize != "none" or self.weight_layout == "torch"):
            raise ValueError("weights gguf run as they are: use quantize none and weight_layout auto with them")
        return self

    @property
    def number_bounds(self) -> NumberBounds:
        """The digits JSON numbers of grammar-constrained output may have (``json_*_digits``)."""
        return NumberBounds(self.json_integer_digits, self.json_fraction_digits)

    @property
    def model_name(self) -> str:
        """The name clients use in ``model``: ``served_model_name``, else the model's last path component."""
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


def lookahead_bounds(settings: LookaheadSettings) -> dict[str, tuple[int, int]]:
    """What a request may ask for: each of ``REQUEST_LOOKAHEAD`` (W, N and G) within the decoder's minimum and this
    server's maximum.

    >>> lookahead_bounds(LookaheadSettings())["ngram_size"]
    (2, 8)
    """
    return {name: (LOOKAHEAD_BOUNDS[name][0], getattr(settings, f"max_{name}")) for name in REQUEST_LOOKAHEAD}


def decoder_lookahead(settings: LookaheadSettings, **request: Any) -> LookaheadConfig:
    """The one conversion of the server's lookahead settings into the decoder's ``LookaheadConfig`` (the server,
    the tuner, the benchmark and the tests all use it): every field the two share, then ``request``'s values (a
    request's W/N/G, ``shared_memory``), ``break_even`` capped at N-1 (no step accepts more).

    >>> config = decoder_lookahead(LookaheadSettings(break_even=3.0), ngram_size=3)
    >>> config.ngram_size, config.break_even
    (3, 2.0)
    """
    values = {name: getattr(settings, name) for name in LOOKAHEAD_STEP_FIELDS} | request
    values["break_even"] = min(values["break_even"], float(values["ngram_size"] - 1))
    return LookaheadConfig(**values)


def batch_policy(config: ServerConfig) -> BatchPolicy:
    """The one conversion of the ``batch`` settings into the engine's ``decoding.batch.BatchPolicy`` (the server
    and the benchmark use it): the built-in CPU curve when the config gives none. ``decoding.batch`` is imported
    here, not at the top, so reading a config never loads torch."""
    from decoding.batch import BatchPolicy

    settings = config.batch
    curve = tuple(tuple(point) for point in settings.step_cost) if settings.step_cost else BatchPolicy().step_cost
    return BatchPolicy(settings.max_step_tokens, settings.prefill_chunk, curve, settings.static_step,
                       config.max_running, settings.measure_step_cost, settings.prefix_cache_tokens,
                       settings.payoff_guard)


# ---- Walking the definition: its leaves, a field's extras, a flag-able annotation ------------------------------


def fields(model: type[BaseModel] = ServerConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """``(dotted key, field)`` of every leaf value of ``model``, in definition order."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def field_extra(info: FieldInfo) -> dict[str, Any]:
    """A field's ``json_schema_extra`` mapping (``flag``: its flag's name, ``secret``: never printed); ``{}`` when
    it has none."""
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def scalar_type(annotation: Any) -> tuple[type | None, tuple[str, ...] | None]:
    """``(python type, choices)`` of a flag-able annotation; ``(None, None)`` for lists, mappings and models."""
    if typing.get_origin(annotation) is Literal:
        return str, tuple(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 2 and {scalar_type(member)[0] for member in members} == {int, str}:
            return str, None  # a count or a word (threads: 2 or auto): the flag passes the text, the model parses it
        return scalar_type(members[0]) if len(members) == 1 else (None, None)
    if typing.get_origin(annotation) is Annotated:
        return scalar_type(typing.get_args(annotation)[0])
    return (annotation, None) if annotation in (bool, int, float, str) else (None, None)
