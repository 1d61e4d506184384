"""What an admin allows each user, applied to the requests already running: the day's token
quota (the limit the request was submitted with, or the one an admin set since), a disabled
account, a revoked API key. The runner ends the requests named here each tick
(appliance/engine/runner.py)."""

from __future__ import annotations

from collections.abc import Iterable

from appliance.engine.request import ACCESS_ENDED, UserAccess
from appliance.engine.seq import Seq
from appliance.sched.usage import RollingUsage


class AccessRules:
    """Per user, what an admin's change left allowed (:meth:`restrict`), checked against the
    tokens each user has used in the rolling day (``usage``)."""

    def __init__(self, usage: RollingUsage) -> None:
        self.usage = usage
        self._access: dict[str, UserAccess] = {}

    def restrict(self, user_key: str, access: UserAccess) -> None:
        self._access[user_key] = access

    def daily_limit(self, s: Seq) -> int | None:
        access = self._access.get(s.handle.request.user_key)
        return s.handle.request.tokens_per_day if access is None else access.tokens_per_day

    def over_quota(self, seqs: Iterable[Seq], now: float) -> list[Seq]:
        """The requests whose user has used up the day's tokens."""
        return [s for s in seqs if (limit := self.daily_limit(s)) is not None
                and self.usage.total(s.handle.request.user_key, now) >= limit]

    def tokens_left(self, s: Seq, now: float) -> int | None:
        """Tokens the user of ``s`` may still generate today (None: no daily limit)."""
        limit = self.daily_limit(s)
        if limit is None:
            return None
        return max(limit - self.usage.total(s.handle.request.user_key, now), 0)

    def cut_off(self, seqs: Iterable[Seq]) -> list[tuple[Seq, str]]:
        """The requests of a disabled user or made with a revoked key, each with the error
        it ends with."""
        ended: list[tuple[Seq, str]] = []
        for s in seqs:
            r = s.handle.request
            access = self._access.get(r.user_key)
            if access is None:
                continue
            if access.disabled:
                ended.append((s, ACCESS_ENDED["disabled"]))
            elif r.api_key_id is not None and r.api_key_id in access.revoked_keys:
                ended.append((s, ACCESS_ENDED["revoked"]))
        return ended
