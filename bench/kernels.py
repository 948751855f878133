"""Kernels per forward of the fused static step, counted the way inductor emits them.

Contract: ``fused_kernels(model, tokens)`` compiles the ``"fused"`` static step's forward (``decoding.forward.
static_fused``: inductor, CUDA's code path, rehearsed where there is no GPU) for one sequence of ``tokens`` tokens and
returns a ``KernelCount`` of the code inductor wrote; ``count_kernels(code)`` counts one module of that code.

What counts as a kernel, so that a count made on the CPU predicts the launches of a GPU's step:

- a library call (``extern_kernels.mm``/``addmm``/``bmm``, an ATen fallback such as attention or top-k): one each;
- a Triton kernel launch (``triton_*.run(...)``, CUDA): one each;
- a C++ kernel (``cpp_fused_*``, the CPU): one per loop nest inside it. The C++ backend puts nests of different
  shapes that it could not fuse into one function, one after another; Triton launches a kernel for each, so a
  nest is what a GPU pays for. One exception: a nest that reduces a whole row to one value (a one-token step's
  RMSNorm: the C++ backend loops over the row twice, the sum, then the scaling) counts with the nest after it, as
  Triton's persistent reduction does both in one kernel. ``functions`` keeps the C++ functions' own count (what a
  GPU would launch if inductor's combo kernels merged the independent nests).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from decoding.forward.kv_cache import KVPool
from decoding.forward.static import StaticStep
from decoding.forward.static_inputs import Bucket

_CPP_SOURCE = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[.*?\], r?'''(.*?)'''", re.M | re.S)
_CPP_CALL = re.compile(r"^\s+(cpp_fused_\w+)\(", re.M)
_TRITON_CALL = re.compile(r"^\s+(triton_\w+)\.run\(", re.M)
_LIBRARY_CALL = re.compile(r"^\s+.*?\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)
_NEST = "for(int64_t x0="  # each loop nest's outermost loop
_SCALAR_STORE = re.compile(r"\bout_ptr\d+\[static_cast<int64_t>\(0L\)\] = ")
_ANY_STORE = re.compile(r"\.store\(|\b(?:in_)?out_ptr\d+\[[^\]]*\] = ")


@dataclass(frozen=True)
class KernelCount:
    """One compiled forward's kernels (module contract): ``kernels`` = ``fused + library``; ``fused`` the generated
    kernels (loop nests on the CPU, Triton launches on CUDA), ``functions`` the generated functions called,
    ``library`` the library calls, ``by_call`` every call by name (library) or ``"generated"``."""

    kernels: int
    fused: int
    functions: int
    library: int
    by_call: dict[str, int]


def _call_body(code: str) -> str:
    """The wrapper's ``call`` function: the launches, in order."""
    start = code.index("def call(")
    end = code.find("\ndef ", start + 1)
    return code[start:] if end < 0 else code[start:end]


def _nests(source: str) -> int:
    """Loop nests of one C++ kernel, a whole-row reduction counted with the nest after it (module contract)."""
    parts = source.split(_NEST)[1:]
    scalar = sum(1 for part in parts[:-1]
                 if _SCALAR_STORE.search(part) and len(_ANY_STORE.findall(part)) == len(_SCALAR_STORE.findall(part)))
    return max(1, len(parts) - scalar)


def count_kernels(code: str) -> KernelCount:
    """The ``KernelCount`` of one module inductor wrote (module contract)."""
    sources = {name: source for name, source in _CPP_SOURCE.findall(code)}
    body = _call_body(code)
    cpp = _CPP_CALL.findall(body)
    triton = _TRITON_CALL.findall(body)
    library = _LIBRARY_CALL.findall(body)
    nests = sum(_nests(sources[name]) for name in cpp)
    by_call = Counter(library)
    by_call["generated"] = nests + len(triton)
    return KernelCount(nests + len(triton) + len(library), nests + len(triton), len(cpp) + len(triton), len(library),
                       dict(by_call))


def fused_kernels(model: PreTrainedModel, tokens: int, attended: int = 512) -> KernelCount:
    """Compile the fused step's forward for one sequence of ``tokens`` tokens over ``attended`` slots and count its
    kernels (module contract). Compiles: tens of seconds for a 30-layer model on a small CPU, less from inductor's
    cache."""
    from torch._inductor.utils import run_and_get_code

    static = StaticStep(model, KVPool(model, 1, attended, scratch_tokens=max(tokens, 64)), "fused")
    bucket = Bucket(1, tokens, attended)
    with torch.inference_mode():
        _, codes = run_and_get_code(static.warm_up, [bucket])
    counts = [count_kernels(code) for code in codes if "def call(" in code]
    if len(counts) != 1:
        raise RuntimeError(f"expected one compiled forward, inductor wrote {len(counts)} modules")
    return counts[0]
