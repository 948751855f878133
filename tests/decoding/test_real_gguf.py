"""The real default model from its GGUF weights as they are: the same weights as the de-quantized checkpoint
(q/k rows un-permuted), logits within the 8-bit rounding's noise of the float32 model's (the same best tokens), and
lookahead == greedy on it."""

from __future__ import annotations

import pytest
import torch

from decoding.decoder import Decoder
from decoding.params import LookaheadConfig
from decoding.weights import native
from decoding.weights.gguf_model import read_tensors, rope_order
from decoding.weights.loading import gguf_files
from decoding.weights.quant_panels import dequantize
from server.config import decoder_lookahead
from server.config_layers import load_config
from tests.decoding.test_real_model import MESSAGES, decode, prompt_ids

pytestmark = [pytest.mark.real_model, pytest.mark.slow,
              pytest.mark.skipif(native.panel_gemm() is None, reason="needs the native kernel")]


@pytest.fixture(scope="module")
def gguf_decoder() -> Decoder:
    decoder = Decoder.load("default", device="cpu", weights="gguf")
    assert decoder.linears == "gguf"
    return decoder


@pytest.fixture(scope="module")
def gguf_greedy(gguf_decoder) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt ids and the greedy continuation (40 tokens) of each message on the GGUF weights."""
    return {text: (ids, decode(gguf_decoder, ids, None, 40))
            for text in MESSAGES for ids in [prompt_ids(gguf_decoder.tokenizer, text)]}


def test_the_gguf_weights_are_the_checkpoints_weights(real_model):
    _, tensors = read_tensors(gguf_files("default")[0])
    config = real_model.model.config
    attention = real_model.model.model.layers[3].self_attn
    for name, linear, heads in [("attn_q", attention.q_proj, config.num_attention_heads),
                                ("attn_k", attention.k_proj, config.num_key_value_heads)]:
        weight = tensors[f"blk.3.{name}.weight"].quantized()
        assert torch.equal(dequantize(weight.permuted(rope_order(weight.rows, heads))), linear.weight)


def test_logits_are_the_float32_models_within_the_roundings_noise(real_model, gguf_decoder):
    # The quantized kernel rounds each product's input to 8 bits a block of 32 at a time, as llama.cpp does (the
    # tiny models of tests/decoding/weights/test_gguf_model.py match a reference that rounds the same way to float
    # tolerance; over 30 layers a rounding that falls the other way on a float difference moves what follows, so
    # here the measure is the noise): the logits within 5% of their spread (root mean square; 4.5% when measured)
    # and the same best token at every position.
    ids = torch.tensor([prompt_ids(real_model.tokenizer, MESSAGES[0])])
    with torch.inference_mode():
        ours, theirs = gguf_decoder.loaded.model(ids).logits, real_model.model(ids).logits
    assert (ours - theirs).pow(2).mean().sqrt() <= 0.05 * theirs.std()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize(
    "config",
    [decoder_lookahead(load_config(device_preset="cpu").lookahead), LookaheadConfig(2, 4, 4),
     LookaheadConfig(7, 5, 7), LookaheadConfig(16, 5, 16, copy_length=32, copy_min_match=0, window_chains=True)],
    ids=["cpu-preset", "2-4-4", "7-5-7", "16-5-16-copies-chains"],
)
def test_lookahead_equals_greedy_on_the_gguf_weights(gguf_decoder, gguf_greedy, config):
    for text, (ids, expected) in gguf_greedy.items():
        assert decode(gguf_decoder, ids, config, 40) == expected, text
