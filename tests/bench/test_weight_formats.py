"""``bench.weight_formats`` (``python -m bench weights``): the report states each weights' speed, the gguf /
float32 ratios and the memory figures; bad arguments exit with status 2."""

from __future__ import annotations

import pytest

from bench import weight_formats


def test_the_report_gives_speeds_ratios_identity_and_memory():
    figures = {
        "speed": {"dataset": "humaneval", "prompts": 2, "max_tokens": 64,
                  "tokens_per_second": {"gguf greedy": 40.0, "gguf lookahead": 80.0, "float32 greedy": 20.0,
                                        "float32 lookahead": 50.0},
                  "lookahead_identical_to_greedy": {"gguf": 2, "float32": 2}},
        "step_cost": {"gguf": {1: {"ms": 20.0, "ratio": 1.0}, 8: {"ms": 40.0, "ratio": 2.0}}},
        "memory": {"gguf": {"before_load_mb": 450.0, "after_load_mb": 640.0, "linears": "gguf"}},
    }
    text = weight_formats.report(figures)
    assert "greedy: gguf / float32 = 2.00x" in text and "lookahead: gguf / float32 = 1.60x" in text
    assert "RSS gguf: 450 MB before the load, 640 MB after" in text
    assert "{'gguf': 2, 'float32': 2} of 2" in text
    assert "step cost gguf: 1: 20.0 ms (1.00x), 8: 40.0 ms (2.00x)" in text


def test_bad_arguments_exit_with_status_2():
    with pytest.raises(SystemExit) as caught:
        weight_formats.main(["--limit", "0"])
    assert caught.value.code == 2
