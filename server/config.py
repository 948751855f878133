"""The server's one typed configuration: every configurable value is defined once, here, with its bounds.

Contract:
- ``ServerConfig`` is the one definition of each value: its default, its bounds and what it means. The CLI
  flags (``config_flags``), the reference page ``docs/configuration.md`` (``reference_markdown``), the OpenAPI
  limits and the per-request validation (``lookahead_bounds``) derive from it. The lookahead defaults and
  bounds come from ``decoding.params`` (``LookaheadConfig``, ``LOOKAHEAD_BOUNDS``), where the decoder checks them.
- A lookahead knob is declared twice and exposed everywhere from there: a field of ``LookaheadConfig`` (with its
  bounds) and of ``LookaheadSettings`` (with its meaning) is a step setting (``LOOKAHEAD_STEP_FIELDS``): the server
  runs it (``decoder_lookahead``), the benchmark and the tuner take it as a flag (``bench.cli``, from
  ``config_flags``) and the config reference lists it. Named in ``REQUEST_LOOKAHEAD`` with a ``max_<name>``
  setting, a request may set it too (``server.protocol.LookaheadRequest``, the OpenAPI document, within
  ``lookahead_bounds``).
- Layers, later wins: field defaults < the device preset ``configs/<cpu|cuda>.yaml`` (always, for the resolved
  device) < the ``--config`` file < flags. Nothing else is read: what a device runs is its preset file.
  ``resolve`` returns the validated, immutable config and, for every value, the layer it came from.
- Unknown keys in a YAML file are an error (a typo must not be silently ignored). Nothing here imports torch:
  the caller resolves ``device: auto`` and passes the preset name in.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from annotated_types import Ge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from decoding.params import DEFAULT_MODEL, LOOKAHEAD_BOUNDS, MAX_TOP_TOKENS, LookaheadConfig, NumberBounds
from decoding.weights.cores import AUTO, usable_cores

if TYPE_CHECKING:  # decoding.batch loads torch: imported where it is used
    from decoding.batch import BatchPolicy

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEVICE_PRESETS = ("cpu", "cuda")
DEFAULT_LAYER = "default"
FLAG_LAYER = "flag"
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
    static_step: Literal["off", "eager", "compile", "graphs"] = Field(
        "off", description="run steps that fit a bucket through the static step (decoding/static.py): graphs "
        "captures each bucket as a CUDA graph (CUDA only), compile uses torch.compile, eager the same ops as is; "
        "off: every step eager",
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
        AUTO, description="threads of the native kernels' pool and of torch's intra-op work (auto: the physical "
        "cores this process may use, affinity and cgroup quota respected; 0: torch's default)",
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
                       config.max_running, settings.measure_step_cost, settings.prefix_cache_tokens)


# ---- Layers -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """A validated config, its layers in order, and per dotted key (``lookahead.window_size``) the layer its
    value came from."""

    config: ServerConfig
    sources: dict[str, str]
    layers: tuple[str, ...] = ()

    def source(self, key: str) -> str:
        """The layer of ``key``: a file's name, ``flag``, or ``default``."""
        return self.sources.get(key, DEFAULT_LAYER)


def resolve_config_path(name: str) -> Path:
    """Map ``cpu`` or ``cpu.yaml`` to ``configs/cpu.yaml``; pass any existing path through."""
    path = Path(name)
    if path.exists():
        return path
    candidate = CONFIG_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if candidate.exists():
        return candidate
    raise ConfigError(f"config file not found: {name}")


def read_yaml(path: Path) -> dict[str, Any]:
    """Read one YAML mapping (an empty file is an empty mapping)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge two mappings; ``override`` wins, nested mappings merge key by key.

    >>> merge({"lookahead": {"window_size": 2, "ngram_size": 4}}, {"lookahead": {"window_size": 7}})
    {'lookahead': {'window_size': 7, 'ngram_size': 4}}
    """
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def leaves(mapping: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-mapping value.

    >>> list(leaves({"port": 1, "lookahead": {"window_size": 2}}))
    [('port', 1), ('lookahead.window_size', 2)]
    """
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def layers(path: str | None, overrides: dict[str, Any], device_preset: str | None) -> list[tuple[str, dict]]:
    """The ``(name, mapping)`` layers in order, later wins (see the module docstring)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if device_preset is not None:
        preset = CONFIG_DIR / f"{device_preset}.yaml"
        found.append((f"configs/{preset.name}", read_yaml(preset)))
    if path is not None:
        resolved = resolve_config_path(path)
        found.append((str(resolved), read_yaml(resolved)))
    found.append((FLAG_LAYER, drop_none(overrides)))
    return found


def resolve(
    path: str | None = None, overrides: dict[str, Any] | None = None, device_preset: str | None = None
) -> Resolved:
    """Build and validate the config from its layers; raise ``ConfigError`` naming the bad field.

    ``overrides`` uses the config's own shape (``{"lookahead": {"window_size": 7}}``); ``None`` values in it
    are dropped so unset flags never override a file. ``device_preset`` is ``"cpu"``, ``"cuda"`` or None (no
    preset: field defaults, then the file and the flags).
    """
    if device_preset is not None and device_preset not in DEVICE_PRESETS:
        raise ConfigError(f"unknown device preset {device_preset!r}: expected one of {', '.join(DEVICE_PRESETS)}")
    settings: dict[str, Any] = {}
    sources: dict[str, str] = {}
    found = layers(path, overrides or {}, device_preset)
    for name, mapping in found:
        settings = merge(settings, mapping)
        sources.update((key, name) for key, _ in leaves(mapping))
    try:
        return Resolved(ServerConfig.model_validate(settings), sources, (DEFAULT_LAYER, *(name for name, _ in found)))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "config"
        raise ConfigError(f"invalid configuration: {where}: {first['msg']}") from exc


def load_config(
    path: str | None = None, overrides: dict[str, Any] | None = None, device_preset: str | None = None
) -> ServerConfig:
    """``resolve(...).config``: the validated config alone."""
    return resolve(path, overrides, device_preset).config


def requested_device(path: str | None, overrides: dict[str, Any]) -> str:
    """The ``device`` the file and flags ask for (``auto`` when neither does), before any preset."""
    settings = read_yaml(resolve_config_path(path)) if path is not None else {}
    return str(drop_none(overrides).get("device", settings.get("device", ServerConfig.model_fields["device"].default)))


def drop_none(mapping: dict[str, Any]) -> dict[str, Any]:
    """Remove ``None`` values recursively, and nested mappings left empty."""
    cleaned: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            value = drop_none(value)
            if value:
                cleaned[key] = value
        elif value is not None:
            cleaned[key] = value
    return cleaned


# ---- What derives from the definition: flags, the resolved listing, the reference page ---------------------


@dataclass(frozen=True)
class ConfigFlag:
    """One command-line flag derived from a config field."""

    key: str  # dotted config key, e.g. "lookahead.window_size"
    name: str  # e.g. "--window-size"
    kind: type  # bool, int, float or str
    choices: tuple[str, ...] | None
    help: str
    multiple: bool = False  # a list of strings: the flag takes one or more values

    @property
    def dest(self) -> str:
        """The argparse attribute: the key with dots and dashes made underscores."""
        return self.key.replace(".", "_")


def _scalar(annotation: Any) -> tuple[type | None, tuple[str, ...] | None]:
    """``(python type, choices)`` of a flag-able annotation; ``(None, None)`` for lists, mappings and models."""
    if typing.get_origin(annotation) is Literal:
        return str, tuple(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 2 and {_scalar(member)[0] for member in members} == {int, str}:
            return str, None  # a count or a word (threads: 2 or auto): the flag passes the text, the model parses it
        return _scalar(members[0]) if len(members) == 1 else (None, None)
    if typing.get_origin(annotation) is Annotated:
        return _scalar(typing.get_args(annotation)[0])
    return (annotation, None) if annotation in (bool, int, float, str) else (None, None)


def fields(model: type[BaseModel] = ServerConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """``(dotted key, field)`` of every leaf value of ``model``, in definition order."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def config_flags() -> list[ConfigFlag]:
    """Every scalar config value as a flag named after its key's last part (``--window-size``), in order.

    A field may rename its flag (``json_schema_extra={"flag": ...}``); a list of strings (``allowed_origins``) is
    a flag taking one or more values; other lists (``batch.step_cost``) are file-only.
    """
    flags = []
    for key, info in fields():
        multiple = info.annotation == list[str]
        kind, choices = (str, None) if multiple else _scalar(info.annotation)
        if kind is None:
            continue
        name = _extra(info).get("flag", "--" + key.rsplit(".", 1)[-1].replace("_", "-"))
        flags.append(ConfigFlag(key, name, kind, choices, info.description or "", multiple))
    return flags


def flag_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Config-shaped overrides from ``{dotted key: value}`` (``None`` = not given, kept for ``drop_none``).

    >>> flag_overrides({"port": 1, "lookahead.window_size": None})
    {'port': 1, 'lookahead': {'window_size': None}}
    """
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *sections, leaf = key.split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value
    return nested


def value_text(value: Any) -> str:
    """A value as one line of YAML (``null``, ``true``, ``[[1, 1.0], [2, 1.4]]``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def describe(resolved: Resolved, header: str = "") -> str:
    """The resolved config as YAML that ``--config`` accepts, each value commented with the layer it came from.

    Secrets (``api_key``) are not printed: their line is commented out and says where they were set; ``threads:
    auto`` says how many threads it gives here (``decoding.cores.usable_cores``).
    """
    lines = [header] if header else []
    section = ""
    dumped = resolved.config.model_dump(mode="json")
    for key, info in fields():
        *parents, leaf = key.split(".")
        if parents and parents[0] != section:
            section = parents[0]
            lines.append(f"{section}:")
        indent = "  " * len(parents)
        value = dumped
        for part in key.split("."):
            value = value[part]
        source = resolved.source(key)
        if key == "threads" and value == AUTO:
            source += f" (auto: {usable_cores()} here)"
        if _extra(info).get("secret") and value is not None:
            lines.append(f"{indent}# {leaf}: <hidden>".ljust(48) + f"  # {source}")
        else:
            lines.append(f"{indent}{leaf}: {value_text(value)}".ljust(48) + f"  # {source}")
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The table of every config key for ``docs/configuration.md``: flag, default, what each device preset sets,
    range, meaning."""
    presets = {name: resolve(device_preset=name) for name in DEVICE_PRESETS}
    dumped = {name: resolved.config.model_dump(mode="json") for name, resolved in presets.items()}
    defaults = ServerConfig().model_dump(mode="json")
    flags = {flag.key: flag.name for flag in config_flags()}
    rows = ["| key | flag | default | cpu preset | cuda preset | range | meaning |",
            "|---|---|---|---|---|---|---|"]
    for key, info in fields():
        parts = key.split(".")
        cells = [f"`{key}`", f"`{flags[key]}`" if key in flags else "(file only)",
                 f"`{value_text(_lookup(defaults, parts))}`"]
        for name, resolved in presets.items():
            preset_sets = resolved.source(key) != DEFAULT_LAYER
            cells.append(f"`{value_text(_lookup(dumped[name], parts))}`" if preset_sets else "")
        cells += [_range(info), (info.description or "").replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _lookup(mapping: dict[str, Any], parts: list[str]) -> Any:
    for part in parts:
        mapping = mapping[part]
    return mapping


def _member_range(annotation: Any) -> str:
    """One member of a union as ``_range`` writes it: an Annotated int's bound, a Literal's choices."""
    if typing.get_origin(annotation) is Literal:
        return ", ".join(typing.get_args(annotation))
    low = next((m.ge for m in typing.get_args(annotation)[1:] if hasattr(m, "ge")), None)
    return f">= {low}" if low is not None else "any"


def _range(info: FieldInfo) -> str:
    """``[low, high]``, ``>= low`` or a Literal's choices, from the field's own constraints."""
    low = next((m.ge for m in info.metadata if hasattr(m, "ge")), None)
    high = next((m.le for m in info.metadata if hasattr(m, "le")), None)
    _, choices = _scalar(info.annotation)
    if choices:
        return ", ".join(choices)
    members = typing.get_args(info.annotation)
    if any(typing.get_origin(member) is Literal for member in members):  # a count or a word (threads)
        return ", or ".join(_member_range(member) for member in members)
    if low is not None and high is not None:
        return f"[{low}, {high}]"
    return f">= {low}" if low is not None else ""
