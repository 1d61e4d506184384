"""The engine as the transports see it: what ``api/``, ``web/`` and ``jobs/`` may ask of it
(:class:`EngineClient`) and the engine's types they handle (re-exported here), so that no
transport imports ``appliance.engine.core`` or holds a bare ``Engine``
(scripts/layers.py's transport rule).

``Services.engine`` is typed as this protocol; the daemon's assembly hands it the real
``Engine`` (mypy checks that the engine is one). Submission, admission, embeddings and their
ledger rows go through the service's own functions (generation.py, embeddings.py); the
members below are what those functions and the read-only pages (health, metrics, the
dashboard's live view) use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from appliance.engine.core import EngineDown, EngineStopping, SwitchRefused
from appliance.engine.embed import EmbedJob
from appliance.engine.model import DEMO_MODEL_DIR, LoadedModel
from appliance.engine.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    RequestHandle,
    TokenEvent,
    UserAccess,
)
from appliance.engine.snapshot import EngineSnapshot, SlotInfo
from appliance.sched.usage import RollingUsage

__all__ = ["DEMO_MODEL_DIR", "EngineClient", "EngineDown", "EngineSnapshot", "EngineStopping",
           "Event", "FinishEvent", "GenerationRequest", "RequestHandle", "SlotInfo",
           "SwitchRefused", "TokenEvent", "UserAccess"]


class EngineClient(Protocol):
    """What the service and the transports call on the engine (any thread but the
    engine's own, unless a member says otherwise)."""

    # ---- submission ----
    def submit(self, request: GenerationRequest, sink: Callable[[Event], None],
               max_concurrent: int | None = None) -> RequestHandle:
        """Queue a generation; its events go to ``sink``. Raises the engine's refusals
        (busy, down, stopping, the user's concurrency)."""
        ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def embed(self, rows: list[list[int]],
              done: Callable[[list[list[float]] | None, str | None], None],
              user: str = "", request_id: str = "") -> EmbedJob:
        """Queue rows of token ids for embedding, read in pieces after the ticks."""
        ...

    def cancel_embedding(self, job: EmbedJob) -> None: ...

    def check_grammar(self, grammar: str) -> str | None:
        """Why the engine could not run ``grammar``, or None (off the event loop)."""
        ...

    # ---- the household's state in the engine ----
    @property
    def usage(self) -> RollingUsage:
        """Each user's tokens over the rolling day (quotas read it)."""
        ...

    def release_cache(self, user_key: str) -> None:
        """Forget one user's prompt-cache entries."""
        ...

    def restrict(self, user_key: str, access: UserAccess) -> None:
        """What an admin left one user allowed; their running requests obey it."""
        ...

    def switch_model(self, path: Path, drain_s: float, load_s: float = 600.0,
                     then: Callable[[LoadedModel], None] | None = None) -> LoadedModel:
        """Serve the model at ``path`` instead (blocks)."""
        ...

    # ---- what it reports (read-only, never slows the engine) ----
    @property
    def snapshot(self) -> EngineSnapshot:
        """Slots, queue and counters as of the last tick."""
        ...

    @property
    def loaded(self) -> LoadedModel | None:
        """The served model and its device's plug (None before it has loaded)."""
        ...

    @property
    def kv_budget_bytes(self) -> int | None: ...

    @property
    def embedding_tokens(self) -> int: ...

    @property
    def embeddings_cancelled(self) -> int: ...

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving for good, or None."""
        ...

    def check(self, now: float | None = None) -> str | None:
        """Why the engine is not serving (dead or stalled), or None."""
        ...

    def group_status(self) -> dict[str, Any] | None:
        """The machines serving the model together (None: one machine)."""
        ...
