"""Browser sessions: opaque cookie tokens, stored as SHA-256, rotated at every login."""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from appliance.store.models import User, WebSession
from appliance.vocab import DAY_S

SESSION_TTL_S = 30 * DAY_S


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


SHARED = "s."
"""Tokens of 'Shared device' sessions start with this: their expiry slides with use
(``idle_s`` after the last request) instead of lasting SESSION_TTL_S."""
SLIDE_EVERY_S = 60.0
"""A shared session's expiry is pushed forward at most once a minute (one small write)."""


def start_session(session: Session, user: User, *, now: float | None = None,
                  ttl_s: float = SESSION_TTL_S, shared: bool = False) -> str:
    """A fresh token for ``user`` (never a reused one: the id rotates at login); a shared
    one (``shared``) lasts ``ttl_s`` past its last use."""
    now = time.time() if now is None else now
    token = (SHARED if shared else "") + secrets.token_urlsafe(32)
    session.add(WebSession(token_hash=_hash(token), user_id=user.id, created_at=now,
                           expires_at=now + ttl_s))
    session.execute(delete(WebSession).where(WebSession.expires_at < now))
    return token


def session_user(session: Session, token: str, *, now: float | None = None) -> User | None:
    """The enabled user behind ``token``, or None (unknown, expired, disabled)."""
    now = time.time() if now is None else now
    row = session.scalars(select(WebSession).where(
        WebSession.token_hash == _hash(token))).one_or_none()
    if row is None or row.expires_at < now:
        return None
    user = session.get(User, row.user_id)
    return None if user is None or user.disabled else user


def of_disabled_user(session: Session, token: str, *, now: float | None = None) -> bool:
    """Whether ``token`` is a live session of a user an admin has disabled: the browser
    was logged out for that reason, and the login page can say so. (Disabling keeps the
    rows for this; enabling the user again ends them, so they never come back to life.)"""
    now = time.time() if now is None else now
    row = session.scalars(select(WebSession).where(
        WebSession.token_hash == _hash(token))).one_or_none()
    if row is None or row.expires_at < now:
        return False
    user = session.get(User, row.user_id)
    return user is not None and user.disabled


def slide_shared(session: Session, token: str, idle_s: float, *,
                 now: float | None = None) -> None:
    """Push a live shared session's end to ``idle_s`` from now (the tablet is in use)."""
    now = time.time() if now is None else now
    if not token.startswith(SHARED):
        return
    row = session.scalars(select(WebSession).where(
        WebSession.token_hash == _hash(token))).one_or_none()
    if row is not None and row.expires_at >= now and \
            row.expires_at < now + idle_s - SLIDE_EVERY_S:
        row.expires_at = now + idle_s


def end_session(session: Session, token: str) -> None:
    session.execute(delete(WebSession).where(WebSession.token_hash == _hash(token)))


def end_user_sessions(session: Session, user_id: int) -> None:
    """Log a user out everywhere (password change, disable)."""
    session.execute(delete(WebSession).where(WebSession.user_id == user_id))
