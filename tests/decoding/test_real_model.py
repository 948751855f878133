"""Lookahead == greedy == transformers.generate on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest
import torch

from decoding.decoder import Decoder
from decoding.params import LookaheadConfig, StopCriteria

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MESSAGES = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
]


def prompt_ids(tokenizer, text: str) -> list[int]:
    if text.startswith("def "):
        return tokenizer(text)["input_ids"]
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def decode(decoder: Decoder, ids: list[int], lookahead: LookaheadConfig | None, max_tokens: int) -> list[int]:
    stop = StopCriteria(max_tokens, decoder.eos_token_ids())
    return [token for step in decoder.decode(ids, stop, lookahead=lookahead) for token in step.token_ids]


@pytest.fixture(scope="module")
def greedy_outputs(real_model) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt ids and the greedy continuation (40 tokens) of each message, computed once."""
    decoder = Decoder(real_model)
    outputs = {}
    for text in MESSAGES:
        ids = prompt_ids(real_model.tokenizer, text)
        outputs[text] = (ids, decode(decoder, ids, None, 40))
    return outputs


def test_greedy_loop_equals_transformers_generate(real_model, greedy_outputs):
    decoder = Decoder(real_model)
    ids, ours = greedy_outputs[MESSAGES[0]]
    with torch.inference_mode():
        output = real_model.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    theirs = [token for token in output[0, len(ids) :].tolist() if token not in decoder.eos_token_ids()]
    assert ours == theirs


@pytest.mark.parametrize(
    "config",
    [LookaheadConfig(2, 4, 4), LookaheadConfig(7, 5, 7),
     LookaheadConfig(16, 5, 16, copy_length=32, copy_min_match=0, copy_candidates=8, window_chains=True)],
    ids=["2-4-4", "7-5-7", "16-5-16-copies-chains"],
)
def test_lookahead_equals_greedy_on_the_real_model(real_model, greedy_outputs, config):
    decoder = Decoder(real_model)
    for text, (ids, expected) in greedy_outputs.items():
        assert decode(decoder, ids, config, 40) == expected, text


def test_window_chains_accept_where_the_window_converged(real_model):
    """No pool, no copies: without chains nothing can be accepted; with them the window's own columns are, on a
    counting prompt where Jacobi iteration converges, and one step commits more than N tokens."""
    decoder = Decoder(real_model)
    ids = real_model.tokenizer("Count from 1 to 60, separated by commas: 1, 2, 3,")["input_ids"]
    stop = StopCriteria(40, decoder.eos_token_ids())
    runs = {}
    for chains in (False, True):
        config = LookaheadConfig(5, 4, 0, prompt_pool=False, output_pool=False, window_chains=chains)
        runs[chains] = list(decoder.decode(ids, stop, lookahead=config))
    expected = decode(decoder, ids, None, 40)
    assert [[t for step in steps for t in step.token_ids] for steps in runs.values()] == [expected, expected]
    assert sum(step.stats.accepted for step in runs[False]) == 0
    assert sum(step.stats.accepted for step in runs[True]) >= 5
    assert max(step.stats.committed for step in runs[True]) > config.ngram_size


def engine_decode(engine, ids: list[int], config: LookaheadConfig, max_tokens: int) -> tuple[list[int], int]:
    """One request through ``engine`` (a ``BatchEngine``): its tokens and its steps (forward passes)."""
    stop = StopCriteria(max_tokens, frozenset())
    engine.add("request", ids, stop, lookahead=config)
    tokens, steps = [], 0
    while engine.has_work:
        for _, step in engine.step():
            tokens.extend(step.token_ids)
            steps += 1
    return tokens, steps


def test_a_saved_memory_serves_a_restarted_engine(real_model, greedy_outputs, tmp_path, caplog):
    """A memory saved by one engine and loaded by the next (a server restart) offers the first engine's
    completions: the same request takes fewer steps and returns the same tokens."""
    decoder = Decoder(real_model)
    ids, expected = greedy_outputs[MESSAGES[1]]
    config = LookaheadConfig(2, 4, 4)
    first = decoder.batch_engine(memory_tokens=10_000)
    assert engine_decode(first, ids, config, 40)[0] == expected[:40]
    path = str(tmp_path / "memory.json.gz")
    assert decoder.save_memory(first, path) == 1
    cold_tokens, cold_steps = engine_decode(decoder.batch_engine(memory_tokens=10_000), ids, config, 40)
    warm = decoder.batch_engine(memory_tokens=10_000, memory_file=path)
    warm_tokens, warm_steps = engine_decode(warm, ids, config, 40)
    assert cold_tokens == warm_tokens == expected[:40]
    assert warm_steps < cold_steps // 2, (warm_steps, cold_steps)
    assert decoder.save_memory(decoder.batch_engine(memory_tokens=0), path) is None  # no memory: nothing written
    (tmp_path / "other.json.gz").write_bytes(b"not a memory file")
    engine = decoder.batch_engine(memory_tokens=10_000, memory_file=str(tmp_path / "other.json.gz"))
    assert len(engine.memory) == 0 and "starts empty" in caplog.text


def test_stretched_copies_equal_greedy_and_reach_past_copy_length(real_model):
    """The model repeats a word: copies accepted whole stretch past ``copy_length`` and the output stays greedy's."""
    decoder = Decoder(real_model)
    ids = prompt_ids(real_model.tokenizer, "Write the word 'hello' twenty times, separated by spaces.")
    config = LookaheadConfig(16, 5, 16, copy_length=8, copy_min_match=0, copy_candidates=4, copy_stretch=4)
    steps = list(decoder.decode(ids, StopCriteria(96, decoder.eos_token_ids()), lookahead=config))
    assert [token for step in steps for token in step.token_ids] == decode(decoder, ids, None, 96)
    assert max(step.stats.committed for step in steps) > config.copy_length + 1


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_the_static_step_on_the_real_model_equals_greedy(greedy_outputs, mode):
    """The default model (9:3 heads, tied embeddings, its rotary base) through the static step: greedy and the
    CUDA preset's lookahead both give the eager greedy tokens. A fresh copy: the static step re-points its weights.
    ``"graphs"`` rehearses CUDA's path, where a layer's attention is the tree attention op (heads of 64)."""
    from decoding.batch import BatchEngine
    from decoding.forward.kv_cache import KVPool
    from decoding.forward.static import StaticStep
    from decoding.weights.loading import load_model
    from server.config import decoder_lookahead
    from server.config_layers import load_config
    from tests.decoding.forward.test_static import drain

    loaded = load_model(device="cpu", dtype="float32")
    static = StaticStep(loaded.model, KVPool(loaded.model, 2, 1024, scratch_tokens=256), mode)
    assert static.weights.tree_kernel == (mode == "graphs")
    preset = decoder_lookahead(load_config(device_preset="cuda").lookahead)
    eos = Decoder(loaded).eos_token_ids()
    for text in MESSAGES[:2]:
        ids, expected = greedy_outputs[text]
        for config in (None, preset):
            engine = BatchEngine(loaded.model, static=static)
            engine.add(text, ids, StopCriteria(40, eos), lookahead=config)
            assert drain(engine)[text] == expected, (text, config)
    assert static.runs > 0 and static.eager == 0
