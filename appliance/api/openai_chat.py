"""The OpenAI chat request's tools, tool_choice, response_format and thinking, turned into a
prompt, a grammar and an output parser; parsed deltas turned back into OpenAI shapes.

``tool_choice``: ``auto`` (default) renders the tools and parses calls from the answer;
``none`` leaves the tools out of the prompt (the model cannot see them, nothing is parsed);
``required`` and a named function force one call by constrained decoding when the model's
call syntax is JSON (``<tool_call>`` JSON tags, or Llama's bare JSON); for other syntaxes they
fall back to ``auto``. ``response_format`` (``json_object`` / ``json_schema``) is enforced the
same way. Thinking: ``enable_thinking`` (top level or in ``chat_template_kwargs``), or
``reasoning_effort: "none"`` for off; the thinking text is sent as ``reasoning_content``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from appliance.api.common import chat_turns
from appliance.api.errors import bad_request
from appliance.api.schemas import ChatCompletionRequest
from appliance.service.chat_format import (
    Delta,
    OutputParser,
    ToolCall,
    render_prompt,
    supports_thinking,
    tool_names,
)
from appliance.service.structured import JSON_OBJECT, Constraint, tag_term, tool_call_grammar
from appliance.vocab import FinishReason

JSON_TOOL_PARSERS = {"json_tools"}
"""mlx-lm parser modules whose call body is ``{"name": ..., "arguments": {...}}``."""


@dataclass(slots=True)
class ChatSetup:
    prompt: list[int]
    parser: OutputParser
    constraint: Constraint | None
    grammar: str | None


def _check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("Each tool must be {\"type\": \"function\", \"function\": "
                              "{\"name\": ..., \"parameters\": {...}}}.", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"Tool '{fn['name']}': 'parameters' must be a JSON schema "
                              "object.", param="tools")
    return tools


def _choice(tool_choice: str | dict[str, Any] | None,
            tools: list[dict[str, Any]] | None) -> tuple[str, list[str] | None]:
    """('auto' | 'none' | 'force', names to force or None for any)."""
    if tool_choice is None or tool_choice == "auto":
        return ("auto" if tools else "none"), None
    if tool_choice == "none":
        return "none", None
    if not tools:
        raise bad_request("tool_choice needs 'tools'.", param="tool_choice")
    if tool_choice == "required":
        return "force", None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in tool_names(tools):
                raise bad_request(f"tool_choice names '{name}', which is not in 'tools'.",
                                  param="tool_choice")
            return "force", [name]
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                      param="tool_choice")


def _force_grammar(tokenizer: Any, tools: list[dict[str, Any]],
                   names: list[str] | None) -> str | None:
    """A grammar for exactly one call in the model's syntax, when that syntax is JSON."""
    if getattr(tokenizer, "has_tool_calling", False):
        parser = getattr(tokenizer, "tool_parser", None)
        module = getattr(parser, "__module__", "").rsplit(".", 1)[-1]
        if module not in JSON_TOOL_PARSERS:
            return None
        newline = json.dumps("\n")
        return tool_call_grammar(
            tools, names, start=(tag_term(tokenizer, tokenizer.tool_call_start), newline),
            end=(newline, tag_term(tokenizer, tokenizer.tool_call_end)))
    return tool_call_grammar(tools, names, arguments_key="parameters")


def response_constraint(fmt: dict[str, Any] | None) -> Constraint | None:
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return JSON_OBJECT
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs 'json_schema': {\"name\": "
                              "..., \"schema\": {...}}.", param="response_format")
        return schema
    raise bad_request("response_format type must be 'text', 'json_object' or 'json_schema'.",
                      "unsupported_value", "response_format")


def _think(body: ChatCompletionRequest) -> tuple[bool | None, str]:
    """Whether thinking was asked for, and by which field (named in a 400)."""
    if body.enable_thinking is not None:
        return body.enable_thinking, "enable_thinking"
    kwargs = body.chat_template_kwargs or {}
    value = kwargs.get("enable_thinking", kwargs.get("thinking"))
    if isinstance(value, bool):
        return value, "chat_template_kwargs"
    if body.reasoning_effort is not None:
        return body.reasoning_effort != "none", "reasoning_effort"
    return None, "reasoning_effort"


def prepare_chat(tokenizer: Any, body: ChatCompletionRequest) -> ChatSetup:
    tools = _check_tools(body.tools)
    mode, names = _choice(body.tool_choice, tools)
    constraint = response_constraint(body.response_format)
    grammar = None
    if mode == "force":
        assert tools is not None
        if constraint is not None:
            raise bad_request("response_format cannot be combined with a forced tool_choice.",
                              param="response_format")
        grammar = _force_grammar(tokenizer, tools, names)
    shown = tools if mode != "none" else None
    think, field = _think(body)
    if think and not supports_thinking(tokenizer):
        # render_prompt would name Ollama's `think`; a /v1 caller sent another field
        raise bad_request(f"This model does not support thinking; leave '{field}' out"
                          + (" or send 'none'." if field == "reasoning_effort" else "."),
                          "unsupported_value", field)
    prompt = render_prompt(tokenizer, chat_turns(body.messages), shown, think)
    return ChatSetup(prompt, OutputParser(tokenizer, shown, think, prompt=prompt), constraint,
                     grammar)


def openai_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function", "function": {
        "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    if index is not None:
        out = {"index": index, **out}
    return out


def finish_reason(reason: FinishReason, calls: int) -> FinishReason:
    """OpenAI's ``finish_reason``: the engine's, but ``tool_calls`` for a ``stop`` whose
    answer called tools (``quota`` is ours: the user's daily tokens ran out mid-answer)."""
    return FinishReason.TOOL_CALLS if calls and reason is FinishReason.STOP else reason


def message(parsed: Delta) -> dict[str, Any]:
    """The assistant message of a whole (non-streamed) answer."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": parsed.content if parsed.content or not parsed.tool_calls
                           else None}
    if parsed.thinking:
        msg["reasoning_content"] = parsed.thinking
    if parsed.tool_calls:
        msg["tool_calls"] = [openai_call(c) for c in parsed.tool_calls]
    return msg


def stream_deltas(parsed: Delta, first_index: int) -> list[dict[str, Any]]:
    """The ``delta`` objects for one parsed piece of a streamed answer (maybe none)."""
    out: list[dict[str, Any]] = []
    if parsed.thinking:
        out.append({"reasoning_content": parsed.thinking})
    if parsed.content:
        out.append({"content": parsed.content})
    for i, call in enumerate(parsed.tool_calls):
        out.append({"tool_calls": [openai_call(call, first_index + i)]})
    return out
