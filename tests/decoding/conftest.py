"""Fixtures shared by the decoding tests: the native kernel with each of its entries."""

from __future__ import annotations

import pytest

from decoding.weights import native


@pytest.fixture(params=["avx2", "avx512"])
def gemm(request, monkeypatch):
    """The loaded kernel with each entry in turn: panels of 8 (AVX2, forced by the environment), of 16 (AVX-512,
    skipped where the CPU lacks it)."""
    if request.param == "avx512" and not native.wide_cpu():
        pytest.skip("this CPU has no AVX-512")
    if request.param == "avx2":
        monkeypatch.setenv(native.DISABLE_VARIABLE, "avx2")
    else:
        monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    native.forget()
    loaded = native.panel_gemm()
    assert loaded is not None and loaded.lanes == (8 if request.param == "avx2" else 16)
    yield loaded
    native.forget()


@pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def pool(request):
    """The native thread pool at 1, 2 and 3 threads in turn (3: an odd split), every call split however small
    (``native.set_min_parallel_cost(0)``); back to one thread and the default threshold after."""
    native.set_threads(request.param)
    native.set_min_parallel_cost(0)
    yield request.param
    native.set_min_parallel_cost(None)
    native.set_threads(1)
