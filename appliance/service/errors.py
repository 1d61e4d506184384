"""Domain errors: why the service refused a request, in words and ids, never a status.

Each transport maps them to its wire: ``appliance.api.errors`` to HTTP statuses and the
OpenAI and Ollama bodies, ``web/`` to pages and notices, ``appliance.jobs`` to a run's
outcome (wait and retry, or fail). ``code`` and ``param`` are the stable words clients read;
``retry_after_s`` says when trying again can work.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses."""

    default_code: str | None = None

    def __init__(self, message: str, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(ServiceError):
    """The request itself is wrong (a value out of range, a prompt too long)."""

    default_code = "invalid_value"


class OverQuota(ServiceError):
    """The user's quota refuses the request (``code`` names the limit)."""


class AtConcurrencyLimit(OverQuota):
    """The user already runs as many requests as their quota allows; one finishing frees
    room, so waiting a moment works (a job waits, where other quotas fail it)."""

    default_code = "max_concurrent"


class Unavailable(ServiceError):
    """The server cannot take the request now; the same request can work later."""


class Busy(Unavailable):
    """The queue is full."""

    default_code = "overloaded"

    def __init__(self) -> None:
        super().__init__("Server is busy. Retry later.", retry_after_s=RETRY_AFTER_BUSY_S)


class ShuttingDown(Unavailable):
    default_code = "shutting_down"

    def __init__(self, changing_to: str | None = None) -> None:
        # the model being changed (appliance/service/model_choice.py) is a short wait
        super().__init__(f"The model is being changed to {changing_to}. Retry in a moment."
                         if changing_to else "The server is shutting down. Retry later.",
                         retry_after_s=5 if changing_to else 10)


class EngineUnavailable(Unavailable):
    """The engine stopped serving (dead or stalled thread); the daemon is restarting."""

    default_code = "engine_unavailable"

    def __init__(self, reason: str | None) -> None:
        super().__init__(f"The inference engine is not serving ({reason or 'unknown'}); the "
                         "server is restarting. Retry later.", retry_after_s=10)


class StorageUnavailable(Unavailable):
    """The database takes no writes (disk full, read-only file, I/O error)."""

    default_code = "storage_unavailable"

    def __init__(self, reason: str) -> None:
        super().__init__(f"The server cannot save anything right now ({reason}); nothing "
                         "was changed. Retry later.", retry_after_s=RETRY_AFTER_STORAGE_S)


RETRY_AFTER_BUSY_S = 2
RETRY_AFTER_STORAGE_S = 10
