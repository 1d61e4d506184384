"""Failed-login rate limiting, per account and per address (pure; the clock is passed in)."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

WINDOW_S = 15 * 60.0
MAX_PER_ACCOUNT = 5
MAX_PER_ADDRESS = 20


@dataclass(slots=True)
class LoginThrottle:
    """At most ``MAX_PER_ACCOUNT`` failures per name and ``MAX_PER_ADDRESS`` per client
    address within a sliding ``WINDOW_S``; a success clears the name's failures."""

    window_s: float = WINDOW_S
    per_account: int = MAX_PER_ACCOUNT
    per_address: int = MAX_PER_ADDRESS
    _fails: dict[str, deque[float]] = field(default_factory=lambda: defaultdict(deque))

    def retry_after(self, name: str, address: str, now: float) -> float | None:
        """Seconds until another try is allowed, or None when it is allowed now."""
        waits = []
        for key, limit in ((f"n:{name.lower()}", self.per_account),
                           (f"a:{address}", self.per_address)):
            q = self._prune(key, now)
            if len(q) >= limit:
                waits.append(q[len(q) - limit] + self.window_s - now)
        return max(waits) if waits else None

    def failed(self, name: str, address: str, now: float) -> None:
        self._fails[f"n:{name.lower()}"].append(now)
        self._fails[f"a:{address}"].append(now)

    def succeeded(self, name: str) -> None:
        self._fails.pop(f"n:{name.lower()}", None)

    def _prune(self, key: str, now: float) -> deque[float]:
        q = self._fails[key]
        while q and q[0] <= now - self.window_s:
            q.popleft()
        return q
