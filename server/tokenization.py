"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: text and conversations to token ids and back.

Contract: ``tokenize`` gives the ids a completion (``prompt``) or a chat (``messages``, rendered as
``server.chat.chat_prompt`` renders it, tools included) would decode from: 400 unless exactly one of them is
given, and for tool messages chat would refuse. ``detokenize`` gives the text of token ids (special tokens
skipped, as in responses): 400 naming the first id outside the vocabulary. Both block on the tokenizer: call them
off the event loop.
"""

from __future__ import annotations

from server import tools
from server.chat import chat_prompt
from server.errors import BadRequestError
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.text import TextCodec


def tokenize(codec: TextCodec, request: TokenizeRequest) -> list[int]:
    """``/tokenize``: the ids of ``prompt`` or of ``messages`` (module contract)."""
    if (request.prompt is None) == (request.messages is None):
        raise BadRequestError("send exactly one of prompt and messages", param="prompt")
    if request.prompt is not None:
        return codec.encode_text(request.prompt, request.add_special_tokens)
    tools.check_messages(request.messages or [])
    return chat_prompt(codec, request, None)


def detokenize(codec: TextCodec, request: DetokenizeRequest) -> str:
    """``/detokenize``: the text of ``tokens`` (module contract)."""
    vocab = codec.vocab_size
    for index, token in enumerate(request.tokens):
        if not 0 <= token < vocab:
            raise BadRequestError(f"token id {token} is outside the vocabulary [0, {vocab})", param=f"tokens[{index}]")
    return codec.decode(request.tokens)
