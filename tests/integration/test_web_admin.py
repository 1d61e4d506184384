"""Admin pages (users, roles, classes, weights, quotas) and the API keys page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.service.services import Services
from appliance.store import limits, users
from tests.browser.support import HOSTILE, browser
from tests.gguf_files import ollama_store
from tests.helpers import PASSWORD, LiveServer, live_server, make_settings


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model)) as s:
        yield s


@pytest.fixture()
def policy_changes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(Services, "policy_changed", lambda self: calls.append(1))
    return calls


def test_an_admin_adds_a_user_who_can_then_log_in(server: LiveServer,
                                                   policy_changes: list[int]) -> None:
    with browser(server.url, "alice") as alice:
        r = alice.post("/manage/users", data={"name": "erin", "password": PASSWORD,
                                              "role": "member", "max_class": "background",
                                              "weight": "2"})
        assert r.status_code == 201 and "Added erin." in r.text
        assert r.text.startswith('<div id="users-panel">')
    assert policy_changes == [1]
    with server.store.read_sessions() as s:
        erin = users.get_user_by_name(s, "erin")
        assert erin is not None and (erin.max_class, erin.weight) == ("background", 2.0)
    with browser(server.url, "erin", htmx=False) as erin_session:
        assert erin_session.get("/chat").status_code == 200


def test_a_failed_form_comes_back_with_the_reason_and_the_name_as_text(
        server: LiveServer, policy_changes: list[int]) -> None:
    with browser(server.url, "alice") as alice:
        taken = alice.post("/manage/users", data={"name": "bob", "password": PASSWORD})
        assert taken.status_code == 409 and "already exists" in taken.text
        hostile = alice.post("/manage/users", data={"name": HOSTILE, "password": PASSWORD})
        assert hostile.status_code == 400 and "user name must be" in hostile.text
        assert "<script>window" not in hostile.text and "<img src=x" not in hostile.text
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in hostile.text
        short = alice.post("/manage/users", data={"name": "fred", "password": "x"})
        assert short.status_code == 400 and 'value="fred"' in short.text  # kept as typed
    assert policy_changes == []


def test_role_status_class_weight_and_quotas_change_at_once(
        server: LiveServer, policy_changes: list[int]) -> None:
    carol = server.user_ids["carol"]
    form = {"role": "member", "status": "active", "max_class": "background", "weight": "0.5",
            "tokens_per_day": "1,000", "max_concurrent": "2", "max_prompt_tokens": "",
            "max_output_tokens": "64", "password": ""}
    with browser(server.url, "alice") as alice:
        r = alice.post(f"/manage/users/{carol}", data=form)
        assert r.status_code == 200 and "Saved." in r.text
        assert r.text.startswith(f'<article class="card user-card" id="user-{carol}"')
        assert 'value="1000"' in r.text and 'value="64"' in r.text
        bad = alice.post(f"/manage/users/{carol}", data={**form, "max_concurrent": "-1"})
        assert bad.status_code == 400  # named as the form names it, the typing kept
        assert "Concurrent requests must be a whole number" in bad.text
        assert 'name="max_concurrent" inputmode="numeric" placeholder="unlimited" value="-1"' \
            in bad.text and 'value="64"' in bad.text
    assert policy_changes == [1]
    with server.store.read_sessions() as s:
        u = users.get_user(s, carol)
        assert u is not None and (u.max_class, u.weight) == ("background", 0.5)
        assert limits.get_quota(s, carol) == limits.QuotaLimits(1000, 2, None, 64)
    with server.client("carol") as api:  # the new maximum class holds at once
        r = api.post("/v1/chat/completions", headers={"X-Appliance-Class": "interactive"},
                     json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert r.status_code == 403
    with browser(server.url, "alice") as alice:
        alice.post(f"/manage/users/{carol}", data={
            **form, "max_class": "interactive", "weight": "1", "tokens_per_day": "",
            "max_concurrent": "", "max_output_tokens": ""})
    with server.store.read_sessions() as s:
        assert limits.get_quota(s, carol) == limits.UNLIMITED


def test_disabling_a_user_ends_their_sessions_and_the_last_admin_stays(
        server: LiveServer) -> None:
    bob = server.user_ids["bob"]
    with browser(server.url, "bob", htmx=False) as bob_session, \
            browser(server.url, "alice") as alice:
        assert bob_session.get("/chat").status_code == 200
        r = alice.post(f"/manage/users/{bob}", data={"status": "disabled"})
        assert r.status_code == 200 and "disabled" in r.text
        assert bob_session.get("/chat").status_code == 303  # back to the login page
        alice.post(f"/manage/users/{bob}", data={"status": "active"})
        me = alice.post(f"/manage/users/{server.user_ids['alice']}", data={"role": "member"})
        assert me.status_code == 409 and "only enabled admin" in me.text


def test_a_key_is_shown_once_works_and_can_be_revoked(server: LiveServer) -> None:
    with browser(server.url, "alice") as alice:
        r = alice.post("/keys", data={"user_id": str(server.user_ids["carol"]),
                                      "name": HOSTILE, "max_class": "background"})
        assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
        start = r.text.index('id="new-key">') + len('id="new-key">')
        key = r.text[start:r.text.index("<", start)]
        assert key.startswith("apl_")
        assert "<script>window" not in r.text and "&lt;script&gt;" in r.text
        page = alice.get("/keys").text
        assert key not in page  # never shown again
        prefix = key.split("_")[1]
        with httpx.Client(base_url=server.url,
                          headers={"Authorization": f"Bearer {key}"}) as program:
            assert program.get("/v1/models").status_code == 200
            revoked = alice.post(f"/keys/{prefix}/revoke")
            assert revoked.status_code == 200 and "Revoked" in revoked.text
            assert program.get("/v1/models").status_code == 401


def test_members_manage_only_their_own_keys(server: LiveServer) -> None:
    with browser(server.url, "bob") as bob, server.client("carol") as carol_api:
        carol_key = carol_api.post("/me/keys", json={"name": "carol's laptop"}).json()
        r = bob.post("/keys", data={"name": "mine", "user_id": str(server.user_ids["carol"])})
        assert r.status_code == 201
        page = bob.get("/keys", headers={"hx-request": ""}).text
        assert "carol's laptop" not in page and carol_key["prefix"] not in page
        assert 'name="user_id"' not in page  # no choice of user for members
        assert bob.post(f"/keys/{carol_key['prefix']}/revoke").status_code == 404
        too_high = bob.post("/keys", data={"name": "loud", "max_class": "voice"})
        assert too_high.status_code == 400 and "above the user" in too_high.text
    with server.client("bob") as bob_api:
        names = [k["name"] for k in bob_api.get("/me/keys").json()]
        assert "mine" in names  # made for bob, whatever user_id the form claimed


def test_an_admin_brings_a_model_in_from_the_ollama_store(
        server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Models page: an Ollama model imported from this machine's store (the same import
    as `appliance model import`, in a process of its own) is listed after; what the form
    cannot take gets the reason, as text, and leaves nothing."""
    store = ollama_store(tmp_path / "ollama")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    models = server.daemon.settings.models_dir
    with browser(server.url, "alice") as alice:
        listed = alice.get("/manage/models")
        assert listed.status_code == 200 and "tiny-q8" not in listed.text
        r = alice.post("/manage/models", data={"source": "tiny:q8"})
        assert r.status_code == 201 and "Imported tiny-q8." in r.text
        assert 'aria-label="Serve tiny-q8"' in r.text and "<td>tiny-q8</td>" in r.text
        assert (models / "tiny-q8" / "config.json").is_file()
        again = alice.post("/manage/models", data={"source": "ollama:tiny:q8"})
        assert again.status_code == 200 and "tiny-q8 is here already." in again.text
        missing = alice.post("/manage/models", data={"source": "llama3.2:3b"})
        assert missing.status_code == 404 and "no Ollama model" in missing.text
        for bad in ("mlx-community/Qwen3-4B-4bit", "model.gguf", ""):
            refused = alice.post("/manage/models", data={"source": bad})
            assert refused.status_code == 400 and "the full path of a .gguf file" in refused.text
        hostile = alice.post("/manage/models", data={"source": HOSTILE})
        assert hostile.status_code in (400, 404) and "<script>window" not in hostile.text
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + b"\0" * 64)
        cut = alice.post("/manage/models", data={"source": str(broken)})
        assert cut.status_code == 422 and "Could not import" in cut.text
    assert sorted(p.name for p in models.iterdir()) == ["tiny-q8"]
    with browser(server.url, "bob") as bob:
        assert bob.get("/manage/models").status_code == 403
