"""The GPU check's command: refuses without CUDA, and its report reads as tables (the GPU runs are its own)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from bench import gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run")
def test_without_cuda_the_check_refuses(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


def test_the_report_reads_as_tables():
    report = {
        "date": "2026-11-25", "commit": "abc1234", "device": "NVIDIA H100", "torch": "2.11.0", "model": "default model",
        "tests": {"command": "pytest", "status": 0, "seconds": 30.0, "tail": ["25 passed in 30.0s"]},
        "step_cost": [{"batch": 1, "k": 1, "forward_packed_ms": 24.0, "static_eager_ms": 9.1, "static_graphs_ms": 1.2,
                       "static_graphs_whole_step_ms": 1.6}, {"captures": 9, "capture_seconds": 1.5}],
        "heldout": "no converted model or GGUF under /tmp/x",
        "load": [{"command": "loadtest", "status": 0, "seconds": 60.0, "tail": ["1 client: 150 tok/s"]}],
    }
    text = gpu.markdown(report)
    assert "| 1 | 1 | 24.0 | 9.1 | 1.2 | 1.6 |" in text
    assert "skipped: no converted model or GGUF under /tmp/x" in text
    assert "25 passed in 30.0s" in text and "1 client: 150 tok/s" in text


def test_the_shell_wrapper_explains_how_to_carry_the_model():
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--help"], capture_output=True, text=True, check=True)
    assert "gpu-pack" in done.stdout and ".gpu-model-1" in done.stdout and "64 MiB" in done.stdout


def test_the_random_stand_in_has_the_default_models_shape():
    config = gpu.default_model_shape().config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size) == (30, 576, 9, 3, 49152)
