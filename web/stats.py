"""Per-user service figures from the ledger, for the dashboard (read in a worker thread).

One pass over the last day's ledger rows gives, per user: tokens served in the last hour and
day (prompt + output, what the daily quota counts), requests, preemptions, time to first
token p50/p95, inter-token latency p50/p95 (chat and voice only), and tokens per minute
over the last hour; and the same latencies per class, background readings apart.

ITL percentiles come from per-request figures (the ledger keeps each request's mean and p95
inter-token latency, not every gap): p50 is the median of the requests' means, p95 the 95th
percentile of the requests' p95s.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from appliance.percentiles import percentile
from appliance.store import ledger, limits, users
from appliance.vocab import CLASS_LABELS, DAY_S, HOUR_S, Klass

SERIES_BUCKETS = 60
"""Points in each user's chart: one per minute over the last hour."""
MAX_ROWS = 50_000
"""Rows read per refresh at most (newest first): bounds the cost on a very busy day."""


@dataclass(frozen=True, slots=True)
class UserService:
    user_id: int
    name: str
    role: str
    disabled: bool
    max_class: str
    weight: float
    counter: float | None
    tokens_hour: int
    tokens_day: int
    tokens_per_day: int | None
    """The daily quota (None: unlimited)."""
    requests_day: int
    preemptions_day: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    series: tuple[int, ...]
    """Tokens served per minute over the last hour, oldest first."""


@dataclass(slots=True)
class _Acc:
    tokens_hour: int = 0
    tokens_day: int = 0
    requests: int = 0
    preemptions: int = 0
    ttft: list[float] | None = None
    itl_mean: list[float] | None = None
    itl_p95: list[float] | None = None
    series: list[int] | None = None

    def add(self, now: float, finished: float, tokens: int, pre: int, ttft: float | None,
            itl_mean: float | None, itl_p95: float | None) -> None:
        self.tokens_day += tokens
        self.requests += 1
        self.preemptions += pre
        for value, bucket in ((ttft, "ttft"), (itl_mean, "itl_mean"), (itl_p95, "itl_p95")):
            if value is not None:
                got = getattr(self, bucket)
                if got is None:
                    got = []
                    setattr(self, bucket, got)
                got.append(value)
        age = now - finished
        if age < HOUR_S:
            self.tokens_hour += tokens
            if self.series is None:
                self.series = [0] * SERIES_BUCKETS
            index = SERIES_BUCKETS - 1 - int(age // (HOUR_S / SERIES_BUCKETS))
            self.series[max(index, 0)] += tokens


@dataclass(frozen=True, slots=True)
class ClassLatency:
    """The household's wait and pace in one class over the last day."""

    klass: str
    requests: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None


Service = tuple[list[UserService], list[ClassLatency]]


def service(session: Session, now: float) -> Service:
    """Every user's service over the last hour and day (disabled users included), and the
    latency of each class. A person's wait and pace count their chats and voice requests
    only: a background reading of a file waits behind them by design, and its minute-long
    first token would read as a slow chat."""
    rows = ledger.service_rows(session, now - DAY_S, MAX_ROWS)
    acc: dict[int, _Acc] = {}
    by_class = {k: _Acc() for k in CLASS_LABELS}
    for uid, finished, tokens, pre, ttft, itl_mean, itl_p95, klass in rows:
        chat = klass != Klass.BACKGROUND.label
        acc.setdefault(uid, _Acc()).add(now, finished, int(tokens or 0), int(pre or 0),
                                        ttft if chat else None, itl_mean if chat else None,
                                        itl_p95 if chat else None)
        by_class.setdefault(klass, _Acc()).add(now, finished, 0, 0, ttft, itl_mean, itl_p95)
    classes = [ClassLatency(k, a.requests, percentile(a.ttft or [], 50),
                            percentile(a.ttft or [], 95), percentile(a.itl_mean or [], 50),
                            percentile(a.itl_p95 or [], 95)) for k, a in by_class.items()]
    return _users(session, acc), classes


def service_table(session: Session, now: float) -> list[UserService]:
    """Every user's service over the last hour and day (see :func:`service`)."""
    return service(session, now)[0]


def _users(session: Session, acc: dict[int, _Acc]) -> list[UserService]:
    quotas = limits.load_quotas(session)
    counters = limits.load_counters(session)
    out = []
    for u in users.list_users(session):
        a = acc.get(u.id, _Acc())
        quota = quotas.get(u.id)
        out.append(UserService(
            user_id=u.id, name=u.name, role=u.role, disabled=u.disabled,
            max_class=u.max_class, weight=u.weight, counter=counters.get(u.id),
            tokens_hour=a.tokens_hour, tokens_day=a.tokens_day,
            tokens_per_day=quota.tokens_per_day if quota else None,
            requests_day=a.requests, preemptions_day=a.preemptions,
            ttft_p50_ms=percentile(a.ttft or [], 50), ttft_p95_ms=percentile(a.ttft or [], 95),
            itl_p50_ms=percentile(a.itl_mean or [], 50),
            itl_p95_ms=percentile(a.itl_p95 or [], 95),
            series=tuple(a.series or [0] * SERIES_BUCKETS)))
    return out


HISTORY_HOURS = 24
HISTORY_DAYS = 14


@dataclass(frozen=True, slots=True)
class UsageHistory:
    """One person's tokens (prompt + output) per hour over the last day and per day over
    the last two weeks, oldest first; the last bucket is the current hour or day."""

    user_id: int
    name: str
    hours: tuple[int, ...]
    days: tuple[int, ...]

    @property
    def total_days(self) -> int:
        return sum(self.days)


def usage_history(session: Session, now: float, only_user: int | None = None
                  ) -> list[UsageHistory]:
    """From the ledger: everyone's (or one person's) usage history. Days are local
    calendar days; hours are the last 24 clock hours."""
    import time as _time

    today = _time.localtime(now)
    midnight = _time.mktime(today[:3] + (0, 0, 0, 0, 0, -1))
    start = midnight - (HISTORY_DAYS - 1) * DAY_S
    hour_start = (now // HOUR_S - (HISTORY_HOURS - 1)) * HOUR_S
    rows = ledger.token_rows_since(session, min(start, hour_start), MAX_ROWS * 4, only_user)
    hours: dict[int, list[int]] = {}
    days: dict[int, list[int]] = {}
    for uid, finished, tokens in rows:
        n = int(tokens or 0)
        h = int((finished - hour_start) // HOUR_S)
        if 0 <= h < HISTORY_HOURS:
            hours.setdefault(uid, [0] * HISTORY_HOURS)[h] += n
        d = round((_time.mktime(_time.localtime(finished)[:3] + (0, 0, 0, 0, 0, -1)) - start)
                  / DAY_S)
        if 0 <= d < HISTORY_DAYS:
            days.setdefault(uid, [0] * HISTORY_DAYS)[d] += n
    out = []
    for u in users.list_users(session):
        if only_user is not None and u.id != only_user:
            continue
        out.append(UsageHistory(u.id, u.name, tuple(hours.get(u.id, [0] * HISTORY_HOURS)),
                                tuple(days.get(u.id, [0] * HISTORY_DAYS))))
    return out
