"""OpenAI-shaped errors: ``{"error": {"message", "type", "code"}}`` for every failure, and
the service's domain errors mapped to them (Ollama's ``{"error": "..."}`` under ``/api/``)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, NotAuthorizedException

from appliance.service.errors import (
    Busy,
    EngineUnavailable,
    InvalidRequest,
    OverQuota,
    ServiceError,
    ShuttingDown,
    StorageUnavailable,
    Unavailable,
)
from appliance.store.faults import driver_message, is_busy, storage_fault

log = logging.getLogger(__name__)

class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, code: str = "invalid_value", param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param=param)


# The service's refusals on the wire: (status, OpenAI type); the first class that matches
# wins, so subclasses come before their bases.
_SERVICE_WIRE: tuple[tuple[type[ServiceError], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (OverQuota, 429, "rate_limit_error"),
    (Busy, 503, "overloaded"),
    (ShuttingDown, 503, "overloaded"),
    (Unavailable, 503, "server_error"),
)


def as_api_error(exc: ServiceError) -> ApiError:
    """A domain error as the API's error (status, body, ``Retry-After``)."""
    status, type_ = next(((status, type_) for kind, status, type_ in _SERVICE_WIRE
                          if isinstance(exc, kind)), (500, "server_error"))
    headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return ApiError(status, exc.message, type_, exc.code, headers=headers, param=exc.param)


def service_error_handler(request: Request, exc: ServiceError) -> Response:
    return api_error_handler(request, as_api_error(exc))


def busy() -> ApiError:
    return as_api_error(Busy())


def shutting_down() -> ApiError:
    return as_api_error(ShuttingDown())


def engine_down(reason: str | None) -> ApiError:
    """The engine stopped serving (dead or stalled thread); the daemon is restarting."""
    return as_api_error(EngineUnavailable(reason))


def backend_error(message: str | None = None) -> ApiError:
    return ApiError(500, message or "inference backend error", "server_error", "backend_error")


OLLAMA_PREFIX = "/api/"


def api_error_handler(request: Request, exc: ApiError) -> Response:
    """OpenAI's shape everywhere, except Ollama's ``{"error": "..."}`` under ``/api/``."""
    body: dict[str, object] = exc.body()
    if request.scope.get("path", "").startswith(OLLAMA_PREFIX):
        body = {"error": exc.message}
    return Response(body, status_code=exc.status, headers=exc.headers,
                    media_type=MediaType.JSON)


class InvalidApiKey(NotAuthorizedException):
    """A bearer key that matches no live key: OpenAI's ``invalid_api_key`` (its clients
    tell it from other 401s by the code)."""

    def __init__(self) -> None:
        super().__init__("Invalid or revoked API key.")


# OpenAI answers every 401 as an invalid request (a bad key, a missing one)
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}

# a machine-readable word where Litestar has none (clients tell a body too large by it)
_CODES = {413: "request_too_large"}


def http_error_handler(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (unknown route, wrong method, body too large) in our shape."""
    status = exc.status_code
    message = str(exc.detail)
    extra = getattr(exc, "extra", None)
    if extra:  # validation details: which field, what was wrong
        details = "; ".join(f"{e.get('key', '')}: {e.get('message', '')}" if isinstance(e, dict)
                            else str(e) for e in (extra if isinstance(extra, list) else [extra]))
        message = f"{message}: {details}"
    code = "invalid_api_key" if isinstance(exc, InvalidApiKey) else _CODES.get(status)
    err = ApiError(status, message, _TYPES.get(status, "server_error"), code,
                   headers=dict(exc.headers or {}))
    return api_error_handler(request, err)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return api_error_handler(request, ApiError(500, "internal server error", "server_error"))


def store_error_handler(status: int) -> Any:
    """Store errors (NotFound, AlreadyExists, LastAdmin, Invalid) as clear JSON errors."""
    def handler(request: Request, exc: Exception) -> Response:
        type_ = {404: "not_found_error", 409: "conflict_error"}.get(status,
                                                                    "invalid_request_error")
        return api_error_handler(request, ApiError(status, str(exc), type_))
    return handler


def limit_error_handler(message: str) -> Any:
    """Inputs past what the machine can represent, wherever they are parsed: a JSON body
    nested deeper than the decoder's recursion limit, an integer (id in a path, quota value)
    beyond SQLite's signed 64 bits. The client's mistake: 400, never a 500."""
    def handler(request: Request, exc: Exception) -> Response:
        return api_error_handler(request, ApiError(400, message, "invalid_request_error",
                                                   "out_of_range"))
    return handler


LIMIT_ERROR_HANDLERS: dict[int | type[Exception], Any] = {
    RecursionError: limit_error_handler("The request is nested too deeply."),
    OverflowError: limit_error_handler(
        "A number in the request is out of range (integers must be below 2**63)."),
}


RETRY_AFTER_DB_BUSY_S = 5


def storage_unavailable(reason: str) -> ApiError:
    """The database takes no writes (disk full, read-only file, I/O error)."""
    return as_api_error(StorageUnavailable(reason))


def database_error(request: Request, exc: Exception) -> ApiError | None:
    """A database error that is a condition of the machine, not a bug, as the 503 to send:
    locked past the busy timeout (another process holds the lock), or a storage fault. One
    log line with ids and SQLite's error name, no traceback. None: anything else."""
    fault = storage_fault(exc)
    user = getattr(request.scope.get("user"), "user_id", None)
    if fault is not None:
        log.warning("storage fault on %s %s user_id=%s: %s (%s)", request.method,
                    request.url.path, user, fault, driver_message(exc))
        return storage_unavailable(f"{fault}: {driver_message(exc)}")
    if is_busy(exc):
        log.warning("database busy on %s %s user_id=%s", request.method, request.url.path, user)
        return ApiError(503, "The database is busy. Retry later.", "overloaded",
                        "database_busy", headers={"Retry-After": str(RETRY_AFTER_DB_BUSY_S)})
    return None


def database_error_handler(request: Request, exc: Exception) -> Response:
    """Locked or faulted database: 503 with ``Retry-After``, nothing half-done (the
    transaction rolled back). Anything else is a 500."""
    err = database_error(request, exc)
    if err is None:
        return internal_error_handler(request, exc)
    return api_error_handler(request, err)
