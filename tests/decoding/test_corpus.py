"""A memory corpus: text files loaded into the shared n-gram memory at start, bounded, kept by the memory file."""

from __future__ import annotations

from pathlib import Path

from decoding.decoder import Decoder
from decoding.proposers.ngram_memory import CORPUS_DOCUMENT_TOKENS, MemoryUsage, NGramMemory, load_memory
from decoding.weights.loading import load_model
from tests.bench.helpers import save_tiny_model


def tiny_decoder(tmp_path: Path) -> Decoder:
    save_tiny_model(tmp_path / "model")
    return Decoder(load_model(str(tmp_path / "model"), "cpu", "float32"))


def test_a_corpus_enters_the_memory_bounded_and_a_memory_file_keeps_it(tmp_path: Path, caplog) -> None:
    decoder = tiny_decoder(tmp_path)
    corpus = tmp_path / "notes.txt"
    corpus.write_text(" ".join(f"w{10 + i % 20}" for i in range(300)))
    missing = tmp_path / "missing.txt"
    engine = decoder.batch_engine(memory_tokens=1000, memory_corpus=[str(missing), str(corpus)])
    assert engine.memory.documents == 1 and len(engine.memory) == 300  # the unreadable file skipped, with a warning
    assert "missing.txt skipped" in caplog.text
    assert engine.memory.candidates([13, 14, 15], length=3, limit=1) == [(16, 17, 18)]  # "w10 w11 w12" -> w13..
    small = decoder.batch_engine(memory_tokens=100, memory_corpus=[str(corpus)])
    assert len(small.memory) == 100  # the bound holds: a document longer than the memory keeps its tail
    saved = tmp_path / "memory.json.gz"
    assert decoder.save_memory(engine, str(saved)) == 1
    restarted = NGramMemory(1000)
    assert load_memory(restarted, saved, decoder.vocabulary_id) == 1
    assert restarted.snapshot() == engine.memory.snapshot()


def test_a_long_file_is_cut_into_documents(tmp_path: Path) -> None:
    decoder = tiny_decoder(tmp_path)
    memory = NGramMemory(3 * CORPUS_DOCUMENT_TOKENS)
    corpus = tmp_path / "long.txt"
    corpus.write_text(" ".join(f"w{10 + i % 7}" for i in range(CORPUS_DOCUMENT_TOKENS + 5)))
    assert decoder.load_corpus(memory, [str(corpus)]) == 2
    assert len(memory) == CORPUS_DOCUMENT_TOKENS + 5


def test_the_engine_adds_documents_to_its_memory_and_reports_its_usage(tmp_path: Path) -> None:
    """``BatchEngine.add_documents`` (the run-time corpus): each token run one document, the bound held; None, and
    nothing stored, for an engine without a memory."""
    decoder = tiny_decoder(tmp_path)
    engine = decoder.batch_engine(memory_tokens=10)
    assert engine.memory_usage() == MemoryUsage(tokens=0, documents=0, capacity=10)
    assert engine.add_documents([[1, 2, 3], [4, 5, 6, 7]]) == MemoryUsage(tokens=7, documents=2, capacity=10)
    assert engine.add_documents([[8, 9, 10, 11, 12]]) == MemoryUsage(tokens=9, documents=2, capacity=10)
    assert engine.memory.snapshot() == [[4, 5, 6, 7], [8, 9, 10, 11, 12]]  # the oldest evicted whole
    without = decoder.batch_engine(memory_tokens=0)
    assert without.add_documents([[1, 2]]) is None and without.memory_usage() is None
