"""The demo model's token names and chat template, shared by the builder and its household
lessons (:mod:`appliance.demo.household`), which render training turns exactly as the
template does."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_TOKENS: tuple[str, ...] = (TOOL_CALL, TOOL_CALL_END)
"""Added (not special) tokens, the two last ids: mlx-lm reads them as text, and the tags
in the template make it pick its ``json_tools`` parser."""

TOOLS_FOOTER = (f'To call a tool, answer {TOOL_CALL}\n{{"name": <tool-name>, "arguments": '
                f'<args-json-object>}}\n{TOOL_CALL_END}')

PLAIN_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:\\n' }}{% for tool in tools %}"
    "{{ tool | tojson + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, tools (when a request has them) as one JSON line each in a system turn and calls
as bare JSON (no tags): the test and benchmark shapes (random weights). A template that
shows no tools makes a model refuse requests with tools (chat_format.renders_tools)."""

CHAT_TEMPLATE = (
    # With tools: one system turn holding the system message, then the tools one per line
    # (name, parameter names, first sentence of the description). A JSON dump of Home
    # Assistant's schemas would add about 1,800 tokens that a model this small cannot use.
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools:\\n' }}"
    "{%- for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ '- ' + f.name + '(' + ((f.parameters or {}).properties or {}).keys() | join(', ') "
    "+ '): ' + (f.description or '').split('. ')[0] + '\\n' }}"
    "{%- endfor %}"
    "{{ 'To call a tool, answer <tool_call>\\n{\"name\": <tool-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    "{{ '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' "
    "+ tool_call.arguments | tojson + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' "
    "+ '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_turns(turns: Sequence[dict[str, Any]],
                 tools: Sequence[dict[str, Any]] | None) -> list[tuple[str, bool]]:
    """``turns`` as CHAT_TEMPLATE renders them, in pieces marked True where the model learns
    (assistant answers and their end token). A test checks that the pieces join to exactly
    what the template gives."""
    pieces: list[tuple[str, bool]] = []
    msgs = list(turns)
    if tools:
        head = f"{IM_START}system\n"
        if msgs and msgs[0]["role"] == "system":
            head += msgs[0]["content"] + "\n"
            msgs = msgs[1:]
        head += "Tools:\n"
        for tool in tools:
            f = tool.get("function", tool)
            props = ", ".join((f.get("parameters") or {}).get("properties") or {})
            head += f"- {f['name']}({props}): {(f.get('description') or '').split('. ')[0]}\n"
        pieces.append((head + TOOLS_FOOTER + IM_END + "\n", False))
    for m in msgs:
        if m.get("tool_calls"):
            body = "".join(
                f'{TOOL_CALL}\n{{"name": "{c["function"]["name"]}", "arguments": '
                f'{json.dumps(c["function"]["arguments"], ensure_ascii=False)}}}\n{TOOL_CALL_END}'
                for c in m["tool_calls"])
            pieces += [(f"{IM_START}assistant\n", False), (body + IM_END, True), ("\n", False)]
        elif m["role"] == "assistant":
            pieces += [(f"{IM_START}assistant\n", False), ((m["content"] or "") + IM_END, True),
                       ("\n", False)]
        else:
            pieces.append((f"{IM_START}{m['role']}\n{m['content'] or ''}{IM_END}\n", False))
    return pieces
