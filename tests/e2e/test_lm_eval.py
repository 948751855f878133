"""lm-evaluation-harness against the live server: ``local-completions`` with its remote tokenizer (``/tokenizer_info``,
``/tokenize``) scores a small multiple-choice task, and every loglikelihood equals lm-eval's own ``hf`` model's on the
same weights (a server on the de-quantized float32 checkpoint, ``--weights float32``: the GGUF default rounds its
products' activations to 8 bits, which no ``hf`` model reproduces), continuations the model would end with EOS
included (lm-eval drops the last logprob entry as the generated token, so the server must list EOS there)."""

from __future__ import annotations

import json

import httpx
import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tests.e2e.conftest import API_KEY, start_server  # noqa: E402

pytestmark = pytest.mark.real_model
TOLERANCE = 1e-4
CHAT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
ITEMS = [  # (question, choices, answer): chat-formatted ones end where the model would close its turn (EOS next)
    (CHAT.format(question="What is the capital of France?"), ["Paris.", "The capital of France is Paris.", "Rome."], 1),
    (CHAT.format(question="What is 2 + 2?"), ["4", "2 + 2 = 4.", "5"], 1),
    (CHAT.format(question="Say hello."), ["Hello!", "Goodbye.", "Hello! How can I help you today?"], 2),
    ("The capital of Italy is", [" Rome", " Paris", " Madrid"], 0),
    ("Water freezes at", [" 0 degrees Celsius", " 100 degrees Celsius", " 50 degrees Celsius"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mars", " Venus"], 0),
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""


def loglikelihoods(results: dict) -> list[float]:
    """Every (item, choice) loglikelihood of a ``simple_evaluate`` run with samples logged, in order."""
    samples = sorted(results["samples"]["tiny_mc"], key=lambda sample: sample["doc_id"])
    return [float(response[0][0]) for sample in samples for response in sample["resps"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server on the float32 checkpoint that lm-eval's ``hf`` model loads too (module contract)."""
    running = start_server(tmp_path_factory.mktemp("lm_eval") / "server.log", "--api-key", API_KEY, "--weights",
                           "float32")
    yield running
    assert running.stop() == 0, running.log()


def test_local_completions_loglikelihoods_equal_the_hf_models(server, tmp_path, monkeypatch):
    from decoding.weights.loading import load_model

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # how lm-eval's API models take a key
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))
    served = LocalCompletionsAPI(
        base_url=f"{server.base_url}/v1/completions", model="SmolLM2-135M-Instruct", tokenizer_backend="remote",
        num_concurrent=1, max_retries=1, auth_token=API_KEY,
    )
    local = load_model(device="cpu", dtype="float32")
    reference = HFLM(pretrained=local.model, tokenizer=local.tokenizer, batch_size=1, device="cpu")
    runs = [lm_eval.simple_evaluate(model=model, tasks=["tiny_mc"], task_manager=tasks, log_samples=True)
            for model in (served, reference)]
    ours, theirs = (loglikelihoods(run) for run in runs)
    assert len(ours) == sum(len(choices) for _, choices, _ in ITEMS)
    assert ours == pytest.approx(theirs, abs=TOLERANCE)
    ended = 0  # continuations after which the model's next token is EOS: the case lm-eval got wrong
    for question, choices, _ in ITEMS:
        for choice in choices:
            response = httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"prompt": question + choice, "max_tokens": 1, "temperature": 0}, timeout=60)
            ended += response.json()["choices"][0]["finish_reason"] == "stop"
    assert ended >= 2, "the task must hold continuations that the model ends with EOS"
