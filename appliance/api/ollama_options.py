"""Ollama's ``options`` and ``keep_alive``, checked and turned into our request fields.

- ``options``: ``num_predict``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
  ``stop``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty`` are honoured;
  ``num_ctx`` caps prompt + answer (it never allocates anything: the KV cache grows with
  the tokens actually used); every other key is ignored, as Ollama ignores what a runner
  does not use. A known key with a wrong type is a 400 naming it.
- ``keep_alive``: a number of seconds or a Go duration string (``"300s"``, ``"5m"``,
  ``"1h30m"``, ``"-1s"``); negative means forever. The model is always resident here
  (``/api/ps`` says so); ``0`` releases the caller's prompt-cache entries when the answer
  ends (an empty request: at once), and any other value changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from appliance.api.errors import bad_request
from appliance.api.schemas import SamplingFields

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
           "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")

_FLOATS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
           "frequency_penalty")
_INTS = ("num_predict", "top_k", "seed", "num_ctx")


def parse_keep_alive(value: float | str | None) -> float | None:
    """Seconds to keep the model loaded; None for "forever" (any negative value)."""
    if value is None:
        return 300.0  # Ollama's default
    if isinstance(value, int | float):
        return None if value < 0 else float(value)
    text = value.strip()
    if _NUMBER.fullmatch(text):
        seconds = float(text)
        return None if seconds < 0 else seconds
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    pos, total = 0, 0.0
    for m in _DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise bad_request(f"Invalid keep_alive {value!r}: use seconds (a number) or a "
                          "duration like '300s', '5m' or '-1s'.", param="keep_alive")
    return None if sign < 0 else total


@dataclass(frozen=True, slots=True)
class Options:
    sampling: SamplingFields
    num_predict: int | None
    """Most tokens to generate; None for the server's default (Ollama's -1 and -2)."""
    num_ctx: int | None
    keep_alive: float | None = 300.0
    """Seconds, None for forever (only ``0`` does anything here: see the module note)."""


def _typed(options: dict[str, Any], key: str) -> Any:
    value = options.get(key)
    if value is None:
        return None
    if key in _INTS and (isinstance(value, bool) or not isinstance(value, int)):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad_request(f"options.{key} must be an integer, got {value!r}.", param=key)
    if key in _FLOATS and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise bad_request(f"options.{key} must be a number, got {value!r}.", param=key)
    return value


def parse_options(options: dict[str, Any] | None) -> Options:
    opts = options or {}
    if not isinstance(opts, dict):
        raise bad_request("'options' must be an object.", param="options")
    stop = opts.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad_request("options.stop must be a string or a list of strings.", param="stop")
    v = {k: _typed(opts, k) for k in (*_INTS, *_FLOATS)}
    num_predict = v["num_predict"]
    num_ctx = v["num_ctx"]
    if num_ctx is not None and num_ctx < 1:
        raise bad_request(f"options.num_ctx must be positive, got {num_ctx}.", param="num_ctx")
    sampling = SamplingFields(
        temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"] or None,
        min_p=v["min_p"], seed=v["seed"], stop=stop,
        repetition_penalty=v["repeat_penalty"] if v["repeat_penalty"] not in (None, 1.0)
        else None,
        presence_penalty=v["presence_penalty"] or None,
        frequency_penalty=v["frequency_penalty"] or None)
    return Options(sampling=sampling,
                   num_predict=num_predict if num_predict is not None and num_predict > 0
                   else None,
                   num_ctx=num_ctx)
