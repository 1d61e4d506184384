"""The Ollama-compatible API on a live loopback server, through the real `ollama` client
(pinned to 0.6.2, as Home Assistant pins it) with a Bearer key, and through raw HTTP for the
wire format and bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from sqlalchemy import select

from appliance.api.ollama import OLLAMA_API_VERSION
from appliance.engine.request import GenerationRequest
from appliance.store.models import LedgerEntry
from tests.gguf_files import ollama_store
from tests.helpers import LiveServer, live_server, make_settings, wait_until

FAULT = 13
"""num_predict that makes the test hook fail the request mid-stream."""

TOOLS = [{"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on/opens a device or entity",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string"}, "area": {"type": "string"}}, "required": []}}}]


def _fault(request: GenerationRequest, phase: str) -> None:
    if request.max_tokens == FAULT and phase == "decode":
        raise RuntimeError("injected fault")


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=1024, default_max_tokens=8),
                     fault=_fault) as s:
        yield s


def _client(server: LiveServer, who: str = "bob") -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization":
                                                   f"Bearer {server.keys[who]}"})


def _ledger_rows(server: LiveServer, who: str, endpoint: str) -> list[LedgerEntry]:
    with server.store.read_sessions() as s:
        return list(s.scalars(select(LedgerEntry).where(
            LedgerEntry.user_id == server.user_ids[who], LedgerEntry.endpoint == endpoint)
            .order_by(LedgerEntry.id)))


def _new_row(server: LiveServer, who: str, endpoint: str, before: int) -> LedgerEntry:
    wait_until(lambda: len(_ledger_rows(server, who, endpoint)) > before, 10, "ledger row")
    return _ledger_rows(server, who, endpoint)[-1]


def test_list_shows_the_served_model_with_the_fields_the_client_validates(
        server: LiveServer) -> None:
    models = _client(server).list().models
    assert [m.model for m in models] == ["tiny:latest"]
    m = models[0]
    assert m.size and m.size > 0 and m.digest and len(m.digest) == 64
    assert m.modified_at is not None
    assert m.details is not None and m.details.family == "llama"
    assert m.details.parameter_size


def test_show_reports_model_info_details_and_capabilities(server: LiveServer) -> None:
    for name in ("tiny", "tiny:latest"):
        shown = _client(server).show(name)
        assert shown.capabilities == ["completion", "tools", "embedding"]
        assert shown.modelinfo is not None
        assert shown.modelinfo["general.architecture"] == "llama"
        assert shown.modelinfo["llama.context_length"] == 1024
        assert shown.details is not None and shown.details.family == "llama"


def test_ps_lists_the_loaded_model(server: LiveServer) -> None:
    running = _client(server).ps().models
    assert [m.model for m in running] == ["tiny:latest"]
    assert running[0].size and running[0].expires_at is not None


def test_pull_of_the_served_model_succeeds_streamed_and_not(server: LiveServer) -> None:
    client = _client(server)
    assert client.pull("tiny").status == "success"
    statuses = [p.status for p in client.pull("tiny:latest", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"


def test_a_member_cannot_pull_another_model(server: LiveServer) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        _client(server).pull("llama3.2")
    assert err.value.status_code == 404
    assert "only an admin" in err.value.error


def test_an_admin_pull_without_network_ends_with_an_error_line(server: LiveServer) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        list(_client(server, "alice").pull("mlx-community/nothing-here", stream=True))
    assert "pull failed" in err.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        _client(server, "alice").pull("mlx-community/too/deep")
    assert bad.value.status_code == 400 and "Hugging Face repo id" in bad.value.error


def test_an_admin_pulls_an_ollama_model_from_this_machines_store(
        server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A household moving from Ollama: ``ollama pull NAME`` imports the model's GGUF from the
    local Ollama store into the models folder, served after a restart with its folder's
    name; a name the store lacks is a 404 naming where it looked; a damaged blob ends the
    stream with an error and leaves nothing behind."""
    store = ollama_store(tmp_path / "ollama")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    folder = server.daemon.settings.models_dir
    admin = _client(server, "alice")
    statuses = [p.status for p in admin.pull("tiny:q8", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "success: restart with --model tiny-q8 to serve it" in statuses
    config = json.loads((folder / "tiny-q8" / "config.json").read_text())
    assert config["model_type"] == "llama"
    # again: already there, not written twice; unstreamed, as `ollama pull` without --stream
    assert admin.pull("ollama:tiny:q8").status == "success"
    with pytest.raises(ollama.ResponseError) as missing:
        admin.pull("llama3.2:3b")
    assert missing.value.status_code == 404 and "no Ollama model 'llama3.2:3b'" in \
        missing.value.error and str(store) in missing.value.error
    with pytest.raises(ollama.ResponseError) as member:
        _client(server).pull("tiny:q8")
    assert member.value.status_code == 404 and "only an admin" in member.value.error
    blob = next((store / "blobs").iterdir())
    blob.write_bytes(blob.read_bytes()[:4096])  # truncated
    (store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "cut").write_text(
        (store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8").read_text())
    with pytest.raises(ollama.ResponseError) as cut:
        list(admin.pull("tiny:cut", stream=True))
    assert "pull failed" in cut.value.error
    assert not (folder / "tiny-cut").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-q8"]


def test_a_streamed_chat_with_tools_like_home_assistant_parses_and_matches_the_ledger(
        server: LiveServer) -> None:
    before = len(_ledger_rows(server, "bob", "/api/chat"))
    chunks = list(_client(server).chat(
        model="tiny:latest", messages=[{"role": "user", "content": "turn on the light"}],
        tools=TOOLS, stream=True, keep_alive=-1, options={"num_ctx": 8192}, think=False))
    assert chunks and all(c.message.role == "assistant" for c in chunks)
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done
    final = chunks[-1]
    assert final.done_reason in ("stop", "length")
    for field in ("total_duration", "load_duration", "prompt_eval_count",
                  "prompt_eval_duration", "eval_count", "eval_duration"):
        assert isinstance(getattr(final, field), int), field
    row = _new_row(server, "bob", "/api/chat", before)
    assert final.prompt_eval_count == row.prompt_tokens
    assert final.eval_count == row.output_tokens
    assert row.klass == "interactive"


def test_a_non_streamed_chat_returns_the_whole_message(server: LiveServer) -> None:
    reply = _client(server).chat(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                 options={"num_predict": 5, "temperature": 0, "seed": 3})
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.eval_count is not None and reply.eval_count <= 5
    assert isinstance(reply.message.content, str)


def test_generate_streams_and_answers_with_context(server: LiveServer) -> None:
    client = _client(server)
    before = len(_ledger_rows(server, "bob", "/api/generate"))
    reply = client.generate(model="tiny", prompt="Once upon a time",
                            options={"num_predict": 4})
    assert reply.done and reply.context and reply.eval_count == len(reply.context) - \
        reply.prompt_eval_count
    row = _new_row(server, "bob", "/api/generate", before)
    assert (reply.prompt_eval_count, reply.eval_count) == (row.prompt_tokens, row.output_tokens)
    parts = list(client.generate(model="tiny", prompt="Once", stream=True,
                                 options={"num_predict": 3}))
    assert parts[-1].done and all(not p.done for p in parts[:-1])
    raw = client.generate(model="tiny", prompt="Once", raw=True, options={"num_predict": 2})
    assert raw.prompt_eval_count == len(server.engine.loaded.tokenizer.encode("Once"))  # type: ignore[attr-defined]


def test_streamed_and_non_streamed_greedy_text_agree(server: LiveServer) -> None:
    args: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "same"}],
                                options={"num_predict": 6, "temperature": 0})
    whole = _client(server).chat(**args).message.content
    parts = "".join(c.message.content or "" for c in _client(server).chat(stream=True, **args))
    assert parts == whole


def test_the_wire_format_is_compact_ndjson_one_object_per_line(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 4}}  # no "stream": streaming is the default
    with server.client("bob") as c, c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        text = r.read().decode()
    assert text.endswith("\n") and "\n\n" not in text
    lines = text.splitlines()
    objs = [json.loads(x) for x in lines]
    assert all(": " not in x.split('"content"')[0] for x in lines)  # compact separators
    assert objs[-1]["done"] is True and all(o["done"] is False for o in objs[:-1])
    assert isinstance(objs[-1]["total_duration"], int)


def test_a_failure_mid_stream_ends_with_an_error_line(server: LiveServer) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        list(_client(server).chat(model="tiny", stream=True, options={"num_predict": FAULT},
                                  messages=[{"role": "user", "content": "x"}]))
    assert "injected fault" in err.value.error or "backend" in err.value.error
    assert _client(server).list().models  # still serving


@pytest.mark.parametrize("keep_alive", [-1, -1.0, 0, 300, "-1s", "300s", "5m", "1h30m",
                                        "-1", None])
def test_every_keep_alive_form_is_accepted(server: LiveServer, keep_alive: Any) -> None:
    body: dict[str, Any] = {"model": "tiny", "stream": False, "options": {"num_predict": 1},
                            "messages": [{"role": "user", "content": "hi"}]}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    r = server.client("bob").post("/api/chat", json=body)
    assert r.status_code == 200, r.text


def test_an_empty_chat_answers_like_a_model_load(server: LiveServer) -> None:
    r = server.client("bob").post("/api/chat", json={"model": "tiny", "messages": []})
    assert r.status_code == 200 and r.json()["done_reason"] == "load"


def test_num_ctx_caps_the_prompt(server: LiveServer) -> None:
    r = server.client("bob").post("/api/chat", json={
        "model": "tiny", "stream": False, "options": {"num_ctx": 8},
        "messages": [{"role": "user", "content": "a long question " * 10}]})
    assert r.status_code == 400 and "maximum context length is 8" in r.json()["error"]


def _post(server: LiveServer, path: str, body: Any, who: str | None = "bob") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.client(who) as c:
        return c.post(path, content=content, headers={"content-type": "application/json"})


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": False}


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/api/chat", {**CHAT, "model": "llama3.2"}, 404, "not found"),
    ("/api/chat", {**CHAT, "model": ""}, 400, "model is required"),
    ("/api/chat", {**CHAT, "messages": "hi"}, 400, "Expected `array`"),
    ("/api/chat", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/api/chat", {**CHAT, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {**CHAT, "options": {"num_predict": "ten"}}, 400, "options.num_predict"),
    ("/api/chat", {**CHAT, "options": {"temperature": 9}}, 400, "temperature"),
    ("/api/chat", {**CHAT, "keep_alive": "banana"}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "keep_alive": [1]}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x",
                                         "images": ["iVBORw0KGgo="]}]}, 400, "text only"),
    ("/api/chat", {**CHAT, "think": True}, 400, "does not support thinking"),
    ("/api/chat", b'{"model": "tiny", "messages": [', 400, "Malformed JSON"),
    ("/api/chat", b"", 400, "empty"),
    ("/api/generate", {"model": "tiny", "prompt": 5}, 400, "Expected `str`"),
    ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "not found"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "images": ["aGk="]}, 400, "text only"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "context": [-4]}, 400, "context"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
    ("/api/show", {"model": 7}, 400, "Expected `str`"),
    ("/api/pull", {"model": "nope"}, 404, "not found"),
    ("/api/pull", [], 400, "Expected `object`"),
])
def test_bad_input_gets_a_clear_4xx_in_ollamas_shape(
        server: LiveServer, path: str, body: Any, status: int, fragment: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error"} and isinstance(err["error"], str)
    assert fragment in err["error"], err


def test_a_ten_megabyte_body_is_refused_and_the_daemon_keeps_serving(
        server: LiveServer) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}'
    for path in ("/api/chat", "/api/generate", "/api/show", "/api/pull"):
        r = _post(server, path, big)
        assert r.status_code == 413 and isinstance(r.json()["error"], str)
    assert _client(server).list().models


def test_keys_only_on_api(server: LiveServer) -> None:
    r = _post(server, "/api/tags", b"", who=None)
    assert r.status_code in (401, 405)
    r = httpx.get(server.url + "/api/tags")
    assert r.status_code == 401 and "API key" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=server.url, headers={"Authorization": "Bearer apl_bad"}).list()
    assert err.value.status_code == 401


def test_head_and_version_answer(server: LiveServer) -> None:
    with server.client("bob") as c:
        assert c.head("/api/tags").status_code == 200
        assert c.head("/api/version").status_code == 200
        assert c.get("/api/version").json()["version"].count(".") == 2


def test_version_answers_without_a_key_as_ollamas_does(server: LiveServer) -> None:
    assert httpx.get(server.url + "/api/version").json()["version"] == OLLAMA_API_VERSION
    assert httpx.head(server.url + "/api/version").status_code == 200
    assert httpx.get(server.url + "/api/tags").status_code == 401  # the rest still need one


def test_the_root_says_ollama_is_running_to_api_clients_only(server: LiveServer) -> None:
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    with server.client("bob") as c:
        assert c.get("/").text == "Ollama is running"
        assert c.head("/").status_code == 200
    bad = httpx.get(server.url + "/", headers={"Authorization": "Bearer apl_nope"})
    assert bad.status_code == 401
    browser = httpx.get(server.url + "/", headers={"Accept": "text/html,*/*"})
    assert browser.status_code == 303 and browser.headers["location"] in ("/login", "/chat")


def test_quota_ends_an_answer_with_quota_then_gets_429_with_retry_after(
        server: LiveServer) -> None:
    with server.client("alice") as alice:
        r = alice.put(f"/admin/users/{server.user_ids['carol']}/quota",
                      json={"tokens_per_day": 40})
        assert r.status_code == 200, r.text
    ban = {"num_predict": 200, "stop": None}
    try:
        first = _post(server, "/api/chat", {**CHAT, "options": ban}, who="carol")
        assert first.status_code == 200, first.text
        assert first.json()["done_reason"] in ("quota", "stop")
        r = _post(server, "/api/chat", {**CHAT, "options": {"num_predict": 50}}, who="carol")
        assert r.status_code == 429, r.text
        assert "quota" in r.json()["error"].lower() and int(r.headers["retry-after"]) > 0
    finally:
        with server.client("alice") as alice:
            alice.put(f"/admin/users/{server.user_ids['carol']}/quota",
                      json={"tokens_per_day": None})


def test_num_ctx_without_num_predict_keeps_the_servers_default_length(
        server: LiveServer) -> None:
    reply = _client(server).chat(model="tiny", options={"num_ctx": 8192},
                                 messages=[{"role": "user", "content": "hi"}])
    assert reply.eval_count is not None and reply.eval_count <= 8  # default_max_tokens


def _cache_entries(server: LiveServer) -> int:
    with server.client("bob") as c:
        return int(c.get("/v1/cache/stats").json()["entries"])


def test_keep_alive_zero_releases_my_prompt_cache_and_the_model_stays(
        server: LiveServer) -> None:
    with server.client("alice") as alice:
        dave = alice.post("/admin/users", json={"name": "dave", "password": "longenough1"})
        assert dave.status_code == 201, dave.text
        key = alice.post(f"/admin/users/{dave.json()['id']}/keys", json={"name": "d"}).json()
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {key['key']}"})
    chat: dict[str, Any] = dict(model="tiny", options={"num_predict": 3},
                                messages=[{"role": "user", "content": "remember the kettle"}])
    client.chat(keep_alive="5m", **chat)
    with_mine = _cache_entries(server)
    # `ollama stop`: an empty request with keep_alive 0; the model stays, my cache goes
    stopped = client.generate(model="tiny", keep_alive=0)
    assert stopped.done_reason == "unload"
    wait_until(lambda: _cache_entries(server) == with_mine - 1, 10, "dave's entry released")
    client.chat(keep_alive=0, **chat)  # answered, and its KV not kept
    assert _cache_entries(server) == with_mine - 1
    running = client.ps().models
    assert [m.model for m in running] == ["tiny:latest"]
    assert running[0].expires_at is not None and running[0].expires_at.year > 2100


def test_a_long_history_is_cut_from_the_front_as_ollama_does(server: LiveServer) -> None:
    tokenizer = server.engine.loaded.tokenizer  # type: ignore[attr-defined]
    system = {"role": "system", "content": "You control the house."}
    last = {"role": "user", "content": "turn on the light"}
    history = [{"role": role, "content": f"turn {i} said some words about the garden"}
               for i in range(40) for role in ("user", "assistant")]
    messages = [system, *history, last]
    kept = len(tokenizer.apply_chat_template([system, last], add_generation_prompt=True))
    whole = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert whole > 300
    for stream in (False, True):
        reply = _client(server).chat(model="tiny", messages=messages, stream=stream,
                                     options={"num_ctx": 300, "num_predict": 4})
        final = reply if not stream else list(reply)[-1]  # type: ignore[call-overload]
        assert final.done
        # what was read: the system prompt, the question and the newest turns that fit
        assert kept < final.prompt_eval_count <= 300 - 4
    # a history whose users' text alone could never fit: only the question must
    long_turns = [{"role": role, "content": "garden " * 400} for _ in range(20)
                  for role in ("user", "assistant")]
    assert sum(len(t["content"]) for t in long_turns) // 2 // max(
        1, server.services.model.max_token_chars) >= server.services.model.ctx_limit
    cut = _client(server).chat(model="tiny", messages=[system, *long_turns, last],
                               options={"num_predict": 4})
    assert cut.done and cut.prompt_eval_count is not None and cut.prompt_eval_count < 1024
    generated = _client(server).generate(model="tiny", prompt="and then", context=[5] * 400,
                                         options={"num_ctx": 300, "num_predict": 4})
    assert generated.prompt_eval_count <= 296 and generated.done
    with pytest.raises(ollama.ResponseError) as err:  # the question alone does not fit
        _client(server).chat(model="tiny", options={"num_ctx": 20},
                             messages=[system, *history, {"role": "user", "content": "x " * 50}])
    assert err.value.status_code == 400 and "maximum context length is 20" in err.value.error
