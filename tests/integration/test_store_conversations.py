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


# ---- branches (issue 54) ----
def test_editing_an_earlier_question_keeps_the_old_branch_with_its_later_turns(
        store: Store, ids: dict[str, int]) -> None:
    from appliance.store import branches, versions
    alice = ids["alice"]
    with store.sessions.begin() as s:
        cid = convs.create_conversation(s, alice, "Soup", auto_title=True).id
        q1 = convs.add_message(s, alice, cid, "user", "Soup for four?").id
        convs.add_message(s, alice, cid, "assistant", "Leek soup.")
        q2 = convs.add_message(s, alice, cid, "user", "And bread?").id
        a2 = convs.add_message(s, alice, cid, "assistant", "Soda bread.").id
        versions.rewrite_answer(s, alice, cid, a2, "Rye bread.", keep_old=True,
                                finish_reason=None)
        edited = branches.edit_question(s, alice, cid, q1, "Soup for six?").id
        convs.add_message(s, alice, cid, "assistant", "Pea soup.")
    with store.read_sessions() as s:
        path = convs.list_messages(s, alice, cid)
        assert [m.content for m in path] == ["Soup for six?", "Pea soup."]
        assert branches.places(s, path) == {edited: versions.Place(2, 2)}
        assert len(convs.all_messages(s, alice, cid)) == 6  # nothing was deleted
        conv = convs.get_conversation(s, alice, cid)
        assert conv is not None and conv.title == "Soup for six?"
    with store.sessions.begin() as s:
        assert branches.show_branch(s, alice, cid, edited, 1) == versions.Place(1, 2)
    with store.read_sessions() as s:
        path = convs.list_messages(s, alice, cid)
        assert [m.id for m in path][0] == q1 and path[2].id == q2
        assert [m.content for m in path] == ["Soup for four?", "Leek soup.", "And bread?",
                                             "Rye bread."]
        assert versions.places(s, cid)[a2] == versions.Place(2, 2)  # its versions too
        conv = convs.get_conversation(s, alice, cid)
        assert conv is not None and conv.title == "Soup for four?"


def test_a_generated_title_follows_its_branch_and_a_given_name_stays(
        store: Store, ids: dict[str, int]) -> None:
    from appliance.store import branches
    alice = ids["alice"]
    with store.sessions.begin() as s:
        cid = convs.create_conversation(s, alice, "Soup", auto_title=True).id
        q1 = convs.add_message(s, alice, cid, "user", "Soup for four?").id
        assert branches.set_title(s, alice, cid, q1, " Leek soup\nfor four ")
        q1b = branches.edit_question(s, alice, cid, q1, "Bread?").id
        conv = convs.get_conversation(s, alice, cid)
        assert conv is not None and conv.title == "Bread?"
        branches.show_branch(s, alice, cid, q1b, 1)
        assert conv.title == "Leek soup for four"
        convs.rename_conversation(s, alice, cid, "Kitchen")
        branches.show_branch(s, alice, cid, q1b, 2)
        assert conv.title == "Kitchen"


def test_a_question_cut_into_a_title_ends_on_a_word_with_an_ellipsis() -> None:
    long = "How long should I boil potatoes for a creamy mash that keeps its shape well"
    cut = convs.cut_title(long)
    assert cut == "How long should I boil potatoes for a creamy mash that keeps…"
    assert len(cut) <= convs.CUT_TITLE_CHARS + 1
    assert convs.cut_title("  Short\n question ") == "Short question"
    assert convs.cut_title("x" * 80) == "x" * 60 + "…"


def test_a_search_snippet_shows_the_words_around_the_match() -> None:
    text = ("We talked about many things first. " * 3 + "The measuring jug is in the "
            "left cupboard, behind the flour. " + "Then other things. " * 4)
    before, match, after = convs.snippet(text, "MEASURING  jug") or ("", "", "")
    assert match == "measuring jug"
    assert before.startswith("…") and before.endswith("The ")
    assert after.startswith(" is in the left cupboard") and after.endswith("…")
    assert convs.snippet("short one", "one") == ("short ", "one", "")
    assert convs.snippet("short one", "two") is None
