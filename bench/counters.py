"""What a step would make a GPU wait on, and how many ops it dispatches: the counters of ``python -m bench anatomy``.

Contract: ``SyncCounter(device)`` counts, while active, the reads of tensors into Python and the blocking copies to
``device`` (what would block the host on a GPU); ``count_aten_ops(run)`` counts the ATen ops ``run()`` dispatches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__})


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(run: Callable[[], object]) -> int:
    """ATen ops ``run()`` dispatches (views and in-place ops included; a GPU launches a kernel for most)."""
    with OpCounter() as counter:
        run()
    return sum(counter.ops.values())


class SyncCounter(TorchFunctionMode):
    """Counts what would block the host on a GPU while active: reading a tensor into Python (``item``,
    ``tolist``, ``cpu``, ``bool()``/``int()``/``float()`` ...), and blocking copies to ``device`` (``.to``,
    ``copy_`` or a factory given ``device=``, without ``non_blocking``). ``device`` is the model's: on the CPU
    the copies it names cost nothing, but they are the ones a GPU would wait on. ``calls`` lists them."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.calls: list[str] = []
        self.reads = 0  # of which reads into Python (device-to-host)

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = func in _READS
        if read or self._blocking_copy(func, args, kwargs):
            self.calls.append(getattr(func, "__name__", str(func)))
            self.reads += read
        return func(*args, **kwargs)

    def _blocking_copy(self, func, args: tuple, kwargs: dict) -> bool:
        if kwargs.get("non_blocking") or (func is torch.Tensor.copy_ and len(args) > 2 and args[2]):
            return False
        if func is torch.Tensor.to:
            targets = [arg for arg in (*args[1:], kwargs.get("device")) if isinstance(arg, (str, torch.device))]
            return any(torch.device(target).type == self.device.type for target in targets)
        if func is torch.Tensor.copy_:
            return args[0].device != args[1].device
        device = kwargs.get("device")
        return device is not None and func in (torch.tensor, torch.as_tensor) and \
            torch.device(device).type == self.device.type
