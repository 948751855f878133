"""What a benchmark run records: one decode's output, one timed run of a method on a prompt, one step-cost row,
and the signature of a method's runner.

Contract: plain data shared by the measuring (``bench.measure``), the runners that live elsewhere
(``bench.llama_cpp``, ``bench.baseline``) and the arithmetic (``bench.report``); it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel

from decoding.params import StopCriteria


@dataclass(frozen=True)
class Decoded:
    """What one decode produced: new token ids (no stop token), forward passes, guessed tokens offered/accepted,
    ``seconds`` when the runner timed the decode itself (a child process: ``time_run`` reports those), and the
    input tokens of each forward in order (``step_tokens``, prefill chunks first: ``prefill_steps`` of them) when
    the runner saw them (our own decodes)."""

    output_ids: list[int]
    steps: int | None
    offered: int | None = None
    accepted: int | None = None
    seconds: float | None = None
    step_tokens: list[int] | None = None
    prefill_steps: int = 0


@dataclass(frozen=True)
class RunRecord:
    """One timed decode of one prompt by one method (a row of the JSON ``runs``)."""

    id: str
    method: str
    new_tokens: int
    steps: int | None
    seconds: float
    output_ids: list[int]
    offered: int | None = None
    accepted: int | None = None
    step_tokens: list[int] | None = None  # input tokens per forward, prefill chunks first (our own decodes)
    prefill_steps: int = 0


@dataclass(frozen=True)
class StepCost:
    """Median wall time of one forward pass with ``k`` new tokens, reading the last / every position's logits."""

    k: int
    ms_last_logits: float
    ms_all_logits: float


Runner = Callable[[PreTrainedModel, Sequence[int], StopCriteria], Decoded]
