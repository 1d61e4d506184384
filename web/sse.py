"""Server-sent events for htmx's SSE extension: framing and the response type."""

from __future__ import annotations

from collections.abc import AsyncIterator

from appliance.api.streams import SSE_HEADERS, EventStream


def event(name: str, data: str) -> bytes:
    """One SSE event; every line of ``data`` gets its own ``data:`` field (the browser joins
    them with newlines), so a newline in the payload can never end the event early."""
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    body = "".join(f"data: {line}\n" for line in lines)
    return f"event: {name}\n{body}\n".encode()


def retry(ms: int) -> bytes:
    """Tell the browser how soon to reconnect after the server ends a stream."""
    return f"retry: {ms}\n\n".encode()


def stream(events: AsyncIterator[bytes]) -> EventStream:
    """An SSE response (``EventStream`` keeps its media type under Litestar 2.25)."""
    return EventStream(events, media_type="text/event-stream", headers=SSE_HEADERS)
