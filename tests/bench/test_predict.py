"""The predicted-outputs benchmark: the prediction changes steps, never tokens."""

from __future__ import annotations

from bench.predict import INSTRUCTION, edit_request, totals
from bench.workload import serve
from decoding.batch import BatchEngine, BatchPolicy
from decoding.params import LookaheadConfig, StopCriteria
from tests.decoding.stubs import StubLM


def test_the_prediction_saves_steps_and_is_counted():
    model = StubLM(vocab_size=64, next_token=lambda token: (5 * token + 3) % 64)
    engine = BatchEngine(model, BatchPolicy())
    config = LookaheadConfig(1, 3, 2, lazy_window=True, copy_length=8, copy_min_match=1)
    stop = StopCriteria(40)
    plain = serve(engine, [1, 2], stop, config, None)
    predicted = serve(engine, [1, 2], stop, config, plain.tokens)
    assert predicted.tokens == plain.tokens
    report = {"with": totals([predicted]), "without": totals([plain])}
    assert report["with"]["steps"] < report["without"]["steps"]
    assert report["with"]["prediction_share"] > 0.5 and report["without"]["prediction_share"] == 0


def test_the_edit_request_carries_the_snippet():
    spec = edit_request("def f(x):\n")
    assert spec.messages == ({"role": "user", "content": INSTRUCTION + "def f(x):\n"},)
