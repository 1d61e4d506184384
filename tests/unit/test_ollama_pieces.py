"""How /api/chat turns the model's text into Ollama message fields (through i8-tools'
OutputParser): each tool call whole in one chunk, its arguments an object."""

from __future__ import annotations

import json
from types import SimpleNamespace

from appliance.api.ollama import ChatPieces
from appliance.service.chat_format import OutputParser

TOOLS = [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}}}}]
LLAMA_LIKE = SimpleNamespace(has_tool_calling=False, has_thinking=False, chat_template="")


def test_a_bare_json_tool_call_comes_whole_with_object_arguments() -> None:
    pieces = ChatPieces(OutputParser(LLAMA_LIKE, TOOLS, None))
    text = json.dumps({"name": "HassTurnOn", "parameters": {"name": "Kitchen Light"}})
    chunks = [pieces.feed(ch) for ch in text] + [pieces.finish()]
    calls = [c["tool_calls"] for c in chunks if "tool_calls" in c]
    assert calls == [[{"function": {"name": "HassTurnOn",
                                    "arguments": {"name": "Kitchen Light"}}}]]
    assert not any(c.get("content") for c in chunks)


def test_plain_text_stays_content() -> None:
    pieces = ChatPieces(OutputParser(LLAMA_LIKE, TOOLS, None))
    chunks = [pieces.feed(w) for w in ("The light ", "is on.")] + [pieces.finish()]
    assert "".join(c.get("content", "") for c in chunks) == "The light is on."
    assert not any("tool_calls" in c for c in chunks)
