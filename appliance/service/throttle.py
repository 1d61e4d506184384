"""Failed-login rate limiting (pure; the clock is passed in).

Three limits on *failed* logins, each over a sliding window:

- per (account, address): ``per_pair`` failures in ``window_s``. Guessing one person's
  password from one place stops there, and nobody can lock the real user out from another
  address (the old per-account limit let anyone block the admin for 15 minutes);
- per address: ``per_address`` failures in ``window_s``, whatever names it tries;
- global: ``global_per_minute`` failures in 60 s from everywhere together, a small ceiling
  that bounds password guessing (and argon2 work) from many addresses at once. It holds
  back only addresses that have themselves failed within ``window_s``: an address with a
  clean record always gets its try. (It used to block everyone: two addresses failing 15
  times each for made-up names, each under its own limit, locked the real user out for a
  minute; issue 37.) A guesser spread over many fresh addresses so gets one try per
  address, then the ceiling; a member who mistyped at the same address waits the minute
  out at most.

Memory is bounded by construction: asking (``retry_after``) never creates an entry, a
429 answer records nothing, each entry keeps at most its limit of timestamps, entries
expire with their window, and past ``max_entries`` the least recently failed ones go first.
Names and passwords are bounded by the caller (``MAX_NAME_LENGTH``,
``MAX_PASSWORD_LENGTH``: longer is a 400 before the throttle or the hasher see them).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from appliance.store.auth import MAX_PASSWORD_LENGTH
from appliance.store.users import MAX_NAME_LENGTH

__all__ = ["MAX_NAME_LENGTH", "MAX_PASSWORD_LENGTH", "LoginThrottle"]

WINDOW_S = 15 * 60.0
MAX_PER_PAIR = 5
MAX_PER_ADDRESS = 20
GLOBAL_WINDOW_S = 60.0
MAX_GLOBAL_PER_MINUTE = 30
MAX_ENTRIES = 10_000


@dataclass(slots=True)
class LoginThrottle:
    window_s: float = WINDOW_S
    per_pair: int = MAX_PER_PAIR
    per_address: int = MAX_PER_ADDRESS
    global_per_minute: int = MAX_GLOBAL_PER_MINUTE
    max_entries: int = MAX_ENTRIES
    _fails: OrderedDict[str, deque[float]] = field(default_factory=OrderedDict)
    _global: deque[float] = field(default_factory=deque)

    def retry_after(self, name: str, address: str, now: float) -> float | None:
        """Seconds until another try is allowed, or None when it is allowed now.
        Creates nothing: a refused (429) attempt costs no memory."""
        self._expire(now)
        waits = []
        for key, limit in ((_pair(name, address), self.per_pair),
                           (_addr(address), self.per_address)):
            q = self._fails.get(key)
            if q is not None:
                _prune(q, now - self.window_s)
                if len(q) >= limit:
                    waits.append(q[len(q) - limit] + self.window_s - now)
        _prune(self._global, now - GLOBAL_WINDOW_S)
        if len(self._global) >= self.global_per_minute and self._failed_here(address):
            waits.append(self._global[len(self._global) - self.global_per_minute]
                         + GLOBAL_WINDOW_S - now)
        return max(waits) if waits else None

    def failed(self, name: str, address: str, now: float) -> None:
        for key, limit in ((_pair(name, address), self.per_pair),
                           (_addr(address), self.per_address)):
            q = self._fails.pop(key, None)
            if q is None:
                q = deque(maxlen=limit)
            q.append(now)
            self._fails[key] = q  # most recently failed last
        self._global.append(now)
        while len(self._global) > self.global_per_minute:
            self._global.popleft()
        while len(self._fails) > self.max_entries:
            self._fails.popitem(last=False)

    def succeeded(self, name: str, address: str) -> None:
        """The right password from this address: its failures for this account are over
        (the address's own count stays: a success does not buy more guesses elsewhere)."""
        self._fails.pop(_pair(name, address), None)

    def _failed_here(self, address: str) -> bool:
        """Whether this address has failed within the window (``retry_after`` pruned it)."""
        return bool(self._fails.get(_addr(address)))

    def __len__(self) -> int:
        return len(self._fails)

    def _expire(self, now: float) -> None:
        """Drop entries whose newest failure is out of the window (oldest first)."""
        horizon = now - self.window_s
        while self._fails:
            key, q = next(iter(self._fails.items()))
            if q and q[-1] > horizon:
                break
            del self._fails[key]


def _pair(name: str, address: str) -> str:
    return f"p:{address}:{name.lower()}"


def _addr(address: str) -> str:
    return f"a:{address}"


def _prune(q: deque[float], horizon: float) -> None:
    while q and q[0] <= horizon:
        q.popleft()
