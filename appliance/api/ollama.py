"""The Ollama-compatible API under ``/api``: what Home Assistant and the ``ollama`` client call.

Thin handlers over :mod:`appliance.service`, like the OpenAI ones: same quotas, classes,
fairness and ledger. Streams are NDJSON (:mod:`appliance.api.ollama_stream`); errors are
Ollama's ``{"error": "..."}`` (``errors.api_error_handler`` picks the shape by path).
``/api/tags``, ``/api/ps``, ``/api/show`` and ``/api/version`` read cached facts and the
engine's last snapshot, so they answer at once however busy the engine is.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from litestar import Request, get, head, post
from litestar.datastructures import State

from appliance import __version__
from appliance.api.auth import request_class
from appliance.api.common import decode_body
from appliance.api.errors import bad_request
from appliance.api.ollama_fit import answer_reserve, fit_context, fit_turns, kept_turns
from appliance.api.ollama_models import (
    model_facts,
    model_info,
    ollama_name,
    require_model,
    tag_entry,
)
from appliance.api.ollama_options import Options, parse_keep_alive, parse_options
from appliance.api.ollama_pull import pull_response
from appliance.api.ollama_schemas import ChatBody, GenerateBody, ModelBody, OllamaMessage
from appliance.api.ollama_stream import (
    Clock,
    Pieces,
    collect,
    finish_error,
    ndjson,
    now_iso,
    stream_response,
)
from appliance.api.openai import CLASS_HEADER
from appliance.service import chat_format
from appliance.service.chat_format import Delta, OutputParser, text_chars
from appliance.service.checks import check_context, check_prompt_size
from appliance.service.generation import Generation, off_loop, submit
from appliance.service.services import Services
from appliance.vocab import FinishReason

OLLAMA_API_VERSION = "0.12.0"
"""The Ollama API level this server speaks (clients gate features on it)."""

PUBLIC_PATHS = ("^/api/version$",)
"""Ollama itself answers these without a key, and clients probe them to find a server; the
version string is all they tell."""

ROLES = ("system", "user", "assistant", "tool")
B = TypeVar("B", ChatBody, GenerateBody)


def _services(state: State) -> Services:
    return state.services


def _no_images(services: Services, images: list[str] | None) -> None:
    if images:
        raise bad_request(f"model '{ollama_name(services.model.name)}' reads text only and "
                          "cannot take images; send the request without 'images'.",
                          param="images")


def _think(services: Services, think: bool | str | None) -> bool | None:
    """Ollama's ``think``: a bool, or a level (``"low"``/``"medium"``/``"high"``) that
    turns thinking on; True on a model without thinking is a 400."""
    if think is None or think == "":
        return None
    wanted = think if isinstance(think, bool) else True
    if wanted and not chat_format.supports_thinking(services.model.tokenizer):
        raise bad_request(f"model '{ollama_name(services.model.name)}' does not support "
                          "thinking; send 'think': false or leave it out.", param="think")
    return wanted


def _constraint(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's ``format``: ``"json"`` for any JSON object, or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return fmt
    raise bad_request(f"'format' must be \"json\" or a JSON schema, got {fmt!r}.",
                      param="format")


class ChatPieces(Pieces):
    """Model text split by the model's own tool-call and thinking syntax."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser

    def feed(self, text: str) -> dict[str, Any]:
        return delta_fields(self.parser.feed(text)) if text else {}

    def finish(self) -> dict[str, Any]:
        return delta_fields(self.parser.finish())


def delta_fields(delta: Delta) -> dict[str, Any]:
    """A parsed delta as Ollama message fields; each tool call whole, arguments an object."""
    out: dict[str, Any] = {}
    if delta.content:
        out["content"] = delta.content
    if delta.thinking:
        out["thinking"] = delta.thinking
    if delta.tool_calls:
        out["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}}
                             for c in delta.tool_calls]
    return out


def ollama_turns(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama messages as the OpenAI-shaped turns chat templates read.

    Tool calls get ids (Ollama sends none); a tool result without ``tool_call_id`` answers
    the earliest unanswered call of the assistant turn before it, as Home Assistant sends
    them in order and without names.
    """
    turns: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}]: unknown role '{m.role}' (use system, user, "
                              "assistant or tool).", param="messages")
        turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            pending = []
            for j, tc in enumerate(m.tool_calls):
                cid = tc.id or f"call_{i}_{j}"
                calls.append({"id": cid, "type": "function", "function": {
                    "name": tc.function.name, "arguments": tc.function.arguments}})
                pending.append((cid, tc.function.name))
            turn["tool_calls"] = calls
        if m.role == "tool":
            cid, name = pending.pop(0) if pending else ("", "")
            turn["tool_call_id"] = m.tool_call_id or cid
            if m.tool_name or name:
                turn["name"] = m.tool_name or name
        turns.append(turn)
    return turns


def _max_tokens(opts: Options, n_prompt: int, services: Services) -> int | None:
    """``num_predict``, capped so prompt + answer stay inside ``num_ctx`` when it is given."""
    if opts.num_ctx is None:
        return opts.num_predict
    cap = min(opts.num_ctx, services.model.ctx_limit)
    check_context(n_prompt, cap)
    room = cap - n_prompt
    if opts.num_predict is None:  # the server's default (clamped by quotas), if it fits
        return None if services.default_max_tokens <= room else room
    return min(opts.num_predict, room)


def _room(opts: Options, services: Services) -> tuple[int, int]:
    """The context a prompt must fit (``num_ctx`` caps the model's) and the room it keeps
    for the answer while the oldest history is dropped (:mod:`appliance.api.ollama_fit`)."""
    limit = min(opts.num_ctx or services.model.ctx_limit, services.model.ctx_limit)
    return limit, answer_reserve(opts.num_predict, services.default_max_tokens, limit)


def _klass(request: Request[Any, Any, Any]) -> Any:
    return request_class(request.user, request.headers.get(CLASS_HEADER))


async def _start(request: Request[Any, Any, Any], services: Services, prompt: list[int],
                 opts: Options, endpoint: str, constraint: dict[str, Any] | None
                 ) -> Generation:
    return await submit(services, prompt, opts.sampling,
                        _max_tokens(opts, len(prompt), services), request.user,
                        _klass(request), endpoint, constraint=constraint, param="format",
                        keep_cache=opts.keep_alive != 0)


def _load_reply(request: Request[Any, Any, Any], services: Services, field: str,
                opts: Options) -> dict[str, Any]:
    """Ollama's answer to an empty request: the model is (already) loaded; with
    ``keep_alive: 0`` (``ollama stop``) Ollama unloads it, here the model stays and the
    caller's prompt-cache entries are released (see the README's Decisions)."""
    empty: Any = {"role": "assistant", "content": ""} if field == "message" else ""
    reason = FinishReason.LOAD
    if opts.keep_alive == 0:
        services.engine.release_cache(str(request.user.user_id))
        reason = FinishReason.UNLOAD
    return {"model": ollama_name(services.model.name), "created_at": now_iso(),
            field: empty, "done": True, "done_reason": reason}


def _read(services: Services, raw: bytes, kind: type[B]) -> tuple[B, Options]:
    """A chat or generate body, checked the same way: the model named, ``keep_alive`` and
    ``options`` (each a 400 when malformed)."""
    body: B = decode_body(raw, kind)
    require_model(services.model, body.model)
    keep_alive = parse_keep_alive(body.keep_alive)
    return body, replace(parse_options(body.options), keep_alive=keep_alive)


@post("/api/chat", status_code=200)
async def chat(request: Request[Any, Any, Any], state: State) -> Any:
    clock = Clock()
    services = _services(state)
    body, opts = _read(services, await request.body(), ChatBody)
    if not body.messages:
        return _load_reply(request, services, "message", opts)
    for m in body.messages:
        _no_images(services, m.images)
    if body.tools and not services.model.tools:  # Ollama's words for such a model
        raise bad_request(f"{ollama_name(services.model.name)} does not support tools",
                          "unsupported_parameter", "tools")
    think = _think(services, body.think)
    constraint = _constraint(body.format)
    # what is never dropped to fit (system messages, the current turn, tools) counts
    # before any templating
    check_prompt_size(services.model, text_chars(kept_turns(body.messages), body.tools))
    limit, reserve = _room(opts, services)
    prompt, _ = await off_loop(
        services, fit_turns,
        lambda turns: chat_format.render_prompt(services.model.tokenizer, turns, body.tools,
                                                think),
        ollama_turns(body.messages), limit, reserve)
    gen = await _start(request, services, prompt, opts, "/api/chat", constraint)
    name = ollama_name(services.model.name)

    def chunk(fields: dict[str, Any], done: bool) -> dict[str, Any]:
        return {"model": name, "created_at": now_iso(),
                "message": {"role": "assistant", "content": "", **fields}, "done": done}

    pieces = ChatPieces(OutputParser(services.model.tokenizer, body.tools, think, prompt))
    if body.stream:
        return stream_response(ndjson(gen, clock, pieces, chunk))
    fields, finish = await collect(gen, clock, pieces, request.receive)
    if not finish.reason.answered:
        raise finish_error(finish)
    return {**chunk(fields, True), **clock.final(finish)}


def _generate_prompt(services: Services, body: GenerateBody, think: bool | None,
                     opts: Options) -> list[int]:
    if body.suffix:
        raise bad_request("'suffix' (fill-in-the-middle) is not supported.", param="suffix")
    if body.template:
        raise bad_request("'template' overrides are not supported; the model's own chat "
                          "template is used (or send 'raw': true).", param="template")
    tokenizer = services.model.tokenizer
    if body.raw:
        prompt = list(tokenizer.encode(body.prompt))
    else:
        turns = ([{"role": "system", "content": body.system}] if body.system else [])
        turns.append({"role": "user", "content": body.prompt})
        prompt = chat_format.render_prompt(tokenizer, turns, None, think)
    context = list(body.context or [])
    if any(not 0 <= t < services.model.vocab_size for t in context):
        raise bad_request("'context' must hold token ids of this model (from an earlier "
                          "/api/generate answer).", param="context")
    return fit_context(context, prompt, *_room(opts, services))


@post("/api/generate", status_code=200)
async def generate(request: Request[Any, Any, Any], state: State) -> Any:
    clock = Clock()
    services = _services(state)
    body, opts = _read(services, await request.body(), GenerateBody)
    _no_images(services, body.images)
    think = _think(services, body.think)
    constraint = _constraint(body.format)
    if not body.prompt and not body.context:
        return _load_reply(request, services, "response", opts)
    check_prompt_size(services.model, text_chars(body.prompt, body.system), "prompt")
    prompt = await off_loop(services, _generate_prompt, services, body, think, opts)
    gen = await _start(request, services, prompt, opts, "/api/generate", constraint)
    name = ollama_name(services.model.name)
    pieces = GeneratePieces(OutputParser(services.model.tokenizer, None, think, prompt))

    def chunk(fields: dict[str, Any], done: bool) -> dict[str, Any]:
        out = {"model": name, "created_at": now_iso(),
               "response": fields.get("content", ""), "done": done}
        if fields.get("thinking"):
            out["thinking"] = fields["thinking"]
        if done:
            out["context"] = prompt + pieces.tokens
        return out

    if body.stream:
        return stream_response(ndjson(gen, clock, pieces, chunk))
    fields, finish = await collect(gen, clock, pieces, request.receive)
    if not finish.reason.answered:
        raise finish_error(finish)
    return {**chunk(fields, True), "response": fields.get("content", ""),
            **clock.final(finish)}


class GeneratePieces(ChatPieces):
    """The answer (and thinking), and the generated token ids for the final ``context``."""

    def __init__(self, parser: OutputParser) -> None:
        super().__init__(parser)
        self.tokens: list[int] = []

    def token(self, token: int) -> None:
        self.tokens.append(token)


@get("/api/tags", sync_to_thread=False)
def tags(state: State) -> dict[str, Any]:
    return {"models": [tag_entry(_services(state).model)]}


@head("/api/tags", sync_to_thread=False)
def tags_head() -> None:
    return None


@get("/api/version", sync_to_thread=False)
def version() -> dict[str, Any]:
    return {"version": OLLAMA_API_VERSION, "appliance": __version__}


@head("/api/version", sync_to_thread=False)
def version_head() -> None:
    return None


@get("/api/ps", sync_to_thread=False)
def ps(state: State) -> dict[str, Any]:
    services = _services(state)
    entry = tag_entry(services.model)
    snap = services.engine.snapshot
    size = entry["size"] + snap.kv_bytes
    # the model is never unloaded, whatever keep_alive said: say so (see README, Decisions)
    forever = datetime.now(UTC) + timedelta(days=365 * 100)
    return {"models": [{**{k: entry[k] for k in ("name", "model", "size", "digest",
                                                      "details")},
                        "size": size, "size_vram": size if _unified_memory() else 0,
                        "expires_at": forever.isoformat().replace("+00:00", "Z"),
                        "context_length": services.model.ctx_limit}]}


def _unified_memory() -> bool:
    """On Apple Silicon the weights live in memory the GPU uses (Ollama's ``size_vram``)."""
    import platform

    return platform.system() == "Darwin" and platform.machine() == "arm64"


def capabilities(services: Services) -> list[str]:
    """What Ollama lists for a model; ``embedding``: /api/embed pools its hidden states."""
    caps = ["completion", "tools", "embedding"] if services.model.tools else [
        "completion", "embedding"]
    if chat_format.supports_thinking(services.model.tokenizer):
        caps.append("thinking")
    return caps


@post("/api/show", status_code=200)
async def show(request: Request[Any, Any, Any], state: State) -> dict[str, Any]:
    services = _services(state)
    body: ModelBody = decode_body(await request.body(), ModelBody)
    require_model(services.model, body.wanted)
    facts = model_facts(services.model.path)
    return {"license": "", "modelfile": f"# served by the appliance\nFROM {services.model.path}\n",
            "parameters": "", "template": facts.template, "details": facts.details(),
            "model_info": model_info(services.model, facts),
            "capabilities": capabilities(services), "modified_at": facts.modified_at}


@post("/api/pull", status_code=200)
async def pull(request: Request[Any, Any, Any], state: State) -> Any:
    body: ModelBody = decode_body(await request.body(), ModelBody)
    return await pull_response(_services(state), request.user, body)


ROUTES: list[Any] = [chat, generate, tags, tags_head, version, version_head, ps, show, pull]
