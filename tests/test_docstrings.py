"""The examples written in docstrings are run, so they stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "bench.oracle",
    "bench.tune",
    "decoding.batch_policy",
    "decoding.forward.choice",
    "decoding.forward.static_forward",
    "decoding.forward.tree_attention",
    "decoding.forward.static_fused",
    "decoding.forward.static_inputs",
    "decoding.payoff",
    "decoding.proposers.ngram_memory",
    "decoding.proposers.pool",
    "decoding.proposers.recycled",
    "decoding.proposers.survival",
    "decoding.step.tree",
    "decoding.step.verify",
    "decoding.weights.fetch",
    "decoding.weights.quant_panels",
    "server.body",
    "server.chat_client",
    "server.config",
    "server.config_layers",
    "server.errors",
    "server.flags",
    "server.ray_app",
    "server.ray_metrics",
    "server.messages",
    "server.protocol",
    "server.responses",
    "server.responses_protocol",
    "server.serving",
    "server.sse",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
