"""Schedules: a cron expression, an interval in seconds, or none (run on demand).

Triggers are APScheduler's own (``CronTrigger.from_crontab``, ``IntervalTrigger``) in the
household time zone. An interval is anchored at the job's creation time, so its slots are
the same before and after a restart (that is what lets a missed slot be recognised).
"""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from appliance.vocab import Refused

MIN_INTERVAL_S = 1
MAX_INTERVAL_S = 366 * 86400


def household_zone(name: str) -> tzinfo:
    if not name:
        local = datetime.now().astimezone().tzinfo
        assert local is not None
        return local
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"jobs.timezone: unknown time zone {name!r} (use an IANA name such "
                         "as 'Europe/Paris')") from None


def make_trigger(kind: str, cron: str | None, interval_s: int | None, anchor: float,
                 zone: tzinfo) -> BaseTrigger | None:
    """The trigger of a schedule, or None for on-demand jobs; Refused when invalid."""
    if kind == "none":
        return None
    if kind == "cron":
        fields = (cron or "").split()
        if len(fields) != 5:  # definitions store what appliance.jobs.phrases made of words
            raise Refused("cron must have 5 fields: minute hour day month weekday "
                          "(e.g. '0 7 * * *' for 07:00 every day)")
        try:
            return CronTrigger.from_crontab(" ".join(fields), timezone=zone)
        except ValueError as exc:
            raise Refused(f"cron {cron!r} is not valid: {exc}") from None
    if kind == "interval":
        if interval_s is None or not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise Refused(f"interval_s must be between {MIN_INTERVAL_S} and "
                          f"{MAX_INTERVAL_S} seconds")
        return IntervalTrigger(seconds=interval_s, start_date=datetime.fromtimestamp(anchor, zone),
                               timezone=zone)
    raise Refused("schedule must be 'none', 'cron' or 'interval'")


def next_times(trigger: BaseTrigger | None, now: datetime, n: int = 3) -> list[datetime]:
    out: list[datetime] = []
    prev: datetime | None = None
    t = now
    while trigger is not None and len(out) < n:
        fire = trigger.get_next_fire_time(prev, t)
        if fire is None:
            break
        out.append(fire)
        prev, t = fire, fire + timedelta(microseconds=1)
    return out


def shortest_gap(trigger: BaseTrigger | None, now: datetime, samples: int = 100) -> float | None:
    """Seconds between the closest two of the next ``samples`` runs (None: fewer than two).
    A cron's closest runs repeat within its first hour or day of runs, which 100 cover."""
    times = next_times(trigger, now, samples)
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    return min(gaps) if gaps else None


def latest_slot(trigger: BaseTrigger, after: datetime, now: datetime,
                limit: int = 100_000) -> datetime | None:
    """The last fire time in ``(after, now]`` (None when there is none)."""
    last = None
    prev: datetime | None = None
    t = after + timedelta(microseconds=1)
    for _ in range(limit):
        fire = trigger.get_next_fire_time(prev, t)
        if fire is None or fire > now:
            break
        if fire > after:
            last = fire
        prev, t = fire, fire + timedelta(microseconds=1)
    return last


def describe(kind: str, cron: str | None, interval_s: int | None) -> str:
    """The schedule in words ('At 07:00 AM', 'Every 2 hours', 'On demand')."""
    if kind == "cron" and cron:
        try:
            from cron_descriptor import get_description

            return str(get_description(cron))
        except Exception:  # the library raises its own types for odd input
            return cron
    if kind == "interval" and interval_s:
        for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
            if interval_s % size == 0:
                n = interval_s // size
                return f"Every {n} {unit}{'s' if n != 1 else ''}" if n != 1 else f"Every {unit}"
        return f"Every {interval_s} seconds" if interval_s != 1 else "Every second"
    return "On demand"


def in_words(when: datetime, now: datetime) -> str:
    """'today at 07:00', 'tomorrow at 07:00', 'Mon 3 Dec at 07:00', 'in 5 s'."""
    delta = (when - now).total_seconds()
    if delta < 90:
        return f"in {max(0, int(delta))} s"
    if delta < 3600:
        return f"in {int(delta // 60)} min"
    day = (when.date() - now.date()).days
    clock = when.strftime("%H:%M")
    if day == 0:
        return f"today at {clock}"
    if day == 1:
        return f"tomorrow at {clock}"
    return f"{when.strftime('%a')} {when.day} {when.strftime('%b')} at {clock}"
