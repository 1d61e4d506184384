"""Tokens each user was served in the rolling day, for the daily quota.

The engine adds tokens as it serves them (prompt tokens once per request, output tokens as
they are made); the HTTP layer reads totals and events when it admits a request. Minute
buckets keep it small; a lock makes the two threads' access safe (both hold it briefly).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Iterable

from appliance.vocab import DAY_S

BUCKET_S = 60.0


class RollingUsage:
    def __init__(self, window_s: float = DAY_S, bucket_s: float = BUCKET_S) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._lock = threading.Lock()
        self._buckets: dict[str, deque[list[float]]] = defaultdict(deque)
        self._totals: dict[str, int] = defaultdict(int)

    def add(self, user: str, now: float, tokens: int) -> None:
        if tokens <= 0:
            return
        start = now - now % self.bucket_s
        with self._lock:
            q = self._buckets[user]
            if q and q[-1][0] == start:
                q[-1][1] += tokens
            else:
                q.append([start, float(tokens)])
            self._totals[user] += tokens

    def load(self, rows: Iterable[tuple[str, float, int]]) -> None:
        """Start from the ledger: (user, time, tokens) rows of the last day, oldest first."""
        for user, t, n in sorted(rows, key=lambda r: r[1]):
            self.add(user, t, n)

    def total(self, user: str, now: float) -> int:
        with self._lock:
            self._expire(user, now)
            return self._totals.get(user, 0)

    def events(self, user: str, now: float) -> list[tuple[float, int]]:
        """(bucket end, tokens) in the window: when each bucket's tokens age out, minus a day."""
        with self._lock:
            self._expire(user, now)
            return [(t + self.bucket_s, int(n)) for t, n in self._buckets.get(user, ())]

    def _expire(self, user: str, now: float) -> None:
        q = self._buckets.get(user)
        while q and q[0][0] + self.bucket_s <= now - self.window_s:
            _, n = q.popleft()
            self._totals[user] -= int(n)
