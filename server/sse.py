"""Reading server-sent events on the client side: the ``data:`` payloads of a ``text/event-stream``.

Contract: ``iter_data(lines)`` yields one payload per event from an iterable of lines (bytes or str, with or
without line endings), joining multi-line ``data:`` fields with newlines and skipping comments (``: ping``) and
other fields; ``data_events(text)`` does the same for a whole body. One optional space after ``data:`` is
removed. Standard library only: the chat client, the scripts and the tests share it. ``STREAMED`` is how a route
that streams documents its 200's ``text/event-stream`` (its ``responses=``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

# A stream's schema: the raw text, or one event as an SSE parser yields it (schemathesis validates each parsed
# event against the stream's schema); each event's data is a JSON chunk, an error object or "[DONE]".
EVENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "object", "required": ["data"],
         "properties": {"data": {"type": "string"}, "event": {"type": "string"}}},
    ]
}
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"description": "The reply object, or with stream: true its chunks as server-sent events.",
          "content": {"text/event-stream": {"schema": EVENT_SCHEMA}}},
}


def iter_data(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The ``data:`` payloads of an event stream, one per event (comments and pings skipped).

    >>> list(iter_data(iter([b'data: {"a": 1}\\n', b'\\n', b': ping\\n', b'data: [DONE]\\n', b'\\n'])))
    ['{"a": 1}', '[DONE]']
    >>> list(iter_data(["data: a", "data:b", "", "data: c"]))
    ['a\\nb', 'c']
    """
    pending: list[str] = []
    for raw in lines:
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).rstrip("\r\n")
        if line.startswith("data:"):
            pending.append(line[5:].removeprefix(" "))
        elif not line and pending:
            yield "\n".join(pending)
            pending = []
    if pending:
        yield "\n".join(pending)


def data_events(text: str) -> list[str]:
    """Every event's ``data:`` payload in a whole stream body.

    >>> data_events('data: {"x": 1}\\n\\n: ping\\n\\ndata: [DONE]\\n\\n')
    ['{"x": 1}', '[DONE]']
    """
    return list(iter_data(text.splitlines()))
