"""Users: create, look up, change, and authenticate by password.

Functions take a ``Session`` and never commit: the caller owns the transaction
(``with factory.begin() as session: ...``).
"""

from __future__ import annotations

import re
import time

from argon2 import PasswordHasher
from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from appliance.store import auth
from appliance.store.errors import AlreadyExists, Invalid, LastAdmin, NotFound
from appliance.store.models import ROLES, User, WebSession
from appliance.vocab import CLASS_LABELS, WEIGHT_MAX, WEIGHT_MIN, Klass

MAX_NAME_LENGTH = 64
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def validate_name(name: str) -> str:
    """User names: 1-64 ASCII letters, digits, ``_ . -``, starting with a letter or digit."""
    if not _NAME_RE.fullmatch(name):
        raise Invalid(
            "user name must be 1-64 characters of letters, digits, '_', '.', '-' "
            "and start with a letter or digit"
        )
    return name


def validate_class(klass: str) -> str:
    if klass not in CLASS_LABELS:
        raise Invalid(f"class must be one of {', '.join(CLASS_LABELS)}")
    return klass


def _validate_role(role: str) -> str:
    if role not in ROLES:
        raise Invalid(f"role must be one of {', '.join(ROLES)}")
    return role


def _validate_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
            WEIGHT_MIN <= weight <= WEIGHT_MAX):
        raise Invalid(f"weight must be a number from {WEIGHT_MIN:g} to {WEIGHT_MAX:g}, "
                         f"got {weight!r}")
    return float(weight)


def create_user(
    session: Session,
    name: str,
    password: str,
    *,
    role: str = "member",
    max_class: str = Klass.INTERACTIVE.label,
    weight: float = 1.0,
    now: float | None = None,
    hasher: PasswordHasher = auth.DEFAULT_HASHER,
) -> User:
    """Add a user; raises ``AlreadyExists`` when the name is taken (in any letter case)."""
    validate_name(name)
    _validate_role(role)
    validate_class(max_class)
    weight = _validate_weight(weight)
    if get_user_by_name(session, name) is not None:
        raise AlreadyExists(f"user {name!r} already exists")
    user = User(
        name=name,
        password_hash=auth.hash_password(auth.validate_password(password), hasher),
        role=role,
        max_class=max_class,
        weight=weight,
        disabled=False,
        created_at=time.time() if now is None else now,
    )
    session.add(user)
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent insert won the race
        raise AlreadyExists(f"user {name!r} already exists") from exc
    return user


def get_user(session: Session, user_id: int) -> User | None:
    return session.get(User, user_id)


def get_user_by_name(session: Session, name: str) -> User | None:
    """Case-insensitive lookup (the column collates NOCASE)."""
    return session.scalars(select(User).where(User.name == name)).one_or_none()


def require_user(session: Session, name: str) -> User:
    user = get_user_by_name(session, name)
    if user is None:
        raise NotFound(f"no user named {name!r}")
    return user


def list_users(session: Session, *, include_disabled: bool = True) -> list[User]:
    query = select(User).order_by(User.name)
    if not include_disabled:
        query = query.where(User.disabled.is_(False))
    return list(session.scalars(query))


def count_admins(session: Session) -> int:
    """Enabled admins."""
    query = select(func.count()).select_from(User).where(
        User.role == "admin", User.disabled.is_(False)
    )
    return int(session.scalar(query) or 0)


def _guard_last_admin(session: Session, user: User) -> None:
    if user.role == "admin" and not user.disabled and count_admins(session) <= 1:
        raise LastAdmin("this is the only enabled admin; make another admin first")


def set_password(
    session: Session, user: User, password: str, *, hasher: PasswordHasher = auth.DEFAULT_HASHER
) -> None:
    """A new password ends every browser session of the user (whoever knew the old one is
    logged out), whichever tool changed it: web, admin API or CLI."""
    user.password_hash = auth.hash_password(auth.validate_password(password), hasher)
    _end_sessions(session, user.id)


def disable_user(session: Session, user: User, disabled: bool = True) -> None:
    """Disable (or re-enable) a user: logins, browser sessions and API keys stop working at
    once. The session rows stay while the user is disabled, so a browser can be told why it
    was logged out (``websessions.of_disabled_user``); enabling deletes them, so it never
    brings an old session back."""
    if disabled:
        _guard_last_admin(session, user)
    elif user.disabled:
        _end_sessions(session, user.id)
    user.disabled = disabled


def _end_sessions(session: Session, user_id: int) -> None:
    session.execute(delete(WebSession).where(WebSession.user_id == user_id))


def set_role(session: Session, user: User, role: str) -> None:
    _validate_role(role)
    if role != "admin":
        _guard_last_admin(session, user)
    user.role = role


def set_max_class(session: Session, user: User, max_class: str) -> None:
    user.max_class = validate_class(max_class)


def set_weight(session: Session, user: User, weight: float) -> None:
    user.weight = _validate_weight(weight)


def authenticate_password(
    session: Session, name: str, password: str, *, hasher: PasswordHasher = auth.DEFAULT_HASHER,
    allow_disabled: bool = False,
) -> User | None:
    """The enabled user with this name and password, or None. ``allow_disabled``: a disabled
    user with the right password is returned too (to tell them so; start no session).

    Unknown names cost one argon2 verification too, so timing does not reveal which names
    exist. A hash made with other argon2 parameters than ``hasher``'s is re-made on a
    successful login (the session must be a write session for that to be saved).
    """
    user = get_user_by_name(session, name)
    if user is None:
        auth.burn_password_check(password, hasher)
        return None
    if not auth.verify_password(user.password_hash, password, hasher):
        return None
    if user.disabled:
        return user if allow_disabled else None
    if auth.password_needs_rehash(user.password_hash, hasher):
        user.password_hash = auth.hash_password(password, hasher)
    return user
