"""Benchmark measurement: decode each prompt with each method, timed, and time single forwards (step cost).

Contract: ``run_benchmark(model, prompts, runners, max_tokens, stop_ids)`` takes ``(id, token ids)`` prompts and
``{method: Runner}`` (from ``make_runners``) and returns one ``RunRecord`` per (prompt, method), in run order:
every method decodes every prompt greedily with the same ``max_tokens``, stopping at EOS, and the order of
methods rotates from prompt to prompt (``rotation``) so drift in machine load hits all methods alike. A record's
``steps`` counts forward passes, prefill included (for ``generate``/``prompt_lookup`` counted with a forward
pre-hook on the model); its seconds are wall time end to end, the device synchronized.
``measure_step_cost(model)`` times one forward of k random tokens over a KV cache of ``context`` tokens and
returns ``StepCost`` rows. Nothing here prints; ``bench.report`` does the arithmetic and the tables.

Methods: ``greedy`` (our reference loop), ``lookahead`` (our generator, stepped through
``decoding.step_batch`` with the server's ``BatchPolicy`` when one is given: the server's code path, its payoff
guard included, ``decoding.batch.payoff_guard``; a lone stream is never limited by the policy's budgets),
``generate`` and ``prompt_lookup`` (transformers' ``model.generate``, plain and with prompt-lookup decoding),
``llama_cpp`` (llama.cpp on the model's GGUF file, ``bench.llama_cpp``: an optional extra), ``base_greedy`` and
``base_lookahead`` (an earlier commit's greedy and lookahead in a child process, ``bench.baseline``: their seconds
are the child's, timed around the decode alone).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from bench.llama_cpp import llama_cpp_runner
from bench.records import Decoded, Runner, RunRecord, StepCost
from decoding.batch import BatchPolicy, engine_guard, step_batch
from decoding.errors import InvalidParameterError
from decoding.forward.kv_cache import SlotCache, new_cache
from decoding.forward.packed import forward_packed
from decoding.forward.slices import Slice
from decoding.forward.static import StaticStep, build_static_step
from decoding.params import LookaheadConfig, SamplingParams, StopCriteria
from decoding.payoff import PayoffGuard
from decoding.proposers.ngram_memory import NGramMemory
from decoding.step.stream import DecodeStream, Step, StepStats, generate_autoregressive
from decoding.weights.loading import context_length

if TYPE_CHECKING:
    from bench.baseline import BaselineChild

METHODS = (
    "greedy", "lookahead", "generate", "prompt_lookup", "generate_compiled", "llama_cpp",
    "base_greedy", "base_lookahead",  # an earlier commit's, with --baseline (bench.baseline)
)
DEFAULT_METHODS = "greedy,lookahead,generate"
STEP_COST_KS = (1, 2, 4, 8, 16, 32, 64, 128)
WARMUP_TOKENS = 16

GuardFactory = Callable[[BatchPolicy], "PayoffGuard | None"]  # a batch policy -> its payoff guard (or none)
Wall = Callable[[StepStats, float], float]  # a step and its seconds here -> the seconds its guard prices it at


def own_wall(stats: StepStats, seconds: float) -> float:
    """A ``Wall`` that prices each step at its own ``seconds`` here, as the server's engine times its steps."""
    return seconds


# --- decoding methods -------------------------------------------------------------------------------------


def _collect(steps: Iterator[Step]) -> Decoded:
    """Drain a step generator into a ``Decoded`` (one step per forward pass)."""
    tokens: list[int] = []
    sizes: list[int] = []
    count = offered = accepted = prefill = 0
    for step in steps:
        tokens.extend(step.token_ids)
        count += 1
        offered += step.stats.offered
        accepted += step.stats.accepted
        sizes.append(step.stats.input_tokens)
        prefill += step.stats.prefill
    return Decoded(tokens, count, offered, accepted, step_tokens=sizes, prefill_steps=prefill)


_STATIC_STEPS: dict[int, StaticStep | None] = {}  # per model (by id): the static step its policy asks for


def static_for(model: PreTrainedModel, policy: BatchPolicy | None) -> StaticStep | None:
    """The static step a server with ``policy`` runs ``model``'s steps through (one per model, built on first use
    over a one-row KV pool); None when the policy has none or the model is not one it runs (packed linears).
    ``"graphs"`` off CUDA rehearses the capture, as the server does (``decoding.forward.static``)."""
    if policy is None or policy.static_step == "off":
        return None
    if id(model) not in _STATIC_STEPS:
        _STATIC_STEPS[id(model)] = build_static_step(model, policy.static_step, 1)
    return _STATIC_STEPS[id(model)]


def decode_greedy(
    model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria, policy: BatchPolicy | None = None
) -> Decoded:
    """Our greedy reference loop (``generate_autoregressive``); through the static step when ``policy`` names one
    (as the server runs it)."""
    static = static_for(model, policy)
    if static is None:
        return _collect(generate_autoregressive(model, prompt_ids, stop, SamplingParams()))
    return _collect(batched_steps(DecodeStream(model, prompt_ids, stop, pool=static.pool), policy, static))


def batched_steps(
    stream: DecodeStream, policy: BatchPolicy, static: StaticStep | None = None, guard: PayoffGuard | None = None,
    wall: Wall | None = None,
) -> Iterator[Step]:
    """The steps of ``stream``, each from its own ``step_batch([stream], policy, static, guard)``: the server worker's
    way of advancing a request (an exception that ended the stream is raised). With ``guard`` and ``wall``, each
    step's wall seconds (timed as ``BatchEngine.step`` times them, passed through ``wall``: a simulation may replace
    them) price it for the guard, as the engine's do. The stream is closed at the end."""
    try:
        while not stream.finished:
            started = time.perf_counter()
            result = step_batch([stream], policy, static, guard)[0]
            seconds = time.perf_counter() - started
            if isinstance(result, BaseException):
                raise result
            if result is not None:
                if guard is not None and wall is not None:
                    guard.observe(result.stats, wall(result.stats, seconds))
                yield result
    finally:
        stream.close()


def decode_lookahead(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    config: LookaheadConfig,
    policy: BatchPolicy | None = None,
    memory: NGramMemory | None = None,
    guard: PayoffGuard | None = None,
    wall: Wall | None = None,
) -> Decoded:
    """Greedy lookahead decoding with ``config``: through ``step_batch`` under ``policy`` when one is given (as
    the server runs it, with its payoff ``guard`` when given: the decode is forgotten there at the end, as the
    engine forgets a finished request), else by iterating the generator. With ``memory`` (the server-wide n-gram
    memory) the decode draws candidates from it and, once finished, adds its output to it, as a server request does.
    ``wall`` (see ``batched_steps``) feeds the guard's measured price."""
    static = static_for(model, policy)
    pool = static.pool if static is not None else None
    stream = DecodeStream(model, prompt_ids, stop, SamplingParams(), config, memory=memory, pool=pool)
    if policy is None:
        return _collect(stream)
    try:
        return _collect(batched_steps(stream, policy, static, guard, wall))
    finally:
        if guard is not None:
            guard.forget(stream)


def decode_generate(
    model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria, prompt_lookup_tokens: int | None = None,
    static_cache: bool = False,
) -> Decoded:
    """``model.generate`` with ``do_sample=False`` (prompt-lookup decoding when ``prompt_lookup_tokens``; with
    ``static_cache``, transformers' static cache, whose decode steps transformers compiles with ``torch.compile``
    on a GPU: the fastest ``generate`` a transformers user gets).

    A trailing stop token is stripped so the output compares with ours; forward passes are counted with a
    pre-hook on the model's forward.
    """
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    stop_ids = sorted(stop.stop_token_ids)
    extra = {} if prompt_lookup_tokens is None else {"prompt_lookup_num_tokens": prompt_lookup_tokens}
    if static_cache:
        extra["cache_implementation"] = "static"
    try:
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=stop.max_tokens,
            do_sample=False,
            eos_token_id=stop_ids or None,
            pad_token_id=stop_ids[0] if stop_ids else model.generation_config.pad_token_id,
            **extra,
        )
    finally:
        hook.remove()
    tokens = output[0, input_ids.shape[1] :].tolist()
    if tokens and tokens[-1] in stop.stop_token_ids:
        tokens.pop()
    return Decoded(tokens, forwards[0])


def parse_methods(text: str) -> list[str]:
    """``"greedy,lookahead"`` -> ``["greedy", "lookahead"]``; raises ``ValueError`` on unknown or repeated names."""
    methods = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in methods if name not in METHODS]
    if not methods or unknown:
        raise ValueError(f"unknown methods {unknown or text!r}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"method listed twice in {text!r}")
    return methods


def _on_model(model: PreTrainedModel, runner: Runner) -> Runner:
    """``runner`` pinned to ``model`` whatever model it is handed."""
    return lambda _model, prompt_ids, stop: runner(model, prompt_ids, stop)


def _with_torch_threads(runner: Runner, threads: int) -> Runner:
    """``runner`` with torch's intra-op threads at ``threads`` while it runs (restored after): transformers'
    ``generate`` runs on torch's kernels, which get the threads a transformers user gives them, where our decodes
    leave torch one thread beside the native pool (``decoding.decoder.configure_threads``)."""

    def run(model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria) -> Decoded:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return runner(model, prompt_ids, stop)
        finally:
            torch.set_num_threads(before)

    return run


def make_runners(
    methods: Sequence[str],
    lookahead: LookaheadConfig,
    prompt_lookup_tokens: int,
    transformers_model: PreTrainedModel | None = None,
    policy: BatchPolicy | None = None,
    memory: NGramMemory | None = None,
    gguf_path: Path | None = None,
    threads: int = 1,
    baseline: BaselineChild | None = None,
    guard: GuardFactory = engine_guard,
    wall: Wall | None = None,
) -> dict[str, Runner]:
    """Map each method name (see ``METHODS``) to its runner, in the given order. ``transformers_model``, when
    given, is the model ``generate`` and ``prompt_lookup`` run on (the others run on the benchmark's model);
    ``policy`` and ``memory``, when given, are the ``BatchPolicy`` lookahead steps under and the n-gram memory
    all its decodes share; lookahead's decodes share one payoff guard too, ``guard(policy)`` (the server's engine
    keeps one for all its requests), priced on ``wall`` when given (see ``decode_lookahead``), else on the curve
    alone (the policy's ``measure_step_cost`` left out). Transformers' methods run with torch at ``threads``.
    ``llama_cpp`` runs llama.cpp on ``gguf_path`` with ``threads`` threads (``bench.llama_cpp``); asking for it
    without a GGUF file raises ``ValueError``, as does asking for ``base_greedy`` or ``base_lookahead`` without
    the ``baseline`` child that runs them."""
    transformers_methods: dict[str, Runner] = {
        "generate": decode_generate,
        "prompt_lookup": partial(decode_generate, prompt_lookup_tokens=prompt_lookup_tokens),
        "generate_compiled": partial(decode_generate, static_cache=True),
    }
    if transformers_model is not None:
        transformers_methods = {name: _on_model(transformers_model, run) for name, run in transformers_methods.items()}
    transformers_methods = {name: _with_torch_threads(run, threads) for name, run in transformers_methods.items()}
    priced = policy if policy is None or wall is not None else replace(policy, measure_step_cost=False)
    watched = None if priced is None else guard(priced)
    table: dict[str, Runner] = {
        "greedy": partial(decode_greedy, policy=policy),
        "lookahead": partial(decode_lookahead, config=lookahead, policy=policy, memory=memory, guard=watched,
                             wall=wall),
        **transformers_methods,
    }
    if "llama_cpp" in methods:
        if gguf_path is None:
            raise ValueError("the llama_cpp method needs the model's GGUF file (--gguf PATH)")
        table["llama_cpp"] = llama_cpp_runner(gguf_path, threads)
    for name in ("base_greedy", "base_lookahead"):
        if name in methods:
            if baseline is None:
                raise ValueError(f"the {name} method needs a baseline commit (--baseline REV)")
            table[name] = baseline.runner(name)
    return {name: table[name] for name in methods}


# --- running ----------------------------------------------------------------------------------------------


def rotation(methods: Sequence[str], index: int) -> list[str]:
    """The run order for prompt ``index``: ``methods`` rotated left by ``index``. ``(["a","b","c"], 1)`` -> b, c, a."""
    if not methods:
        return []
    shift = index % len(methods)
    return [*methods[shift:], *methods[:shift]]


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_run(
    model: PreTrainedModel, prompt_id: str, method: str, runner: Runner, prompt_ids: Sequence[int], stop: StopCriteria
) -> RunRecord:
    """Run one decode and time it end to end (prefill included); a runner that timed the decode itself
    (``Decoded.seconds``) gives the seconds instead."""
    gc.collect()
    _synchronize(model.device)
    started = time.perf_counter()
    decoded = runner(model, prompt_ids, stop)
    _synchronize(model.device)
    seconds = time.perf_counter() - started if decoded.seconds is None else decoded.seconds
    return RunRecord(
        id=prompt_id,
        method=method,
        new_tokens=len(decoded.output_ids),
        steps=decoded.steps,
        seconds=seconds,
        output_ids=decoded.output_ids,
        offered=decoded.offered,
        accepted=decoded.accepted,
        step_tokens=decoded.step_tokens,
        prefill_steps=decoded.prefill_steps,
    )


def run_benchmark(
    model: PreTrainedModel,
    prompts: Sequence[tuple[str, Sequence[int]]],
    runners: Mapping[str, Runner],
    max_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
    warmup: int = 1,
    progress: Callable[[RunRecord], None] | None = None,
    after_warmup: Callable[[], None] | None = None,
    rounds: int = 1,
) -> list[RunRecord]:
    """Run every method on every ``(id, token ids)`` prompt, interleaved; return the records in run order.

    Before timing, each method decodes ``warmup`` times ``WARMUP_TOKENS`` tokens of the first prompt; then
    ``after_warmup`` is called (e.g. to forget what a shared memory learnt from them). With ``rounds`` > 1 each
    prompt runs every method that many times, the methods' order rotating each round, and each method's run of median
    time is kept (one record per prompt and method, as with one round): a VM whose speed wanders within minutes then
    moves one method's time less than one run's does.
    """
    stop = StopCriteria(max_tokens, frozenset(stop_token_ids))
    if prompts and warmup > 0:
        short = StopCriteria(min(WARMUP_TOKENS, max_tokens), stop.stop_token_ids)
        for _ in range(warmup):
            for runner in runners.values():
                runner(model, prompts[0][1], short)
    if after_warmup is not None:
        after_warmup()
    records = []
    for index, (prompt_id, prompt_ids) in enumerate(prompts):
        timed: dict[str, list[RunRecord]] = {method: [] for method in runners}
        for round_ in range(rounds):
            for method in rotation(list(runners), index + round_):
                record = time_run(model, prompt_id, method, runners[method], prompt_ids, stop)
                timed[method].append(record)
                if progress is not None:
                    progress(record)
        for method in rotation(list(runners), index):
            runs = sorted(timed[method], key=lambda run: run.seconds)
            records.append(runs[(len(runs) - 1) // 2])
    return records


# --- step cost --------------------------------------------------------------------------------------------


def _step_slice(
    model: PreTrainedModel, cache: SlotCache, tokens: list[int], start: int, every: bool, tree: bool = False
) -> Slice:
    """``tokens`` as one causal slice at positions ``start``.. over ``cache``, reading every row's logits when
    ``every``, else the last row's. ``tree``: the causal visibility given as a mask, as a lookahead step's tree
    is, so the forward takes a decode step's path (the fused CPU step attends natively, in one call) rather
    than a prompt chunk's."""
    count = len(tokens)
    rows = torch.arange(count) if every else torch.tensor([count - 1])
    visible = torch.ones((count, count), dtype=torch.bool).tril() if tree else None
    return Slice(tokens, torch.arange(start, start + count, device=model.device), visible, rows, cache)


def _median_forward_ms(
    model: PreTrainedModel, cache: SlotCache, tokens: list[int], context: int, every: bool, repeats: int
) -> float:
    """Median ms of ``repeats`` engine forwards (``forward_packed``, as a decode step runs) of ``tokens`` after one
    warm-up, rolling the cache back to ``context`` slots after each; the logits of every row when ``every``, else
    of the last row only."""
    device = model.device
    slice_ = _step_slice(model, cache, tokens, context, every, tree=True)
    times = []
    for attempt in range(repeats + 1):
        _synchronize(device)
        started = time.perf_counter()
        forward_packed(model, [slice_])
        _synchronize(device)
        elapsed = time.perf_counter() - started
        cache.commit(context, [])
        if attempt:
            times.append(elapsed)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def measure_step_cost(
    model: PreTrainedModel, context: int = 300, ks: Sequence[int] = STEP_COST_KS, repeats: int = 7, seed: int = 0
) -> list[StepCost]:
    """Time one engine forward (``forward_packed``, what a decode step runs: the k tokens with their visibility
    given, as a lookahead tree's) of k random tokens over a ``SlotCache`` holding ``context`` random tokens, per k:
    the last row's logits, and every row's.

    Raises ``InvalidParameterError`` when ``context + max(ks)`` does not fit the model's context length.
    """
    if context < 1 or context + max(ks) > context_length(model):
        limit = context_length(model)
        raise InvalidParameterError("context", f"context {context} + k {max(ks)} does not fit the model ({limit})")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    cache = new_cache(model, context + max(ks))
    prefix = torch.randint(vocab, (context,), generator=generator).tolist()
    forward_packed(model, [_step_slice(model, cache, prefix, 0, every=False)])
    results = []
    for k in ks:
        tokens = torch.randint(vocab, (k,), generator=generator).tolist()
        last = _median_forward_ms(model, cache, tokens, context, False, repeats)
        every = _median_forward_ms(model, cache, tokens, context, True, repeats)
        results.append(StepCost(k, last, every))
    return results
