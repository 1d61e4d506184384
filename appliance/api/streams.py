"""Server-sent event responses, shared by the OpenAI streams, the voice hook and the pages."""

from __future__ import annotations

from typing import Any

from litestar.response import Stream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(Stream):
    """A Stream whose own media type wins over the route's (Litestar 2.25 prefers the route's)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)
