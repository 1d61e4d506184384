"""Secrets handling without a database: passwords and API key material."""

from __future__ import annotations

import pytest
from argon2 import PasswordHasher

from appliance.store import auth

# Cheap parameters keep the unit tests fast; the argon2 code path is the same.
FAST = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)


def test_alices_password_verifies_and_a_wrong_one_does_not() -> None:
    stored = auth.hash_password("correct horse battery", FAST)
    assert stored.startswith("$argon2id$")
    assert "correct horse" not in stored
    assert auth.verify_password(stored, "correct horse battery", FAST)
    assert not auth.verify_password(stored, "correct horse battery!", FAST)


def test_same_password_hashes_differently_each_time() -> None:
    assert auth.hash_password("password1", FAST) != auth.hash_password("password1", FAST)


def test_malformed_hash_is_a_failed_login_not_a_crash() -> None:
    assert not auth.verify_password("not-a-hash", "whatever1")


def test_short_password_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        auth.validate_password("short")


def test_hash_made_with_weaker_parameters_needs_rehash() -> None:
    weak = auth.hash_password("password1", FAST)
    assert auth.password_needs_rehash(weak)
    assert not auth.password_needs_rehash(auth.hash_password("password1"))


def test_generated_first_admin_password_is_long_random_and_valid() -> None:
    passwords = {auth.generate_password() for _ in range(50)}
    assert len(passwords) == 50
    for password in passwords:
        assert len(password) >= 20
        auth.validate_password(password)
        assert not set(password) & set("0O1lI")


def test_api_key_has_scheme_prefix_and_long_secret() -> None:
    prefix, plaintext = auth.generate_api_key()
    scheme, key_prefix, secret = plaintext.split("_", 2)
    assert scheme == "apl"
    assert key_prefix == prefix
    assert len(secret) >= 40
    assert auth.parse_api_key(plaintext) == prefix


@pytest.mark.parametrize(
    "presented",
    ["", "apl", "apl_abc", "sk_0123abcd_secret", "apl_0123ABCD_secret", "apl_0123abcd_", "x" * 80],
)
def test_malformed_api_keys_are_rejected_before_any_lookup(presented: str) -> None:
    assert auth.parse_api_key(presented) is None


def test_api_key_is_stored_as_sha256_and_compared_exactly() -> None:
    _, plaintext = auth.generate_api_key()
    stored = auth.hash_api_key(plaintext)
    assert len(stored) == 64
    assert plaintext not in stored
    assert auth.api_key_matches(plaintext, stored)
    assert not auth.api_key_matches(plaintext + "x", stored)
    assert not auth.api_key_matches(plaintext[:-1], stored)
