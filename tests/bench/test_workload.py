"""The repeated workload: the engines with and without the memory differ in speed only."""

from __future__ import annotations

from bench.datasets import PromptSpec
from bench.workload import SYSTEM_PROMPT, run_workload, summary, templated
from decoding.batch import BatchPolicy
from decoding.params import LookaheadConfig, StopCriteria
from tests.decoding.stubs import StubLM


def test_the_second_request_accepts_the_first_ones_output_only_with_the_memory():
    model = StubLM(vocab_size=64, next_token=lambda token: (5 * token + 3) % 64)
    config = LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1)
    results = run_workload(model, [[1, 2, 7, 20], [9, 33, 7, 20]], StopCriteria(30), config, BatchPolicy(), 1000)
    assert all(remembered.tokens == plain.tokens for remembered, plain in results)
    (_, _), (remembered, plain) = results
    assert remembered.counts.memory_accepted > 15 and plain.counts.memory_accepted == 0
    report = summary(results)
    assert report["with_memory"]["steps"] < report["without_memory"]["steps"]
    assert report["with_memory"]["tokens"] == report["without_memory"]["tokens"] == 60
    assert report["with_memory"]["accepted_share"] > report["without_memory"]["accepted_share"]


def test_templated_wraps_text_and_chat_prompts_alike():
    chat = PromptSpec(id="a", messages=({"role": "user", "content": "sort a list"},))
    for spec in (PromptSpec(id="a", text="sort a list"), chat):
        wrapped = templated(spec)
        assert wrapped.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert wrapped.messages[1]["content"].endswith("Request: sort a list")


def test_a_named_preset_gives_the_lookahead_settings_and_the_device_the_model(monkeypatch):
    """``--preset cuda`` on a CPU: the CUDA preset's lookahead settings and batch policy, the CPU preset's model."""
    from bench import workload
    from server.config_layers import load_config

    loads = []
    monkeypatch.setattr(workload.Decoder, "load", staticmethod(lambda *args: loads.append(args) or "decoder"))
    config, lookahead, decoder = workload.load_preset("cpu", "cuda")
    cuda, cpu = load_config(device_preset="cuda"), load_config(device_preset="cpu")
    assert decoder == "decoder" and config == cuda
    assert (lookahead.window_size, lookahead.copy_stretch) == (cuda.lookahead.window_size, cuda.lookahead.copy_stretch)
    assert loads == [(cpu.model, "cpu", cpu.dtype, cpu.quantize, cpu.weight_layout, cpu.weights)]
    _, own, _ = workload.load_preset("cpu")
    assert own.window_size == cpu.lookahead.window_size
