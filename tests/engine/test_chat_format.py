"""The output parser on scripted token streams, with tokenizers loaded the way mlx-lm loads
them (so the tool parser is the one mlx-lm picks from the chat template)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from transformers import PreTrainedTokenizerFast

from appliance.service.chat_format import (
    Delta,
    OutputParser,
    render_prompt,
    renders_tools,
    supports_thinking,
)
from appliance.service.errors import InvalidRequest
from appliance.vocab import FinishReason

DEMO = Path(__file__).resolve().parents[2] / "appliance" / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a function like this:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.tool_calls %}<|im_start|>assistant\n"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
LLAMA_TEMPLATE = (  # tools as JSON in the last turn, calls answered as bare JSON
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if tools and loop.last %}Functions: {{ tools | tojson }}\n{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {
        "name": "HassTurnOn", "description": "Turns on a device or entity.",
        "parameters": {"type": "object", "properties": {
            "name": {"type": "string"}, "domain": {"type": "array",
                                                   "items": {"type": "string"}}}}}},
    {"type": "function", "function": {
        "name": "HassTurnOff", "description": "Turns off a device or entity.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}},
]


def _tokenizer_dir(tmp: Path, template: str, extra_tokens: tuple[str, ...] = ()) -> Any:
    tmp.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / name, tmp / name)
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    if extra_tokens:
        hf = PreTrainedTokenizerFast.from_pretrained(str(tmp))
        hf.add_tokens(list(extra_tokens), special_tokens=False)
        hf.save_pretrained(str(tmp))
    return load_tokenizer(tmp)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _tokenizer_dir(tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _tokenizer_dir(tmp_path_factory.mktemp("llama"), LLAMA_TEMPLATE)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _tokenizer_dir(tmp_path_factory.mktemp("think"), THINKING_TEMPLATE,
                          ("<think>", "</think>"))


def run(parser: OutputParser, pieces: list[str]) -> Delta:
    """Feed the pieces one by one and merge every delta (the finish included)."""
    content, thinking, calls = [], [], []
    for d in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content.append(d.content)
        thinking.append(d.thinking)
        calls.extend(d.tool_calls)
    return Delta("".join(content), "".join(thinking), tuple(calls))


def token_pieces(tok: Any, text: str) -> list[str]:
    """The text as the engine streams it: one detokenized segment per token."""
    detok = tok.detokenizer
    pieces = []
    for t in tok.encode(text, add_special_tokens=False):
        detok.add_token(t)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    return pieces


CALL = '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}\n</tool_call>'


def test_mlx_lm_picks_the_json_tool_parser_from_the_template(hermes: Any) -> None:
    assert hermes.has_tool_calling
    assert hermes.tool_call_start == "<tool_call>" and hermes.tool_call_end == "</tool_call>"


def test_a_qwen_tool_call_split_at_every_boundary_is_one_call_and_no_tag_text(
        hermes: Any) -> None:
    text = "Sure. " + CALL
    for cut in range(len(text) + 1):
        d = run(OutputParser(hermes, TOOLS, None), [text[:cut], text[cut:]])
        assert d.content == "Sure. ", cut
        assert [(c.name, c.arguments) for c in d.tool_calls] == [
            ("HassTurnOn", {"name": "kitchen light"})], cut
    d = run(OutputParser(hermes, TOOLS, None), token_pieces(hermes, text))
    assert d.content == "Sure. " and len(d.tool_calls) == 1
    d = run(OutputParser(hermes, TOOLS, None), list(text))  # one character at a time
    assert d.content == "Sure. " and d.tool_calls[0].arguments == {"name": "kitchen light"}


def test_no_delta_ever_shows_part_of_a_tag(hermes: Any) -> None:
    parser = OutputParser(hermes, TOOLS, None)
    for ch in CALL:
        assert "<" not in parser.feed(ch).content
    assert parser.finish().content == ""
    assert len(parser.calls) == 1


def test_two_calls_in_one_turn(hermes: Any) -> None:
    second = CALL.replace("HassTurnOn", "HassTurnOff").replace("kitchen", "hall")
    d = run(OutputParser(hermes, TOOLS, None), token_pieces(hermes, CALL + "\n" + second))
    assert [c.name for c in d.tool_calls] == ["HassTurnOn", "HassTurnOff"]
    assert d.content == ""
    assert d.tool_calls[0].id != d.tool_calls[1].id


def test_malformed_json_comes_back_as_plain_content(hermes: Any) -> None:
    bad = '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": }\n</tool_call>'
    d = run(OutputParser(hermes, TOOLS, None), token_pieces(hermes, bad))
    assert d.tool_calls == () and d.content == bad


def test_an_unknown_tool_name_comes_back_as_plain_content(hermes: Any) -> None:
    text = CALL.replace("HassTurnOn", "OpenThePodBayDoors")
    d = run(OutputParser(hermes, TOOLS, None), token_pieces(hermes, text))
    assert d.tool_calls == () and d.content == text


def test_a_call_cut_before_its_arguments_end_is_dropped_not_content(hermes: Any) -> None:
    """Issue 52, item 4: a call cut by max_tokens never puts tag text in content."""
    parser = OutputParser(hermes, TOOLS, None)
    d = run(parser, ["Sure. ", '<tool_call>\n{"name": "HassTurnOn", "argu'])
    assert d.tool_calls == () and d.content == "Sure. "
    assert parser.dropped_cut_call


def test_a_call_cut_before_its_end_tag_is_a_call(hermes: Any) -> None:
    parser = OutputParser(hermes, TOOLS, None)
    d = run(parser, token_pieces(hermes, CALL.removesuffix("</tool_call>")))
    assert d.content == "" and [c.name for c in d.tool_calls] == ["HassTurnOn"]
    assert not parser.dropped_cut_call


def test_a_template_that_drops_tools_is_told_from_one_that_shows_them(
        hermes: Any, tmp_path: Path) -> None:
    plain = _tokenizer_dir(tmp_path, "{% for message in messages %}<|im_start|>"
                           "{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}")
    assert renders_tools(hermes)
    assert not renders_tools(plain)


def test_without_tools_tags_are_just_text(hermes: Any) -> None:
    d = run(OutputParser(hermes, None, None), [CALL])
    assert d.tool_calls == () and d.content == CALL


def test_plain_text_passes_through_and_a_lone_angle_bracket_is_released(hermes: Any) -> None:
    parser = OutputParser(hermes, TOOLS, None)
    assert parser.feed("a <").content == "a "
    assert parser.feed(" b").content == "< b"
    assert parser.finish() == Delta()


def test_a_llama_bare_json_call(llama: Any) -> None:
    assert not llama.has_tool_calling
    text = '{"name": "HassTurnOn", "parameters": {"name": "kitchen light", "domain": ["light"]}}'
    d = run(OutputParser(llama, TOOLS, None), token_pieces(llama, text))
    assert d.content == ""
    assert [(c.name, c.arguments) for c in d.tool_calls] == [
        ("HassTurnOn", {"name": "kitchen light", "domain": ["light"]})]
    d = run(OutputParser(llama, TOOLS, None),
            ["<|python_tag|>", text, "; ", text.replace("HassTurnOn", "HassTurnOff")])
    assert [c.name for c in d.tool_calls] == ["HassTurnOn", "HassTurnOff"]


def test_llama_prose_and_broken_json_are_content(llama: Any) -> None:
    d = run(OutputParser(llama, TOOLS, None), token_pieces(llama, "The light is on {ok}."))
    assert d.content == "The light is on {ok}." and d.tool_calls == ()
    broken = '{"name": "HassTurnOn", "parameters": {"name": "kitch'
    d = run(OutputParser(llama, TOOLS, None), token_pieces(llama, broken))
    assert d.content == broken and d.tool_calls == ()
    unknown = '{"name": "Nope", "parameters": {}}'
    assert run(OutputParser(llama, TOOLS, None), [unknown]).content == unknown


def test_render_prompt_puts_tools_and_object_arguments_through_the_template(
        hermes: Any) -> None:
    turns = [{"role": "user", "content": "turn on the kitchen light"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {
                     "name": "HassTurnOn", "arguments": '{"name": "kitchen light"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"success": true}'}]
    ids = render_prompt(hermes, turns, TOOLS, None)
    text = hermes.decode(ids)
    assert '"name": "HassTurnOn"' in text and "<tools>" in text
    assert '{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_think_true_on_a_model_without_thinking_is_a_400(hermes: Any) -> None:
    assert not supports_thinking(hermes)
    with pytest.raises(InvalidRequest) as err:
        render_prompt(hermes, [{"role": "user", "content": "hi"}], None, True)
    assert err.value.param == "think"
    render_prompt(hermes, [{"role": "user", "content": "hi"}], None, False)  # fine


def test_thinking_goes_to_thinking_never_to_content(thinker: Any) -> None:
    assert supports_thinking(thinker)
    text = "<think>The kitchen light is off.</think>\n\nTurning it on." + CALL
    for cut in range(len(text) + 1):
        d = run(OutputParser(thinker, TOOLS, True), [text[:cut], text[cut:]])
        assert d.thinking == "The kitchen light is off.", cut
        assert d.content == "Turning it on.", cut
        assert len(d.tool_calls) == 1


def test_think_false_renders_an_empty_think_block(thinker: Any) -> None:
    off = thinker.decode(render_prompt(thinker, [{"role": "user", "content": "hi"}], None,
                                       False))
    assert off.endswith("<think>\n\n</think>\n\n")
    on = thinker.decode(render_prompt(thinker, [{"role": "user", "content": "hi"}], None,
                                      True))
    assert on.endswith("<|im_start|>assistant\n")


def test_a_prompt_that_opens_thinking_starts_the_answer_inside_it(thinker: Any) -> None:
    prompt = thinker.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    d = run(OutputParser(thinker, None, True, prompt=prompt), ["plan</think>Hello"])
    assert d.thinking == "plan" and d.content == "Hello"


def test_v1_thinking_goes_to_reasoning_content_and_a_call_to_tool_calls(thinker: Any) -> None:
    from appliance.api.openai_chat import finish_reason, message, prepare_chat, stream_deltas
    from appliance.api.schemas import ChatCompletionRequest, ChatMessage

    body = ChatCompletionRequest(messages=[ChatMessage(role="user", content="lights")],
                                 tools=TOOLS, chat_template_kwargs={"enable_thinking": True})
    setup = prepare_chat(thinker, body)
    assert thinker.decode(setup.prompt).endswith("<|im_start|>assistant\n")
    d = run(setup.parser, ["<think>dark in here</think>", CALL])
    msg = message(d)
    assert msg["reasoning_content"] == "dark in here" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"name": "kitchen light"}
    assert finish_reason(FinishReason.STOP, len(d.tool_calls)) == "tool_calls"
    deltas = stream_deltas(d, 3)
    assert deltas[0] == {"reasoning_content": "dark in here"}
    assert deltas[1]["tool_calls"][0]["index"] == 3
    off = prepare_chat(thinker, ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="hi")], reasoning_effort="none"))
    assert thinker.decode(off.prompt).endswith("<think>\n\n</think>\n\n")
