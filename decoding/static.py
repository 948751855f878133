"""The static step: one forward of fixed shapes over every running sequence, ready to be captured as a CUDA graph.

Contract: ``StaticStep(model, pool)`` runs the same forward as ``decoding.packed.forward_packed`` (a LLaMA-family
model, ``supports``) for slices whose caches are rows of ``pool`` (``decoding.kv_cache.KVPool``), padded up to a
``Bucket``: ``sequences`` x ``tokens`` input tokens attending over ``attended`` cache slots. ``run(slices)``
returns, per slice, the logits ``[len(logit_rows), vocab]`` of its ``logit_rows`` (a view of the bucket's output
buffer, valid until the next ``run``) and their ids as Python ints (``decoding.choice.RowIds``: the argmax ids,
and the top ``Slice.top_k`` ids of each row, computed on the device for up to ``top_k`` and read back with the
argmax in the step's one device-to-host copy); each slice's cache grows by its token count, as in an eager
forward. ``bucket(slices)`` says which bucket a step would run in (None: it does not fit,
run it eagerly).

Everything a step varies is data in one int64 input buffer, filled on the host and copied in one go: token ids,
positions, each token's parent in the step (the mask is the ancestor closure of the parents, built on the device
once per step), the rows to read, where each token's keys/values go (pool row, slot), each sequence's cache
length and pool row. Keys/values are written by index (``index_put_``) and read with one gather per layer;
attention runs over the bucket's attended length under an additive mask. Padding tokens of a real sequence are
written in the scratch slots past its tokens; padding sequences use the pool's scratch row. Padding tokens see
themselves (and their row's prefix), so no row is empty and no NaN arises; real tokens never see padding.

The forward itself is ``decoding.static_forward``: plain torch over fixed shapes, no host sync.

Modes: ``"eager"`` calls ``static_forward``; ``"compile"`` wraps one copy of it per bucket in ``torch.compile``
(one code object per bucket: one graph each, and no bucket evicts another from Dynamo's cache); ``"graphs"``
(CUDA) captures each bucket as a ``torch.cuda.CUDAGraph`` sharing one memory pool and replays it. ``"graphs"`` off
CUDA rehearses the capture: the forward takes CUDA's code path (``prepare_weights(path="cuda")``: grouped heads
folded, attention outputs with CUDA's strides), each bucket is run on the capture's warm-up inputs into the shared
output buffers, and a replay is a plain call; only the CUDA graph API is left out.

Every index a step's kernels use is checked on the host before they run (``check_inputs``): a bad index is a
``StaticInputError`` naming the bucket, never a device-side assert (which would poison the CUDA context for the
life of the process). A ``Bucket`` that cannot hold its tokens cannot be built.
"""

from __future__ import annotations

import array
import functools
import itertools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from decoding.choice import RowIds
from decoding.engine import context_length
from decoding.kv_cache import KVPool
from decoding.packed import CUDA_BACKENDS, Slice
from decoding.params import MAX_STEP_TOKENS, MAX_TOP_TOKENS
from decoding.static_forward import (
    SEQUENCE_FIELDS,
    TOKEN_FIELDS,
    fresh_forward,
    prepare_weights,
    static_forward,
    supports,
)

log = logging.getLogger(__name__)

SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)  # the CUDA preset's steps reach ~340
MIN_ATTENDED = 64  # attended lengths: MIN_ATTENDED doubled until a pool row's capacity
MAX_BUCKET_TOKENS = 1024  # sequences x tokens of the largest bucket
MODES = ("eager", "compile", "graphs")


@dataclass(frozen=True)
class StaticStats:
    """What a static step has built so far (plain data, for metrics): its mode (``"graphs (rehearsed)"`` off
    CUDA), buckets built, captures (rehearsed ones included) and their seconds, captures failed on a working
    device."""

    mode: str
    buckets: int
    captures: int
    capture_failures: int
    capture_seconds: float


class StaticInputError(ValueError):
    """A static step's inputs index outside its bucket, the KV pool or the vocabulary (the message names which)."""


@dataclass(frozen=True, order=True)
class Bucket:
    """A static step's shape: ``sequences`` x ``tokens`` input tokens, attending over ``attended`` cache slots.

    A bucket whose tokens do not fit its attended slots cannot be built: its keys/values would be written past
    the slots it attends over.

    >>> Bucket(1, 96, 64)
    Traceback (most recent call last):
    ...
    ValueError: Bucket(sequences=1, tokens=96, attended=64) cannot hold its tokens: 96 tokens > 64 attended slots
    """

    sequences: int
    tokens: int
    attended: int

    def __post_init__(self) -> None:
        if min(self.sequences, self.tokens) < 1:
            raise ValueError(f"{self} has no tokens")
        if self.tokens > self.attended:
            raise ValueError(f"{self} cannot hold its tokens: {self.tokens} tokens > {self.attended} attended slots")

    @property
    def input_size(self) -> int:
        """Ints in the step's input buffer."""
        return len(TOKEN_FIELDS) * self.sequences * self.tokens + len(SEQUENCE_FIELDS) * self.sequences


def _round_up(value: int, choices: Sequence[int]) -> int | None:
    """The smallest of ``choices`` (ascending) that is at least ``value``; None when none is."""
    return next((choice for choice in choices if choice >= value), None)


def bucket_shape(
    sequences: int, tokens: int, max_sequences: int = SEQUENCE_BUCKETS[-1], max_tokens: int = MAX_BUCKET_TOKENS
) -> tuple[int, int] | None:
    """``(sequences, tokens)`` rounded up to a bucket's (at most ``max_sequences`` sequences and ``max_tokens``
    tokens in all); None when no bucket holds them. The rule both the static step and the batch planner use.

    >>> bucket_shape(3, 20), bucket_shape(1, 300), bucket_shape(4, 300)
    ((4, 32), (1, 384), None)
    """
    rounded = (_round_up(sequences, [size for size in SEQUENCE_BUCKETS if size <= max_sequences]),
               _round_up(tokens, TOKEN_BUCKETS))
    if None in rounded or rounded[0] * rounded[1] > max_tokens:
        return None
    return rounded


def build_static_step(model: PreTrainedModel, mode: str, sequences: int) -> StaticStep | None:
    """A static step in ``mode`` over a new KV pool of ``sequences`` rows, each of the model's context length plus
    the largest lookahead step (``MAX_STEP_TOKENS``) and the largest bucket's padding; None, with a warning, for a
    model it cannot run (``supports``). ``"graphs"`` off CUDA rehearses the capture (module contract), with a
    warning."""
    if not supports(model):
        log.warning("static step %s: %s is not a model it runs; every step runs eagerly", mode, type(model).__name__)
        return None
    if mode == "graphs" and model.device.type != "cuda":
        log.warning("static step graphs needs CUDA: rehearsing the capture on %s (CUDA's code path, no graphs)",
                    model.device)
    pool = KVPool(model, sequences, context_length(model) + MAX_STEP_TOKENS, scratch_tokens=TOKEN_BUCKETS[-1])
    return StaticStep(model, pool, mode)


def warm_buckets(static: StaticStep, longest: int = 1024) -> list[Bucket]:
    """The buckets a server builds at start: one sequence, every token bucket, attended lengths up to
    ``longest`` (the rest are built, or captured, on first use)."""
    attended = [length for length in static.attended if length <= longest] or [static.attended[0]]
    return [Bucket(1, tokens, length) for tokens in TOKEN_BUCKETS for length in attended if tokens <= length]


def attended_lengths(row_capacity: int) -> tuple[int, ...]:
    """The attended-length buckets of a pool whose rows hold ``row_capacity`` slots.

    >>> attended_lengths(300)
    (64, 128, 256, 300)
    """
    lengths, length = [], MIN_ATTENDED
    while length < row_capacity:
        lengths.append(length)
        length *= 2
    return (*lengths, row_capacity)


def _ranges(bucket: Bucket, pool_rows: int, vocab: int) -> dict[str, tuple[int, int]]:
    """Each field's range ``[low, high)`` (``input_bounds``), a parent's high being its sequence's token count (it
    must also come before its token: ``input_bounds`` holds each one's own)."""
    return {
        "token_ids": (0, vocab), "positions": (0, 2**62), "parents": (-1, bucket.tokens),
        "read_rows": (0, bucket.sequences * bucket.tokens), "write_rows": (0, pool_rows),
        "write_slots": (0, bucket.attended), "lengths": (0, bucket.attended - bucket.tokens + 1),
        "rows": (0, pool_rows),
    }


def input_bounds(bucket: Bucket, pool_rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``: for each int of ``bucket``'s input buffer (module contract), the range ``[low, high)`` the
    kernels that use it can index: token ids below ``vocab``; rows read within the step's tokens; pool rows
    (written and read) below ``pool_rows``; write slots below the attended length; each token's parent -1 or an
    earlier token of its sequence; cache lengths that leave room for the step's tokens."""
    count, sequences = bucket.sequences * bucket.tokens, bucket.sequences
    ranges = _ranges(bucket, pool_rows, vocab)
    low, high = [], []
    for name in (*TOKEN_FIELDS, *SEQUENCE_FIELDS):
        size = count if name in TOKEN_FIELDS else sequences
        low.append(torch.full((size,), ranges[name][0]))
        high.append(torch.arange(bucket.tokens).repeat(sequences) if name == "parents"
                    else torch.full((size,), ranges[name][1]))
    return torch.cat(low), torch.cat(high)


def within_bounds(fields: Sequence[Sequence[int]], limits: Sequence[tuple[int, int]], tokens: int) -> bool:
    """Whether every int of the input buffer's ``fields`` (``TOKEN_FIELDS`` then ``SEQUENCE_FIELDS``, as Python
    ints) lies in its range: ``limits`` per field (``_ranges``), each parent also before its token (``tokens`` per
    sequence). What ``check_inputs`` checks, on the ints a step already holds: two passes of ``min``/``max`` per
    field, no tensor.

    >>> limits = list(_ranges(Bucket(1, 2, 64), pool_rows=3, vocab=10).values())
    >>> fields = [[5, 6], [0, 1], [-1, 0], [0, 1], [0, 0], [62, 63], [62], [0]]
    >>> within_bounds(fields, limits, 2), within_bounds([*fields[:2], [-1, 1], *fields[3:]], limits, 2)
    (True, False)
    """
    for values, (low, high) in zip(fields, limits, strict=True):
        if values and (min(values) < low or max(values) >= high):
            return False
    return not any(map(operator.ge, fields[2], itertools.cycle(range(tokens))))


def check_inputs(values: torch.Tensor, bucket: Bucket, bounds: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise ``StaticInputError``, naming ``bucket``, the field and the value, unless every int of the host input
    buffer ``values`` lies in its range (``bounds``: ``input_bounds(bucket, ...)``). Three small ops when all is
    well (a few microseconds); a step that passes cannot index out of range on the device.

    >>> bucket = Bucket(1, 2, 64)
    >>> bounds = input_bounds(bucket, pool_rows=3, vocab=10)
    >>> check_inputs(torch.tensor([5, 6, 0, 1, -1, 0, 0, 1, 0, 0, 62, 63, 62, 0]), bucket, bounds)
    >>> check_inputs(torch.tensor([5, 6, 0, 1, -1, 0, 0, 1, 0, 0, 63, 64, 63, 0]), bucket, bounds)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decoding.static.StaticInputError: Bucket(sequences=1, tokens=2, attended=64): write_slots[1] holds 64, ...
    """
    low, high = bounds
    outside = torch.logical_or(values < low, values >= high)
    if not outside.any():
        return
    index = int(outside.nonzero()[0])
    count = bucket.sequences * bucket.tokens
    field = index // count if index < len(TOKEN_FIELDS) * count else len(TOKEN_FIELDS) + (
        index - len(TOKEN_FIELDS) * count) // bucket.sequences
    offset = index % count if field < len(TOKEN_FIELDS) else (index - len(TOKEN_FIELDS) * count) % bucket.sequences
    name = (*TOKEN_FIELDS, *SEQUENCE_FIELDS)[field]
    raise StaticInputError(f"{bucket}: {name}[{offset}] holds {int(values[index])}, outside "
                           f"[{int(low[index])}, {int(high[index])})")


class _Compiled:
    """One bucket's buffers and callable (eager, compiled, or a replayed CUDA graph). ``host`` is the input buffer
    on the host (pinned on CUDA; on the CPU the device's ``inputs`` itself), ``writable`` a view of its memory that
    Python's ints are copied into without a tensor op."""

    def __init__(self, bucket: Bucket, device: torch.device, pinned: bool, pool_rows: int, vocab: int) -> None:
        self.bucket = bucket
        self.bounds = input_bounds(bucket, pool_rows, vocab)
        self.limits = tuple(_ranges(bucket, pool_rows, vocab).values())
        self.host = torch.zeros(bucket.input_size, dtype=torch.long, pin_memory=pinned)
        self.writable = memoryview(self.host.numpy()).cast("B").cast("q")
        self.inputs = self.host if device.type == "cpu" else torch.zeros(bucket.input_size, dtype=torch.long,
                                                                           device=device)
        self.run: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


class StaticStep:
    """Runs steps whose slices fit a bucket through ``static_forward`` (module contract).

    ``mode``: one of ``MODES``; ``"graphs"`` needs CUDA. ``backend`` is ``torch.compile``'s in ``"compile"`` mode.
    ``runs`` counts the steps it ran, ``eager`` the steps its caller ran eagerly because they fit no bucket
    (``decoding.batch.forward_batch`` counts them), ``replays`` and ``captures`` the graph replays and captures
    (``capture_seconds`` their total time; a rehearsal counts its own), ``capture_failures`` the captures that
    failed on a device still usable (the step then runs eagerly, logged once). ``rehearsal``: ``"graphs"`` off CUDA.
    ``top_k``: the top ids every forward computes per read row (at most the vocabulary), for slices that want them
    (``Slice.top_k``; a slice wanting more reads them off its logits itself).
    """

    def __init__(
        self, model: PreTrainedModel, pool: KVPool, mode: str = "eager", backend: str | Callable = "inductor",
        max_bucket_tokens: int = MAX_BUCKET_TOKENS, top_k: int = MAX_TOP_TOKENS,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not supports(model):
            raise ValueError(f"the static step cannot run a {type(model).__name__}")
        self.model, self.pool, self.mode, self.backend = model, pool, mode, backend
        self.device = pool.storage.device
        self.rehearsal = mode == "graphs" and self.device.type != "cuda"
        self.weights = prepare_weights(model, "cuda" if mode == "graphs" else None)
        self.max_bucket_tokens = max_bucket_tokens
        self.top_k = min(top_k, self.weights.embed.shape[0])
        self.attended = attended_lengths(pool.row_capacity)
        self.runs = self.eager = self.replays = self.captures = self.capture_failures = 0
        self.capture_seconds = 0.0
        self._buckets: dict[Bucket, _Compiled] = {}
        self._graph_pool = None
        self._output_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._attended_views: dict[int, tuple[torch.Tensor, ...]] = {}

    def stats(self) -> StaticStats:
        """The step's ``StaticStats`` now."""
        mode = f"{self.mode} (rehearsed)" if self.rehearsal and self.mode == "graphs" else self.mode
        return StaticStats(mode, len(self._buckets), self.captures, self.capture_failures,
                           round(self.capture_seconds, 3))

    def bucket(self, slices: Sequence[Slice]) -> Bucket | None:
        """The bucket ``slices`` run in, or None when they do not fit one (run them eagerly)."""
        widest = max(max(len(slice_.tokens), slice_.row_count) for slice_ in slices)  # rows may repeat
        shape = bucket_shape(len(slices), widest, self.pool.sequences, self.max_bucket_tokens)
        if shape is None:
            return None
        sequences, tokens = shape
        reach = 0
        for slice_ in slices:
            masked = slice_.visible is not None or slice_.visibility is not None
            if slice_.cache.pool_row is None or (masked and slice_.parents is None):
                return None
            reach = max(reach, slice_.cache.length + tokens)
        attended = _round_up(reach, self.attended)
        return None if attended is None else Bucket(sequences, tokens, attended)

    def run(self, slices: Sequence[Slice], bucket: Bucket | None = None) -> tuple[list[torch.Tensor], list[RowIds]]:
        """Run ``slices`` (they must fit: ``bucket(slices)`` is not None); see the module contract."""
        compiled = self.prepare(slices, bucket)
        return self.collect(slices, *self.launch(compiled))

    def prepare(self, slices: Sequence[Slice], bucket: Bucket | None = None) -> _Compiled:
        """Apply the pool's deferred commits, fill the bucket's inputs for ``slices`` and start their copy to
        the device (no wait); return the bucket, ready to ``launch``."""
        bucket = bucket or self.bucket(slices)
        if bucket is None:
            raise ValueError("these slices fit no static bucket")
        self.pool.flush()
        compiled = self._compiled(bucket)
        fields = self._fields(slices, bucket)
        values = array.array("q")  # 8-byte ints, copied into the host buffer as they are
        for field in fields:
            values.extend(field)
        if not within_bounds(fields, compiled.limits, bucket.tokens):
            check_inputs(torch.frombuffer(values, dtype=torch.long), bucket, compiled.bounds)  # names the field
        compiled.writable[:] = values
        if compiled.inputs is not compiled.host:
            compiled.inputs.copy_(compiled.host, non_blocking=True)
        return compiled

    def launch(self, compiled: _Compiled) -> tuple[torch.Tensor, torch.Tensor]:
        """Run (or replay) the prepared bucket: its logits ``[B, T, vocab]`` and ids ``[B, 1 + top_k, T]`` buffers."""
        self.runs += 1
        return compiled.run()

    def collect(
        self, slices: Sequence[Slice], logits: torch.Tensor, ids: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[RowIds]]:
        """Read the step's ids (its one device-to-host copy: every read row's argmax and as many top ids as a slice
        wants, ``Slice.top_k``), grow each slice's cache by its tokens, and split the outputs per slice."""
        rows = max(slice_.row_count for slice_ in slices)
        wanted = min(max(slice_.top_k for slice_ in slices), ids.shape[1] - 1)
        read = ids[: len(slices), : 1 + wanted, :rows].tolist()
        results, predicted = [], []
        for index, slice_ in enumerate(slices):
            count, columns = slice_.row_count, read[index]
            results.append(logits[index, :count])
            if count < rows:
                columns = [column[:count] for column in columns]
            predicted.append(RowIds(columns[0], columns[1 : 1 + min(slice_.top_k, wanted)]))
            slice_.cache.advance(len(slice_.tokens))
        return results, predicted

    def _fields(self, slices: Sequence[Slice], bucket: Bucket) -> list[list[int]]:
        """The step's input fields (module contract; ``TOKEN_FIELDS`` then ``SEQUENCE_FIELDS``) as Python ints (a
        slice without ``host_positions`` / ``host_rows`` has its tensors read instead)."""
        tokens = bucket.tokens
        fields: list[list[int]] = [[] for _ in (*TOKEN_FIELDS, *SEQUENCE_FIELDS)]
        ids, positions, parents, read_rows, write_rows, write_slots, lengths, rows = fields
        for index in range(bucket.sequences):
            slice_ = slices[index] if index < len(slices) else None
            base = index * tokens
            if slice_ is None:  # a padding sequence: the scratch row, nothing cached
                real, length, row, read = 0, 0, self.pool.scratch_row, ()
            else:
                real, length, row = len(slice_.tokens), slice_.cache.length, slice_.cache.pool_row
                ids += slice_.tokens
                positions += slice_.host_positions if slice_.host_positions is not None else slice_.positions.tolist()
                parents += slice_.parents if slice_.parents is not None else range(-1, real - 1)
                read = slice_.host_rows if slice_.host_rows is not None else slice_.logit_rows.tolist()
            pad = tokens - real
            ids += [0] * pad
            positions += [length + real] * pad  # padding: past the sequence, any finite value
            parents += [-1] * pad
            read_rows += [base + r for r in read] if base else read
            read_rows += [base] * (tokens - len(read))
            write_rows += [row] * tokens
            write_slots += range(length, length + tokens)
            lengths.append(length)
            rows.append(row)
        return fields

    def _compiled(self, bucket: Bucket) -> _Compiled:
        """The bucket's buffers and callable, built (and in ``"graphs"`` mode captured) on first use."""
        compiled = self._buckets.get(bucket)
        if compiled is not None:
            return compiled
        compiled = _Compiled(bucket, self.device, self.device.type == "cuda", self.pool.sequences + 1,
                             self.weights.embed.shape[0])
        caches = self._views(bucket.attended)
        if self.mode == "compile":
            function = torch.compile(fresh_forward(), fullgraph=True, dynamic=False, backend=self.backend)
        else:
            function = static_forward
        call = functools.partial(function, self.weights, caches, compiled.inputs, bucket.sequences, bucket.tokens,
                                 top_k=self.top_k)
        if self.mode != "graphs":
            compiled.run = self._kernels(call)
        elif self.rehearsal:
            compiled.run = self._rehearse(functools.partial(call, self._outputs()), compiled)
        else:
            try:
                compiled.run = self._capture(functools.partial(call, self._outputs()), compiled)
            except StaticInputError:
                raise
            except Exception:
                self._fall_back(bucket)
                compiled.run = self._kernels(call)
        self._buckets[bucket] = compiled
        return compiled

    def _fall_back(self, bucket: Bucket) -> None:
        """After a failed capture of ``bucket``: run eagerly from now on (logged, counted) when the device still
        works; re-raise when it does not (a device-side error poisons the CUDA context: nothing after it can run,
        and a server must fail its start loudly rather than answer 503 forever)."""
        try:
            torch.cuda.synchronize(self.device)
            torch.zeros(1, device=self.device).add_(1).item()
        except Exception as error:
            raise RuntimeError(f"CUDA graph capture of {bucket} failed and left {self.device} unusable") from error
        log.exception("CUDA graph capture of %s failed; the static step runs eagerly from now on", bucket)
        self.capture_failures += 1
        self.mode = "eager"

    def _kernels(self, call: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable:
        """``call`` run with ``decoding.packed``'s attention kernels on CUDA (no cuDNN), as is elsewhere."""
        if self.device.type != "cuda":
            return call

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            with torch.nn.attention.sdpa_kernel(CUDA_BACKENDS):
                return call()

        return run

    def _capture(self, call: Callable[[], tuple[torch.Tensor, torch.Tensor]], compiled: _Compiled) -> Callable:
        """Capture ``call`` as a CUDA graph (after warm-up runs on a side stream); return its replay."""
        started = time.perf_counter()
        run = self._kernels(call)
        # Warm-up writes the pool's scratch row only: the inputs are zeros (every token of sequence 0 at row 0
        # would clobber a real row, so point the rows at scratch first).
        self._point_at_scratch(compiled)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = run()
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        log.info("captured static bucket %s in %.1f ms", compiled.bucket, 1000 * (time.perf_counter() - started))

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()
            self.replays += 1
            return outputs

        return replay

    def _rehearse(self, call: Callable[[], tuple[torch.Tensor, torch.Tensor]], compiled: _Compiled) -> Callable:
        """``_capture`` without the CUDA graph API: a run on the capture's inputs, into the shared output buffers
        (the capture's two warm-ups and its recorded run repeat that same run: one checks what three would, at a
        third of a CPU's start-up); its replay calls ``call`` again."""
        started = time.perf_counter()
        self._point_at_scratch(compiled)
        call()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            self.replays += 1
            return call()

        return replay

    def _point_at_scratch(self, compiled: _Compiled) -> None:
        """Fill the bucket's device inputs with a step of padding sequences only (scratch row, no cache)."""
        bucket = compiled.bucket
        count = bucket.sequences * bucket.tokens
        host = torch.zeros(bucket.input_size, dtype=torch.long)
        parents_start, rows_field = 2 * count, 4 * count
        host[parents_start : parents_start + count] = -1
        host[rows_field : rows_field + count] = self.pool.scratch_row
        host[5 * count : 6 * count] = torch.arange(bucket.tokens).repeat(bucket.sequences)
        host[6 * count + bucket.sequences :] = self.pool.scratch_row
        check_inputs(host, bucket, compiled.bounds)
        compiled.inputs.copy_(host)

    def _outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and ids buffers every captured bucket writes (one allocation, not one per graph)."""
        if self._output_buffers is None:
            vocab = self.weights.head.shape[1]
            rows = self.max_bucket_tokens
            self._output_buffers = (torch.empty((rows, vocab), dtype=self.weights.embed.dtype, device=self.device),
                                    torch.empty(rows * (1 + self.top_k), dtype=torch.long, device=self.device))
        return self._output_buffers

    def _views(self, attended: int) -> tuple[torch.Tensor, ...]:
        """Each layer's pool view cut to ``attended`` slots (made once per length)."""
        views = self._attended_views.get(attended)
        if views is None:
            views = self._attended_views[attended] = tuple(view[:, :, :attended] for view in self.pool.layer_views)
        return views

    def warm_up(self, buckets: Sequence[Bucket]) -> float:
        """Build (and capture) ``buckets`` now rather than on first use; return the seconds it took."""
        started = time.perf_counter()
        for bucket in buckets:
            self._compiled(bucket)
        return time.perf_counter() - started
