"""The one native kernel: ``csrc/panel_gemm.cpp``, compiled on first use and called through ctypes.

Contract: ``panel_gemm()`` returns a ``PanelGemm`` (the loaded kernel) or None where it cannot run here: not an
x86-64 CPU with AVX2 and FMA, no C++ compiler (``$CXX`` or ``g++``), a failed build, or
``LOOKAHEAD_NATIVE=0`` in the environment. Callers fall back to torch's kernels on None; nothing else changes.
The shared library is built once per source version into ``<cache>/native/`` (``decoding.loading.cache_root``)
with ``-O3 -mavx2 -mfma`` (about 2 s) and reused by every later process; a concurrent build by another process
is harmless (each writes its own file and renames it into place). The result is cached per process.

Why native: on a 2-core AVX2 CPU, torch's float32 products over 2-8 rows (oneDNN, MKL) read the weights at
half the speed of a one-row product, so a lookahead step of 4 tokens cost 1.7x a one-token step. The panel
kernel streams each weight once for up to 8 rows (``docs/design.md``, "The panel kernel").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from decoding.loading import cache_root

SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
PANEL = 8  # output columns per panel: one AVX2 register of float32
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
DISABLE_VARIABLE = "LOOKAHEAD_NATIVE"

log = logging.getLogger(__name__)


class PanelGemm:
    """``y = x @ W^T`` for float32 rows ``x`` [M, K] and a weight packed by ``pack`` ([N / 8, K, 8]).

    Each output element is one FMA chain over k in order, so a row's result is the same bit for bit whatever
    the other rows of the call (``csrc/panel_gemm.cpp``). The call releases the GIL.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._call = library.panel_gemm
        self._call.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
        self._call.restype = None

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] (N a multiple of 8) as contiguous float32 panels [N / 8, K, 8]."""
        rows, columns = weight.shape
        if rows % PANEL:
            raise ValueError(f"the panel layout needs a multiple of {PANEL} output features, got {rows}")
        return weight.detach().float().reshape(rows // PANEL, PANEL, columns).transpose(1, 2).contiguous()

    def __call__(self, rows: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, K] times the packed weight: [M, N] float32 (``rows`` is made contiguous float32)."""
        rows = rows.contiguous().float()
        count, depth = rows.shape
        if panels.shape[1] != depth:
            raise ValueError(f"rows have {depth} features, the weight {panels.shape[1]}")
        out = torch.empty((count, panels.shape[0] * PANEL), dtype=torch.float32)
        self._call(rows.data_ptr(), count, depth, panels.data_ptr(), out.shape[1], out.data_ptr())
        return out


def supported_cpu() -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA (what the kernel is compiled for)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    words = set(flags.split())
    return {"avx2", "fma"} <= words


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``g++`` on the PATH; None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def library_path() -> Path:
    """Where this source version's shared library lives in the cache."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_root() / "native" / f"panel_gemm-{digest}.so"


def build(target: Path, cxx: str) -> None:
    """Compile ``SOURCE`` into ``target`` (atomically: built beside it, then renamed); raises on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([cxx, *FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.replace(built, target)


@functools.lru_cache(maxsize=1)
def panel_gemm() -> PanelGemm | None:
    """The loaded panel kernel, built on first use; None where it cannot run (see the module contract)."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0" or not supported_cpu():
        return None
    target = library_path()
    if not target.exists():
        cxx = compiler()
        if cxx is None:
            log.info("no C++ compiler: float32 products over several rows run on oneDNN")
            return None
        try:
            build(target, cxx)
        except (OSError, subprocess.SubprocessError) as error:
            log.warning("building the panel kernel failed (%s): float32 products run on oneDNN", error)
            return None
    return PanelGemm(ctypes.CDLL(str(target)))
