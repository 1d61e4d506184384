"""Chat history belongs to one user: nobody else can read, change or even detect it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import delete, func, select

from appliance.store import conversations as convs
from appliance.store import users
from appliance.store.db import Store, open_store
from appliance.store.errors import NotFound
from appliance.store.models import Conversation, Message
from tests.helpers import FAST_HASHER


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    opened = open_store(db_path)
    with opened.sessions.begin() as s:
        users.create_user(s, "alice", "alice-secret-1", role="admin", hasher=FAST_HASHER)
        users.create_user(s, "bob", "bob-secret-22", hasher=FAST_HASHER)
    yield opened
    opened.close()




def _alice_conversation(store: Store, alice: int) -> int:
    with store.sessions.begin() as s:
        conv = convs.create_conversation(s, alice, "  Dinner\nplans  ", now=100.0)
        convs.add_message(s, alice, conv.id, "user", "what can I cook with leeks?", now=101.0)
        convs.add_message(
            s, alice, conv.id, "assistant", "Leek soup.", prompt_tokens=12, output_tokens=3,
            now=102.0,
        )
        return conv.id


def test_alice_sees_her_conversation_with_messages_in_order(
    store: Store, ids: dict[str, int]
) -> None:
    conv_id = _alice_conversation(store, ids["alice"])
    with store.read_sessions() as s:
        conv = convs.get_conversation(s, ids["alice"], conv_id)
        assert conv is not None
        assert (conv.title, conv.created_at, conv.updated_at) == ("Dinner plans", 100.0, 102.0)
        messages = convs.list_messages(s, ids["alice"], conv_id)
        assert [(m.role, m.output_tokens) for m in messages] == [("user", None), ("assistant", 3)]
        assert [c.id for c in convs.list_conversations(s, ids["alice"])] == [conv_id]


def test_bob_cannot_read_alices_conversation(store: Store, ids: dict[str, int]) -> None:
    conv_id = _alice_conversation(store, ids["alice"])
    with store.read_sessions() as s:
        assert convs.get_conversation(s, ids["bob"], conv_id) is None
        assert convs.list_conversations(s, ids["bob"]) == []
        with pytest.raises(NotFound):
            convs.list_messages(s, ids["bob"], conv_id)


def test_bob_cannot_delete_or_write_into_alices_conversation(
    store: Store, ids: dict[str, int]
) -> None:
    conv_id = _alice_conversation(store, ids["alice"])
    with store.sessions.begin() as s:
        with pytest.raises(NotFound):
            convs.delete_conversation(s, ids["bob"], conv_id)
        with pytest.raises(NotFound):
            convs.add_message(s, ids["bob"], conv_id, "user", "hi")
        with pytest.raises(NotFound):
            convs.rename_conversation(s, ids["bob"], conv_id, "mine now")
    with store.read_sessions() as s:
        assert len(convs.list_messages(s, ids["alice"], conv_id)) == 2


def test_someone_elses_conversation_looks_exactly_like_a_missing_one(
    store: Store, ids: dict[str, int]
) -> None:
    conv_id = _alice_conversation(store, ids["alice"])
    with store.sessions() as s:
        with pytest.raises(NotFound) as theirs:
            convs.delete_conversation(s, ids["bob"], conv_id)
        with pytest.raises(NotFound) as missing:
            convs.delete_conversation(s, ids["bob"], conv_id + 1000)
    assert str(theirs.value) == str(missing.value)
    assert str(conv_id) not in str(theirs.value)


def test_alice_deletes_her_conversation_and_its_messages_go_too(
    store: Store, ids: dict[str, int]
) -> None:
    conv_id = _alice_conversation(store, ids["alice"])
    with store.sessions.begin() as s:
        convs.delete_conversation(s, ids["alice"], conv_id)
    with store.read_sessions() as s:
        assert convs.get_conversation(s, ids["alice"], conv_id) is None
        assert s.scalar(select(func.count()).select_from(Message)) == 0


def test_deleting_via_sql_cascades_to_messages(store: Store, ids: dict[str, int]) -> None:
    """The database enforces the cascade itself (foreign keys are on), not only the ORM."""
    conv_id = _alice_conversation(store, ids["alice"])
    with store.sessions.begin() as s:
        s.execute(delete(Conversation))
    with store.read_sessions() as s:
        assert convs.get_conversation(s, ids["alice"], conv_id) is None
        assert s.scalar(select(func.count()).select_from(Message)) == 0


def test_conversations_list_most_recently_updated_first(
    store: Store, ids: dict[str, int]
) -> None:
    alice = ids["alice"]
    with store.sessions.begin() as s:
        first = convs.create_conversation(s, alice, "first", now=1.0)
        second = convs.create_conversation(s, alice, "second", now=2.0)
        convs.add_message(s, alice, first.id, "user", "bump", now=3.0)
    with store.read_sessions() as s:
        assert [c.title for c in convs.list_conversations(s, alice)] == ["first", "second"]
        assert [c.id for c in convs.list_conversations(s, alice, limit=1, offset=1)] == [
            second.id
        ]


def test_unknown_message_role_is_refused(store: Store, ids: dict[str, int]) -> None:
    conv_id = _alice_conversation(store, ids["alice"])
    with store.sessions() as s, pytest.raises(ValueError):
        convs.add_message(s, ids["alice"], conv_id, "narrator", "once upon a time")
