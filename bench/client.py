"""The benchmarks' client: one streamed chat completion, timed chunk by chunk.

Nothing here imports MLX: the benchmark process only talks HTTP to the servers under test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestTiming:
    """What the client saw of one streamed request. Times are seconds since it was sent."""

    client: int
    index: int
    duration_s: float
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    text: str = ""
    """The generated text (for a chat benchmark's next turn; never in a summary)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        """Request sent → first chunk carrying generated text."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens when available, else the number of text chunks."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        """A compact JSON-able record: no text, and the gaps between chunks in whole
        milliseconds (where in a stream the slow gaps fall)."""
        return {
            "client": self.client,
            "index": self.index,
            "ok": self.ok,
            "error": self.error,
            "duration_s": round(self.duration_s, 6),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "chunks": len(self.chunk_times),
            "usage_tokens": self.usage_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "itl_ms": [round(gap * 1000) for gap in self.inter_token_latencies],
        }


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """All generated text in one `chat.completion.chunk` (content and reasoning deltas)."""
    parts: list[str] = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            value = delta.get(key)
            if isinstance(value, str):
                parts.append(value)
    return "".join(parts)


def usage_completion_tokens(chunk: Mapping[str, Any]) -> int | None:
    """`usage.completion_tokens` of a chunk, if it carries one."""
    return _usage_int(chunk, "completion_tokens")


def _usage_int(chunk: Mapping[str, Any], key: str, detail: str | None = None) -> int | None:
    usage = chunk.get("usage")
    if not isinstance(usage, Mapping):
        return None
    value = usage.get(key)
    if detail is not None:
        value = value.get(detail) if isinstance(value, Mapping) else None
    return value if isinstance(value, int) else None


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, other fields and blank lines."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    payload: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    client_id: int = 0,
    index: int = 0,
) -> RequestTiming:
    """POST a streaming chat completion and time every chunk that carries text."""
    start = time.perf_counter()
    timing = RequestTiming(client=client_id, index=index, duration_s=0.0)
    try:
        async with client.stream("POST", url, json=dict(payload), headers=dict(headers)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {body[:300]}"
            else:
                await _consume_stream(resp, timing, start)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.duration_s = time.perf_counter() - start
    return timing


async def _consume_stream(resp: httpx.Response, timing: RequestTiming, start: float) -> None:
    async for line in resp.aiter_lines():
        data = sse_data(line)
        if not data:
            continue
        if data == "[DONE]":
            return
        now = time.perf_counter() - start
        chunk = json.loads(data)
        if "error" in chunk:
            timing.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            return
        text = chunk_text(chunk)
        if text:
            timing.chunk_times.append(now)
            timing.text += text
        tokens = usage_completion_tokens(chunk)
        if tokens is not None:
            timing.usage_tokens = tokens
            timing.prompt_tokens = _usage_int(chunk, "prompt_tokens")
            timing.cached_tokens = _usage_int(chunk, "prompt_tokens_details", "cached_tokens")
