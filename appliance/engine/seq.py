"""One request inside the engine (:class:`Seq`): its tokens, its KV while it is read, its
sampler and text stream, and the times its ledger row and the scheduler's view need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.engine.request import RequestHandle
from appliance.engine.sampling import RowSampler
from appliance.engine.textstream import TextStream
from appliance.sched.states import RequestState, check_transition
from appliance.sched.types import SeqView


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
