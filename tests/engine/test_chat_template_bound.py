"""Chat templates rendered under a bound (appliance.engine.chat_template), through
transformers' own renderer: hostile templates stop, real ones render unchanged."""

from __future__ import annotations

import time

import pytest
from transformers.utils import chat_template_utils as ctu

from appliance.engine import chat_template as ct

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _render(template: str, turns: list[dict[str, str]] = TURNS) -> str:
    with ct.bounded(ct.output_limit(100), max_steps=100_000, seconds=30):
        return ctu.render_jinja_template(conversations=[turns], chat_template=template,
                                         add_generation_prompt=True)[0][0]


def test_a_real_template_renders_as_without_the_bound() -> None:
    plain = ctu._cached_compile_jinja_template(CHATML).render(messages=TURNS,
                                                             add_generation_prompt=True)
    assert _render(CHATML) == plain
    assert plain.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("template", "said"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ran more than 100,000 steps"),
    ("{% set s = namespace(v='x') %}{% for i in range(64) %}{% set s.v = s.v + s.v %}"
     "{% endfor %}{{ s.v }}", "built a text of more than"),
    ("{{ 'x' * 10000000000 }}", "asked for a text of 10,000,000,000 characters"),
    ("{{ 'x'.ljust(10000000000) }}", "called a function with 10,000,000,000"),
    ("{{ 'x'|center(10000000000) }}", "called a function with 10,000,000,000"),
    ("{{ '%09999999999d' % 1 }}", "wider than a million characters"),
    ("{% macro m() %}{% for i in range(100000) %}{{ messages[1].content * 50 }}"
     "{% endfor %}{% endmacro %}{{ m() }}", "printed more than"),
])
def test_a_hostile_template_is_stopped_with_the_reason(template: str, said: str) -> None:
    started = time.monotonic()
    with pytest.raises(ct.TemplateOverrun, match=said):
        _render(template)
    assert time.monotonic() - started < 20


def test_a_template_that_loops_on_every_conversation_refuses_the_model() -> None:
    class Tok:
        def apply_chat_template(self, turns: list[dict[str, str]], **kw: object) -> str:
            return ctu.render_jinja_template(
                conversations=[turns], chat_template="{% for i in range(100000) %}"
                "{% for j in range(100000) %}{% endfor %}{% endfor %}")[0][0]

    with pytest.raises(ct.ModelRefused, match="cannot be served: .* 200,000 steps"):
        ct.probe(Tok(), "/models/looping")
    ct.probe(type("Fine", (), {"apply_chat_template": lambda self, t, **kw: "ok"})(), "x")
