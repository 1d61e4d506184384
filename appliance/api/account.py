"""Logging in and out, and a member's own things: profile, usage, API keys, conversations.

Every handler acts for ``request.user`` only; another member's conversation or key answers
404, exactly like one that does not exist (no existence leak).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec
from litestar import Request, Response, delete, get, patch, post
from litestar.datastructures import Cookie, State
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Redirect, Template

from appliance.api.auth import SESSION_COOKIE, Principal, key_scope, new_key_class
from appliance.api.common import decode_body
from appliance.api.db import threaded
from appliance.api.errors import ApiError, bad_request
from appliance.service.throttle import MAX_NAME_LENGTH, MAX_PASSWORD_LENGTH
from appliance.store import conversations as convs
from appliance.store import keys as store_keys
from appliance.store import ledger, preferences, users, websessions
from appliance.store.db import Store
from appliance.store.errors import NotFound
from appliance.store.models import ApiKey, Conversation, Message


class LoginBody(msgspec.Struct):
    name: str
    password: str


class KeyBody(msgspec.Struct):
    name: str
    max_class: str | None = None
    default_class: str | None = None


class TitleBody(msgspec.Struct):
    title: str = ""


class MessageBody(msgspec.Struct):
    role: str
    content: str


def _store(state: State) -> Store:
    return state.services.store


def key_json(k: ApiKey) -> dict[str, Any]:
    return {"prefix": k.prefix, "name": k.name, "user_id": k.user_id, "max_class": k.max_class,
            "default_class": k.default_class or k.max_class, "created_at": k.created_at, "last_used_at": k.last_used_at,
            "revoked": k.revoked_at is not None}


def usage_json(u: ledger.Usage | None) -> dict[str, Any]:
    u = u or ledger.Usage()
    return {"requests": u.requests, "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens, "output_tokens": u.output_tokens,
            "total_tokens": u.total_tokens, "preemptions": u.preemptions,
            "ttft_ms_mean": u.ttft_ms_mean, "itl_ms_mean": u.itl_ms_mean}


def _conversation_json(c: Conversation, messages: list[Message] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": c.id, "title": c.title, "created_at": c.created_at,
                           "updated_at": c.updated_at}
    if messages is not None:
        out["messages"] = [{"id": m.id, "role": m.role, "content": m.content,
                            "created_at": m.created_at} for m in messages]
    return out


# ---- login / logout ----
LOGGED_OUT_DISABLED = "This account is disabled; ask an admin."
"""On the login page a browser is sent to when an admin disabled its account."""
SESSION_ENDED = "Your session ended; log in again, your draft is kept."
"""On the login page a browser is sent to when its session ended (the chat keeps the
message being typed, web/static/app.js)."""


@get("/login", sync_to_thread=False)
def login_page(request: Request, reason: FromQuery[str] = "") -> Template:
    return Template("login.html", context={
        "error": LOGGED_OUT_DISABLED if reason == "disabled" else
        SESSION_ENDED if reason == "expired" else None,
        "idle_minutes": _idle(request)})


def _idle(request: Request) -> int:
    """Minutes a 'Shared device' session lasts without use (said on the login form)."""
    return int(request.app.state.services.shared_idle_s // 60)


DISABLED = "This account is switched off. Ask an admin of the household to switch it on again."
"""Said only to someone who gave the right password: nobody else learns the account exists."""


def _login_too_long(body: LoginBody) -> str | None:
    """Names and passwords longer than any real one are refused before they cost anything
    (no throttle entry, no password hash)."""
    if len(body.name) > MAX_NAME_LENGTH:
        return f"The name is longer than {MAX_NAME_LENGTH} characters."
    if len(body.password) > MAX_PASSWORD_LENGTH:
        return f"The password is longer than {MAX_PASSWORD_LENGTH} characters."
    return None


def _check_password(store: Store, name: str, password: str,
                    shared_idle_s: float | None = None) -> Any:
    """The new session's details, or why not; ``shared_idle_s``: a 'Shared device' session
    that ends after that long without a request."""
    with store.sessions.begin() as s:
        user = users.authenticate_password(s, name, password, allow_disabled=True)
        if user is None:
            return None
        if user.disabled:
            return DISABLED
        if shared_idle_s is None:
            token = websessions.start_session(s, user)
        else:
            token = websessions.start_session(s, user, ttl_s=shared_idle_s, shared=True)
        theme = preferences.get_preferences(s, user.id).theme
        return user.id, user.name, user.role, token, theme


@post("/login", status_code=200)
async def login(request: Request, state: State) -> Response[Any]:
    is_form = request.content_type[0] != "application/json"
    shared = False
    if is_form:
        form = await request.form()
        body = LoginBody(name=str(form.get("name", "")), password=str(form.get("password", "")))
        shared = form.get("shared") == "on"
    else:
        body = decode_body(await request.body(), LoginBody)
    too_long = _login_too_long(body)
    if too_long is not None:
        if is_form:
            return Template("login.html", context={"error": too_long,
                                                   "idle_minutes": _idle(request)},
                            status_code=400)
        raise bad_request(too_long, "too_long")
    services = state.services
    address = request.client.host if request.client else "?"
    now = time.monotonic()
    wait = services.throttle.retry_after(body.name, address, now)
    if wait is not None:
        raise ApiError(429, f"Too many failed logins; try again in {int(wait) + 1} s.",
                       "rate_limit_error", "login_throttled",
                       headers={"Retry-After": str(int(wait) + 1)})
    found = await anyio.to_thread.run_sync(_check_password, services.store, body.name,
                                           body.password,
                                           services.shared_idle_s if shared else None)
    if found is None:
        services.throttle.failed(body.name, address, now)
        if is_form:
            return Template("login.html", context={"error": "Wrong name or password.",
                                                   "idle_minutes": _idle(request)},
                            status_code=401)
        raise ApiError(401, "Wrong name or password.", "authentication_error")
    if found == DISABLED:
        if is_form:
            return Template("login.html", context={"error": DISABLED,
                                                   "idle_minutes": _idle(request)},
                            status_code=403)
        raise ApiError(403, DISABLED, "permission_error", "account_disabled")
    services.throttle.succeeded(body.name, address)
    uid, name, role, token, theme = found
    old = request.cookies.get(SESSION_COOKIE)
    if old:  # the id rotates: whatever session the browser had is over
        await anyio.to_thread.run_sync(_end_session, services.store, old)
    # the theme follows the person: this browser takes the one saved in their settings
    cookies = [session_cookie(request, token, remember=not shared), theme_cookie(theme)]
    if is_form:
        return Redirect("/", status_code=303, cookies=cookies)
    return Response({"id": uid, "name": name, "role": role}, cookies=cookies)


THEME_COOKIE = "theme"
"""Mirrors the theme saved in a person's settings; pages read it to colour themselves."""


def theme_cookie(theme: str) -> Cookie:
    return Cookie(key=THEME_COOKIE, value=theme, path="/", samesite="lax",
                  max_age=400 * 24 * 3600)


def session_cookie(request: Request, token: str, remember: bool = True) -> Cookie:
    """The browser's session cookie for a new session id; without ``remember`` (a shared
    device) it ends with the browser."""
    return Cookie(key=SESSION_COOKIE, value=token, httponly=True, samesite="lax", path="/",
                  max_age=int(websessions.SESSION_TTL_S) if remember else None,
                  secure=_is_https(request))


def _is_https(request: Request) -> bool:
    """Served over https: directly, or by a trusted proxy's ``X-Forwarded-Proto: https``
    (uvicorn rewrites the scheme only for ``--trusted-proxies``)."""
    return request.scope.get("scheme") == "https"


def _end_session(store: Store, token: str) -> None:
    with store.sessions.begin() as s:
        websessions.end_session(s, token)


@post("/logout", status_code=200)
async def logout(request: Request, state: State) -> Response[Any]:
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        await anyio.to_thread.run_sync(_end_session, state.services.store, token)
    gone = Cookie(key=SESSION_COOKIE, value="", max_age=0, path="/", httponly=True,
                  samesite="lax", secure=_is_https(request))
    if request.content_type[0] != "application/json":
        return Redirect("/login", status_code=303, cookies=[gone])
    return Response({"logged_out": True}, cookies=[gone])


# ---- me ----
@get("/me", sync_to_thread=False)
def me(request: Request) -> dict[str, Any]:
    p: Principal = request.user
    return {"id": p.user_id, "name": p.name, "role": p.role, "max_class": p.max_class}


@get("/me/usage")
@threaded
def my_usage(request: Request, state: State) -> dict[str, Any]:
    uid = request.user.user_id
    now = time.time()
    with _store(state).read_sessions() as s:
        hour = ledger.usage_last_hour(s, now).get(uid)
        day = ledger.usage_last_day(s, now).get(uid)
    return {"last_hour": usage_json(hour), "last_day": usage_json(day)}


@get("/me/keys")
@threaded
def my_keys(request: Request, state: State) -> list[dict[str, Any]]:
    with _store(state).read_sessions() as s:
        return [key_json(k) for k in store_keys.list_keys(s, user_id=request.user.user_id,
                                                          include_revoked=True,
                                                          at_most=key_scope(request.user))]


@post("/me/keys", status_code=201)
@threaded
def create_my_key(request: Request, state: State, data: JSONBody[KeyBody]) -> dict[str, Any]:
    with _store(state).sessions.begin() as s:
        user = users.get_user(s, request.user.user_id)
        if user is None:
            raise NotFound("no such user")
        key, plaintext = store_keys.create_api_key(s, user, data.name,
                                                   new_key_class(request.user, data.max_class),
                                                   default_class=data.default_class,
                                                   at_most=key_scope(request.user))
        return {**key_json(key), "key": plaintext}


@delete("/me/keys/{prefix:str}", status_code=204)
@threaded
def revoke_my_key(request: Request, state: State, prefix: FromPath[str]) -> None:
    with _store(state).sessions.begin() as s:
        store_keys.revoke_key(s, prefix, user_id=request.user.user_id,
                              at_most=key_scope(request.user))
    state.services.access_changed(request.user.user_id)  # the key's streams end too


# ---- conversations ----
@get("/conversations")
@threaded
def list_conversations(request: Request, state: State) -> list[dict[str, Any]]:
    with _store(state).read_sessions() as s:
        return [_conversation_json(c) for c in convs.list_conversations(s, request.user.user_id)]


@post("/conversations", status_code=201)
@threaded
def create_conversation(request: Request, state: State, data: JSONBody[TitleBody]) -> dict[str, Any]:
    with _store(state).sessions.begin() as s:
        return _conversation_json(convs.create_conversation(s, request.user.user_id, data.title))


@get("/conversations/{cid:int}")
@threaded
def get_conversation(request: Request, state: State, cid: FromPath[int]) -> dict[str, Any]:
    with _store(state).read_sessions() as s:
        c = convs.get_conversation(s, request.user.user_id, cid)
        if c is None:
            raise NotFound("conversation not found")
        return _conversation_json(c, convs.list_messages(s, request.user.user_id, cid))


@patch("/conversations/{cid:int}")
@threaded
def rename_conversation(request: Request, state: State, cid: FromPath[int], data: JSONBody[TitleBody]) -> dict[str, Any]:
    with _store(state).sessions.begin() as s:
        convs.rename_conversation(s, request.user.user_id, cid, data.title)
        c = convs.get_conversation(s, request.user.user_id, cid)
        assert c is not None
        return _conversation_json(c)


@delete("/conversations/{cid:int}", status_code=204)
@threaded
def delete_conversation(request: Request, state: State, cid: FromPath[int]) -> None:
    with _store(state).sessions.begin() as s:
        convs.delete_conversation(s, request.user.user_id, cid)


@post("/conversations/{cid:int}/messages", status_code=201)
@threaded
def add_message(request: Request, state: State, cid: FromPath[int], data: JSONBody[MessageBody]) -> dict[str, Any]:
    if len(data.content) > convs.MAX_MESSAGE_CHARS:
        raise bad_request(f"Messages are limited to {convs.MAX_MESSAGE_CHARS} characters.",
                          "too_long", "content")
    with _store(state).sessions.begin() as s:
        m = convs.add_message(s, request.user.user_id, cid, data.role, data.content)
        return {"id": m.id, "role": m.role, "content": m.content, "created_at": m.created_at}


ROUTES = [login_page, login, logout, me, my_usage, my_keys, create_my_key, revoke_my_key,
          list_conversations, create_conversation, get_conversation, rename_conversation,
          delete_conversation, add_message]
