"""Embeddings as a service: inputs counted and tokenised, admission, the engine's job and
its ledger row. Every transport (``/api/embed``, ``/api/embeddings``, ``/v1/embeddings``)
comes through here, so an embedding is charged, limited and recorded as a generation is.

* Each text input is first counted by the cheap bound (``chars // max_token_chars`` tokens
  at least, service/checks.py): one that cannot fit the context is refused, or, when the
  caller cuts (``truncate``), cut to what could ever be read, before any tokenizer time;
  then all are tokenised off the event loop (``off_loop``).
* Admission as for any model request: the store can take the ledger row, the owner's daily
  tokens and classes allow it (a ``background`` request).
* The engine reads the job in pieces after its ticks (appliance/engine/embed.py); leaving
  (:meth:`Embedding.close`, a client gone) cancels what is left.
* Whatever the outcome, one ledger row (``background``, the endpoint, the tokens the engine
  read, no output tokens, ``stop``, ``cancelled`` or ``error``), and those tokens count in
  the daily quota.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import anyio

from appliance.engine.core import EngineDown, EngineStopping
from appliance.engine.embed import CANCELLED, EmbedJob, Vectors
from appliance.engine.request import new_request_id
from appliance.service.checks import quota_of
from appliance.service.errors import (
    EngineUnavailable,
    InvalidRequest,
    ServiceError,
    ShuttingDown,
)
from appliance.service.generation import check_quota, check_storage, off_loop
from appliance.service.identity import Principal
from appliance.service.services import Services
from appliance.store.records import LedgerRecord
from appliance.vocab import FinishReason, Klass

log = logging.getLogger(__name__)

MAX_INPUTS = 512
"""Inputs of one request: a bigger list is refused (send it in parts)."""

CUT_MARGIN = 64
"""Tokens' worth of characters kept past the context when a text is cut before
tokenising (a token at the cut may merge with what follows it)."""


class EmbeddingFailed(ServiceError):
    """The engine could not embed the inputs (HTTP 500)."""

    default_code = "backend_error"


def _too_long(param: str, i: int, what: str, limit: int, hint: str) -> InvalidRequest:
    return InvalidRequest(f"{param}[{i}] has {what}; this model reads at most {limit} tokens "
                          f"an input.{hint}", "context_length_exceeded", param)


def _cut_texts(services: Services, inputs: Sequence[Any], truncate: bool, param: str,
               hint: str) -> list[Any]:
    """The inputs with each text checked by the cheap bound: refused when it cannot fit,
    or cut (``truncate``) to the characters that could ever be read."""
    if not inputs:
        raise InvalidRequest(f"'{param}' must hold at least one input.", param=param)
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"'{param}' holds {len(inputs)} inputs; at most {MAX_INPUTS} a "
                             "request (send them in parts).", param=param)
    limit, widest = services.model.ctx_limit, services.model.max_token_chars
    out: list[Any] = []
    for i, item in enumerate(inputs):
        if not item:
            raise InvalidRequest(f"{param}[{i}] is empty.", param=param)
        if isinstance(item, str) and widest > 0 and len(item) // widest > limit:
            if not truncate:
                raise _too_long(param, i, f"{len(item)} characters, at least "
                                f"{len(item) // widest} tokens", limit, hint)
            item = item[:(limit + CUT_MARGIN) * widest]
        out.append(item)
    return out


def _tokenise(tokenizer: Any, inputs: list[Any]) -> list[list[int]]:
    return [list(tokenizer.encode(item)) if isinstance(item, str) else list(item)
            for item in inputs]


async def embedding_rows(services: Services, inputs: Sequence[Any], *, truncate: bool,
                         param: str, hint: str = "") -> list[list[int]]:
    """Token rows of ``inputs`` (texts, or lists of token ids), each cut to the context
    (``truncate``) or refused naming ``param`` (``hint``: what the caller can do about a
    too long input, in its API's words)."""
    inputs = _cut_texts(services, inputs, truncate, param, hint)
    rows = await off_loop(services, _tokenise, services.model.tokenizer, inputs)
    limit, vocab = services.model.ctx_limit, services.model.vocab_size
    for i, row in enumerate(rows):
        if not row:
            raise InvalidRequest(f"{param}[{i}] is empty.", param=param)
        if any(not 0 <= t < vocab for t in row):
            raise InvalidRequest(f"{param}[{i}]: token ids must be inside the vocabulary.",
                                 param=param)
        if len(row) > limit:
            if not truncate:
                raise _too_long(param, i, f"{len(row)} tokens", limit, hint)
            rows[i] = row[:limit]
    return rows


class Embedding:
    """One embedding request seen from the event loop: :meth:`vectors` when the engine has
    read every input; :meth:`close` (a client gone) cancels the rest."""

    def __init__(self, services: Services, principal: Principal, rows: list[list[int]],
                 endpoint: str) -> None:
        self._services = services
        self._principal = principal
        self._endpoint = endpoint
        self._loop = asyncio.get_running_loop()
        self._answer: asyncio.Future[tuple[Vectors | None, str | None]] = (
            self._loop.create_future())
        self.request_id = new_request_id()
        self.tokens = sum(len(r) for r in rows)
        self.started = time.time()
        self.finished = False
        self.job: EmbedJob | None = None
        try:
            self.job = services.engine.embed(rows, self._done,
                                                       str(principal.user_id),
                                                       self.request_id)
        except EngineDown as exc:
            raise EngineUnavailable(str(exc)) from None
        except EngineStopping:
            raise ShuttingDown() from None

    def _done(self, vectors: Vectors | None, error: str | None) -> None:
        """On the engine thread, once: the ledger row, then the answer to the loop."""
        self.finished = True
        if vectors is not None:
            reason, tokens = FinishReason.STOP, self.tokens
        else:
            reason = FinishReason.CANCELLED if error == CANCELLED else FinishReason.ERROR
            tokens = 0 if self.job is None else self.job.read
        self._account(reason, tokens)
        self._loop.call_soon_threadsafe(self._settle, vectors, error)

    def _settle(self, vectors: Vectors | None, error: str | None) -> None:
        if not self._answer.done():
            self._answer.set_result((vectors, error))

    def _account(self, reason: FinishReason, tokens: int) -> None:
        """The tokens the engine read in the daily usage, and the ledger row."""
        now = time.time()
        services, principal = self._services, self._principal
        services.engine.usage.add(str(principal.user_id), now, tokens)
        log.info("embedding finished id=%s user_id=%d reason=%s tokens=%d of=%d",
                 self.request_id, principal.user_id, reason, tokens, self.tokens)
        if services.writer is None:
            return
        services.writer.submit_ledger(LedgerRecord(
            request_id=self.request_id, user_id=principal.user_id,
            api_key_id=principal.key_id, klass=Klass.BACKGROUND.label,
            endpoint=self._endpoint, model="", prompt_tokens=tokens, cached_tokens=0,
            output_tokens=0, queued_at=self.started, admitted_at=self.started,
            first_token_at=None, finished_at=now, finish_reason=reason))

    async def vectors(self) -> Vectors:
        """The vectors, one an input; leaving while waiting (cancelled) cancels the job."""
        try:
            vectors, error = await self._answer
        except asyncio.CancelledError:
            self.close()
            raise
        if vectors is not None:
            return vectors
        failure = self._services.engine.failure
        if failure is not None:
            raise EngineUnavailable(failure)
        raise EmbeddingFailed(error or "inference backend error")

    def close(self) -> None:
        """Cancel the job unless it already finished (idempotent)."""
        if not self.finished and self.job is not None:
            self._services.engine.cancel_embedding(self.job)


async def start_embedding(services: Services, principal: Principal, rows: list[list[int]],
                          endpoint: str) -> Embedding:
    """Admit ``rows`` as the principal's ``background`` request and queue them."""
    check_storage(services)
    quota = await anyio.to_thread.run_sync(quota_of, services.store, principal.user_id)
    check_quota(quota, services, principal, sum(len(r) for r in rows), 0, Klass.BACKGROUND)
    return Embedding(services, principal, rows, endpoint)
