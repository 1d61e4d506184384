"""Chat turns in, prompt tokens out; generated text in, content / thinking / tool calls out.

Both APIs (``/v1`` and ``/api``) go through here, so a model's tool-call and thinking syntax
is known in one place:

- :func:`render_prompt` renders OpenAI-shaped turns (``role``, ``content``, ``tool_calls``
  with ``function.arguments`` as an object, ``tool_call_id``) and the request's tools through
  the model's own chat template, with ``enable_thinking`` when the template has it.
- :class:`OutputParser` reads the text deltas of one answer and splits them into content,
  thinking and whole tool calls. The tool-call syntax comes from mlx-lm: its tokenizer wrapper
  picks a parser module (``mlx_lm.tool_parsers.*``) from the chat template and gives the
  start and end tags; the text between them goes to that module's ``parse_tool_call``.
  Models whose template has no tags (Llama 3.x) answer a tool call with bare JSON,
  ``{"name": ..., "parameters": {...}}``, as the whole answer: that is the fallback.

Rules the parser keeps: tag text never reaches ``content`` (a possible start of a tag is held
back until the next delta shows what it is); a call is accepted only when it parses, names
one of the request's tools and has object arguments; anything else comes back as plain
content, unchanged; but a call the answer ended inside (cut by ``max_tokens``, no end tag)
is a call when its text parses and is dropped when it does not.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from appliance.engine.chat_template import TemplateOverrun, bounded, output_limit
from appliance.service.errors import InvalidRequest

TEMPLATE_OVERRUN = "template_overrun"
"""The code of the 400 for a template stopped at its bound."""
PYTHON_TAG = "<|python_tag|>"
"""Llama 3.x's marker before a tool call in some answers (bare JSON follows)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True, slots=True)
class Delta:
    content: str = ""
    thinking: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_names(tools: Sequence[dict[str, Any]] | None) -> set[str]:
    names: set[str] = set()
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


# --------------------------------------------------------------------------------------
# Prompt


def supports_thinking(tokenizer: Any) -> bool:
    """Whether the model has a thinking mode that its chat template knows about."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return True  # a custom renderer (mlx-lm chat_templates) handles it
    start = getattr(tokenizer, "think_start", None) or "<think>"
    return "enable_thinking" in template or start in template


PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
"""The tool :func:`renders_tools` renders to see whether a template shows tools at all."""


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows the model its ``tools``: a probe turn rendered with
    and without :data:`PROBE_TOOL` gives other tokens. SmolLM2's template drops them (the
    same 35 tokens either way): such a model never sees a tool, so it must not take one.
    Called once at load; a template that fails on the probe has no tools either."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return True  # a custom renderer (mlx-lm chat_templates) handles them
    turns = [{"role": "user", "content": "Turn on the light."}]
    try:
        plain = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        shown = tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                              tools=[PROBE_TOOL])
    except Exception:  # a template that cannot take the probe cannot take a request's tools
        return False
    return list(plain) != list(shown)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary stands for (0: unknown). A text of
    C characters is at least ``C // longest`` tokens: the bound that lets a prompt that
    cannot fit be refused before it is templated or tokenised. A vocabulary entry is never
    shorter than what it decodes to (byte-level entries are one character a byte, byte
    fallbacks ``<0x41>`` six characters for one byte)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary we can read: no bound
        return 0
    return max((len(t) for t in vocab), default=0)


def text_chars(*values: Any) -> int:
    """Characters of every string in ``values`` (turns, tools: dicts, lists, structs, keys
    included): what a chat template may print of them."""
    total, stack = 0, list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
        elif hasattr(v, "__struct_fields__"):  # a msgspec body
            stack.extend(getattr(v, f) for f in v.__struct_fields__)
    return total


def _template_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """A turn as chat templates expect it: text content, tool-call arguments as objects."""
    out = dict(turn)
    if out.get("content") is None:
        out["content"] = ""
    calls = []
    for call in out.get("tool_calls") or ():
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise InvalidRequest("A tool call's 'function.arguments' is not valid JSON.",
                                  param="messages") from None
        if not isinstance(args, dict):
            raise InvalidRequest("A tool call's 'function.arguments' must be a JSON object.",
                              param="messages")
        if not isinstance(fn.get("name"), str):
            raise InvalidRequest("A tool call needs 'function.name'.", param="messages")
        fn["arguments"] = args
        calls.append({"id": call.get("id") or new_call_id(), "type": "function",
                      "function": fn})
    if calls:
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def render_prompt(tokenizer: Any, turns: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, think: bool | None) -> list[int]:
    """Prompt token ids for ``turns`` through the model's chat template.

    ``think``: None leaves the template's default; True on a model without a thinking mode
    is a 400.
    """
    thinking = supports_thinking(tokenizer)
    if think and not thinking:
        raise InvalidRequest("This model does not support thinking; send think: false or "
                          "leave it out.", "unsupported_value", "think")
    if not turns:
        raise InvalidRequest("'messages' must hold at least one message.", param="messages")
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    if thinking and think is not None:
        kwargs["enable_thinking"] = think
    try:
        # bounded in steps, time and output (the template is code from a model file)
        with bounded(output_limit(text_chars(turns, tools))):
            ids = tokenizer.apply_chat_template([_template_turn(t) for t in turns], **kwargs)
    except TemplateOverrun as exc:
        raise InvalidRequest(f"These messages cannot be turned into a prompt: {exc}.",
                             TEMPLATE_OVERRUN, "messages") from None
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"The model's chat template rejected these messages: {exc}",
                          param="messages") from None
    return [int(i) for i in ids]


def thinking_open_at_end(tokenizer: Any, prompt: Sequence[int]) -> bool:
    """Whether the prompt leaves the model inside a thinking block (the template opened it)."""
    if not getattr(tokenizer, "has_thinking", False) or not prompt:
        return False
    start, end = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    return _rfind(prompt, start) > _rfind(prompt, end)


def _rfind(seq: Sequence[int], sub: Sequence[int] | None) -> int:
    if not sub:
        return -1
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if tuple(seq[i:i + n]) == tuple(sub):
            return i
    return -1


# --------------------------------------------------------------------------------------
# Output


def _held_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper start of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class OutputParser:
    """Splits one answer's text deltas into content, thinking and tool calls."""

    CONTENT, THINKING, TAGGED, BARE = "content", "thinking", "tagged", "bare"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None,
                 think: bool | None, prompt: Sequence[int] | None = None) -> None:
        self._names = tool_names(tools)
        self._tools = tools or []
        has_tags = bool(getattr(tokenizer, "has_tool_calling", False))
        self._parse = getattr(tokenizer, "tool_parser", None) if has_tags else None
        self._start: str | None = tokenizer.tool_call_start if has_tags and self._names else None
        self._end: str = (tokenizer.tool_call_end or "") if self._start else ""
        self._bare = bool(self._names) and not has_tags
        has_think = bool(getattr(tokenizer, "has_thinking", False))
        self._think = (tokenizer.think_start, tokenizer.think_end) if has_think else None
        self._mode = self.CONTENT
        if prompt is not None and thinking_open_at_end(tokenizer, prompt):
            self._mode = self.THINKING
        self._buf = ""
        self._started = False  # some content or a call was produced
        self._after_block = False  # just after a think block or a call: drop leading space
        self.calls: list[ToolCall] = []
        self.dropped_cut_call = False
        """The answer ended inside a tool call whose arguments could not be read (cut by
        max_tokens): the call is in neither content nor tool calls."""

    # ---- public ----
    def feed(self, text: str) -> Delta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> Delta:
        return self._run(final=True)

    # ---- the state machine ----
    def _run(self, final: bool) -> Delta:
        content: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        while True:
            before = (self._mode, len(self._buf))
            if self._mode == self.THINKING:
                self._step_thinking(thinking, final)
            elif self._mode == self.TAGGED:
                self._step_tagged(content, calls, final)
            elif self._mode == self.BARE:
                self._step_bare(content, calls, final)
            else:
                self._step_content(content, final)
            if (self._mode, len(self._buf)) == before:
                break
        return Delta("".join(content), "".join(thinking), tuple(calls))

    def _emit_content(self, out: list[str], text: str) -> None:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return
            self._after_block = False
        if text:
            self._started = True
            out.append(text)

    def _step_thinking(self, thinking: list[str], final: bool) -> None:
        assert self._think is not None
        end = self._think[1]
        i = self._buf.find(end)
        if i >= 0:
            thinking.append(self._buf[:i])
            self._buf = self._buf[i + len(end):]
            self._mode = self.CONTENT
            self._after_block = True
            return
        keep = 0 if final else _held_prefix(self._buf, [end])
        cut = len(self._buf) - keep
        if cut:
            thinking.append(self._buf[:cut])
            self._buf = self._buf[cut:]

    def _markers(self) -> list[str]:
        markers = []
        if self._think is not None:
            markers.append(self._think[0])
        if self._start:
            markers.append(self._start)
        return markers

    def _step_content(self, content: list[str], final: bool) -> None:
        if self._bare and not self._started:
            stripped = self._buf.lstrip()
            if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
                self._mode = self.BARE
                return
            if not stripped or (PYTHON_TAG.startswith(stripped) and not final):
                if final:
                    self._buf = ""
                return  # nothing to decide on yet (only space, or a start of the tag)
            self._bare = False  # prose: a bare-JSON call can only be the whole answer
        markers = self._markers()
        hits = [(self._buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i, m = min(hits)
            self._emit_content(content, self._buf[:i])
            self._buf = self._buf[i + len(m):]
            self._mode = self.THINKING if self._think and m == self._think[0] else self.TAGGED
            return
        keep = 0 if final else _held_prefix(self._buf, markers)
        if self._after_block and not final and not self._buf[:len(self._buf) - keep].strip():
            return  # only space after a block so far: wait to see whether prose follows
        cut = len(self._buf) - keep
        if cut:
            self._emit_content(content, self._buf[:cut])
            self._buf = self._buf[cut:]

    def _step_tagged(self, content: list[str], calls: list[ToolCall], final: bool) -> None:
        assert self._start is not None
        cut = False
        if self._end:
            i = self._buf.find(self._end)
            if i < 0 and not final:
                return
            cut = i < 0  # the answer ended inside the call (max_tokens): no end tag
            body = self._buf[:i] if i >= 0 else self._buf
            raw = self._start + body + (self._end if i >= 0 else "")
            self._buf = self._buf[i + len(self._end):] if i >= 0 else ""
        else:  # the call runs to the end of the answer (Mistral's [TOOL_CALLS])
            if not final:
                return
            body, raw, self._buf = self._buf, self._start + self._buf, ""
        parsed = self._parse_tagged(body)
        self._mode = self.CONTENT
        if parsed is None and cut:
            # a cut call that cannot be read is dropped: tag text never reaches content
            self.dropped_cut_call = True
            return
        if parsed is None:
            self._emit_content(content, raw)
            return
        calls.extend(parsed)
        self.calls.extend(parsed)
        self._started = True
        self._after_block = True

    def _parse_tagged(self, body: str) -> list[ToolCall] | None:
        if self._parse is None:
            return None
        try:
            result = self._parse(body.strip(), self._tools)
        except Exception:  # a model's malformed call is content, whatever the parser raised
            return None
        items = result if isinstance(result, list) else [result]
        calls = [self._call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]

    def _step_bare(self, content: list[str], calls: list[ToolCall], final: bool) -> None:
        if not final:
            return  # a bare-JSON call is the whole answer: decide at the end
        raw, self._buf = self._buf, ""
        parsed = self._parse_bare(raw)
        self._mode = self.CONTENT
        if parsed is None:
            self._bare = False
            self._emit_content(content, raw)
            return
        calls.extend(parsed)
        self.calls.extend(parsed)
        self._started = True

    def _parse_bare(self, raw: str) -> list[ToolCall] | None:
        text = raw.strip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].strip()
        decoder = json.JSONDecoder()
        out: list[ToolCall] = []
        pos = 0
        while pos < len(text):
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None
            call = self._call(obj)
            if call is None:
                return None
            out.append(call)
            pos = end
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
        return out or None

    def _call(self, item: Any) -> ToolCall | None:
        """A parsed call, accepted only with a known name and object arguments."""
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return None
        if not isinstance(name, str) or name not in self._names or not isinstance(args, dict):
            return None
        return ToolCall(name=name, arguments=args, id=new_call_id())


@dataclass(frozen=True, slots=True)
class Turn:
    """One plain-text turn of a conversation (the web chat's and the jobs' prompts)."""

    role: str
    content: str


def text_prompt(tokenizer: Any, turns: Sequence[Turn]) -> list[int]:
    """Prompt token ids for plain-text turns, no tools, the template's default thinking."""
    return render_prompt(tokenizer, [{"role": t.role, "content": t.content} for t in turns],
                         None, None)
