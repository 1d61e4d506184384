"""Users, passwords and API keys against a real, migrated SQLite file.

Personas: alice (admin), bob (member), carol (member, later disabled).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from appliance.store import keys, users
from appliance.store.db import Store, open_store
from appliance.store.errors import AlreadyExists, LastAdmin, NotFound
from appliance.store.models import ApiKey, User
from tests.helpers import FAST_HASHER

ALICE_PW = "alice-secret-1"
BOB_PW = "bob-secret-22"
CAROL_PW = "carol-secret-333"




@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    opened = open_store(db_path)
    with opened.sessions.begin() as s:
        users.create_user(s, "alice", ALICE_PW, role="admin", max_class="voice", hasher=FAST_HASHER)
        users.create_user(s, "bob", BOB_PW, hasher=FAST_HASHER)
        users.create_user(s, "carol", CAROL_PW, max_class="background", hasher=FAST_HASHER)
    yield opened
    opened.close()


def _user(store: Store, name: str) -> User:
    with store.sessions() as s:
        return users.require_user(s, name)


def test_alice_logs_in_with_her_password_and_not_with_bobs(store: Store) -> None:
    with store.sessions.begin() as s:
        alice = users.authenticate_password(s, "alice", ALICE_PW, hasher=FAST_HASHER)
        assert alice is not None and alice.name == "alice" and alice.role == "admin"
        assert users.authenticate_password(s, "alice", BOB_PW, hasher=FAST_HASHER) is None
        assert users.authenticate_password(s, "mallory", ALICE_PW, hasher=FAST_HASHER) is None


def test_user_names_are_case_insensitive_for_login_and_uniqueness(store: Store) -> None:
    with store.sessions.begin() as s:
        assert users.authenticate_password(s, "ALICE", ALICE_PW, hasher=FAST_HASHER) is not None
        with pytest.raises(AlreadyExists):
            users.create_user(s, "Bob", "another-password", hasher=FAST_HASHER)


def test_password_is_stored_as_argon2_hash(store: Store) -> None:
    bob = _user(store, "bob")
    assert bob.password_hash.startswith("$argon2id$")
    assert BOB_PW not in bob.password_hash


def test_invalid_names_roles_and_classes_are_refused(store: Store) -> None:
    with store.sessions.begin() as s:
        for bad_name in ["", " dave", "dave smith", "x" * 65, "ünï"]:
            with pytest.raises(ValueError):
                users.create_user(s, bad_name, "password-123", hasher=FAST_HASHER)
        with pytest.raises(ValueError):
            users.create_user(s, "dave", "password-123", role="root", hasher=FAST_HASHER)
        with pytest.raises(ValueError):
            users.create_user(s, "dave", "password-123", max_class="urgent", hasher=FAST_HASHER)
        with pytest.raises(ValueError):
            users.create_user(s, "dave", "short", hasher=FAST_HASHER)


def test_bob_changes_password_and_the_old_one_stops_working(store: Store) -> None:
    with store.sessions.begin() as s:
        users.set_password(s, users.require_user(s, "bob"), "bobs-new-password", hasher=FAST_HASHER)
    with store.sessions.begin() as s:
        assert users.authenticate_password(s, "bob", BOB_PW, hasher=FAST_HASHER) is None
        assert users.authenticate_password(s, "bob", "bobs-new-password", hasher=FAST_HASHER) is not None


def test_disabled_carol_cannot_log_in_until_enabled_again(store: Store) -> None:
    with store.sessions.begin() as s:
        users.disable_user(s, users.require_user(s, "carol"))
    with store.sessions.begin() as s:
        assert users.authenticate_password(s, "carol", CAROL_PW, hasher=FAST_HASHER) is None
        users.disable_user(s, users.require_user(s, "carol"), disabled=False)
    with store.sessions.begin() as s:
        assert users.authenticate_password(s, "carol", CAROL_PW, hasher=FAST_HASHER) is not None


def test_the_last_enabled_admin_cannot_be_disabled_or_demoted(store: Store) -> None:
    with store.sessions.begin() as s:
        alice = users.require_user(s, "alice")
        with pytest.raises(LastAdmin):
            users.disable_user(s, alice)
        with pytest.raises(LastAdmin):
            users.set_role(s, alice, "member")
        users.set_role(s, users.require_user(s, "bob"), "admin")
        users.set_role(s, alice, "member")  # fine now that bob is an admin
    assert _user(store, "alice").role == "member"


def test_list_users_is_sorted_and_can_hide_disabled(store: Store) -> None:
    with store.sessions.begin() as s:
        users.disable_user(s, users.require_user(s, "carol"))
    with store.read_sessions() as s:
        assert [u.name for u in users.list_users(s)] == ["alice", "bob", "carol"]
        assert [u.name for u in users.list_users(s, include_disabled=False)] == ["alice", "bob"]


def test_login_upgrades_a_hash_made_with_weaker_parameters(store: Store) -> None:
    with store.sessions.begin() as s:
        assert users.authenticate_password(s, "bob", BOB_PW) is not None  # default hasher
    upgraded = _user(store, "bob").password_hash
    assert "m=65536" in upgraded
    with store.sessions.begin() as s:
        assert users.authenticate_password(s, "bob", BOB_PW) is not None


def test_unknown_user_is_not_found(store: Store) -> None:
    with store.sessions() as s, pytest.raises(NotFound):
        users.require_user(s, "mallory")


def test_bobs_api_key_is_shown_once_and_authenticates_as_bob(store: Store) -> None:
    with store.sessions.begin() as s:
        key, plaintext = keys.create_api_key(s, users.require_user(s, "bob"), "laptop script")
    assert plaintext.startswith(f"apl_{key.prefix}_")
    assert key.key_hash != plaintext and plaintext not in key.key_hash
    with store.sessions.begin() as s:
        found = keys.authenticate_key(s, plaintext, now=1000.0)
        assert found is not None
        user, api_key = found
        assert (user.name, api_key.id, api_key.last_used_at) == ("bob", key.id, 1000.0)
        assert keys.authenticate_key(s, plaintext[:-1] + "x") is None
        assert keys.authenticate_key(s, "apl_00000000_nothing") is None


def test_api_key_plaintext_never_reaches_the_database_file(store: Store, db_path: Path) -> None:
    with store.sessions.begin() as s:
        key, plaintext = keys.create_api_key(s, users.require_user(s, "alice"), "home assistant")
    store.close()
    files = [db_path, db_path.with_name(db_path.name + "-wal")]
    raw = b"".join(p.read_bytes() for p in files if p.exists())
    secret = plaintext.split("_", 2)[2]
    assert key.key_hash.encode() in raw  # we are looking at the right bytes
    assert plaintext.encode() not in raw
    assert secret.encode() not in raw


def test_revoked_key_no_longer_authenticates(store: Store) -> None:
    with store.sessions.begin() as s:
        key, plaintext = keys.create_api_key(s, users.require_user(s, "bob"), "old phone")
    with store.sessions.begin() as s:
        revoked = keys.revoke_key(s, key.prefix, now=50.0)
        assert revoked.revoked_at == 50.0
        keys.revoke_key(s, key.prefix, now=60.0)  # idempotent, keeps the first time
        assert revoked.revoked_at == 50.0
    with store.sessions.begin() as s:
        assert keys.authenticate_key(s, plaintext) is None
        assert keys.list_keys(s, user_id=revoked.user_id) == []
        assert [k.prefix for k in keys.list_keys(s, include_revoked=True)] == [key.prefix]


def test_disabled_users_keys_fail(store: Store) -> None:
    with store.sessions.begin() as s:
        _, plaintext = keys.create_api_key(s, users.require_user(s, "carol"), "cron")
        users.disable_user(s, users.require_user(s, "carol"))
    with store.sessions.begin() as s:
        assert keys.authenticate_key(s, plaintext) is None


def test_bob_cannot_revoke_alices_key_and_learns_nothing(store: Store) -> None:
    bob = _user(store, "bob")
    with store.sessions.begin() as s:
        key, plaintext = keys.create_api_key(s, users.require_user(s, "alice"), "voice")
    with store.sessions.begin() as s:
        with pytest.raises(NotFound) as theirs:
            keys.revoke_key(s, key.prefix, user_id=bob.id)
        with pytest.raises(NotFound) as missing:
            keys.revoke_key(s, "ffffffff", user_id=bob.id)
        assert str(theirs.value).replace(key.prefix, "") == str(missing.value).replace(
            "ffffffff", ""
        )
    with store.sessions.begin() as s:
        assert keys.authenticate_key(s, plaintext) is not None


def test_key_class_cannot_exceed_its_owner_and_is_capped_by_later_changes(store: Store) -> None:
    with store.sessions.begin() as s:
        bob = users.require_user(s, "bob")  # interactive
        with pytest.raises(ValueError, match="above"):
            keys.create_api_key(s, bob, "wants voice", "voice")
        key, plaintext = keys.create_api_key(s, bob, "default")
        assert key.max_class == "interactive"
        users.set_max_class(s, bob, "background")
    with store.sessions.begin() as s:
        found = keys.authenticate_key(s, plaintext)
        assert found is not None
        assert keys.effective_max_class(*found) == "background"


def test_last_used_is_refreshed_at_most_once_a_minute(store: Store) -> None:
    with store.sessions.begin() as s:
        key, plaintext = keys.create_api_key(s, users.require_user(s, "bob"), "script")
    for now in (1000.0, 1030.0):
        with store.sessions.begin() as s:
            keys.authenticate_key(s, plaintext, now=now)
    with store.sessions() as s:
        assert s.scalars(select(ApiKey.last_used_at)).one() == 1000.0
    with store.sessions.begin() as s:
        keys.authenticate_key(s, plaintext, now=1061.0)
    with store.sessions() as s:
        assert s.scalars(select(ApiKey.last_used_at)).one() == 1061.0
