"""The GPU check, on the CPU: it refuses without CUDA; parts are selected per device call; each part's results are
written as it ends (a part that raises, overruns its budget or is killed leaves the earlier ones); the folder holds
at most 8 files; the report reads as tables; the wrapper and the docstring describe the two calls the parts make."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from bench import gpu, gpu_parts, gpu_runner, gpu_step_cost
from bench.gpu_runner import Output, Part, PartContext, TooManyFiles, run_parts, select_parts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run")
def test_without_cuda_the_check_refuses(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


# --- selection ------------------------------------------------------------------------------------------------


def test_each_device_call_selects_its_parts_and_names_the_others():
    first, left_out = select_parts(gpu_parts.PARTS, call=1)
    assert first == ["tests", "step_cost", "fused_step_cost"]
    assert left_out["heldout"] == "runs in device call 2, not this call 1"
    second, left_out = select_parts(gpu_parts.PARTS, call=2)
    assert second == ["model_tests", "heldout", "server", "load", "anatomy"]
    assert set(left_out) == {"tests", "step_cost", "fused_step_cost"}


def test_parts_by_name_and_skip():
    selected, left_out = select_parts(gpu_parts.PARTS, "heldout,load,tests", skip="load")
    assert selected == ["tests", "heldout"]  # the parts' order, not the list's
    assert left_out["load"] == "left out by --skip" and left_out["server"].startswith("not selected")
    assert select_parts(gpu_parts.PARTS)[0] == [part.name for part in gpu_parts.PARTS]
    with pytest.raises(ValueError, match="unknown parts nope"):
        select_parts(gpu_parts.PARTS, "tests,nope")


def test_an_unknown_part_is_a_usage_error():
    with pytest.raises(SystemExit) as error:
        gpu.main(["--parts", "nope"])
    assert error.value.code == 2


# --- running parts -------------------------------------------------------------------------------------------


def writes_a_file(context: PartContext) -> None:
    context.output.file("first.json").write_text("{}")
    context.record("value", 1)


def raises(context: PartContext) -> None:
    context.record("partial", "kept")
    raise RuntimeError("broken on purpose")


def overruns(context: PartContext) -> None:
    context.run([sys.executable, "-c", "import time; time.sleep(30)"])


def asks_for_too_many_files(context: PartContext) -> None:
    for index in range(20):
        context.output.file(f"extra-{index}.json").write_text("{}")


FAKE_PARTS = (
    Part("first", 1, 60, writes_a_file),
    Part("raises", 1, 60, raises),
    Part("overruns", 1, 1, overruns),
    Part("needs", 1, 60, writes_a_file, needs=lambda: "no model here"),
    Part("broken_needs", 1, 60, writes_a_file, needs=lambda: 1 / 0),
    Part("files", 1, 60, asks_for_too_many_files),
    Part("last", 2, 60, lambda context: context.record("ran", True)),
)


def test_a_part_that_raises_or_overruns_leaves_the_others_and_skips_are_named(tmp_path):
    selected, left_out = select_parts(FAKE_PARTS, call=1)
    started = time.monotonic()
    run_parts(FAKE_PARTS, selected, Output(tmp_path), {"selected": selected}, gpu_parts.markdown, left_out)
    assert time.monotonic() - started < 20  # the overrunning command was stopped at its budget
    report = json.loads((tmp_path / "gpu.json").read_text())
    parts = report["parts"]
    assert parts["first"]["status"] == "done" and parts["first"]["results"] == {"value": 1}
    assert parts["raises"]["status"] == "failed" and "broken on purpose" in parts["raises"]["error"]
    assert parts["raises"]["results"] == {"partial": "kept"}
    assert parts["overruns"]["status"] == "timeout" and parts["overruns"]["results"]["runs"][0]["status"] == "timeout"
    assert parts["files"]["status"] == "failed" and "TooManyFiles" in parts["files"]["error"]
    assert report["skipped"] == {"needs": "no model here", "last": "runs in device call 2, not this call 1",
                                 "broken_needs": "checking what it needs failed: ZeroDivisionError('division by zero')"}
    assert (tmp_path / "first.json").exists()
    assert len(list(tmp_path.iterdir())) <= gpu_runner.MAX_FILES
    text = (tmp_path / "gpu.md").read_text()
    assert "## raises: failed" in text and "- needs: no model here" in text and "## overruns: timeout" in text


KILLED = """
import sys, time
from bench import gpu_parts, gpu_runner
def first(context):
    context.output.file("first.json").write_text("{}")
    context.record("value", 1)
def hangs(context):
    time.sleep(60)
parts = (gpu_runner.Part("first", 1, 60, first), gpu_runner.Part("hangs", 1, 120, hangs))
gpu_runner.run_parts(parts, ["first", "hangs"], gpu_runner.Output(sys.argv[1]), {}, gpu_parts.markdown)
"""


def test_a_check_killed_mid_part_leaves_what_the_earlier_parts_wrote(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = (tmp_path / "gpu.json").read_text() if (tmp_path / "gpu.json").exists() else "{}"
            if json.loads(text).get("parts", {}).get("hangs"):
                break
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["parts"]["first"]["status"] == "done" and report["parts"]["hangs"]["status"] == "running"
    assert (tmp_path / "first.json").exists() and "## hangs: running" in (tmp_path / "gpu.md").read_text()


def test_the_output_folder_refuses_a_ninth_file(tmp_path):
    output = Output(tmp_path)
    for index in range(gpu_runner.MAX_FILES):
        output.file(f"{index}.json")
    assert output.file("0.json") == tmp_path / "0.json"  # a name already counted is free
    with pytest.raises(TooManyFiles):
        output.file("ninth.json")


class NoRun(PartContext):
    """A context whose commands do nothing (status 1): which files the real parts name."""

    def run(self, command, timeout=None, env=None) -> dict:
        return {"command": " ".join(command), "status": 1, "seconds": 0.0, "tail": []}


def test_every_part_together_names_at_most_8_files(tmp_path):
    output = Output(tmp_path)
    output.file("gpu.json"), output.file("gpu.md")
    for part in gpu_parts.PARTS:
        if part.name != "server":  # it names no file (its results go to gpu.json); it spawns a real server
            part.run(NoRun(output, time.monotonic() + 60))
    assert output._names == ["gpu.json", "gpu.md", "step-cost.json", "fused-step-cost.json", "heldout-humaneval.json",
                             "heldout-chat.json", "heldout-mtbench.json", "load.json"]


# --- the report ------------------------------------------------------------------------------------------------


def full_report() -> dict:
    def section(results: dict, status: str = "done") -> dict:
        return {"status": status, "budget_seconds": 60, "seconds": 30.0, "results": results}

    heldout = {name: [{"method": "greedy", "prompts": 8, "tokens_per_second": 720.5, "speedup_vs_greedy": 1.0,
                       "tokens_per_step": 1.0, "identical_to_greedy": 8},
                      {"method": "lookahead", "prompts": 8, "tokens_per_second": 1500.0, "speedup_vs_greedy": speedup,
                       "tokens_per_step": 3.7, "identical_to_greedy": 8}]
               for name, speedup in (("humaneval", 2.1), ("chat", 1.3), ("mtbench", 1.5))}
    return {
        "date": "2026-11-28", "commit": "abc1234", "device": "NVIDIA H100", "torch": "2.11.0", "selected": ["tests"],
        "parts": {
            "tests": section({"runs": [{"command": "pytest", "status": 0, "seconds": 30.0,
                                        "tail": ["25 passed in 30.0s"]}]}),
            "step_cost": section({"model": "random weights", "complete": False, "rows": [
                {"batch": 1, "k": 1, "forward_packed_ms": 24.0, "static_eager_ms": 9.1, "static_graphs_ms": 1.0,
                 "static_graphs_whole_step_ms": 1.1},
                {"batch": 1, "k": 128, "static_eager_ms": 9.1, "static_graphs_ms": 2.0,
                 "static_graphs_whole_step_ms": 2.4}]}, "timeout"),
            "heldout": section(heldout),
            "server": section({"startup_seconds": 12.5, "first_request": {"ttft_seconds": 0.2}}),
            "load": section({"rows": [
                {"prompt_set": "humaneval", "concurrency": 1, "throughput": 1400.0, "relative_throughput": 1.0},
                {"prompt_set": "humaneval", "concurrency": 8, "throughput": 6000.0, "relative_throughput": 4.3}]}),
        },
        "skipped": {"model_tests": "no converted model or GGUF under /tmp/x"},
    }


def test_the_report_reads_as_tables():
    text = gpu_parts.markdown(full_report())
    assert "| 1 | 1 | 24.0 | 9.1 | 1.0 | 1.1 |" in text and "| 1 | 128 | - | 9.1 | 2.0 | 2.4 |" in text
    assert "## step_cost: timeout, 30.0 s of 60" in text
    assert "| lookahead | 8 | 1500.0 | 2.1 | 3.7 | 8 |" in text
    assert "- startup_seconds: 12.5" in text and "25 passed in 30.0s" in text
    assert "- model_tests: no converted model or GGUF under /tmp/x" in text


def test_the_goals_are_judged_on_what_the_report_measured():
    met = {goal: ok for goal, _, ok in gpu_parts.goals(full_report())}
    assert met == {
        "whole greedy step, batch 1, k=1 <= 1.2 ms": True,
        "whole step, batch 1, every k <= 128 <= 2.0 ms": False,
        "greedy >= 700 tok/s (each held-out set)": True,
        "lookahead >= 2.0x greedy on humaneval": True,
        "lookahead >= 1.4x greedy on mtbench": True,
        "lookahead >= 1.4x greedy on chat": False,
        "one stream within 10% of the engine (HumanEval)": True,
        "8 streams >= 4x one (HumanEval)": True,
    }
    assert gpu_parts.goals({"parts": {}}) == []


def test_a_heldout_file_is_summarized_per_method(tmp_path):
    path = tmp_path / "heldout.json"
    path.write_text(json.dumps({"summary": {"methods": [
        {"method": "lookahead", "prompts": 8, "tokens_per_second": 370.123456, "speedup_vs_greedy": 1.2345678,
         "tokens_per_step": 3.78, "identical_to_greedy": 8, "seconds": 3.2}]}}))
    assert gpu_parts.heldout_summary(path) == [{"method": "lookahead", "prompts": 8, "tokens_per_second": 370.123,
                                                "speedup_vs_greedy": 1.235, "tokens_per_step": 3.78,
                                                "identical_to_greedy": 8}]


# --- the two calls, as documented -------------------------------------------------------------------------------


def test_the_wrapper_and_the_docstring_describe_the_two_calls_and_each_parts_budget():
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--help"], capture_output=True, text=True, check=True)
    for text in (done.stdout, gpu.__doc__):
        assert 'command="scripts/gpu-check 1"  carry=[".gpu-model-1"]' in text
        assert 'command="scripts/gpu-check 2"  carry=[".gpu-carry"]' in text
        assert "scripts/gpu-pack" in text
    assert "64 MiB" in done.stdout
    for part in gpu_parts.PARTS:
        assert f"{part.name} (" in done.stdout and f"{part.budget_seconds:g} s)" in done.stdout, part.name
        assert f"``{part.name}``" in gpu.__doc__ and f"{part.budget_seconds:g} s)" in gpu.__doc__, part.name


def test_the_random_stand_in_has_the_default_models_shape():
    config = gpu_step_cost.default_model_shape().config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size) == (30, 576, 9, 3, 49152)


@pytest.mark.parametrize(("events", "message"), [
    (['{"choices": [{"delta": {"content": "x"}}]}', '{"error": {"message": "boom"}}'], "an error: boom"),
    (['{"choices": [{"delta": {"content": "x"}}]}', "[DONE]"], "without its usage"),
])
def test_a_streamed_request_that_ends_in_an_error_fails(events, message):
    """On the first H200 run every stream after the first ended in an error event, and the part read them as
    served: a stream with an error, or without its usage, is a failure."""
    body = "".join(f"data: {event}\n\n" for event in events).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the standard library's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(gpu_parts.RequestFailed, match=message):
            gpu_parts.streamed_request(f"http://127.0.0.1:{server.server_port}", "m", 10)
    finally:
        server.shutdown()


@pytest.mark.real_model
@pytest.mark.slow
def test_the_server_part_times_the_start_up_and_two_streamed_requests(tmp_path):
    context = PartContext(Output(tmp_path), time.monotonic() + 300)
    gpu_parts.server_startup(context, "cpu")
    results = context.results
    assert results["startup_seconds"] > 0 and results["exit_status"] == 0
    for key in ("first_request", "second_request"):
        request = results[key]
        assert 0 < request["ttft_seconds"] <= request["seconds"]
        assert 0 < request["completion_tokens"] <= gpu_parts.FIRST_REQUEST_TOKENS
