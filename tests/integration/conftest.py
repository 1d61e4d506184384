"""Store fixtures shared by the integration tests: a migrated SQLite file and a household."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.store import migrate, users
from appliance.store.db import Store, open_store
from tests.helpers import FAST_HASHER


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "appliance.db"
    migrate.upgrade(path)
    return path


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    """alice, bob and carol (members, password ``<name>-password``); modules that need other
    roles or classes define their own ``store`` over ``db_path``."""
    opened = open_store(db_path)
    with opened.sessions.begin() as s:
        for name in ("alice", "bob", "carol"):
            users.create_user(s, name, f"{name}-password", hasher=FAST_HASHER)
    yield opened
    opened.close()


@pytest.fixture
def ids(store: Store) -> dict[str, int]:
    with store.sessions() as s:
        return {u.name: u.id for u in users.list_users(s)}
