"""One request inside the engine (:class:`Seq`): its tokens, its KV while it is read, its
sampler and text stream, and the times its ledger row and the scheduler's view need."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.lookup import StreamDrafts
from appliance.engine.request import RequestHandle, Usage
from appliance.engine.sampling import RowSampler
from appliance.engine.snapshot import SlotInfo
from appliance.engine.textstream import TextStream
from appliance.percentiles import percentile
from appliance.sched.states import RequestState, check_transition
from appliance.sched.types import SeqView
from appliance.store.records import LedgerRecord
from appliance.vocab import FinishReason

log = logging.getLogger("appliance.engine.runner")  # a request's lines stay with the runner's


@dataclass(slots=True, eq=False)
class Seq:
    handle: RequestHandle
    arrival: float
    tokens: list[int]
    """Prompt plus generated tokens; after preemption all of them are prefilled again."""
    n_prompt: int
    max_tokens: int
    sampler: RowSampler
    text: TextStream
    state: RequestState = RequestState.QUEUED
    cache: list[Any] | None = None
    computed: int = 0
    next_token: int = -1
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl: list[float] = field(default_factory=list)
    preemptions: int = 0
    prompt_charged: bool = False
    cached_tokens: int = 0
    """Prompt tokens served from the prompt cache at first admission."""
    drafts: StreamDrafts | None = None
    """Its n-grams and record of drafts, once it decodes alone (appliance/engine/lookup.py)."""

    @property
    def rid(self) -> int:
        return self.handle.rid

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    def move(self, new: RequestState) -> None:
        check_transition(self.state, new)
        self.state = new

    def view(self, kv_tokens: int | None = None) -> SeqView:
        r = self.handle.request
        return SeqView(rid=self.rid, user=r.user_key, klass=r.klass, arrival=self.arrival,
                       state=self.state, prefill_len=len(self.tokens), computed=self.computed,
                       kv_tokens=kv_tokens, max_tokens=self.max_tokens,
                       generated=self.generated)

    def slot_info(self, now: float) -> SlotInfo:
        """This request as /slots and the dashboard show it (``now``: the engine's clock)."""
        r = self.handle.request
        prefilled = (min(self.computed, self.n_prompt) if self.state is RequestState.PREFILLING
                     else self.n_prompt if self.state is RequestState.DECODING else 0)
        return SlotInfo(rid=self.rid, user_id=r.user_id, user=r.user, klass=r.klass.label,
                        state=self.state.value, prompt_tokens=self.n_prompt,
                        prefilled=prefilled, generated=self.generated,
                        max_tokens=self.max_tokens, waited_s=now - self.arrival)

    def usage(self) -> Usage:
        """What this request has read and generated so far."""
        return Usage(prompt_tokens=self.n_prompt, completion_tokens=self.generated,
                     cached_tokens=self.cached_tokens)

    def hand_ledger(self, on_finish: Callable[[LedgerRecord], None] | None,
                    reason: FinishReason, usage: Usage, now: float) -> None:
        """Queue this request's ledger row, once whoever ends it (the engine thread, or the
        supervisor failing the engine: ``RequestHandle.claim_finish``); a hand-off that
        fails is logged, never raised into the caller's finishing."""
        if not self.handle.claim_finish() or on_finish is None:
            return
        try:
            on_finish(self.ledger_record(reason, usage, now))
        except Exception:
            log.exception("ledger hand-off failed rid=%d id=%s", self.rid,
                          self.handle.request.request_id)

    def ledger_record(self, reason: FinishReason, usage: Usage, now: float) -> LedgerRecord:
        """The ledger's record of this request: the engine's monotonic times (``now``: its
        clock) as wall-clock times."""
        wall_now = time.time()

        def wall(t: float | None) -> float | None:
            return None if t is None else wall_now - (now - t)

        itl, p95 = self.itl, percentile(self.itl, 95)
        r = self.handle.request
        return LedgerRecord(
            request_id=r.request_id, user_id=r.user_id, api_key_id=r.api_key_id,
            klass=r.klass.label, endpoint=r.endpoint, model="",
            prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
            output_tokens=usage.completion_tokens, queued_at=wall_now - (now - self.arrival),
            admitted_at=wall(self.admitted_at), first_token_at=wall(self.first_token_at),
            finished_at=wall_now, finish_reason=reason, preemptions=self.preemptions,
            ttft_ms=(None if self.first_token_at is None
                     else (self.first_token_at - self.arrival) * 1e3),
            itl_mean_ms=sum(itl) / len(itl) * 1000.0 if itl else None,
            itl_p95_ms=None if p95 is None else p95 * 1000.0)
