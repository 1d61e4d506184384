"""The OpenAI-compatible API on a live loopback server, through the real `openai` client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from appliance.engine.request import GenerationRequest
from tests.helpers import LiveServer, live_server, make_settings, wait_until

SLOW = 99_999
"""max_tokens that marks a request the test hook slows to 50 ms a token (it stays running)."""


def _fault(request: GenerationRequest, phase: str) -> None:
    if request.max_tokens == 13 and phase == "decode":
        raise RuntimeError("injected fault")
    if request.max_tokens == SLOW:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=1024), fault=_fault) as s:
        yield s


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["bob"], max_retries=0)


def _ban_eos(server: LiveServer) -> dict[str, float]:
    return {str(t): -100.0 for t in server.engine.loaded.eos_token_ids}  # type: ignore[attr-defined]


def test_it_streams_a_chat_completion_with_a_final_usage_chunk(
        client: openai.OpenAI, server: LiveServer) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}, logit_bias=_ban_eos(server))
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + 8


def test_a_non_streaming_chat_returns_the_answer_and_usage(
        client: openai.OpenAI, server: LiveServer) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}],
        max_tokens=6, logit_bias=_ban_eos(server))
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens > 5


def test_streamed_and_non_streamed_greedy_text_agree(
        client: openai.OpenAI, server: LiveServer) -> None:
    args = dict(model="tiny", messages=[{"role": "user", "content": "same"}], max_tokens=10,
                temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message.content  # type: ignore[call-overload]
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(stream=True, **args) if c.choices]  # type: ignore[call-overload]
    assert "".join(parts) == whole


def test_text_completions_work(client: openai.OpenAI, server: LiveServer) -> None:
    reply = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4,
                                      logit_bias=_ban_eos(server))
    assert reply.object == "text_completion"
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_models_retrieve_gets_the_served_model_and_a_404_for_another(
        client: openai.OpenAI) -> None:
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "appliance")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-17")
    assert err.value.code == "model_not_found"
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "model"


def test_a_bad_key_is_invalid_api_key_as_openai_says_it(server: LiveServer) -> None:
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="apl_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401
    assert err.value.code == "invalid_api_key" and err.value.type == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens"),
    (b'{"messages": [{"role": 5, "content": "x"}]}', "messages[0].role"),
    (b'{"model": "tiny"}', "messages"),
])
def test_a_wrong_type_names_the_field_in_param(server: LiveServer, body: bytes,
                                               param: str) -> None:
    r = server.client("bob").post("/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_unknown_model_gets_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"


def test_a_prompt_over_the_context_gets_400_with_the_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 1500}])
    assert err.value.code == "context_length_exceeded"
    assert "1024" in err.value.message


@pytest.mark.parametrize("body, fragment", [
    (b'{"messages": [', "Malformed JSON"),
    (b"", "empty"),
    (b'{"messages": "hi"}', "Expected `array`"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n=1"),
    (b'{"messages": []}', "at least one message"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"zz": 1}}',
     "token ids"),
])
def test_bad_input_gets_a_clear_400(server: LiveServer, body: bytes, fragment: str) -> None:
    r = server.client("bob").post("/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert fragment in err["message"]
    assert err["type"] == "invalid_request_error"


def test_an_injected_error_ends_only_that_request(client: openai.OpenAI,
                                                  server: LiveServer) -> None:
    import concurrent.futures as cf

    def ask(max_tokens: int) -> object:
        try:
            return client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}],
                max_tokens=max_tokens, logit_bias=_ban_eos(server)).usage
        except openai.InternalServerError as exc:
            return exc

    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(ask, [20, 13, 20]))
    assert isinstance(results[1], openai.InternalServerError)
    assert "inference backend error" in results[1].message
    assert results[0].completion_tokens == 20  # type: ignore[union-attr]
    assert results[2].completion_tokens == 20  # type: ignore[union-attr]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # no auth needed


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server: LiveServer) -> None:
    before = server.engine.snapshot.cancelled_total
    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": SLOW,
            "stream": True, "logit_bias": _ban_eos(server)}
    with server.client("alice") as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
            wait_until(lambda: c.get("/slots").json()["active"] == 1, what="slot busy")
        # the connection is closed here; the next tick frees the slot and its KV
        wait_until(lambda: c.get("/slots").json()["active"] == 0, what="slot freed")
        assert c.get("/slots").json()["kv_bytes"] == 0
    assert server.engine.snapshot.cancelled_total == before + 1


def test_health_and_slots_report_batch_figures(server: LiveServer) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert {"active", "queued", "completed", "max_batch_size"} <= set(health)
    slots = server.client("alice").get("/slots").json()
    assert slots["max_batch_size"] == 8


def test_a_full_queue_answers_503_with_retry_after(tiny_model: Path) -> None:
    settings = make_settings(tiny_model, max_batch_size=1, max_queue_depth=1)
    with live_server(settings, fault=_fault) as s, s.client("alice") as c:
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": SLOW,
                "stream": True, "logit_bias": _ban_eos(s)}
        with c.stream("POST", "/v1/chat/completions", json=body) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)
            wait_until(lambda: c.get("/health").json()["active"] == 1, what="first running")
            with s.client("bob") as c2, \
                    c2.stream("POST", "/v1/chat/completions", json=body) as second:
                wait_until(lambda: c.get("/health").json()["queued"] == 1, what="one queued")
                third = c.post("/v1/chat/completions", json={**body, "stream": False})
                assert third.status_code == 503
                assert third.headers["retry-after"].isdigit()
                assert third.json() == {"error": {
                    "message": "Server is busy. Retry later.", "type": "overloaded",
                    "param": None, "code": "overloaded"}}
                assert second.status_code == 200
        wait_until(lambda: c.get("/health").json()["active"] == 0, what="all cancelled")


def test_sse_frames_are_well_formed(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with server.client("bob") as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream"), r.read()
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    for f in frames[:-1]:
        assert json.loads(f)["object"] == "chat.completion.chunk"


def test_metrics_are_prometheus_text_with_engine_figures(server: LiveServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with server.client("bob") as bob:
        bob.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "m"}], "max_tokens": 3})
    with server.client("alice") as alice:
        r = alice.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["appliance_generated_tokens"].samples[0].value >= 3
    assert "appliance_active_sequences" in families
    assert families["appliance_engine_mixed_forwards"].samples[0].value >= 0
    users = {s.labels["user_id"] for s in families["appliance_user_virtual_tokens"].samples}
    assert str(server.user_ids["bob"]) in users


def test_chats_sent_at_once_answer_as_they_do_alone(client: openai.OpenAI,
                                                    server: LiveServer) -> None:
    """Requests arriving together while nothing decodes are read in one forward straight
    into the decode batch's slots (appliance/engine/slots.py); greedy, each gets the answer
    it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    questions = ["What is a kettle?", "Name three rivers, please.", "Why is the sky blue?"]

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": question}], max_tokens=12,
            temperature=0, logit_bias=_ban_eos(server))
        return reply.choices[0].message.content or ""

    alone = [ask(q) for q in questions]
    server.engine.wait_idle(30)
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(ask, questions))
    assert together == alone
