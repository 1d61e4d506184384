"""Embeddings from the served model: ``/api/embed``, ``/api/embeddings`` (Ollama) and
``/v1/embeddings`` (OpenAI).

Each input is tokenized here and embedded on the engine thread
(:mod:`appliance.engine.embed`: mean-pooled final hidden states, L2-normalised), a bounded
batch between generation ticks, so embedding a list of documents never stalls the streams
beside it by more than one batch. A text-generation model's pooled states are a usable
similarity signal for a household's notes, not a trained embedding model's quality.

Like every model request they are the caller's: refused over the daily token quota (429),
counted in it (the input tokens), and written to the ledger as ``background`` rows with the
endpoint's path and no output tokens.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from litestar import Request, post
from litestar.datastructures import State

from appliance.api.common import check_model, decode_body
from appliance.api.errors import (
    ApiError,
    bad_request,
    engine_down,
    shutting_down,
    storage_unavailable,
)
from appliance.api.ollama_models import ollama_name, require_model
from appliance.api.ollama_options import parse_keep_alive
from appliance.engine.core import EngineDown, EngineStopping
from appliance.engine.request import new_request_id
from appliance.sched.quota import check_admission
from appliance.service.checks import over_quota, quota_of
from appliance.service.services import Services
from appliance.store.ledger import LedgerRecord
from appliance.vocab import DAY_S, FinishReason, Klass

if TYPE_CHECKING:
    from appliance.api.auth import Principal

MAX_INPUTS = 512
"""Inputs of one request: a bigger list is a 400 (send it in parts)."""


class OllamaEmbedBody(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbeddingsBody(msgspec.Struct, kw_only=True):
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OpenAIEmbedBody(msgspec.Struct, kw_only=True):
    input: Any
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def _rows(services: Services, inputs: list[Any], truncate: bool,
          param: str) -> list[list[int]]:
    """Token rows of the inputs, each cut to the context (``truncate``) or a 400."""
    if not inputs:
        raise bad_request(f"'{param}' must hold at least one input.", param=param)
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"'{param}' holds {len(inputs)} inputs; at most {MAX_INPUTS} a "
                          "request.", param=param)
    limit = services.model.ctx_limit
    rows = []
    for i, item in enumerate(inputs):
        row: list[int] = (list(services.model.tokenizer.encode(item))
                          if isinstance(item, str) else list(item))
        if not row:
            raise bad_request(f"{param}[{i}] is empty.", param=param)
        if any(not 0 <= t < services.model.vocab_size for t in row):
            raise bad_request(f"{param}[{i}]: token ids must be inside the vocabulary.",
                              param=param)
        if len(row) > limit:
            if not truncate:
                raise bad_request(f"{param}[{i}] has {len(row)} tokens; this model reads "
                                  f"at most {limit} (send 'truncate': true to cut it).",
                                  "context_length_exceeded", param)
            row = row[:limit]
        rows.append(row)
    return rows


async def _admit(services: Services, principal: Principal, tokens: int) -> None:
    """The checks a generation gets before it starts: the store can take its ledger row,
    and the owner's daily tokens and classes allow it."""
    if services.writer is not None and (why := services.writer.refusal()) is not None:
        raise storage_unavailable(why)
    quota = await anyio.to_thread.run_sync(quota_of, services.store, principal.user_id)
    now, key = time.time(), str(principal.user_id)
    usage = services.engine.usage
    verdict = check_admission(quota, usage.total(key, now), 0, tokens, 0, Klass.BACKGROUND,
                              principal.klass, now, now - DAY_S, usage.events(key, now))
    if verdict is not None:
        raise over_quota(verdict)


def _account(services: Services, principal: Principal, endpoint: str, tokens: int,
             started: float) -> None:
    """The answered request in the daily usage and the ledger (ids and counts only)."""
    now = time.time()
    services.engine.usage.add(str(principal.user_id), now, tokens)
    if services.writer is None:
        return
    services.writer.submit_ledger(LedgerRecord(
        request_id=new_request_id(), user_id=principal.user_id, api_key_id=principal.key_id,
        klass=Klass.BACKGROUND.label, endpoint=endpoint, model="", prompt_tokens=tokens,
        cached_tokens=0, output_tokens=0, queued_at=started, admitted_at=started,
        first_token_at=None, finished_at=now, finish_reason=FinishReason.STOP))


async def embed_rows(services: Services, principal: Principal, rows: list[list[int]],
                     endpoint: str) -> list[list[float]]:
    """The rows' vectors from the engine thread, admitted and accounted like any model
    request; a client that leaves cancels the rest."""
    started = time.time()
    tokens = sum(len(r) for r in rows)
    await _admit(services, principal, tokens)
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[tuple[list[list[float]] | None, str | None]] = loop.create_future()

    def settle(vectors: list[list[float]] | None, error: str | None) -> None:
        if not answer.done():
            answer.set_result((vectors, error))

    def done(vectors: list[list[float]] | None, error: str | None) -> None:
        loop.call_soon_threadsafe(settle, vectors, error)

    try:
        job = services.engine.embed(rows, done)
    except EngineDown as exc:
        raise engine_down(str(exc)) from None
    except EngineStopping:
        raise shutting_down() from None
    try:
        vectors, error = await answer
    finally:
        job.cancelled.set()  # nothing left to do when it finished; else it stops here
    if vectors is None:
        raise ApiError(500, error or "inference backend error", "server_error",
                       "backend_error")
    _account(services, principal, endpoint, tokens, started)
    return vectors


def _check_dimensions(dimensions: int | None, vectors: list[list[float]]) -> None:
    if dimensions is not None and vectors and dimensions != len(vectors[0]):
        raise bad_request(f"This model's embeddings have {len(vectors[0])} dimensions; "
                          f"'dimensions' {dimensions} is not supported.", param="dimensions")


@post("/api/embed", status_code=200)
async def ollama_embed(request: Request[Any, Any, Any], state: State) -> dict[str, Any]:
    start = time.perf_counter_ns()
    services: Services = state.services
    body: OllamaEmbedBody = decode_body(await request.body(), OllamaEmbedBody)
    require_model(services.model, body.model)
    parse_keep_alive(body.keep_alive)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    rows = _rows(services, inputs, body.truncate, "input")
    vectors = await embed_rows(services, request.user, rows, "/api/embed")
    _check_dimensions(body.dimensions, vectors)
    return {"model": ollama_name(services.model.name), "embeddings": vectors,
            "total_duration": time.perf_counter_ns() - start, "load_duration": 0,
            "prompt_eval_count": sum(len(r) for r in rows)}


@post("/api/embeddings", status_code=200)
async def ollama_embeddings(request: Request[Any, Any, Any], state: State) -> dict[str, Any]:
    """Ollama's older single-prompt form."""
    services: Services = state.services
    body: OllamaEmbeddingsBody = decode_body(await request.body(), OllamaEmbeddingsBody)
    require_model(services.model, body.model)
    parse_keep_alive(body.keep_alive)
    if not body.prompt:  # Ollama answers an empty prompt with an empty embedding
        return {"embedding": []}
    vectors = await embed_rows(services, request.user,
                               _rows(services, [body.prompt], True, "prompt"), "/api/embeddings")
    return {"embedding": vectors[0]}


def _openai_inputs(value: Any) -> list[str] | list[list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, list) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in v) for v in value):
        return value
    raise bad_request("'input' must be a string, a list of strings, a list of token ids or "
                      "a list of lists of token ids.", "invalid_type", "input")


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


@post("/v1/embeddings", status_code=200)
async def openai_embeddings(request: Request[Any, Any, Any], state: State) -> dict[str, Any]:
    services: Services = state.services
    body: OpenAIEmbedBody = decode_body(await request.body(), OpenAIEmbedBody)
    check_model(services, body.model)
    if body.encoding_format not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'.",
                          param="encoding_format")
    rows = _rows(services, _openai_inputs(body.input), False, "input")
    vectors = await embed_rows(services, request.user, rows, "/v1/embeddings")
    _check_dimensions(body.dimensions, vectors)
    tokens = sum(len(r) for r in rows)
    return {"object": "list", "model": services.model.name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


ROUTES = [ollama_embed, ollama_embeddings, openai_embeddings]
