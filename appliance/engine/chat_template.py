"""A model's chat template rendered under a bound: steps, time and output size.

A chat template is code from a model file. The Jinja sandbox stops it from reaching Python,
but not from looping: ``range`` is capped at 100,000, so two nested loops are 10¹⁰ steps,
and a ``{% set s = s + s %}`` in a loop doubles memory each turn. Every render goes through
:func:`bounded` (:func:`appliance.service.chat_format.render_prompt` and the probe at load):

- **steps and time**: a trace function (``sys.settrace``, on the rendering thread only, and
  only in the template's own frames) counts the lines the template runs and raises
  :class:`TemplateOverrun` past ``MAX_STEPS`` or ``MAX_SECONDS``; raising from the trace
  function really stops Jinja, inside any loop or macro;
- **output**: transformers' compiled template is recompiled once in an overlay of its own
  environment whose ``finalize`` counts every ``{{ … }}`` it prints and whose ``*``, ``+``,
  ``**`` and ``%`` refuse a result past the bound before it is built (one operator can
  otherwise ask for gigabytes).

:func:`probe` renders a small conversation at load: a template that overruns there would
overrun on every request, so the model is refused with the reason (:class:`ModelRefused`).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from types import FrameType
from typing import Any

import jinja2

log = logging.getLogger(__name__)

MAX_STEPS = 500_000
"""Lines of template code one render may run: a 10,000-message conversation takes about
100,000 with the common templates."""
PROBE_STEPS = 200_000
"""The probe's four messages take a few hundred steps with any real template."""
MAX_SECONDS = 5.0
"""Wall time of one render (a guard for slow single steps; the step count bounds loops)."""
MIN_OUTPUT_CHARS = 1_000_000
"""Output allowed whatever the input: the template's own text, tool schemas, few turns."""
OUTPUT_PER_INPUT_CHAR = 4
"""Templates print each message once or twice; this many characters of output per
character of input is far above any real template."""
TEMPLATE_FILE = "<template>"
"""The code file name of templates compiled from a string: their frames are traced."""
_WIDTH = re.compile(r"%[-+ #0]*(\d{7,}|\*)")


class TemplateOverrun(jinja2.TemplateError):
    """A render went past its bound; the message says which one, in words."""


class ModelRefused(ValueError):
    """The model cannot be served; the message says why (one line)."""


@dataclass(slots=True)
class _Budget:
    steps: int
    max_steps: int
    deadline: float
    chars: int
    max_chars: int


_local = threading.local()


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


def _over(what: str) -> TemplateOverrun:
    return TemplateOverrun(f"the model's chat template {what}, so it was stopped")


def _spend_chars(n: int) -> None:
    b = _budget()
    if b is None:
        return
    b.chars += n
    if b.chars > b.max_chars:
        raise _over(f"printed more than {b.max_chars:,} characters")


def _finalize(value: Any) -> Any:
    if isinstance(value, str):
        _spend_chars(len(value))
    return value


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


def _call_binop(context: Any, operator: str, left: Any, right: Any) -> Any:
    """The sandbox's binary operators, refusing one whose result would pass the bound."""
    b = _budget()
    limit = b.max_chars if b is not None else None
    if limit is not None:
        ls, rs = _size(left), _size(right)
        if operator == "*" and isinstance(right, int) and ls is not None and ls * right > limit:
            raise _over(f"asked for a text of {ls * right:,} characters")
        if operator == "*" and isinstance(left, int) and rs is not None and rs * left > limit:
            raise _over(f"asked for a text of {rs * left:,} characters")
        if operator == "+" and ls is not None and rs is not None and ls + rs > limit:
            raise _over(f"built a text of more than {limit:,} characters")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and abs(left) > 1 and right * math.log2(abs(left)) > 64 * 1024):
            raise _over("asked for a number too large to print")
        if operator == "%" and isinstance(left, str) and _WIDTH.search(left):
            raise _over("asked for a field wider than a million characters")
    return context.environment.binop_table[operator](left, right)


def _check_ints(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A width or count past the output bound (``'x'.ljust(10**10)``, ``|center``)."""
    b = _budget()
    if b is None:
        return
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > b.max_chars:
            raise _over(f"called a function with {arg:,}, past its bound")


def _bounded_call(env: Any) -> Any:
    plain = type(env).call

    def call(context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_ints(args, kwargs)
        return plain(env, context, obj, *args, **kwargs)

    return call


def _bounded_filter(fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context marks
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_ints(args, kwargs)
        return fn(*args, **kwargs)

    return checked


def _bounded_template(base: Any, source: str) -> Any:
    """``source`` compiled in an overlay of ``base`` (transformers' environment: its
    filters, globals and extensions) that counts what is printed and checks the operators
    that can build huge values. Never compiled in ``base`` itself: Jinja folds constant
    expressions at compile time, and ``{{ 'x' * 10**10 }}`` would be built there."""
    env = base.overlay(finalize=_finalize)
    env.intercepted_binops = frozenset({"*", "+", "**", "%"})
    env.call_binop = _call_binop  # instance attributes: the compiled code calls them so
    env.call = _bounded_call(env)
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    return env.from_string(source)


def _install() -> bool:
    """Route transformers' chat-template compilation through :func:`_bounded_template`
    (its renderer looks the compiler up by name at each call). False where this
    transformers has no such function: then only steps and time are bounded."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        return False
    original = getattr(ctu, "_compile_jinja_template", None)
    if original is None:
        log.warning("chat templates: this transformers has no _compile_jinja_template; "
                    "their output is not bounded, only their steps and time")
        return False
    if getattr(original, "appliance_bounded", False):
        return True

    @lru_cache(maxsize=16)
    def compile_bounded(source: str) -> Any:
        return _bounded_template(original("").environment, source)

    compile_bounded.appliance_bounded = True  # type: ignore[attr-defined]
    ctu._compile_jinja_template = compile_bounded
    return True


_installed: bool | None = None
"""Whether transformers' compiler is routed through the bound (None: not tried yet; at
the first render, so that importing this module, as the CLI does, stays cheap)."""


def _tracer(frame: FrameType, event: str, arg: Any) -> Any:
    """The thread's trace function: only template frames get a line tracer."""
    if frame.f_code.co_filename != TEMPLATE_FILE:
        return None
    return _line


def _line(frame: FrameType, event: str, arg: Any) -> Any:
    b = _budget()
    if b is None:
        return None
    if event == "line":
        b.steps -= 1
        if b.steps <= 0:
            raise _over(f"ran more than {b.max_steps:,} steps (a loop that does not end?)")
        if b.steps % 4096 == 0 and time.monotonic() > b.deadline:
            raise _over(f"took longer than {MAX_SECONDS:g} s")
    return _line


def output_limit(input_chars: int) -> int:
    return MIN_OUTPUT_CHARS + OUTPUT_PER_INPUT_CHAR * max(input_chars, 0)


@contextmanager
def bounded(max_chars: int, max_steps: int = MAX_STEPS,
            seconds: float = MAX_SECONDS) -> Iterator[None]:
    """Bound every chat-template render on this thread inside the block. A render that
    passes a bound raises :class:`TemplateOverrun` (a ``jinja2.TemplateError``)."""
    global _installed
    if _installed is None:
        _installed = _install()
    if _budget() is not None:  # nested: the outer bound holds
        yield
        return
    _local.budget = _Budget(max_steps, max_steps, time.monotonic() + seconds, 0, max_chars)
    previous = sys.gettrace()
    sys.settrace(_tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
        _local.budget = None


PROBE = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hello."},
         {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "What time is it?"}]


def probe(tokenizer: Any, path: object) -> None:
    """Render a four-message conversation (without its system turn where the template
    refuses one) under the bound; raise :class:`ModelRefused` when the template overruns.
    Other template errors are the requests' business (a 400 each)."""
    for turns in (PROBE, PROBE[1:]):
        started = time.monotonic()
        try:
            with bounded(output_limit(200), PROBE_STEPS):
                tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        except TemplateOverrun as exc:
            raise ModelRefused(f"the model in {path} cannot be served: {exc} while rendering "
                               "a four-message conversation. Its tokenizer_config.json's "
                               "chat_template needs fixing.") from None
        except Exception as exc:  # noqa: BLE001 - a template that refuses these turns
            log.info("chat template probe: %s with %d turns (%s)", type(exc).__name__,
                     len(turns), str(exc)[:200])
            continue
        log.info("chat template probe: rendered in %.3f s", time.monotonic() - started)
        return
