"""The native kernels: ``csrc/panel_gemm.cpp`` (float32 panels), ``csrc/quant_gemm.cpp`` (GGUF block-quantized
panels), ``csrc/fused_ops.cpp`` (a step's small operations) and ``csrc/fused_step.cpp`` (a decode step's layers
in one call), on the thread pool of ``csrc/thread_pool.cpp``,
compiled on first use into one library and called through ctypes.

Contract: ``panel_gemm()`` returns a ``PanelGemm`` (the loaded kernel) or None where it cannot run here: not an
x86-64 CPU with AVX2, FMA and F16C, no C++ compiler (``$CXX`` or ``g++``), a failed build, or
``LOOKAHEAD_NATIVE=0`` in the environment. Callers fall back to torch's kernels on None; nothing else changes.
The shared library is built once per source version into ``<cache>/native/`` (``decoding.weights.loading.cache_root``):
each source compiled twice, with ``-O3 -mavx2 -mfma -mf16c`` and again with ``-mavx512f -mavx512bw -mavx512vnni
-DPANEL_WIDE`` added,
and linked into one library (about 10 s; a compiler that cannot build the AVX-512 objects gives a library of the
AVX2 entries alone), reused by every later process; a concurrent build by another process is harmless (each
writes its own file and renames it into place). The library's name is a digest of every file under ``csrc/``
and the flags, so an edited source or header builds a new library. The result is cached per process.

Threads: ``set_threads(n)`` sizes the kernels' pool (n - 1 workers started once, the calling thread the n-th; 1
until set: ``decoding.decoder.configure_threads`` sets it, torch then keeping one thread). Each call cuts its
output into ranges (column panels of a product, attention's (row, head) pairs, rows) run by one thread each, so
every output element is one thread's operations in the same order: the bits are the same at any thread count.
Calls too small to pay for the hand-off run on the calling thread. Every call releases the GIL (ctypes' ``CDLL``).

On a CPU with AVX-512 (``avx512f``, ``avx512bw`` and ``avx512_vnni``) the kernel packs weights in panels of 16
columns and runs the 512-bit entry; elsewhere, or with ``LOOKAHEAD_NATIVE=avx2``, panels of 8 and the AVX2 entry.
Both run every output element as the same FMA chain (the quantized entries: the same exact integer sums, then the
same float32 operations), so they return the same bits; the wide one does twice the work per instruction, which
pays once a step has more than a few rows (16 rows: 0.78x the AVX2 kernel's time on the Intel VM).

Why native: on a 2-core AVX2 CPU, torch's float32 products over 2-8 rows (oneDNN, MKL) read the weights at
half the speed of a one-row product, so a lookahead step of 4 tokens cost 1.7x a one-token step. The panel
kernel streams each weight once for up to 8 rows (``docs/design.md``, "The panel kernel"). The quantized entries
(``PanelGemm.quantized``) read GGUF's Q4_0 / Q4_1 / Q8_0 blocks packed by ``decoding.weights.quant_panels``, round
the rows to 8 bits a block at a time as llama.cpp does and multiply integers (``csrc/quant_gemm.cpp``), and keep the
same property: every row's result is the same bit for bit whatever other rows share the call.
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

from decoding.weights.loading import cache_root

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("panel_gemm.cpp", "quant_gemm.cpp", "fused_ops.cpp", "fused_step.cpp",
                                          "thread_pool.cpp"))
PANEL = 8  # output columns per panel of the AVX2 kernel: one register of float32
WIDE_PANEL = 16  # of the AVX-512 kernel
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-pthread")
WIDE_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vnni", "-DPANEL_WIDE")
DISABLE_VARIABLE = "LOOKAHEAD_NATIVE"  # "0": no native kernel; "avx2": the AVX2 kernel even where AVX-512 runs

log = logging.getLogger(__name__)


class PanelGemm:
    """``y = x @ W^T`` for float32 rows ``x`` [M, K] and a weight packed by ``pack`` ([N / L, K, L]).

    ``lanes`` (L) is the panel width ``pack`` uses: 16 with the AVX-512 entry, else 8. Each output element is
    one FMA chain over k in order, so a row's result is the same bit for bit whatever the other rows of the call
    and whichever entry runs it (``csrc/panel_gemm.cpp``). The call releases the GIL.
    """

    def __init__(self, library: ctypes.CDLL, wide: bool) -> None:
        self._entries = {PANEL: library.panel_gemm}
        self._quantized = {PANEL: library.quant_gemm}
        self._rows = {PANEL: library.quant_rows}
        if wide and hasattr(library, "panel_gemm_wide") and hasattr(library, "quant_gemm_wide"):
            self._entries[WIDE_PANEL] = library.panel_gemm_wide
            self._quantized[WIDE_PANEL] = library.quant_gemm_wide
            self._rows[WIDE_PANEL] = library.quant_rows_wide
        for entry in self._entries.values():
            entry.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_void_p]
            entry.restype = None
        for entry in (*self._quantized.values(), *self._rows.values()):  # (kind, pointer, size, size, pointer, ...)
            entry.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_void_p]
            entry.restype = ctypes.c_int
        self.lanes = max(self._entries)

    def entry_address(self, lanes: int, quantized: bool) -> int:
        """The address of the entry that runs panels of ``lanes`` columns (a quantized or a float32 one), for
        native code that calls it directly (``FusedOps.step_layers``)."""
        entry = (self._quantized if quantized else self._entries)[lanes]
        return int(ctypes.cast(entry, ctypes.c_void_p).value)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] (N a multiple of 8) as contiguous float32 panels [N / L, K, L]: L = ``lanes`` when
        it divides N, else 8."""
        rows, columns = weight.shape
        if rows % PANEL:
            raise ValueError(f"the panel layout needs a multiple of {PANEL} output features, got {rows}")
        lanes = self.lanes if rows % self.lanes == 0 else PANEL
        return weight.detach().float().reshape(rows // lanes, lanes, columns).transpose(1, 2).contiguous()

    def __call__(self, rows: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, K] times the packed weight: [M, N] float32 (``rows`` is made contiguous float32)."""
        rows = rows.contiguous().float()
        count, depth = rows.shape
        if panels.shape[1] != depth:
            raise ValueError(f"rows have {depth} features, the weight {panels.shape[1]}")
        lanes = panels.shape[2]
        out = torch.empty((count, panels.shape[0] * lanes), dtype=torch.float32)
        self._entries[lanes](rows.data_ptr(), count, depth, panels.data_ptr(), out.shape[1], out.data_ptr())
        return out

    def quantized(self, kind: int, rows: torch.Tensor, panels: torch.Tensor, lanes: int, depth: int) -> torch.Tensor:
        """``rows`` [M, K] times a block-quantized weight packed in panels of ``lanes`` columns
        (``decoding.weights.quant_panels``: uint8 [N / lanes, K / 32, block bytes], format ``kind``): [M, N] float32."""
        rows = rows.contiguous().float()
        count = rows.shape[0]
        if rows.shape[1] != depth:
            raise ValueError(f"rows have {rows.shape[1]} features, the weight {depth}")
        out = torch.empty((count, panels.shape[0] * lanes), dtype=torch.float32)
        status = self._quantized[lanes](kind, rows.data_ptr(), count, depth, panels.data_ptr(), out.shape[1],
                                        out.data_ptr())
        if status != 0:
            raise ValueError(f"the quantized kernel does not know block format {kind}")
        return out

    def quantized_rows(
        self, kind: int, panels: torch.Tensor, lanes: int, depth: int, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``ids`` (any shape) of a block-quantized weight packed as ``quantized`` takes it, de-quantized as
        gguf does it: float32 [*ids.shape, K]. Raises ``IndexError`` for an id outside the weight's rows."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], depth), dtype=torch.float32)
        rows = panels.shape[0] * lanes
        status = self._rows[lanes](kind, panels.data_ptr(), rows, depth, flat.data_ptr(), flat.shape[0], out.data_ptr())
        if status == -2:
            raise IndexError(f"token ids must lie in [0, {rows})")
        if status != 0:
            raise ValueError(f"the quantized kernel does not know block format {kind}")
        return out.reshape(*ids.shape, depth)


class StepProduct(ctypes.Structure):
    """One product of ``csrc/fused_step.cpp``: an entry (``PanelGemm.entry_address``), the GGUF block kind (-1:
    float32 panels), the packed weight, N and K, and a bias [N] (0: none)."""

    _fields_ = [("entry", ctypes.c_void_p), ("kind", ctypes.c_int64), ("panels", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class StepLayer(ctypes.Structure):
    """One decoder layer of ``csrc/fused_step.cpp``: its two norms' weights and its four products."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", StepProduct),
                ("output", StepProduct), ("gate_up", StepProduct), ("down", StepProduct)]


class StepSlice(ctypes.Structure):
    """One sequence of a step (``csrc/fused_step.cpp``): its rows, cached length, visibility bytes (0: causal) and
    each layer's key and value buffers."""

    _fields_ = [("start", ctypes.c_int64), ("count", ctypes.c_int64), ("past", ctypes.c_int64),
                ("visible", ctypes.c_void_p), ("keys", ctypes.POINTER(ctypes.c_void_p)),
                ("values", ctypes.POINTER(ctypes.c_void_p)), ("head_stride", ctypes.c_int64)]


class FusedOps:
    """The small operations of a CPU step over raw float32 buffers (``csrc/fused_ops.cpp``): each output row
    depends on its own row alone, bit for bit. Arguments are ``data_ptr()`` addresses and sizes; the callers
    (``decoding.forward.fused``) own the shapes. The calls release the GIL."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        signatures = {
            "fused_rms_norm": [pointer, size, size, pointer, real, pointer],
            "fused_rope": [pointer, size, size, size, size, pointer, pointer],
            "fused_attention": [pointer, size, size, size, size, size, pointer, pointer, size, size, pointer, real,
                                pointer],
            "fused_silu_mul": [pointer, size, size, pointer],
            "fused_top_tokens": [pointer, size, size, size, pointer],
            "fused_step_layers": [pointer, size, size, ctypes.POINTER(StepLayer), size, ctypes.POINTER(StepSlice),
                                  size, size, size, size, size, real, real, pointer, pointer],
        }
        for name, argtypes in signatures.items():
            entry = getattr(library, name)
            entry.argtypes, entry.restype = argtypes, None
        self.rms_norm = library.fused_rms_norm
        self.rope = library.fused_rope
        self.attention = library.fused_attention
        self.silu_mul = library.fused_silu_mul
        self.top_tokens = library.fused_top_tokens
        self.step_layers = library.fused_step_layers


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (read once per process); None where it cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


def supported_cpu() -> bool:
    """Whether this is an x86-64 CPU with AVX2, FMA and F16C (what the kernels are compiled for)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    if flags is None:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return {"avx2", "fma", "f16c"} <= flags


def wide_cpu() -> bool:
    """Whether the AVX-512 entry runs here (``avx512f``, ``avx512bw`` and ``avx512_vnni``, the quantized entry's
    integer dot products, on a supported CPU) and the environment allows it."""
    if os.environ.get(DISABLE_VARIABLE, "").lower() == "avx2" or not supported_cpu():
        return False
    flags = _cpu_flags()
    if flags is None:
        return False
    return {"avx512f", "avx512bw", "avx512_vnni"} <= flags


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``g++`` on the PATH; None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def library_path() -> Path:
    """Where this source version's shared library lives in the cache: named by a digest of every file under
    ``csrc/`` (sources and headers, names and contents) and the flags, so an edited source never loads a stale
    library."""
    digest = hashlib.sha256(" ".join(FLAGS + WIDE_FLAGS).encode())
    for source in sorted(CSRC.iterdir()):
        if source.is_file():
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return cache_root() / "native" / f"panel_gemm-{digest.hexdigest()[:16]}.so"


def build(target: Path, cxx: str) -> None:
    """Compile each of ``SOURCES`` twice (AVX2; AVX-512) and link the objects into ``target`` (atomically: built
    beside it, then renamed); raises when an AVX2 object or the link fails, and leaves the AVX-512 entries out (with
    a warning) when one of their objects fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        narrow = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        for source, output in zip(SOURCES, narrow, strict=True):
            _run([cxx, *FLAGS, "-c", "-o", str(output), str(source)])
        wide = [Path(scratch) / f"{source.stem}-wide.o" for source in SOURCES]
        try:
            for source, output in zip(SOURCES, wide, strict=True):
                _run([cxx, *FLAGS, *WIDE_FLAGS, "-c", "-o", str(output), str(source)])
        except subprocess.SubprocessError as error:
            log.warning("the panel kernel's AVX-512 entry did not build (%s): the AVX2 entry runs alone", error)
            wide = []
        _run([cxx, "-shared", "-pthread", "-o", str(built), *map(str, narrow + wide)])
        os.replace(built, target)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def available() -> bool:
    """Whether the library runs here, without building it: the loaded library's answer once loaded, else whether
    it could be (a supported CPU, ``LOOKAHEAD_NATIVE`` not 0, and the built library cached or a compiler to build
    it). ``decoding.decoder.configure_threads`` asks this before any model is loaded."""
    if library.cache_info().currsize:
        return library() is not None
    if os.environ.get(DISABLE_VARIABLE, "1") == "0" or not supported_cpu():
        return False
    return library_path().exists() or compiler() is not None


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The native library, built on first use; None where it cannot run (see the module contract)."""
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
    loaded = ctypes.CDLL(str(target))
    loaded.pool_set_threads.argtypes, loaded.pool_set_threads.restype = [ctypes.c_int], ctypes.c_int
    loaded.pool_threads.argtypes, loaded.pool_threads.restype = [], ctypes.c_int
    loaded.pool_set_min_cost.argtypes, loaded.pool_set_min_cost.restype = [ctypes.c_int64], ctypes.c_int64
    loaded.pool_set_threads(_POOL["threads"])
    loaded.pool_set_min_cost(_POOL["min_cost"])
    return loaded


# The size asked of the native thread pool (``set_threads``), applied again whenever the library is loaded. The pool
# is per process, as torch's intra-op threads are.
_POOL = {"threads": 1, "min_cost": -1}


def set_threads(count: int) -> int:
    """Size the native kernels' thread pool: ``count`` threads, the calling one included (at least 1), starting
    ``count - 1`` workers once (``csrc/thread_pool.cpp``); a library loaded later gets the same size. Not to be
    called while a kernel runs. Returns the pool's size now (the count asked for while the library is not loaded).
    Every kernel returns the same bits at any size."""
    _POOL["threads"] = max(1, int(count))
    if library.cache_info().currsize:
        loaded = library()
        if loaded is not None:
            return int(loaded.pool_set_threads(_POOL["threads"]))
    return _POOL["threads"]


def set_min_parallel_cost(cost: int | None) -> None:
    """The smallest call (in multiply-adds, or elements touched) the kernels split over the pool; None: the
    default (``csrc/thread_pool.h``: MIN_PARALLEL_COST). Tests pass 0 so that every call of a tiny model splits."""
    _POOL["min_cost"] = -1 if cost is None else max(0, int(cost))
    if library.cache_info().currsize:
        loaded = library()
        if loaded is not None:
            loaded.pool_set_min_cost(_POOL["min_cost"])


def threads() -> int:
    """The native thread pool's size (the size asked for, where the library is not loaded yet)."""
    if library.cache_info().currsize:
        loaded = library()
        if loaded is not None:
            return int(loaded.pool_threads())
    return _POOL["threads"]


@functools.lru_cache(maxsize=1)
def panel_gemm() -> PanelGemm | None:
    """The loaded panel kernel, built on first use; None where it cannot run (see the module contract)."""
    loaded = library()
    return None if loaded is None else PanelGemm(loaded, wide_cpu())


@functools.lru_cache(maxsize=1)
def fused_ops() -> FusedOps | None:
    """The step's small operations (``csrc/fused_ops.cpp``), from the same library; None where it cannot run."""
    loaded = library()
    return None if loaded is None or not hasattr(loaded, "fused_step_layers") else FusedOps(loaded)


def forget() -> None:
    """Drop this process's loaded library and kernels, so the next call builds or loads them anew (tests)."""
    for cached in (library, panel_gemm, fused_ops):
        cached.cache_clear()


# --- the kernels as torch ops, so that torch.compile traces through them (``decoding.forward.compiled``) ------------
# Declared with ``torch.library.Library`` (a CPU kernel and a fake one) rather than ``torch.library.custom_op``:
# a call costs ~3 us more than the ctypes call this way, ~16 us more through ``custom_op``'s wrapper (the 2-core
# Xeon, one row of 576). The eager forward calls ``PanelGemm`` directly.

OPS = torch.library.Library("lookahead", "DEF")
OPS.define("panel_gemm(Tensor rows, Tensor panels) -> Tensor")
OPS.define("quant_gemm(Tensor rows, Tensor panels, int kind, int lanes, int depth) -> Tensor")


def _panel_gemm_op(rows: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """``PanelGemm.__call__`` as the op ``lookahead::panel_gemm``: rows [M, K], panels [N / L, K, L] -> [M, N]."""
    return _loaded()(rows, panels)


def _quant_gemm_op(rows: torch.Tensor, panels: torch.Tensor, kind: int, lanes: int, depth: int) -> torch.Tensor:
    """``PanelGemm.quantized`` as the op ``lookahead::quant_gemm``: rows [M, K] -> [M, N]."""
    return _loaded().quantized(kind, rows, panels, lanes, depth)


@torch.library.register_fake("lookahead::panel_gemm", lib=OPS)
def _panel_gemm_shape(rows: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], panels.shape[0] * panels.shape[2]), dtype=torch.float32)


@torch.library.register_fake("lookahead::quant_gemm", lib=OPS)
def _quant_gemm_shape(rows: torch.Tensor, panels: torch.Tensor, kind: int, lanes: int, depth: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], panels.shape[0] * lanes), dtype=torch.float32)


OPS.impl("panel_gemm", _panel_gemm_op, "CPU")
OPS.impl("quant_gemm", _quant_gemm_op, "CPU")


def _loaded() -> PanelGemm:
    """The loaded kernel (the ops run only where a ``PanelGemm`` was built)."""
    gemm = panel_gemm()
    if gemm is None:
        raise RuntimeError("the native kernel does not run here")
    return gemm
