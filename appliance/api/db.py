"""Running blocking store calls from async handlers."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import anyio

P = ParamSpec("P")
R = TypeVar("R")


def threaded(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """Make a blocking (SQLite) handler async by running its body in a worker thread.

    Used instead of Litestar's ``sync_to_thread=True``: in Litestar 2.25 a path with GET,
    PATCH and DELETE handlers all marked ``sync_to_thread`` calls one of them without
    awaiting it (500 "Unsupported type: coroutine"); reproduced in isolation.
    """
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
    return wrapper
