"""Embeddings from the served model: ``/api/embed``, ``/api/embeddings`` (Ollama) and
``/v1/embeddings`` (OpenAI).

The wire only: inputs are counted, tokenised, admitted, read and recorded by the service
(appliance/service/embeddings.py): mean-pooled final hidden states, L2-normalised, read by
the engine in pieces after its ticks like a prompt, so a long input never stalls the streams
beside it, and a client that leaves cancels the rest. A text-generation model's pooled
states are a usable similarity signal for a household's notes, not a trained embedding
model's quality.

Like every model request they are the caller's: refused over the daily token quota (429),
counted in it (the input tokens), and written to the ledger as ``background`` rows with the
endpoint's path and no output tokens (``cancelled`` when the client left).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State

from appliance.api.common import check_model, decode_body, while_connected
from appliance.api.errors import bad_request
from appliance.api.ollama_models import ollama_name, require_model
from appliance.api.ollama_options import parse_keep_alive
from appliance.service.embeddings import embedding_rows, start_embedding
from appliance.service.services import Services

if TYPE_CHECKING:
    from appliance.api.auth import Principal

OLLAMA_HINT = " Send 'truncate': true to cut it."
OPENAI_HINT = " Shorten it or split it into parts."
"""What a client can do about a too long input, in each API's own words."""


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


async def embed_rows(request: Request[Any, Any, Any], services: Services,
                     principal: Principal, rows: list[list[int]],
                     endpoint: str) -> list[list[float]]:
    """The rows' vectors, admitted and accounted by the service; a client that leaves
    cancels the rest (the ledger row says ``cancelled``)."""
    embedding = await start_embedding(services, principal, rows, endpoint)
    return await while_connected(embedding, request.receive, embedding.vectors())


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
    rows = await embedding_rows(services, inputs, truncate=body.truncate, param="input",
                                hint=OLLAMA_HINT)
    vectors = await embed_rows(request, services, request.user, rows, "/api/embed")
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
    rows = await embedding_rows(services, [body.prompt], truncate=True, param="prompt")
    vectors = await embed_rows(request, services, request.user, rows, "/api/embeddings")
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
    rows = await embedding_rows(services, _openai_inputs(body.input), truncate=False,
                                param="input", hint=OPENAI_HINT)
    vectors = await embed_rows(request, services, request.user, rows, "/v1/embeddings")
    _check_dimensions(body.dimensions, vectors)
    tokens = sum(len(r) for r in rows)
    return {"object": "list", "model": services.model.name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


ROUTES = [ollama_embed, ollama_embeddings, openai_embeddings]
