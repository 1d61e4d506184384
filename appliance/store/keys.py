"""API keys: create (plaintext returned once), list, revoke, authenticate.

Functions take a ``Session`` and never commit: the caller owns the transaction.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from appliance.store import auth
from appliance.store.errors import Invalid, NotFound
from appliance.store.models import ApiKey, User
from appliance.store.users import validate_class
from appliance.vocab import CLASS_LABELS

# last_used_at is refreshed at most this often, so authenticating a key is a read on
# almost every request instead of a write.
LAST_USED_RESOLUTION_S = 60.0


def class_rank(klass: str) -> int:
    """0 for the highest class (voice), larger is lower."""
    return CLASS_LABELS.index(klass)


def effective_max_class(user: User, key: ApiKey | None) -> str:
    """The highest class a request may use: the lower of the user's and the key's maximum.

    Applied at every request, so lowering a user's class also limits their existing keys.
    """
    if key is None:
        return user.max_class
    return max(user.max_class, key.max_class, key=class_rank)


def effective_default_class(user: User, key: ApiKey | None) -> str:
    """The class a request runs in when it asks for none: the key's ``default_class``
    (its maximum when unset), never above the user's and the key's maximum."""
    top = effective_max_class(user, key)
    if key is None or key.default_class is None:
        return top
    return max(key.default_class, top, key=class_rank)


def _check_default(default_class: str | None, max_class: str) -> str | None:
    if not default_class:
        return None
    klass = validate_class(default_class)
    if class_rank(klass) < class_rank(max_class):
        raise Invalid(f"default class {klass!r} is above the key's maximum {max_class!r}")
    return klass


def create_api_key(
    session: Session,
    user: User,
    name: str,
    max_class: str | None = None,
    *,
    default_class: str | None = None,
    now: float | None = None,
    at_most: str | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``user``; returns ``(row, plaintext)``.

    The plaintext exists only in the return value: show it once, it cannot be recovered.
    ``max_class`` defaults to the user's own maximum (no higher than ``at_most``, the
    class of the key making this one) and may not exceed it; ``default_class`` (None: the
    maximum) may not exceed ``max_class``.
    """
    ceiling = user.max_class
    if at_most is not None and class_rank(validate_class(at_most)) > class_rank(ceiling):
        ceiling = at_most
    klass = validate_class(max_class or ceiling)
    if at_most is not None and class_rank(klass) < class_rank(at_most):
        raise Invalid(f"key class {klass!r} is above the creating key's class {at_most!r}")
    if class_rank(klass) < class_rank(user.max_class):
        raise Invalid(f"key class {klass!r} is above the user's maximum {user.max_class!r}")
    default = _check_default(default_class, klass)
    name = name.strip()
    if not name or len(name) > 128:
        raise Invalid("key name must be 1-128 characters")
    prefix, plaintext = auth.generate_api_key()
    while _find_by_prefix(session, prefix) is not None:  # 32-bit prefix: rare, but possible
        prefix, plaintext = auth.generate_api_key()
    key = ApiKey(
        user_id=user.id,
        name=name,
        prefix=prefix,
        key_hash=auth.hash_api_key(plaintext),
        max_class=klass,
        default_class=default,
        created_at=time.time() if now is None else now,
    )
    session.add(key)
    session.flush()
    return key, plaintext


def _find_by_prefix(session: Session, prefix: str) -> ApiKey | None:
    return session.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).one_or_none()


def classes_at_most(klass: str) -> tuple[str, ...]:
    """``klass`` and every class below it."""
    return CLASS_LABELS[class_rank(klass):]


def list_keys(
    session: Session, *, user_id: int | None = None, include_revoked: bool = False,
    at_most: str | None = None,
) -> list[ApiKey]:
    """Keys, oldest first; all users' keys when ``user_id`` is None (admin view).
    ``at_most``: only keys of that class or below (what a key may see of its user's keys)."""
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if user_id is not None:
        query = query.where(ApiKey.user_id == user_id)
    if at_most is not None:
        query = query.where(ApiKey.max_class.in_(classes_at_most(at_most)))
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list(session.scalars(query))


def revoke_key(
    session: Session, prefix: str, *, user_id: int | None = None, now: float | None = None,
    at_most: str | None = None,
) -> ApiKey:
    """Revoke the key with this public prefix. Revoking twice keeps the first time.

    With ``user_id`` (a member managing their own keys) another user's key is reported as
    ``NotFound``, exactly like a missing one; so is, with ``at_most``, a key of a higher class.
    """
    key = _find_by_prefix(session, prefix)
    if key is None or (user_id is not None and key.user_id != user_id) or (
            at_most is not None and key.max_class not in classes_at_most(at_most)):
        raise NotFound(f"no API key {prefix!r}")
    if key.revoked_at is None:
        key.revoked_at = time.time() if now is None else now
    return key


def set_default_class(
    session: Session, prefix: str, default_class: str | None, *, user_id: int | None = None
) -> ApiKey:
    """Change a key's default class (None or "": its maximum). With ``user_id`` another
    user's key is ``NotFound``, as in :func:`revoke_key`."""
    key = _find_by_prefix(session, prefix)
    if key is None or (user_id is not None and key.user_id != user_id):
        raise NotFound(f"no API key {prefix!r}")
    key.default_class = _check_default(default_class, key.max_class)
    return key


def find_key(session: Session, plaintext: str) -> tuple[User, ApiKey] | None:
    """The (user, key) for a presented key, or None when malformed, unknown, wrong,
    revoked, or owned by a disabled user. A pure read (the daemon's authentication path):
    ``last_used_at`` is refreshed through the single writer (``needs_touch``, ``touch_keys``)."""
    prefix = auth.parse_api_key(plaintext)
    if prefix is None:
        return None
    key = _find_by_prefix(session, prefix)
    if key is None or not auth.api_key_matches(plaintext, key.key_hash):
        return None
    if key.revoked_at is not None or key.user.disabled:
        return None
    return key.user, key


def needs_touch(key: ApiKey, now: float) -> bool:
    """Whether ``last_used_at`` is older than its resolution (refreshed at most once a
    minute, so authentication stays a read on almost every request)."""
    return key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION_S


def touch_keys(session: Session, used: Mapping[int, float]) -> None:
    """Record when keys were last used (key id -> time); never moves a time backwards."""
    for key_id, when in used.items():
        session.execute(update(ApiKey).where(
            ApiKey.id == key_id,
            (ApiKey.last_used_at.is_(None)) | (ApiKey.last_used_at < when),
        ).values(last_used_at=when))


def authenticate_key(
    session: Session, plaintext: str, *, now: float | None = None
) -> tuple[User, ApiKey] | None:
    """``find_key`` plus the ``last_used_at`` refresh (at most once a minute) in the same
    write session, for callers without a writer thread."""
    found = find_key(session, plaintext)
    if found is None:
        return None
    user, key = found
    now = time.time() if now is None else now
    if needs_touch(key, now):
        key.last_used_at = now
    return user, key
