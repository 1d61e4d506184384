"""What every API flavour shares on top of the service: reading bodies, OpenAI messages as
chat-template turns, and answers that stop when the client leaves."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from appliance.api.errors import ApiError, bad_request
from appliance.api.schemas import ChatMessage
from appliance.service.engine_client import FinishEvent
from appliance.service.generation import Generation
from appliance.service.services import Services

if TYPE_CHECKING:
    from litestar.types import Receive

T = TypeVar("T")


def decode_body(raw: bytes, kind: type[Any]) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.", "invalid_json")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid request: {exc}", "invalid_type",
                          _error_field(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Malformed JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise bad_request("The JSON is nested too deeply.", "invalid_json") from None


def _error_field(message: str) -> str | None:
    """The field a msgspec validation error names (``... - at `$.messages[0].role```), as
    OpenAI's ``param`` (``messages[0].role``); a missing field is named in the text."""
    found = re.search(r"at `\$\.?([^`]*)`", message)
    missing = re.search(r"missing required field `([^`]+)`", message)
    path = found.group(1) if found else ""
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def check_model(services: Services, name: str | None) -> None:
    if name and name not in (services.model.name, services.model.path, "default"):
        raise ApiError(404, f"The model '{name}' does not exist. This server serves "
                       f"'{services.model.name}' (see GET /v1/models).", "invalid_request_error",
                       "model_not_found", param="model")


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text":
            raise bad_request(f"Content parts of type '{part.type}' are not supported; this "
                              "model reads text only.", "unsupported_value", "messages")
        parts.append(part.text or "")
    return "".join(parts)


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat-template turns (``developer`` is a system message)."""
    if not messages:
        raise bad_request("'messages' must hold at least one message.", param="messages")
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise bad_request(f"Unknown message role '{m.role}'.", param=f"messages[{i}].role")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request("A 'tool' message needs 'tool_call_id': the id of the tool "
                              "call it answers.", param=f"messages[{i}].tool_call_id")
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": message_text(m)}
        if m.tool_calls:
            turn["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
        turns.append(turn)
    return turns


async def text_while_connected(gen: Generation, receive: Receive) -> tuple[str, FinishEvent]:
    """:meth:`Generation.text`, unless the client leaves first (see :func:`while_connected`)."""
    return await while_connected(gen, receive, gen.text())


class Closable(Protocol):
    def close(self) -> None: ...


async def while_connected(gen: Closable, receive: Receive, reading: Awaitable[T]) -> T:
    """``reading`` (which reads ``gen``'s answer: a generation's, an embedding's), unless
    the client leaves first: then the request is cancelled (its slot and KV are freed on the next tick, as for a stream) and
    :class:`ClientGone` is raised. ``receive`` is the ASGI receive of a request whose body
    was read, so the next message it gives is ``http.disconnect``."""
    answer = asyncio.ensure_future(reading)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answer, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(answer, gone, return_exceptions=True)
    if answer.done() and not answer.cancelled():
        return answer.result()
    gen.close()
    raise ClientGone()


class ClientGone(ApiError):
    """The client closed the connection before its answer was ready (nobody reads this)."""

    def __init__(self) -> None:
        super().__init__(499, "The client closed the request.", "invalid_request_error",
                         "client_closed_request")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
