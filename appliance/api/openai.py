"""OpenAI-compatible endpoints: thin handlers over :mod:`appliance.service`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from litestar import Request, get, post
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.response import Stream

from appliance.api.auth import request_class
from appliance.api.common import check_model, decode_body, text_while_connected
from appliance.api.errors import ApiError, backend_error, bad_request, engine_down
from appliance.api.openai_chat import (
    finish_reason,
    message,
    prepare_chat,
    stream_deltas,
)
from appliance.api.schemas import ChatCompletionRequest, CompletionRequest
from appliance.api.streams import SSE_HEADERS, EventStream
from appliance.service.chat_format import Delta, OutputParser, text_chars
from appliance.service.checks import check_prompt_size
from appliance.service.engine_client import FinishEvent, TokenEvent
from appliance.service.generation import Generation, off_loop, submit
from appliance.service.services import Services
from appliance.service.structured import Constraint
from appliance.vocab import FinishReason

CLASS_HEADER = "x-appliance-class"
"""Optional request header: run this request in a lower class (voice|interactive|background)."""


def _usage(finish: FinishEvent) -> dict[str, Any]:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _error_payload(finish: FinishEvent) -> dict[str, Any]:
    if finish.unavailable:
        return engine_down(finish.error).body()
    if finish.reason is FinishReason.CANCELLED and finish.error:  # an admin ended its access
        return {"error": {"message": finish.error, "type": "permission_error",
                          "code": "access_revoked"}}
    return {"error": {"message": finish.error or "inference backend error",
                      "type": "server_error", "code": "backend_error"}}


def _services(state: State) -> Services:
    return state.services


async def _stream(gen: Generation, kind: str, rid: str, model: str,
                  include_usage: bool, parser: OutputParser | None = None) -> AsyncIterator[bytes]:
    """OpenAI SSE chunks; a client that goes away cancels the request (finally).

    Chat text goes through the request's output parser: content, ``reasoning_content`` and
    ``tool_calls`` deltas (each call whole, with its ``index``)."""
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    calls = 0

    def chunk(delta: dict[str, Any] | str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
            choice["logprobs"] = None
        return {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice]}

    def pieces(parsed: Delta) -> list[bytes]:
        nonlocal calls
        out = [_sse(chunk(d, None)) for d in stream_deltas(parsed, calls)]
        calls += len(parsed.tool_calls)
        return out

    try:
        if kind == "chat":
            yield _sse(chunk({"role": "assistant", "content": ""}, None))
        async for event in gen.events():
            if isinstance(event, TokenEvent):
                if parser is None:
                    yield _sse(chunk({"content": event.text} if kind == "chat" else event.text,
                                     None))
                else:
                    for piece in pieces(parser.feed(event.text)):
                        yield piece
                continue
            if not event.reason.answered:
                yield _sse(_error_payload(event))
                break
            if parser is not None:
                for piece in pieces(parser.feed(event.text)) + pieces(parser.finish()):
                    yield piece
            elif event.text:
                yield _sse(chunk({"content": event.text} if kind == "chat" else event.text,
                                 None))
            yield _sse(chunk({} if kind == "chat" else "", finish_reason(event.reason, calls)))
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [], "usage": _usage(event)})
        yield _sse("[DONE]")
    finally:
        gen.close()


def _stream_response(gen: Generation, kind: str, rid: str, model: str,
                     include_usage: bool, parser: OutputParser | None = None) -> Stream:
    return EventStream(_stream(gen, kind, rid, model, include_usage, parser),
                       media_type="text/event-stream", headers=SSE_HEADERS)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Any:
    services = _services(state)
    body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionRequest)
    check_model(services, body.model)
    if body.modalities is not None and body.modalities != ["text"]:
        raise bad_request("Only the 'text' modality is supported.", "unsupported_value",
                          "modalities")
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
        # refused like 'max_tokens: 0' (a 0 here fell through to the default: a 200)
        raise bad_request(f"'max_completion_tokens' must be at least 1, got "
                          f"{body.max_completion_tokens}.", param="max_completion_tokens")
    # every text a template may print (system, tools, names, earlier turns), before any
    # templating: a 5 MB system message costs no prompt thread either
    check_prompt_size(services.model, text_chars(body.messages, body.tools))
    if body.tools and body.tool_choice != "none" and not services.model.tools:
        raise bad_request(f"Unsupported parameter: 'tools' is not supported with this model "
                          f"('{services.model.name}' has no tools in its chat template).",
                          "unsupported_parameter", "tools")
    setup = await off_loop(services, prepare_chat, services.model.tokenizer, body)
    out = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    return await _respond(request, services, body, setup.prompt, out, "chat",
                          setup.parser, setup.constraint, setup.grammar)


@post("/v1/completions", status_code=200)
async def completions(request: Request, state: State) -> Any:
    services = _services(state)
    body: CompletionRequest = decode_body(await request.body(), CompletionRequest)
    check_model(services, body.model)
    if body.echo or body.suffix:
        raise bad_request("'echo' and 'suffix' are not supported.", "unsupported_value")
    tokenizer = services.model.tokenizer
    if isinstance(body.prompt, str):
        check_prompt_size(services.model, len(body.prompt), "prompt")
        prompt = await off_loop(services, _encode, tokenizer, body.prompt)
    elif body.prompt and all(isinstance(p, int) for p in body.prompt):
        prompt = [int(p) for p in body.prompt]
        if any(not 0 <= t < services.model.vocab_size for t in prompt):
            raise bad_request("Prompt token ids must be inside the vocabulary.", param="prompt")
    elif len(body.prompt) == 1:
        check_prompt_size(services.model, len(str(body.prompt[0])), "prompt")
        prompt = await off_loop(services, _encode, tokenizer, str(body.prompt[0]))
    else:
        raise bad_request("Send one prompt per request (batches of prompts are not "
                          "supported).", "unsupported_value", "prompt")
    return await _respond(request, services, body, prompt,
                          16 if body.max_tokens is None else body.max_tokens, "text")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


async def _respond(request: Request, services: Services,
                   body: ChatCompletionRequest | CompletionRequest, prompt: list[int],
                   max_tokens: int | None, kind: str, parser: OutputParser | None = None,
                   constraint: Constraint | None = None, grammar: str | None = None) -> Any:
    """Queue the request, then stream it (SSE) or answer with the whole text."""
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    gen = await submit(services, prompt, body, max_tokens, request.user,
                       request_class(request.user, request.headers.get(CLASS_HEADER)),
                       endpoint, constraint=constraint, grammar=grammar)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{gen.handle.request.request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream_response(gen, kind, rid, services.model.name, include_usage, parser)
    text, finish = await text_while_connected(gen, request.receive)
    if finish.reason is FinishReason.ERROR:
        raise engine_down(finish.error) if finish.unavailable else backend_error(finish.error)
    if kind == "chat" and parser is not None:
        first, last = parser.feed(text), parser.finish()
        parsed = Delta(first.content + last.content, first.thinking + last.thinking,
                       first.tool_calls + last.tool_calls)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "message": message(parsed),
                                  "finish_reason": finish_reason(finish.reason,
                                                                 len(parsed.tool_calls))}
    elif kind == "chat":
        choice = {"index": 0, "finish_reason": finish.reason, "logprobs": None,
                  "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish.reason}
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": services.model.name, "choices": [choice],
            "usage": _usage(finish)}


def _model_entry(services: Services) -> dict[str, Any]:
    m = services.model
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "appliance",
            "demo": m.is_demo, "context_length": m.ctx_limit}


@get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [_model_entry(_services(state))]}


@get("/v1/models/{model_id:path}")
async def retrieve_model(state: State, model_id: FromPath[Path]) -> dict[str, Any]:
    """The ``openai`` client's ``models.retrieve``; a repo id's slash is part of the id."""
    services = _services(state)
    wanted = str(model_id).lstrip("/")
    if wanted not in (services.model.name, services.model.path):
        raise ApiError(404, f"The model '{wanted}' does not exist. This server serves "
                       f"'{services.model.name}' (see GET /v1/models).",
                       "invalid_request_error", "model_not_found", param="model")
    return _model_entry(services)


ROUTES = [chat_completions, completions, list_models, retrieve_model]
