"""Secrets: password hashing and API keys. Pure functions, no database.

Passwords are low-entropy and chosen by people, so they get a slow, memory-hard hash
(argon2id through argon2-cffi's ``PasswordHasher`` with its RFC 9106 defaults).

API keys look like ``apl_<prefix>_<secret>``: ``prefix`` is a short public id (shown in
key listings and used to find the row), ``secret`` is 256 random bits from ``secrets``.
Because the whole key is high-entropy, a single fast sha256 is the right hash: nobody can
brute-force 2**256 candidates, and a slow hash would only add latency to every API call.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from appliance.store.errors import Invalid

KEY_SCHEME = "apl"
PREFIX_BYTES = 4  # 8 hex characters: readable in listings, collisions retried on insert
SECRET_BYTES = 32
MIN_PASSWORD_LENGTH = 8
MAX_PASSWORD_LENGTH = 1024
"""Longer is refused before any hashing (argon2 over megabytes would be a CPU lever)."""

# Unambiguous characters for generated passwords (no 0/O, 1/l/I).
_PASSWORD_ALPHABET = "abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"

# RFC 9106 "low memory" profile (argon2id, 64 MiB, t=3). Tests pass a cheaper hasher.
DEFAULT_HASHER = PasswordHasher()
_hasher = DEFAULT_HASHER


def validate_password(password: str) -> str:
    """The one password rule: at least ``MIN_PASSWORD_LENGTH`` characters."""
    if len(password) < MIN_PASSWORD_LENGTH:
        raise Invalid(f"password must be at least {MIN_PASSWORD_LENGTH} characters")
    if len(password) > MAX_PASSWORD_LENGTH:
        raise Invalid(f"password must be at most {MAX_PASSWORD_LENGTH} characters")
    return password


def hash_password(password: str, hasher: PasswordHasher = _hasher) -> str:
    """Argon2id hash of ``password`` (encoded with its salt and parameters)."""
    return hasher.hash(password)


def verify_password(password_hash: str, password: str, hasher: PasswordHasher = _hasher) -> bool:
    """True when ``password`` matches; False for a mismatch or a malformed hash."""
    try:
        return hasher.verify(password_hash, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def password_needs_rehash(password_hash: str, hasher: PasswordHasher = _hasher) -> bool:
    """True when the hash was made with older parameters than ``hasher`` uses now."""
    try:
        return hasher.check_needs_rehash(password_hash)
    except InvalidHashError:
        return True


# Verified against when a user name is unknown, so that a miss costs as long as a hit and
# login timing does not reveal which names exist.
@functools.cache
def _dummy_hash(hasher: PasswordHasher) -> str:
    return hasher.hash(secrets.token_urlsafe(16))


def burn_password_check(password: str, hasher: PasswordHasher = _hasher) -> None:
    verify_password(_dummy_hash(hasher), password, hasher)


def generate_password(groups: int = 4, group_size: int = 5) -> str:
    """A random password for the first admin, e.g. ``kT4mz-9qXwa-...`` (~115 bits)."""
    return "-".join(
        "".join(secrets.choice(_PASSWORD_ALPHABET) for _ in range(group_size))
        for _ in range(groups)
    )


def generate_api_key() -> tuple[str, str]:
    """Return ``(prefix, plaintext)`` for a new key; show the plaintext once, store the hash."""
    prefix = secrets.token_hex(PREFIX_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return prefix, f"{KEY_SCHEME}_{prefix}_{secret}"


def parse_api_key(plaintext: str) -> str | None:
    """The prefix of a well-formed key, or None. (The secret may itself contain ``_``.)"""
    parts = plaintext.split("_", 2)
    if len(parts) != 3:
        return None
    scheme, prefix, secret = parts
    if scheme != KEY_SCHEME or not prefix or not secret:
        return None
    if len(prefix) != 2 * PREFIX_BYTES or any(c not in "0123456789abcdef" for c in prefix):
        return None
    return prefix


def hash_api_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def api_key_matches(plaintext: str, key_hash: str) -> bool:
    """Constant-time comparison of the key's hash with the stored one."""
    return hmac.compare_digest(hash_api_key(plaintext), key_hash)
