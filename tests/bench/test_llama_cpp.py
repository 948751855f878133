"""llama.cpp as a benchmark method (``bench.llama_cpp``): wiring always, a real decode where the extra is installed."""

from __future__ import annotations

import pytest

from bench import llama_cpp, measure
from decoding.params import LookaheadConfig, StopCriteria
from decoding.weights.loading import default_gguf


def test_asking_for_llama_cpp_without_a_gguf_file_is_an_error() -> None:
    with pytest.raises(ValueError, match="GGUF"):
        measure.make_runners(["greedy", "llama_cpp"], LookaheadConfig(), 10)


def test_the_runner_says_how_to_install_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"\.\[llama-cpp\]"):
        llama_cpp.llama_cpp_runner(default_gguf())


@pytest.mark.real_model
@pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed (optional extra)")
def test_llama_cpp_decodes_the_default_gguf_greedily_and_counts_its_forwards(real_model) -> None:
    tokenizer = real_model.tokenizer
    prompt = tokenizer("def fibonacci(n):\n")["input_ids"]
    eos = frozenset({tokenizer.eos_token_id})
    run = measure.make_runners(["llama_cpp", "greedy"], LookaheadConfig(), 10, gguf_path=default_gguf())
    ours = run["greedy"](real_model.model, prompt, StopCriteria(12, eos))
    theirs = run["llama_cpp"](real_model.model, prompt, StopCriteria(12, eos))
    assert len(theirs.output_ids) == 12 and theirs.steps == 1 + 11  # one prefill batch, 11 tokens fed back
    # Same weights, different arithmetic (llama.cpp quantizes activations): the first tokens agree.
    assert theirs.output_ids[:4] == ours.output_ids[:4]
    again = run["llama_cpp"](real_model.model, prompt, StopCriteria(12, eos))
    assert again.output_ids == theirs.output_ids  # each decode starts from an empty cache
