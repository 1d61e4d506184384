"""A long embedding rides the engine's ticks (issue 52, D14): other streams keep streaming
while it is read, a client that leaves cancels it, and a too long input is refused in the
route's own words, before any tokenizer time."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from appliance.store.models import LedgerEntry
from tests.helpers import LiveServer, live_server, make_settings, wait_until

LONG = 1000
"""Tokens of the long input (token ids, so the count does not depend on the tokenizer)."""


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(demo_model, ctx_size=2048)) as s:
        yield s


def _ids(n: int, seed: int = 0) -> list[int]:
    return [(i * 37 + seed) % 4000 + 3 for i in range(n)]


def _stream(server: LiveServer, stamps: list[float], stop: threading.Event) -> None:
    """Carol's chat stream (EOS banned), each token's arrival time in ``stamps``."""
    ban = {str(t): -100.0 for t in server.engine.loaded.eos_token_ids}  # type: ignore[union-attr]
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "stream": True,
            "max_tokens": 2000, "logit_bias": ban}
    with server.client("carol") as c, c.stream("POST", "/v1/chat/completions",
                                               json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.monotonic())
            if stop.is_set():
                return


def _ledger(server: LiveServer, endpoint: str) -> list[LedgerEntry]:
    server.writer.flush()
    with server.store.read_sessions() as s:
        return list(s.scalars(select(LedgerEntry).where(LedgerEntry.endpoint == endpoint)))


def test_a_too_long_input_is_refused_in_each_routes_words(server: LiveServer) -> None:
    """First in the module: nobody else is present yet, so the cut input is read in the
    pieces of someone alone (later, carol's stream makes it patient work: smaller pieces)."""
    huge = "word " * 80_000  # 400 kB: refused by the cheap bound, never tokenised
    with server.client("bob") as c:
        openai = c.post("/v1/embeddings", json={"input": huge})
        assert openai.status_code == 400
        error = openai.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "input"
        limit = server.services.model.ctx_limit
        assert "truncate" not in error["message"] and str(limit) in error["message"]
        ids = c.post("/v1/embeddings", json={"input": _ids(limit + 1)}).json()["error"]
        assert ids["code"] == "context_length_exceeded" and "truncate" not in ids["message"]
        model = server.services.model.name
        ollama = c.post("/api/embed", json={"model": model, "input": huge, "truncate": False})
        assert ollama.status_code == 400 and "truncate" in ollama.json()["error"]
        cut = c.post("/api/embed", json={"model": model, "input": huge}, timeout=300)
        assert cut.status_code == 200, cut.text
        assert cut.json()["prompt_eval_count"] == server.services.model.ctx_limit


def test_a_long_embedding_is_read_in_pieces_while_another_stream_streams(
        server: LiveServer) -> None:
    stamps: list[float] = []
    stop = threading.Event()
    talker = threading.Thread(target=_stream, args=(server, stamps, stop), daemon=True)
    talker.start()
    try:
        wait_until(lambda: len(stamps) >= 5, 60, "carol's stream")
        pieces_before = len(server.engine.embed_log())
        with server.client("bob") as c:
            began = time.monotonic()
            reply = c.post("/v1/embeddings", json={"input": _ids(LONG)}, timeout=300)
            ended = time.monotonic()
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == LONG
        assert len(reply.json()["data"][0]["embedding"]) == 160
        # the stream outlived the embedding: every piece was read beside it
        wait_until(lambda: stamps[-1] > ended, 30, "carol's stream after the embedding")
    finally:
        stop.set()
    pieces = server.engine.embed_log()[pieces_before:]
    assert sum(n for _, n in pieces) == LONG and len(pieces) >= 3
    # the stream got ticks between the pieces: never two pieces without a tick between
    ticks = [t for t, _ in pieces]
    assert all(b > a for a, b in zip(ticks, ticks[1:], strict=False)), ticks
    during = [t for t in stamps if began <= t <= ended]
    assert len(during) >= len(pieces) - 2, (len(during), len(pieces))
    talker.join(30)


def test_a_client_that_leaves_cancels_its_embedding(server: LiveServer) -> None:
    cancelled = server.engine.embeddings_cancelled
    pieces = len(server.engine.embed_log())
    before = {r.request_id for r in _ledger(server, "/v1/embeddings")}
    body = json.dumps({"input": [_ids(LONG, k) for k in range(8)]}).encode()
    url = httpx.URL(server.url)
    sock = socket.create_connection((url.host, url.port))
    try:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + server.keys["bob"].encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: len(server.engine.embed_log()) > pieces + 1, 120,
                   "the engine reading the embedding")
    finally:
        sock.close()
    wait_until(lambda: server.engine.embeddings_cancelled > cancelled, 30, "the cancel")

    def new_rows() -> list[LedgerEntry]:
        return [r for r in _ledger(server, "/v1/embeddings") if r.request_id not in before]

    wait_until(lambda: bool(new_rows()), 10, "the ledger row")
    [row] = new_rows()
    assert row.finish_reason == "cancelled" and row.output_tokens == 0
    assert 0 < row.prompt_tokens < 8 * LONG  # what the engine read before the client left
    with server.client("alice") as admin:
        metrics = admin.get("/metrics").text
    assert f"appliance_embeddings_cancelled_total {float(cancelled + 1)}" in metrics
