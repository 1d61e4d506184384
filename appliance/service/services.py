"""What every transport's handlers share: the engine's client, the model, the store and their kin."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from appliance.service.engine_client import EngineClient, UserAccess
from appliance.service.latency import LatencyMetrics
from appliance.service.throttle import LoginThrottle
from appliance.service.voice_memory import VoiceMemory
from appliance.store import keys, limits, users
from appliance.store.db import Store
from appliance.store.writer import StoreWriter

PROMPT_THREADS = 4
"""Prompts templated and tokenised at once, each on a worker thread: a few megabyte prompts
must neither block the event loop nor take every thread that authentication and the
database use."""


@dataclass(slots=True)
class ModelInfo:
    name: str
    path: str
    is_demo: bool
    ctx_limit: int
    vocab_size: int
    tokenizer: Any
    """mlx-lm's ``TokenizerWrapper`` (dynamic: it forwards to a Hugging Face tokenizer)."""
    created: int = field(default_factory=lambda: int(time.time()))
    max_token_chars: int = 0
    """The most characters one token stands for (``longest_token_chars``); 0: unknown, no
    cheap size check."""
    tools: bool = True
    """The chat template shows the model its tools (``chat_format.renders_tools``): else a
    request with tools is a 400 and ``/api/show`` lists no ``tools`` capability."""


@dataclass(slots=True)
class Services:
    """Everything a handler may use; built once by ``app.build_services``."""

    engine: EngineClient
    """The engine as transports may use it (the daemon's ``Engine``)."""
    model: ModelInfo
    store: Store
    default_max_tokens: int
    max_batch_size: int
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    started_at: float = field(default_factory=time.time)
    on_policy_change: Callable[[], None] | None = None
    latency: LatencyMetrics = field(default_factory=LatencyMetrics)
    """TTFT, inter-token, queue and end-to-end histograms (``/metrics``)."""
    models_dir: Path | None = None
    """Where admins' ``/api/pull`` downloads go (``appliance model pull`` uses it too)."""
    voice_memory: VoiceMemory = field(default_factory=VoiceMemory)
    """Conversations of ``/hooks/voice`` (in memory, with a TTL)."""
    note_key_used: Callable[[int, float], None] | None = None
    """Where an API key's last-used time goes (the store writer); None: not recorded."""
    writer: StoreWriter | None = None
    """The store writer: its backlog decides whether model requests may start."""
    shared_idle_s: float = 600.0
    """A 'Shared device' browser session ends after this long without a request."""
    drain_s: float = 30.0
    """How long a change of model lets running requests finish (the restart's drain)."""
    configured_model: str = ""
    """The configuration's ``engine.model`` (a model chosen since is recorded over it)."""
    pdf_read_seconds: float = 60.0
    """A PDF attached in the chat is read in a process stopped after this long..."""
    pdf_read_memory_mb: int = 768
    """...or past this much memory (``web.pdftext``)."""
    chat_titles: bool = True
    """The model titles a conversation after its first answer (``web.titles``)."""
    prompt_limiter: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(PROMPT_THREADS))

    def policy_changed(self) -> None:
        """Call after an admin changes weights, classes or quotas: the running scheduler
        re-reads the weights (quotas and classes are read at every request anyway)."""
        if self.on_policy_change is not None:
            self.on_policy_change()

    def access_changed(self, user_id: int) -> None:
        """Call after an admin (or the user) disables a user, revokes a key or changes a
        quota, once committed: the user's running requests obey it within a tick (a
        disabled user's and a revoked key's end ``cancelled``, a day's tokens now used up
        ``quota``; each with its ledger row). Any thread but the event loop's."""
        with self.store.read_sessions() as s:
            user = users.get_user(s, user_id)
            if user is None:
                return
            revoked = frozenset(k.id for k in keys.list_keys(s, user_id=user_id,
                                                             include_revoked=True)
                                if k.revoked_at is not None)
            access = UserAccess(disabled=user.disabled, revoked_keys=revoked,
                                tokens_per_day=limits.get_quota(s, user_id).tokens_per_day)
        self.engine.restrict(str(user_id), access)
