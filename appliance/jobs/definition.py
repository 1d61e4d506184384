"""A job's definition checked as a whole: what an API, page or CLI call may store.

``validate`` takes the fields as they would be stored (after a create or an edit merged
into the existing job) and returns them cleaned, or raises ``InvalidJob`` (a
``ValueError``, mapped to a 400 by the app) with a message meant for the person who typed them and the field's name.
"""

from __future__ import annotations

import json
import time
import unicodedata
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from apscheduler.triggers.base import BaseTrigger

from appliance.jobs.fetch import check_url
from appliance.jobs.netguard import Guard, Refused, Unresolvable
from appliance.jobs.phrases import ACCEPTED, parse_schedule
from appliance.jobs.schedule import make_trigger, shortest_gap
from appliance.store.errors import Invalid
from appliance.store.models import SCHEDULE_KINDS, SOURCE_KINDS

NAME_MAX = 100
INSTRUCTIONS_MAX = 4000
URL_MAX = 2000
HEADERS_MAX = 20
HEADER_VALUE_MAX = 4000
MIN_OUTPUT_TOKENS = 16
DEFAULT_INSTRUCTIONS = "Summarise this for the household in a few short paragraphs."


class InvalidJob(Invalid):
    """A definition refused, in words for the person who typed it; ``param``: the field
    (as the API names it) that is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Refused in a job's name, which lists, logs and webhooks show: control characters (NUL,
# escapes) and the bidirectional overrides and isolates that make text read backwards.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _plain_name(name: str) -> str:
    for c in name:
        if c in _BIDI_CONTROLS or (unicodedata.category(c) == "Cc" and not c.isspace()):
            raise InvalidJob(f"'name' may not contain the control character U+{ord(c):04X}; "
                             f"use letters, digits, spaces and punctuation", "name")
    return " ".join(name.split())


def schedule_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A request's schedule made explicit: ``interval_s`` alone means an interval schedule
    (it was silently dropped); ``interval_s`` with another schedule is refused."""
    if fields.get("interval_s") is None:
        return fields
    kind = fields.get("schedule_kind")
    if kind is None and fields.get("cron") is None:
        return {**fields, "schedule_kind": "interval"}
    if kind != "interval":
        raise InvalidJob("'interval_s' goes with \"schedule\": \"interval\" only; drop it, or "
                         "send \"schedule\": \"interval\" (or no schedule at all)",
                         "interval_s")
    return fields


@dataclass(frozen=True, slots=True)
class Limits:
    document_max_bytes: int
    output_max_tokens: int
    zone: tzinfo


def _text(fields: dict[str, Any], key: str, limit: int, *, required: bool = False) -> str | None:
    value = fields.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise InvalidJob(f"'{key}' is required", key)
        return None
    if not isinstance(value, str):
        raise InvalidJob(f"'{key}' must be text", key)
    if len(value) > limit:
        raise InvalidJob(f"'{key}' is longer than {limit} characters", key)
    return value


def _headers(value: Any) -> str | None:
    if value in (None, "", {}):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidJob("'headers' must be a JSON object of header names and values", "headers") \
                from None
    if not isinstance(value, dict) or len(value) > HEADERS_MAX:
        raise InvalidJob(f"'headers' must be an object of at most {HEADERS_MAX} headers", "headers")
    for k, v in value.items():
        if not isinstance(k, str) or not k or not isinstance(v, str) \
                or len(v) > HEADER_VALUE_MAX or any(c in k + v for c in "\r\n"):
            raise InvalidJob("each header needs a name and a text value (no line breaks)", "headers")
        if k.lower() in ("host", "content-length", "transfer-encoding"):
            raise InvalidJob(f"the header '{k}' is set by the appliance", "headers")
    return json.dumps(value)


def _url(value: str | None, key: str, guard: Guard) -> str | None:
    if value is None:
        return None
    try:
        check_url(value.strip(), guard)
    except Unresolvable:
        pass  # checked again at every run
    except Refused as exc:
        raise InvalidJob(f"'{key}': {exc}", key) from None
    return value.strip()


def _check_floor(trigger: BaseTrigger | None, kind: str, interval: int | None, stamp: float,
                 zone: tzinfo, floor: int, admin: bool) -> None:
    setting = "jobs.admin_min_interval" if admin else "jobs.member_min_interval"
    who = "an admin's" if admin else "a member's"
    if kind == "interval" and interval is not None and interval < floor:
        raise InvalidJob(f"'interval_s' must be at least {floor} seconds for {who} job "
                         f"({setting})", "interval_s")
    gap = shortest_gap(trigger, datetime.fromtimestamp(stamp, zone)) if kind == "cron" else None
    if gap is not None and gap < floor:
        raise InvalidJob(f"'cron' runs {gap:g} seconds apart; {who} job may run at most "
                         f"every {floor} seconds ({setting})", "cron")


def _schedule(fields: dict[str, Any]) -> tuple[str, str | None, Any]:
    """(kind, cron, interval_s): ``cron`` may be any form :mod:`appliance.jobs.phrases`
    reads ('@daily', 'every monday at 8:30'), stored as the 5-field cron it means (or as an
    interval: 'every 90 minutes'); so may ``schedule`` itself when no ``cron`` is given."""
    cron = fields.get("cron")
    schedule = fields.get("schedule_kind") or ("cron" if cron else "none")
    if isinstance(schedule, str) and schedule not in SCHEDULE_KINDS and not cron:
        try:
            parsed = parse_schedule(schedule)
        except ValueError:
            raise InvalidJob(f"'schedule' must be one of {', '.join(SCHEDULE_KINDS)}, or "
                             f"{ACCEPTED}", "schedule") from None
        return parsed.kind, parsed.cron, parsed.interval_s
    if schedule not in SCHEDULE_KINDS:
        raise InvalidJob(f"'schedule' must be one of {', '.join(SCHEDULE_KINDS)}", "schedule")
    if schedule == "interval":
        return schedule, None, fields.get("interval_s")
    if schedule != "cron":
        return schedule, None, None
    if not isinstance(cron, str) or not cron.strip():
        raise InvalidJob(f"a 'cron' schedule needs 'cron': {ACCEPTED}", "cron")
    try:
        parsed = parse_schedule(cron)
    except ValueError as exc:
        raise InvalidJob(str(exc), "cron") from None
    return parsed.kind, parsed.cron, parsed.interval_s


def validate(fields: dict[str, Any], limits: Limits, guard: Guard,
             *, now: float | None = None, min_interval_s: int = 0) -> dict[str, Any]:
    """The stored form of a job definition; ValueError naming the first problem.
    ``min_interval_s``: the owner's shortest schedule (0: not checked, e.g. an edit that
    leaves the schedule as it was); ``guard.privileged`` says whether the owner is an admin."""
    out: dict[str, Any] = {}
    name = _text(fields, "name", NAME_MAX, required=True)
    assert name is not None
    out["name"] = _plain_name(name)
    out["instructions"] = (_text(fields, "instructions", INSTRUCTIONS_MAX)
                           or DEFAULT_INSTRUCTIONS).strip()
    kind = fields.get("source_kind") or "text"
    if kind not in SOURCE_KINDS:
        raise InvalidJob(f"'source' must be one of {', '.join(SOURCE_KINDS)}", "source")
    out["source_kind"] = kind
    out["source_text"] = out["url"] = out["headers"] = None
    if kind == "text":
        text = fields.get("source_text")
        if not isinstance(text, str) or not text.strip():
            raise InvalidJob("a 'text' job needs the document in 'text'", "text")
        if len(text.encode()) > limits.document_max_bytes:
            raise InvalidJob(f"the document is over the {limits.document_max_bytes}-byte "
                             "limit (jobs.document_max_bytes)", "text")
        out["source_text"] = text
    elif kind == "url":
        out["url"] = _url(_text(fields, "url", URL_MAX, required=True), "url", guard)
        out["headers"] = _headers(fields.get("headers"))
    schedule, cron, interval = _schedule(fields)
    out["schedule_kind"] = schedule
    out["cron"] = cron
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)):
        raise InvalidJob("'interval_s' must be a whole number of seconds", "interval_s")
    out["interval_s"] = interval
    stamp = time.time() if now is None else now
    try:
        trigger = make_trigger(schedule, out["cron"], interval, stamp, limits.zone)
    except ValueError as exc:
        raise InvalidJob(str(exc), "cron" if schedule == "cron" else "interval_s") from None
    if min_interval_s:
        _check_floor(trigger, schedule, interval, stamp, limits.zone, min_interval_s,
                     guard.privileged)
    max_out = fields.get("max_output_tokens")
    if max_out is None:
        max_out = min(400, limits.output_max_tokens)
    if isinstance(max_out, bool) or not isinstance(max_out, int) \
            or not MIN_OUTPUT_TOKENS <= max_out <= limits.output_max_tokens:
        raise InvalidJob(f"'max_output_tokens' must be between {MIN_OUTPUT_TOKENS} and "
                         f"{limits.output_max_tokens} (jobs.output_max_tokens)", "max_output_tokens")
    out["max_output_tokens"] = max_out
    out["webhook_url"] = _url(_text(fields, "webhook_url", URL_MAX), "webhook_url", guard)
    paused = fields.get("paused", False)
    if not isinstance(paused, bool):
        raise InvalidJob("'paused' must be true or false", "paused")
    out["paused"] = paused
    return out
