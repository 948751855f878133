"""The static step: one forward of fixed shapes over every running sequence, ready to be captured as a CUDA graph.

Contract: ``StaticStep(model, pool)`` runs the same forward as ``decoding.forward.packed.forward_packed`` (a
LLaMA-family model, ``supports``) for slices whose caches are rows of ``pool`` (``decoding.forward.kv_cache.KVPool``),
padded up to a ``Bucket``: ``sequences`` x ``tokens`` input tokens attending over ``attended`` cache slots.
``run(slices)`` returns, per slice, the logits ``[len(logit_rows), vocab]`` of its ``logit_rows`` (a view of the
bucket's output buffer, valid until the next ``run``) and their ids as Python ints (``decoding.forward.choice.RowIds``:
the argmax ids, and the top ``Slice.top_k`` ids of each row, computed on the device for up to ``top_k`` and read back
with the argmax in the step's one device-to-host copy); each slice's cache grows by its token count, as in an eager
forward. ``bucket(slices)`` says which bucket a step would run in (None: it does not fit, run it eagerly).

Everything a step varies is data in one int64 input buffer (``decoding.forward.static_inputs``), packed from Python
ints on the host and copied in one go: token ids, positions, each token's parent in the step (the mask is the
ancestor closure of the parents, built on the device once per step), the rows to read, each sequence's cache length
and pool row (where its tokens' keys/values go: that row, from slot length on). Keys/values are written by index
(``index_put_``) and read with one gather per layer; attention runs over the bucket's attended length under an
additive mask; or, on CUDA's path for heads the tree kernel takes, all of that is one op a layer
(``decoding.forward.tree_attention``). Padding tokens of a real sequence are written in the scratch slots past its
tokens; padding sequences use the pool's scratch row. Padding tokens see themselves (and their row's prefix), so no
row is empty and no NaN arises; real tokens never see padding.

The forward itself is ``decoding.forward.static_forward``: plain torch over fixed shapes, no host sync.

Modes: ``"eager"`` calls ``static_forward``; ``"compile"`` wraps one copy of it per bucket in ``torch.compile``
(one code object per bucket: one graph each, and no bucket evicts another from Dynamo's cache); ``"graphs"``
(CUDA) captures each bucket as a ``torch.cuda.CUDAGraph`` sharing one memory pool and replays it; ``"fused"``
captures the forward compiled by inductor instead (``decoding.forward.static_fused``: a few fused kernels a layer,
at most eight compiles for every bucket; should a compile or its capture fail, the step captures the plain forward
from then on, as ``"graphs"``). ``"graphs"`` and ``"fused"`` off CUDA rehearse the capture: the forward takes
CUDA's code path (``prepare_weights(path="cuda")``: grouped heads folded, attention outputs with CUDA's strides),
each bucket is run on the capture's warm-up inputs into the shared output buffers, and a replay is a plain call;
only the CUDA graph API is left out.

Every index a step's kernels use is checked on the host before they run (``check_slices``, on the step's ints;
``check_inputs`` on a whole buffer): a bad index is a
``StaticInputError`` naming the bucket, never a device-side assert (which would poison the CUDA context for the
life of the process). A ``Bucket`` that cannot hold its tokens cannot be built.
"""

from __future__ import annotations

import bisect
import functools
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from decoding.forward.choice import RowIds
from decoding.forward.kv_cache import KVPool
from decoding.forward.packed import CUDA_BACKENDS
from decoding.forward.slices import Slice
from decoding.forward.static_forward import (
    fresh_forward,
    prepare_weights,
    static_forward,
    supports,
)
from decoding.forward.static_fused import FusedForwards
from decoding.forward.static_inputs import (
    Bucket,
    StaticInputError,
    check_inputs,
    check_slices,
    input_bounds,
    step_values,
)
from decoding.params import MAX_STEP_TOKENS, MAX_TOP_TOKENS
from decoding.weights.loading import context_length

__all__ = ["CAPTURED", "Bucket", "StaticInputError", "StaticStats", "StaticStep", "attended_lengths", "bucket_shape",
           "build_static_step", "check_inputs", "input_bounds", "warm_buckets"]

log = logging.getLogger(__name__)

SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)  # the CUDA preset's steps reach ~340
MIN_ATTENDED = 64  # attended lengths: MIN_ATTENDED doubled until a pool row's capacity
MAX_BUCKET_TOKENS = 1024  # sequences x tokens of the largest bucket
MODES = ("eager", "compile", "graphs", "fused")
CAPTURED = ("graphs", "fused")  # the modes that capture CUDA graphs (rehearsed off CUDA)


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


def _round_up(value: int, choices: Sequence[int]) -> int | None:
    """The smallest of ``choices`` (ascending) that is at least ``value``; None when none is."""
    at = bisect.bisect_left(choices, value)
    return choices[at] if at < len(choices) else None


@functools.lru_cache(maxsize=4096)
def _bucket(sequences: int, tokens: int, attended: int) -> Bucket:
    """``Bucket(sequences, tokens, attended)``, made once per shape (a step asks for one every time)."""
    return Bucket(sequences, tokens, attended)


@functools.lru_cache(maxsize=4096)
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
    if mode in CAPTURED and model.device.type != "cuda":
        log.warning("static step %s needs CUDA: rehearsing the capture on %s (CUDA's code path, no graphs)", mode,
                    model.device)
    pool = KVPool(model, sequences, context_length(model) + MAX_STEP_TOKENS, scratch_tokens=TOKEN_BUCKETS[-1])
    static = StaticStep(model, pool, mode)
    if static.weights.tree_kernel:
        kernel = "Triton" if model.device.type == "cuda" else "its torch reference (a rehearsal)"
        log.info("static step %s: a layer's attention is one op, the tree attention through %s", mode, kernel)
    return static


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


class _Compiled:
    """One bucket's buffers and callable (eager, compiled, or a replayed CUDA graph). ``host`` is the input buffer
    on the host (pinned on CUDA; on the CPU the device's ``inputs`` itself), ``writable`` its memory, which
    ``packer`` packs a step's Python ints into without a tensor op."""

    def __init__(self, bucket: Bucket, device: torch.device, pinned: bool) -> None:
        self.bucket = bucket
        self.host = torch.zeros(bucket.input_size, dtype=torch.long, pin_memory=pinned)
        self.writable = memoryview(self.host.numpy()).cast("B")
        self.packer = struct.Struct(f"={bucket.input_size}q")
        self.inputs = self.host if device.type == "cpu" else torch.zeros(bucket.input_size, dtype=torch.long,
                                                                           device=device)
        self.run: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


class StaticStep:
    """Runs steps whose slices fit a bucket through ``static_forward`` (module contract).

    ``mode``: one of ``MODES``; ``"graphs"`` and ``"fused"`` need CUDA (rehearsed off it). ``backend`` is
    ``torch.compile``'s in ``"compile"`` and ``"fused"`` modes; ``fused`` holds the latter's compiled forwards.
    ``runs`` counts the steps it ran, ``eager`` the steps its caller ran eagerly because they fit no bucket
    (``decoding.batch.forward_batch`` counts them), ``replays`` and ``captures`` the graph replays and captures
    (``capture_seconds`` their total time, compiles included; a rehearsal counts its own), ``capture_failures`` the
    captures that failed on a device still usable (the step then runs eagerly, or after a failed ``"fused"``
    capture as ``"graphs"``; logged). ``rehearsal``: ``"graphs"`` or ``"fused"`` off CUDA.
    ``top_k``: the top ids every forward computes per read row (at most the vocabulary), for slices that want them
    (``Slice.top_k``; a slice wanting more reads them off its logits itself). ``tree_kernel``: whether CUDA's path
    attends through ``decoding.forward.tree_attention`` (None: where it takes the heads, ``prepare_weights``).
    """

    def __init__(
        self, model: PreTrainedModel, pool: KVPool, mode: str = "eager", backend: str | Callable = "inductor",
        max_bucket_tokens: int = MAX_BUCKET_TOKENS, top_k: int = MAX_TOP_TOKENS, tree_kernel: bool | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not supports(model):
            raise ValueError(f"the static step cannot run a {type(model).__name__}")
        self.model, self.pool, self.mode, self.backend = model, pool, mode, backend
        self.device = pool.storage.device
        self.rehearsal = mode in CAPTURED and self.device.type != "cuda"
        pool.staged = pool.staged or self.rehearsal  # a rehearsal stages the pool's moves as CUDA does
        self.weights = prepare_weights(model, "cuda" if mode in CAPTURED else None, tree_kernel)
        self.max_bucket_tokens = max_bucket_tokens
        self.vocab = self.weights.embed.shape[0]
        self.top_k = min(top_k, self.vocab)
        self.attended = attended_lengths(pool.row_capacity)
        self.runs = self.eager = self.replays = self.captures = self.capture_failures = 0
        self.capture_seconds = 0.0
        self._buckets: dict[Bucket, _Compiled] = {}
        self._graph_pool = None
        self._output_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._attended_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self.fused = FusedForwards(self.weights, self.top_k, backend) if mode == "fused" else None

    def stats(self) -> StaticStats:
        """The step's ``StaticStats`` now."""
        mode = f"{self.mode} (rehearsed)" if self.rehearsal and self.mode in CAPTURED else self.mode
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
        return None if attended is None else _bucket(sequences, tokens, attended)

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
        values = step_values(slices, bucket, self.pool.scratch_row)
        check_slices(values, bucket, self.pool.sequences + 1, self.vocab)
        compiled.packer.pack_into(compiled.writable, 0, *values)
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

    def _compiled(self, bucket: Bucket) -> _Compiled:
        """The bucket's buffers and callable, built (and in ``"graphs"`` or ``"fused"`` mode captured) on first use."""
        compiled = self._buckets.get(bucket)
        if compiled is not None:
            return compiled
        compiled = _Compiled(bucket, self.device, self.device.type == "cuda")
        caches = self._views(bucket.attended)
        if self.mode == "compile":
            function = torch.compile(fresh_forward(), fullgraph=True, dynamic=False, backend=self.backend)
        else:
            function = static_forward
        call = functools.partial(function, self.weights, caches, compiled.inputs, bucket.sequences, bucket.tokens,
                                 top_k=self.top_k)
        if self.mode not in CAPTURED:
            compiled.run = self._kernels(call)
        elif self.rehearsal:
            compiled.run = self._rehearse(self._captured_call(call, bucket, compiled), compiled)
        else:
            compiled.run = self._captured(call, bucket, compiled)
        self._buckets[bucket] = compiled
        return compiled

    def _captured(
        self, call: Callable[..., tuple[torch.Tensor, torch.Tensor]], bucket: Bucket, compiled: _Compiled
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """``bucket``'s capture in this mode; each failed one steps down a mode (``_fall_back``: ``"fused"`` to
        ``"graphs"`` to ``"eager"``) and tries again, so that a step always runs while the device works."""
        while self.mode in CAPTURED:
            try:
                return self._capture(self._captured_call(call, bucket, compiled), compiled)
            except StaticInputError:
                raise
            except Exception:
                self._fall_back(bucket)
        return self._kernels(call)

    def _captured_call(
        self, call: Callable[..., tuple[torch.Tensor, torch.Tensor]], bucket: Bucket, compiled: _Compiled
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """What a capture records for ``bucket``: ``call`` into the shared output buffers, or in ``"fused"`` mode
        the bucket's compiled forward (``decoding.forward.static_fused``)."""
        if self.fused is None:
            return functools.partial(call, self._outputs(bucket))
        return self.fused.call(bucket, self._views(bucket.attended), compiled.inputs, self._outputs(bucket))

    def _fall_back(self, bucket: Bucket) -> None:
        """After a failed capture of ``bucket``: run eagerly from now on (logged, counted) when the device still
        works; re-raise when it does not (a device-side error poisons the CUDA context: nothing after it can run,
        and a server must fail its start loudly rather than answer 503 forever)."""
        try:
            torch.cuda.synchronize(self.device)
            torch.zeros(1, device=self.device).add_(1).item()
        except Exception as error:
            raise RuntimeError(f"CUDA graph capture of {bucket} failed and left {self.device} unusable") from error
        self.capture_failures += 1
        if self.mode == "fused":  # the compiled forward failed: capture the plain one
            log.exception("the fused step of %s failed; the static step captures its plain forward from now on",
                          bucket)
            self.mode, self.fused = "graphs", None
            return
        log.exception("CUDA graph capture of %s failed; the static step runs eagerly from now on", bucket)
        self.mode = "eager"

    def _kernels(self, call: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable:
        """``call`` run with ``decoding.forward.packed``'s attention kernels on CUDA (no cuDNN), as is elsewhere."""
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
        host[2 * count : 3 * count] = -1  # parents: none
        host[4 * count + bucket.sequences :] = self.pool.scratch_row  # rows (lengths 0: slots 0.., all in scratch)
        check_inputs(host, bucket, input_bounds(bucket, self.pool.sequences + 1, self.vocab))
        compiled.inputs.copy_(host)

    def _outputs(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """``bucket``'s views of the logits and ids buffers every captured bucket writes (one allocation, not one per
        graph): ``[B * T, vocab]`` and ``[B, 1 + top_k, T]``."""
        if self._output_buffers is None:
            vocab = self.weights.head.shape[1]
            rows = self.max_bucket_tokens
            self._output_buffers = (torch.empty((rows, vocab), dtype=self.weights.embed.dtype, device=self.device),
                                    torch.empty(rows * (1 + self.top_k), dtype=torch.long, device=self.device))
        logits, ids = self._output_buffers
        count = bucket.sequences * bucket.tokens
        return logits[:count], ids[: count * (1 + self.top_k)].view(bucket.sequences, 1 + self.top_k, bucket.tokens)

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
