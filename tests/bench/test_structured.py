"""The structured-output benchmark: its mask timing walks a valid document, and its request asks for JSON."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from bench.datasets import PromptSpec
from bench.structured import (
    ANSWER_SCHEMA,
    EXAMPLE,
    INSTRUCTION,
    median_mask_seconds,
    structured_request,
    time_llguidance,
)
from decoding.grammar import GrammarCompiler
from decoding.params import Grammar
from decoding.weights.loading import ensure_default_model


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def test_the_example_matches_the_schema_and_is_timed_token_by_token(tokenizer):
    document = tokenizer(json.dumps(EXAMPLE), add_special_tokens=False).input_ids
    constraint = GrammarCompiler(tokenizer, len(tokenizer)).constraint(Grammar.json_schema(ANSWER_SCHEMA))
    assert constraint.valid_prefix(document) == len(document)
    seen: list[int] = []
    assert median_mask_seconds(seen.append, lambda: None, document) >= 0 and seen == document
    timing = time_llguidance(tokenizer, len(tokenizer), document)
    assert timing["mask_median_us"] > 0 and timing["compile_s"] > 0


def test_the_request_asks_for_json_around_the_prompt():
    chat = PromptSpec(id="c", messages=({"role": "user", "content": "Name a color."},))
    assert structured_request(chat).messages == ({"role": "user", "content": INSTRUCTION + "Name a color."},)
    assert structured_request(PromptSpec(id="t", text="Why?")).messages[0]["content"].endswith("Why?")
