"""The native panel kernel: built on first use, equal to torch's product to rounding, each row independent bit for
bit, its AVX2 and AVX-512 entries equal bit for bit, and a clean fallback (None) wherever it cannot run."""

from __future__ import annotations

import ctypes
import logging
import shutil
import threading

import pytest
import torch

from decoding.weights import native
from decoding.weights.linears import PackedFloat32

needs_kernel = pytest.mark.skipif(
    not (native.supported_cpu() and native.compiler()), reason="needs an AVX2 x86-64 CPU and a C++ compiler"
)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """``native.panel_gemm`` with its per-process cache cleared and the library built under ``tmp_path``."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    native.forget()
    yield native.panel_gemm
    native.forget()


@needs_kernel
def test_the_kernel_builds_into_the_cache_and_loads(fresh, tmp_path):
    gemm = fresh()
    assert isinstance(gemm, native.PanelGemm)
    assert native.library_path().is_relative_to(tmp_path) and native.library_path().exists()
    assert fresh() is gemm  # one load per process


@needs_kernel
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 19, 24, 26])
@pytest.mark.parametrize("shape", [(40, 24), (576, 96), (96, 1536)])
def test_the_kernel_equals_torch_to_rounding(gemm, count, shape):
    torch.manual_seed(count)
    weight, rows = torch.randn(*shape), torch.randn(count, shape[1])
    got = gemm(rows, gemm.pack(weight))
    torch.testing.assert_close(got, rows @ weight.t(), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("shape", [(200, 576), (96, 1536), (40, 24), (64, 33), (400, 130)])
def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(gemm, shape):
    # Every path (1-3 rows across all panels; 4+ rows in bands of 3 panels and 1 left over, blocks of K, groups of
    # four or eight rows and a remainder) must run each element's FMA chain in the same order. The shapes leave 1
    # or 2 panels over after the bands of 3 and cut K into whole and partial blocks.
    torch.manual_seed(0)
    panels = gemm.pack(torch.randn(*shape))
    rows = torch.randn(26, shape[1])
    alone = torch.cat([gemm(rows[i : i + 1], panels) for i in range(len(rows))])
    for count in range(2, len(rows) + 1):
        assert torch.equal(gemm(rows[:count], panels), alone[:count]), count


@needs_kernel
@pytest.mark.parametrize("shape", [(200, 576), (96, 1536), (40, 24), (400, 130)])
def test_a_row_gives_the_same_bits_at_any_thread_count(gemm, pool, shape):
    # The panels are cut into ranges run by the pool's threads (every call split, at 1, 2 and 3 threads): each
    # element is still one thread's chain, so a row batched at any count equals the row alone on one thread.
    torch.manual_seed(0)
    panels = gemm.pack(torch.randn(*shape))
    rows = torch.randn(26, shape[1])
    native.set_threads(1)
    alone = torch.cat([gemm(rows[i : i + 1], panels) for i in range(len(rows))])
    native.set_threads(pool)
    for count in range(1, len(rows) + 1):
        assert torch.equal(gemm(rows[:count], panels), alone[:count]), count


@needs_kernel
def test_the_pool_takes_its_size_and_keeps_it_across_loads(gemm):
    assert native.set_threads(3) == 3 and native.threads() == 3
    native.forget()  # a library loaded again gets the size asked for
    assert native.panel_gemm() is not None and native.threads() == 3
    assert native.set_threads(0) == 1 and native.threads() == 1  # at least the calling thread


@needs_kernel
def test_calls_from_two_threads_at_once_give_the_same_bits(gemm, pool):
    # One caller uses the workers at a time; another one meanwhile runs its chunks on its own thread.
    torch.manual_seed(3)
    panels = gemm.pack(torch.randn(400, 576))
    rows = torch.randn(9, 576)
    expected = gemm(rows, panels)
    results = []
    workers = [threading.Thread(target=lambda: results.extend(gemm(rows, panels) for _ in range(20)))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(results) == 40 and all(torch.equal(result, expected) for result in results)


def test_the_library_is_named_by_every_source_and_header(monkeypatch, tmp_path):
    sources = tmp_path / "csrc"
    shutil.copytree(native.CSRC, sources)
    monkeypatch.setattr(native, "CSRC", sources)
    before = native.library_path()
    header = sources / "thread_pool.h"
    header.write_text(header.read_text() + "\n")
    assert native.library_path() != before


def test_the_wide_entry_needs_avx512_bw_and_vnni(monkeypatch):
    # The quantized wide entry's integer dot products (vpdpbusd, byte masks) need AVX-512 BW and VNNI: a CPU with
    # AVX-512F alone (Skylake-X) runs the AVX2 entry, as does LOOKAHEAD_NATIVE=avx2.
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    base = {"avx2", "fma", "f16c", "avx512f"}
    for flags, wide in [(base, False), (base | {"avx512bw"}, False), (base | {"avx512bw", "avx512_vnni"}, True)]:
        monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert native.wide_cpu() is wide, flags
    monkeypatch.setenv(native.DISABLE_VARIABLE, "avx2")
    assert native.wide_cpu() is False


@needs_kernel
@pytest.mark.parametrize("shape", [(576, 576), (96, 1536), (40, 24), (400, 130)])
def test_both_entries_give_the_same_bits(shape):
    if not native.wide_cpu():
        pytest.skip("this CPU has no AVX-512")
    torch.manual_seed(1)
    wide = native.panel_gemm()
    narrow = native.PanelGemm(ctypes.CDLL(str(native.library_path())), wide=False)
    weight, rows = torch.randn(*shape), torch.randn(26, shape[1])
    for count in (1, 2, 3, 4, 7, 8, 13, 26):
        assert torch.equal(wide(rows[:count], wide.pack(weight)), narrow(rows[:count], narrow.pack(weight))), count


@needs_kernel
def test_packing_needs_whole_panels_and_takes_the_widest_that_divides(gemm):
    with pytest.raises(ValueError, match="multiple of 8"):
        gemm.pack(torch.randn(12, 4))
    assert gemm.pack(torch.randn(40, 4)).shape == (5, 4, 8)  # 40 columns: panels of 8 on either entry
    assert gemm.pack(torch.randn(32, 4)).shape == (32 // gemm.lanes, 4, gemm.lanes)


def test_disabled_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert not native.available()
    assert fresh() is None


@needs_kernel
def test_available_says_so_without_building_and_then_follows_the_load(fresh, monkeypatch, tmp_path):
    assert native.available() and not native.library_path().exists()  # a compiler would build it: nothing built
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not native.available()  # no compiler and nothing cached
    monkeypatch.setenv("CXX", "false")  # a compiler that fails: the load's answer is what counts once tried
    assert native.available() and fresh() is None and not native.available()


@needs_kernel
def test_a_failed_build_falls_back_with_a_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="decoding.weights.native"):
        assert fresh() is None
    assert "oneDNN" in caplog.text


@needs_kernel
def test_a_compiler_without_avx512_builds_the_avx2_entry_alone(fresh, monkeypatch, tmp_path, caplog):
    wrapper = tmp_path / "cxx-no-avx512"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *-mavx512f*) exit 1;; esac\nexec {native.compiler()} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    with caplog.at_level(logging.WARNING, logger="decoding.weights.native"):
        gemm = fresh()
    assert gemm is not None and gemm.lanes == 8
    assert "AVX-512 entry did not build" in caplog.text
    weight, rows = torch.randn(32, 24), torch.randn(5, 24)
    torch.testing.assert_close(gemm(rows, gemm.pack(weight)), rows @ weight.t(), rtol=1e-4, atol=1e-4)


def test_no_compiler_falls_back(fresh, monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(native, "supported_cpu", lambda: True)
    assert fresh() is None


@needs_kernel
def test_packed_float32_keeps_the_panels_alone_and_runs_every_product_on_them(monkeypatch):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 576), torch.randn(96)
    kernel = PackedFloat32(weight, bias)
    assert kernel.gemm is not None and kernel.blocked is None  # one copy of the weight
    rows = torch.randn(40, 576)
    assert torch.equal(kernel(rows), kernel.gemm(rows, kernel.panels) + bias)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # several threads: the same kernel, the same bits
    assert torch.equal(kernel(rows), kernel.gemm(rows, kernel.panels) + bias)
    torch.testing.assert_close(kernel(rows), rows @ weight.t() + bias, rtol=1e-4, atol=1e-4)


def test_packed_float32_without_the_kernel_keeps_onednns_blocked_copy_alone(monkeypatch):
    monkeypatch.setattr(native, "panel_gemm", lambda: None)
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    kernel = PackedFloat32(weight, None)
    assert kernel.gemm is None and kernel.panels is None and kernel.blocked is not None
    rows = torch.randn(9, 64)
    alone = torch.cat([kernel(rows[i : i + 1]) for i in range(len(rows))])
    assert torch.equal(kernel(rows), alone)  # one row or several: each row's bits its own
    torch.testing.assert_close(alone, rows @ weight.t(), rtol=1e-5, atol=1e-5)
