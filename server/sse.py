"""Reading server-sent events on the client side: the ``data:`` payloads of a ``text/event-stream``.

Contract: ``iter_data(lines)`` yields one payload per event from an iterable of lines (bytes or str, with or
without line endings), joining multi-line ``data:`` fields with newlines and skipping comments (``: ping``) and
other fields; ``data_events(text)`` does the same for a whole body. One optional space after ``data:`` is
removed. Standard library only: the chat client, the scripts and the tests share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


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
