"""Sampling settings (penalties, logit_bias, min_p, min_tokens, ignore_eos, top_p 0, long stop lists) reach the
decoder's ``SamplingParams`` / ``StopCriteria``, on a scripted stand-in decoder."""

from __future__ import annotations

import pytest

from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, token_steps
from tests.server.test_errors import assert_error

CHAT = "/v1/chat/completions"


def scripted(tokenizer) -> ScriptedDecoder:
    return ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" one", " two"])))


async def test_sampling_fields_reach_the_decoder(tokenizer):
    decoder = scripted(tokenizer)
    fields = {
        "temperature": 0.7, "top_p": 0, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -1.5,
        "repetition_penalty": 1.2, "logit_bias": {"42": 5, "7": -100}, "min_tokens": 3, "ignore_eos": True,
        "max_tokens": 8, "stop": [f"stop{i}" for i in range(16)],
    }
    async with running_app(make_config(), decoder) as (_, client):
        assert (await client.post(CHAT, json=chat_body("Hi", **fields))).status_code == 200
        assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})).status_code == 200
    (stop, sampling), (plain_stop, plain) = decoder.validated[0], decoder.validated[-1]
    assert (sampling.top_p, sampling.min_p, sampling.presence_penalty) == (0.0, 0.05, 0.5)
    assert (sampling.frequency_penalty, sampling.repetition_penalty) == (-1.5, 1.2)
    assert sampling.logit_bias == ((7, -100.0), (42, 5.0))
    assert stop.min_tokens == 3 and stop.stop_token_ids == frozenset()
    assert not plain.adjusts_logits and plain.min_p == 0.0 and plain_stop.min_tokens == 0
    assert plain_stop.stop_token_ids == frozenset({tokenizer.eos_token_id})


async def test_the_stop_list_cap_is_configurable(tokenizer):
    async with running_app(make_config(max_stop_strings=2), scripted(tokenizer)) as (_, client):
        assert (await client.post(CHAT, json=chat_body("Hi", stop=["a", "b"]))).status_code == 200
        assert_error(await client.post(CHAT, json=chat_body("Hi", stop=["a", "b", "c"])), 400, param="stop")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"-5": 1}}, "logit_bias"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"top_p": 1.01}, "top_p"),
    ],
)
async def test_bad_sampling_fields_name_the_field(tokenizer, fields, param):
    async with running_app(make_config(), scripted(tokenizer)) as (_, client):
        assert_error(await client.post(CHAT, json=chat_body("Hi", **fields)), 400, param=param)
