"""HTTP bodies of the Ollama-compatible API (``/api``), as msgspec Structs.

Unknown fields are ignored (Ollama clients send more than we read); known fields are typed,
so a wrong type is a clear 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec


class OllamaFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class OllamaToolCall(msgspec.Struct, kw_only=True):
    function: OllamaFunction
    id: str | None = None


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class OllamaCommon(msgspec.Struct, kw_only=True):
    """Fields shared by ``/api/chat`` and ``/api/generate``."""

    model: str = ""
    stream: bool = True
    """Absent means streaming (Ollama's default)."""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None


class ChatBody(OllamaCommon, kw_only=True):
    messages: list[OllamaMessage] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(OllamaCommon, kw_only=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class ModelBody(msgspec.Struct, kw_only=True):
    """``/api/show`` and ``/api/pull``: ``model`` (``name`` is the older spelling)."""

    model: str = ""
    name: str = ""
    verbose: bool = False
    insecure: bool = False
    stream: bool = True

    @property
    def wanted(self) -> str:
        return self.model or self.name
