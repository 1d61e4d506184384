"""Shared by the web UI's integration and browser tests: sessions, slow requests, parsing."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from appliance.engine.core import Engine
from appliance.engine.request import GenerationRequest, RequestHandle, SamplingParams
from appliance.vocab import Klass
from tests.helpers import PASSWORD, LiveServer

SLOW_USERS = frozenset({"bob"})
"""Requests of these users decode at most one token per SLOW_TOKEN_S (the fault hook)."""
SLOW_TOKEN_S = 0.04
SLOW_MAX_TOKENS = 99_999
"""A request with this max_tokens is slowed too, whoever sends it."""
FAILING_MAX_TOKENS = 13
"""A request with this max_tokens fails in the engine (an injected backend error)."""


def slow_fault(request: GenerationRequest, phase: str) -> None:
    """Test hook: keep some requests running long enough to watch, without timing luck;
    make others fail as a broken model would."""
    if phase == "decode" and request.max_tokens == FAILING_MAX_TOKENS:
        raise RuntimeError("injected fault")
    if phase == "decode" and (request.user in SLOW_USERS
                              or request.max_tokens == SLOW_MAX_TOKENS):
        time.sleep(SLOW_TOKEN_S)


def slow_request(engine: Engine, user: str, user_id: int,
                 klass: Klass = Klass.INTERACTIVE) -> RequestHandle:
    """A request that keeps a slot busy until cancelled: slowed by the hook, EOS banned."""
    eos = getattr(engine.loaded, "eos_token_ids", ()) or ()
    request = GenerationRequest(
        prompt=tuple(range(5, 40)), max_tokens=SLOW_MAX_TOKENS, user=user, user_id=user_id,
        klass=klass, sampling=SamplingParams(logit_bias=tuple((int(t), -100.0) for t in eos)))
    return engine.submit(request, lambda event: None)


@contextmanager
def browser(url: str, name: str | None = None, password: str = PASSWORD,
            htmx: bool = True) -> Iterator[httpx.Client]:
    """A cookie session like a browser's (logged in as ``name``), sending the CSRF header
    (and ``HX-Request`` when ``htmx``) as the page's htmx requests do."""
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/login")
        token = client.cookies.get("csrftoken") or ""
        if name is not None:
            r = client.post("/login", data={"name": name, "password": password,
                                            "_csrf_token": token})
            assert r.status_code == 303, r.text
        client.headers["x-csrftoken"] = token
        if htmx:
            client.headers["hx-request"] = "true"
        yield client


def stream_id(html: str) -> str:
    found = re.search(r'sse-connect="/chat/streams/([\w-]+)"', html)
    assert found, html
    return found.group(1)


def sse_events(body: str) -> list[tuple[str, str]]:
    """(event, data) pairs of an SSE body; multi-line data joined with newlines."""
    out = []
    for block in body.split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data:"):
                data.append(line[6:] if line.startswith("data: ") else line[5:])
        if data:
            out.append((name, "\n".join(data)))
    return out


HOSTILE = '<script>window.__pwned=1</script>"><img src=x onerror="window.__pwned=2">'
"""Markup that would run script if any page let it through unescaped."""


def add_conversation(server: LiveServer, who: str, title: str,
                     turns: list[tuple[str, str]]) -> int:
    """A conversation of ``who``'s with these (role, text) turns, made through the API."""
    with server.client(who) as api:
        cid = int(api.post("/conversations", json={"title": title}).json()["id"])
        for role, text in turns:
            r = api.post(f"/conversations/{cid}/messages", json={"role": role, "content": text})
            assert r.status_code == 201, r.text
    return cid
