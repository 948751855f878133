"""One decode of the tiny-width deep model through the server's engine, timed and replayed: what ``python -m bench
anatomy`` and its device variant (``bench.device_anatomy``) stand on.

Contract: ``tiny_deep_llama()`` is the default model's 30 LLaMA layers at a width of 48 (a forward's arithmetic is
negligible, what is left is the work a GPU step pays on the host); ``preset_lookahead(preset)`` the preset's
lookahead settings and batch policy; ``open_decode(...)`` an engine with one decode of ``anatomy_prompt`` (or a
prompt given); ``engine_step(engine)`` one ``BatchEngine.step()``; ``Clock`` times phases of a step (thread time,
each exclusive of the phases it calls) through ``patched``; ``record_decode(...)`` runs a decode with its forwards'
outputs kept (a ``Recording``), ``replay_host_ms(recording)`` the host work of that decode with its device work
replayed from the recording, ``replayed_host_ms(...)`` both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.settings import batch_policy
from decoding.batch import BatchEngine, BatchPolicy
from decoding.forward.static import StaticStep
from decoding.params import LookaheadConfig, StopCriteria
from decoding.payoff import PayoffGuard
from decoding.step.steps import Step
from server.config_layers import load_config

DEPTH = 30  # the default model's layers
PROMPT_TOKENS = 96
DECODE_TOKENS = 128
def tiny_deep_llama(seed: int = 0, vocab: int = 1024) -> LlamaForCausalLM:
    """A random (seeded) LLaMA with the default model's 30 layers, 3:1 grouped heads and a width of 48."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=DEPTH,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def preset_lookahead(preset: str) -> tuple[LookaheadConfig, BatchPolicy]:
    """The preset's lookahead settings (as the server resolves them for a request that sets none) and policy."""
    config = load_config(device_preset=preset)
    names = {field.name for field in dataclasses.fields(LookaheadConfig)}
    values = {name: getattr(config.lookahead, name) for name in names if hasattr(config.lookahead, name)}
    values["break_even"] = min(values["break_even"], max(values["ngram_size"] - 1, 0))
    return LookaheadConfig(**values), batch_policy(config)


def anatomy_prompt(vocab: int, length: int = PROMPT_TOKENS) -> list[int]:
    """A prompt with the repeats real text has (so copies and the pool have something to find)."""
    phrase = [(7 * index + 3) % vocab for index in range(12)]
    return [(token + (index // 36)) % vocab for index, token in enumerate(phrase * (length // 12 + 1))][:length]


class Clock:
    """Thread time per phase of one engine step: ``wrap`` makes a callable count as a phase, exclusive of the
    phases it calls (so that the phases add up to at most the step)."""

    def __init__(self) -> None:
        self.phases: Counter[str] = Counter()
        self._open: list[str] = []

    def wrap(self, name: str, function: Callable) -> Callable:
        """``function``, its time counted as phase ``name`` (less the wrapped phases inside it)."""

        def timed(*args, **kwargs):
            self._open.append(name)
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                self._open.pop()
                self.phases[name] += spent
                if self._open:
                    self.phases[self._open[-1]] -= spent

        return timed

    def reset(self) -> None:
        self.phases = Counter()


@contextlib.contextmanager
def patched(patches: Sequence[tuple[object, str, Callable]]) -> Iterator[None]:
    """Set each ``(owner, attribute, value)`` for the block, then put the originals back."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)


def resting_guard(policy: BatchPolicy) -> PayoffGuard:
    """A payoff guard that rests a decode after each verifying step for longer than any anatomy decode."""
    return PayoffGuard(lambda tokens: float("inf"), trial=1, warmup=0, rest=1 << 20, max_rest=1 << 20)


def open_decode(model: LlamaForCausalLM, lookahead: LookaheadConfig | None, policy: BatchPolicy,
                static: StaticStep | None, max_tokens: int, rested: bool = False, prompt: Sequence[int] | None = None,
                stop_ids: frozenset[int] = frozenset()) -> BatchEngine:
    """An engine (as the server's: ``BatchEngine``, the static step's pool) with one decode of ``prompt`` (default:
    the anatomy prompt) stopping at ``stop_ids``; without a payoff guard, or (``rested``) with one that keeps it on
    plain steps after its first verifying step."""
    engine = BatchEngine(model, policy, static=static, guard=resting_guard if rested else lambda policy: None)
    prompt = anatomy_prompt(model.config.vocab_size) if prompt is None else prompt
    engine.add(0, list(prompt), StopCriteria(max_tokens, stop_ids), lookahead=lookahead)
    return engine


def engine_step(engine: BatchEngine) -> Step:
    """One ``engine.step()``: the decode's step (raised if it failed)."""
    ((_, step),) = engine.step()
    if isinstance(step, BaseException):
        raise step
    return step


@dataclasses.dataclass(frozen=True)
class Recording:
    """One decode through ``static`` with each forward's outputs kept (``record_decode``): ``open`` makes the same
    decode's engine again, ``steps`` are its engine steps in order."""

    static: StaticStep
    open: Callable[[], BatchEngine]
    outputs: list[tuple[torch.Tensor, ...]]
    steps: list[Step]

    @property
    def tokens(self) -> list[int]:
        """The tokens the decode committed."""
        return [token for step in self.steps for token in step.token_ids]


def record_decode(model: LlamaForCausalLM, lookahead: LookaheadConfig | None, policy: BatchPolicy,
                  static: StaticStep, max_tokens: int = DECODE_TOKENS, rested: bool = False,
                  prompt: Sequence[int] | None = None, stop_ids: frozenset[int] = frozenset()) -> Recording:
    """The ``open_decode`` decode run to its end through ``static``, its forwards' outputs recorded."""
    launch = static.launch
    outputs: list[tuple[torch.Tensor, ...]] = []

    def record(compiled):
        launched = launch(compiled)
        outputs.append(tuple(output.clone() for output in launched))
        return launched

    def opened() -> BatchEngine:
        return open_decode(model, lookahead, policy, static, max_tokens, rested, prompt, stop_ids)

    steps: list[Step] = []
    with torch.inference_mode(), patched([(static, "launch", record)]):
        engine = opened()
        while engine.has_work:
            steps.append(engine_step(engine))
    return Recording(static, opened, outputs, steps)


def replay_host_ms(recording: Recording, replays: int = 1) -> float:
    """Host milliseconds per engine step (CPU thread time, median, prefill excluded) of ``recording``'s decode run
    again with each forward answered by its recorded outputs, so that no forward runs on the CPU between two steps'
    host work; with ``replays``, the median of that many replays' medians. A GPU's host never runs the forward: its
    caches stay warm across steps, where on the CPU the forward's memory traffic evicts the host's working set from
    the caches (a timed decode's ``step_host_ms`` pays that). Each replay must commit the recorded decode's tokens
    (checked); the pool's KV moves (device work) are excluded, as in ``measure_decode``."""
    static, pool, expected = recording.static, recording.static.pool, recording.tokens
    medians = []
    for _ in range(replays):
        answers = iter(recording.outputs)
        clock = Clock()
        device = [(static, "launch", clock.wrap("device", lambda compiled, answers=answers: next(answers))),
                  (pool, "apply_moves", clock.wrap("device", pool.apply_moves))]
        per_step: list[float] = []
        tokens: list[int] = []
        with torch.inference_mode(), patched(device):
            engine = recording.open()
            while engine.has_work:
                clock.reset()
                started = time.thread_time()
                step = engine_step(engine)
                total = time.thread_time() - started
                tokens += step.token_ids
                if not step.stats.prefill:
                    per_step.append(total - clock.phases["device"])
        if tokens != expected:
            raise RuntimeError("the replayed decode did not commit the recorded decode's tokens")
        medians.append(statistics.median(per_step))
    return round(1000 * statistics.median(medians), 3)


def replayed_host_ms(model: LlamaForCausalLM, lookahead: LookaheadConfig | None, policy: BatchPolicy,
                     static: StaticStep, max_tokens: int = DECODE_TOKENS, rested: bool = False) -> float:
    """``replay_host_ms`` of the ``open_decode`` decode, recorded first (``record_decode``)."""
    return replay_host_ms(record_decode(model, lookahead, policy, static, max_tokens, rested))
