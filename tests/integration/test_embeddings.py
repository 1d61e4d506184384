"""Embeddings through the real ``ollama`` (0.6.2) and ``openai`` clients on a live server."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest
from sqlalchemy import select

from appliance.store.models import LedgerEntry
from tests.helpers import LiveServer, live_server, make_settings, wait_until

TEXTS = ["turn on the kitchen light", "the garden needs water", "turn on the kitchen light"]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(make_settings(tiny_model, ctx_size=256)) as s:
        yield s


def _ollama(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization":
                                                   f"Bearer {server.keys['bob']}"})


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["bob"],
                         max_retries=0)


def _close(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_ollama_embed_returns_one_unit_vector_per_input(server: LiveServer) -> None:
    reply = _ollama(server).embed(model="tiny", input=TEXTS)
    vectors = [list(v) for v in reply.embeddings]
    assert len(vectors) == 3 and len({len(v) for v in vectors}) == 1
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)
    assert _close(vectors[0], vectors[2]) and not _close(vectors[0], vectors[1])
    assert reply.prompt_eval_count and reply.prompt_eval_count > 3
    single = _ollama(server).embed(model="tiny:latest", input=TEXTS[1]).embeddings
    assert _close(list(single[0]), vectors[1])  # the same alone as in a batch
    legacy = _ollama(server).embeddings(model="tiny", prompt=TEXTS[1]).embedding
    assert _close(list(legacy), vectors[1])


def test_openai_embeddings_agree_in_float_and_base64(server: LiveServer) -> None:
    ours = _ollama(server).embed(model="tiny", input=TEXTS).embeddings
    for fmt in ("float", "base64"):
        reply = _openai(server).embeddings.create(model="tiny", input=TEXTS,
                                                  encoding_format=fmt)  # type: ignore[arg-type]
        assert [d.index for d in reply.data] == [0, 1, 2]
        for d, v in zip(reply.data, ours, strict=True):
            got: object = d.embedding
            if isinstance(got, str):  # asked for base64 itself: the client leaves it so
                raw = base64.b64decode(got)
                got = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            assert isinstance(got, list) and _close(got, list(v))
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 3
    default = _openai(server).embeddings.create(model="tiny", input="the garden needs water")
    assert _close(list(default.data[0].embedding), list(ours[1]))


def test_show_lists_the_embedding_capability(server: LiveServer) -> None:
    assert "embedding" in (_ollama(server).show("tiny").capabilities or [])


def test_too_long_inputs_are_cut_on_ollama_and_refused_on_v1(server: LiveServer) -> None:
    long = "word " * 400
    assert len(_ollama(server).embed(model="tiny", input=long).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as err:
        _ollama(server).embed(model="tiny", input=long, truncate=False)
    assert err.value.status_code == 400 and "truncate" in err.value.error
    with pytest.raises(openai.BadRequestError) as bad:
        _openai(server).embeddings.create(model="tiny", input=long)
    assert bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        _openai(server).embeddings.create(model="gpt-17", input="x")
    with pytest.raises(openai.BadRequestError) as dims:
        _openai(server).embeddings.create(model="tiny", input="x", dimensions=3)
    assert dims.value.param == "dimensions"


def test_embeddings_are_served_while_the_engine_generates(server: LiveServer) -> None:
    def chat() -> str:
        reply = _ollama(server).chat(model="tiny", options={"num_predict": 40},
                                     messages=[{"role": "user", "content": "tell me more"}])
        return reply.message.content or ""

    with cf.ThreadPoolExecutor(2) as pool:
        talking = pool.submit(chat)
        vectors = pool.submit(lambda: _ollama(server).embed(model="tiny", input=TEXTS * 8))
        assert len(vectors.result(timeout=60).embeddings) == 24
        assert isinstance(talking.result(timeout=60), str)


def _rows(server: LiveServer, endpoint: str) -> list[LedgerEntry]:
    with server.store.read_sessions() as s:
        return list(s.scalars(select(LedgerEntry).where(LedgerEntry.endpoint == endpoint)))


def test_embeddings_are_in_the_ledger_and_the_daily_quota(server: LiveServer) -> None:
    server.writer.flush()
    before = {r.id for r in _rows(server, "/api/embed")}
    reply = _ollama(server).embed(model="tiny", input=TEXTS)
    server.writer.flush()
    wait_until(lambda: len(_rows(server, "/api/embed")) > len(before), 10, "the ledger row")
    [row] = [r for r in _rows(server, "/api/embed") if r.id not in before]
    assert (row.user_id, row.klass, row.prompt_tokens, row.output_tokens) == (
        server.user_ids["bob"], "background", reply.prompt_eval_count, 0)
    with server.client("alice") as alice:
        carol = server.user_ids["carol"]
        assert alice.put(f"/admin/users/{carol}/quota",
                         json={"tokens_per_day": 5}).status_code == 200
        try:
            poor = openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys["carol"],
                                 max_retries=0)
            with pytest.raises(openai.RateLimitError):
                poor.embeddings.create(model="tiny", input="the garden needs water today")
        finally:
            alice.put(f"/admin/users/{carol}/quota", json={"tokens_per_day": None})
