"""Schedules as a household types them, turned into a 5-field cron or an interval (pure).

Written here rather than taken from a library: the ones that read English schedules either
pull in a date-parsing stack for one-off dates or return their own recurrence objects,
while ours must end as what APScheduler's ``CronTrigger.from_crontab`` reads (stored,
shown and checked against the schedule floor like any cron).

Accepted, case and spacing free:
- a 5-field cron: ``0 7 * * *``;
- ``@hourly``, ``@daily`` (``@midnight``), ``@weekly``, ``@monthly``, ``@yearly``
  (``@annually``), and the bare words ``hourly``, ``daily``, ``weekly``, ``monthly``;
- ``every day at 7``, ``daily at 7:30pm``, ``every weekday at 8``, ``every weekend at 10``,
  ``every monday at 8:30``, ``every mon and thu at 18:00``, ``on sundays at noon``
  (without a time: midnight); times ``7``, ``7am``, ``7 pm``, ``19:30``, ``8.30``,
  ``noon``, ``midnight``;
- ``every hour``, ``every minute``, ``every 2 hours``, ``every 15 minutes``,
  ``every 3 days``: a cron when the step divides the hour or the day evenly (on the hour,
  like a household means it), else an interval in seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from appliance.vocab import Refused

ACCEPTED = ("a 5-field cron ('0 7 * * *'), @hourly, @daily, @weekly or @monthly, or words "
            "such as 'every day at 7', 'every monday at 8:30', 'every weekday at 7:30am', "
            "'every 2 hours'")

_MACROS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
           "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *",
           "@annually": "0 0 1 1 *"}
_DAYS = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}
_DAY_WORD = r"(?:sun|mon|tue|tues|wed|thu|thur|thurs|fri|sat)(?:day|nesday|sday|urday|s)?s?"
_UNITS = {"minute": 60, "min": 60, "hour": 3600, "hr": 3600, "day": 86400}
_STEP = re.compile(r"every (?:(\d+) )?(minute|min|hour|hr|day)s?")
_TIME = re.compile(r"(\d{1,2})(?:[:.h](\d{2}))? ?(am|pm|a\.m\.|p\.m\.)?")


@dataclass(frozen=True, slots=True)
class Schedule:
    kind: str
    """``cron`` or ``interval``."""
    cron: str | None = None
    interval_s: int | None = None


def parse_schedule(text: str) -> Schedule:
    """The schedule ``text`` means; Refused naming what is accepted otherwise."""
    words = " ".join(text.lower().replace(",", " ").split())
    if len(words.split()) == 5 and not re.search(r"[a-z]{4,}", words):
        return Schedule("cron", words)  # a cron expression: APScheduler checks its fields
    macro = _MACROS.get(words) or _MACROS.get("@" + words)
    if macro is not None:
        return Schedule("cron", macro)
    step = _STEP.fullmatch(words)
    if step is not None:
        return _every(int(step.group(1) or 1), step.group(2))
    found = _days_at(words)
    if found is not None:
        return Schedule("cron", found)
    raise Refused(f"schedule {text.strip()!r} is not understood; use {ACCEPTED}")


def _every(n: int, unit: str) -> Schedule:
    if n < 1:
        raise Refused(f"'every {n} {unit}s' needs a step of at least 1")
    seconds = n * _UNITS[unit]
    if unit in ("minute", "min") and 60 % n == 0:
        return Schedule("cron", "* * * * *" if n == 1 else f"*/{n} * * * *")
    if unit in ("hour", "hr") and 24 % n == 0:
        return Schedule("cron", "0 * * * *" if n == 1 else f"0 */{n} * * *")
    if unit == "day" and n == 1:
        return Schedule("cron", "0 0 * * *")
    return Schedule("interval", interval_s=seconds)


def _days_at(words: str) -> str | None:
    """``<days> [at <time>]`` or ``at <time> <days>`` as a cron, or None."""
    days_part, _, time_part = words.partition(" at ")
    if not time_part and words.startswith("at "):
        time_part, _, days_part = words[3:].partition(" ")
    days_part = re.sub(r"^(?:every|each|on) ", "", days_part.strip())
    days_part = re.sub(r"^(?:every|each|on) ", "", days_part)
    dow = _weekdays(days_part)
    if dow is None:
        return None
    hour, minute = (0, 0) if not time_part else _clock(time_part.strip())
    return f"{minute} {hour} * * {dow}"


def _weekdays(text: str) -> str | None:
    if text in ("day", "daily", "days", "morning", "evening", "night"):
        return "*"
    if text in ("weekday", "weekdays", "workday", "workdays"):
        return "1-5"
    if text in ("weekend", "weekends"):
        return "0,6"
    names = [w for w in re.split(r" and | ?& ?| ", text) if w]
    if not names or not all(re.fullmatch(_DAY_WORD, n) for n in names):
        return None
    return ",".join(str(_DAYS[n[:3]]) for n in names)


def _clock(text: str) -> tuple[int, int]:
    if text in ("noon", "midday"):
        return 12, 0
    if text == "midnight":
        return 0, 0
    m = _TIME.fullmatch(text)
    if m is None:
        raise Refused(f"time {text!r} is not understood; use e.g. '7', '7:30', '7pm', "
                         "'19:30', 'noon'")
    hour, minute, half = int(m.group(1)), int(m.group(2) or 0), (m.group(3) or "")[:1]
    if half and not 1 <= hour <= 12:
        raise Refused(f"time {text!r}: with am/pm the hour is 1 to 12")
    if half == "p" and hour != 12:
        hour += 12
    elif half == "a" and hour == 12:
        hour = 0
    if not (0 <= hour <= 23 and 0 <= minute <= 59):
        raise Refused(f"time {text!r} is not a time of day")
    return hour, minute
