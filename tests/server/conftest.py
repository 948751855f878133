"""Fixtures of the HTTP-layer tests: the real default model as a ``Decoder`` (loaded once) and configs."""

from __future__ import annotations

import pytest

from server.config import ServerConfig


@pytest.fixture(scope="session")
def decoder(real_model):
    """The real SmolLM2-135M-Instruct decoder on the CPU, one torch thread."""
    from decoding import Decoder, configure_threads

    configure_threads(1)
    return Decoder(real_model)


@pytest.fixture(scope="session")
def tokenizer(decoder):
    return decoder.tokenizer


def make_config(**overrides) -> ServerConfig:
    """A test config: no warm-up (the tests wait for readiness themselves), everything else default."""
    return ServerConfig.model_validate({"warmup": False, **overrides})
