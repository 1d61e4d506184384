"""Issue 37, item 12: what the API used to accept leniently is a 400 naming the field.

Through a real server on loopback (``build_daemon`` as ``appliance serve`` assembles it).
Personas: alice (admin), bob and carol (members).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import LiveServer, live_server, make_settings


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=256, default_max_tokens=2)) as s:
        yield s


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    return str(body["error"]["message"])


@pytest.mark.parametrize("body,param", [({"weight": "1"}, "weight"),
                                        ({"disabled": "true"}, "disabled"),
                                        ({"disabled": 1}, "disabled")])
def test_a_user_patch_with_a_string_for_a_number_or_flag_is_refused(
        server: LiveServer, body: dict[str, Any], param: str) -> None:
    uid = server.user_ids["carol"]
    with server.client("alice") as alice:
        before = next(u for u in alice.get("/admin/users").json() if u["id"] == uid)
        refused(alice.patch(f"/admin/users/{uid}", json=body), param)
        after = next(u for u in alice.get("/admin/users").json() if u["id"] == uid)
        assert after == before
        # the right types still work
        r = alice.patch(f"/admin/users/{uid}", json={"weight": 1.0, "disabled": False})
        assert r.status_code == 200 and r.json()["weight"] == 1.0


def test_a_new_user_with_a_string_weight_is_refused(server: LiveServer) -> None:
    with server.client("alice") as alice:
        refused(alice.post("/admin/users", json={"name": "dora", "password": "x" * 12,
                                                 "weight": "2"}), "weight")
        assert "dora" not in {u["name"] for u in alice.get("/admin/users").json()}


def test_a_tool_message_without_its_call_id_is_refused(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "lights?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "lights", "arguments": "{}"}}]},
                {"role": "tool", "content": "on"}]
    with server.client("bob") as bob:
        message = refused(bob.post("/v1/chat/completions", json={"messages": messages}),
                          "messages[2].tool_call_id")
        assert "tool_call_id" in message


@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"})])
def test_best_of_above_one_is_refused(server: LiveServer, path: str,
                                      extra: dict[str, Any]) -> None:
    with server.client("bob") as bob:
        refused(bob.post(path, json={**extra, "best_of": 3}), "best_of")
        assert bob.post(path, json={**extra, "best_of": 1}).status_code == 200


def test_audio_modalities_are_refused(server: LiveServer) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with server.client("bob") as bob:
        refused(bob.post("/v1/chat/completions", json={**chat, "modalities": ["text", "audio"]}),
                "modalities")
        r = bob.post("/v1/chat/completions", json={**chat, "modalities": ["text"]})
        assert r.status_code == 200


def test_a_body_of_the_wrong_type_names_its_field(server: LiveServer) -> None:
    with server.client("bob") as bob:
        refused(bob.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]}),
                "messages[0].role")
        refused(bob.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}), "max_tokens")
