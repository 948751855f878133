"""The Responses API's stored responses: what ``GET /v1/responses/{id}`` returns and ``previous_response_id``
continues.

Contract: ``ResponseStore(limit)`` keeps the last ``limit`` responses in memory with their conversations (as chat
messages); ``put`` stores one (evicting the least recently stored past the limit), ``get`` and ``conversation``
read one back or raise ``NotFoundError`` naming the field the client sent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.errors import NotFoundError
from server.messages import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    """A finished response as sent, and its conversation as chat messages (input, then output)."""

    response: dict[str, Any]
    conversation: tuple[ChatMessage, ...]


class ResponseStore:
    """The last ``limit`` stored responses, in memory; storing one more evicts the least recently stored
    (``limit`` 0 stores nothing)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: dict[str, Any], conversation: Sequence[ChatMessage]) -> None:
        """Keep ``response`` (by its ``id``) with its conversation."""
        if self.limit == 0:
            return
        self._responses[response["id"]] = StoredResponse(response, tuple(conversation))
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.limit:
            self._responses.popitem(last=False)

    def conversation(self, response_id: str) -> tuple[ChatMessage, ...]:
        """The stored conversation of ``previous_response_id``; 404 naming it when unknown."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise NotFoundError(f"Previous response with id '{response_id}' not found.",
                                param="previous_response_id", code="previous_response_not_found")
        return stored.conversation

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response as it was sent; 404 when unknown (never stored, ``store: false``, or evicted)."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise NotFoundError(f"No response with id '{response_id}' is stored.", param="response_id",
                                code="response_not_found")
        return stored.response
