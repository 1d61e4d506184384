"""Request states as data: an enum, the finished set and the table of allowed moves."""

from __future__ import annotations

import enum

from appliance.vocab import FinishReason


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED_STOP = FinishReason.STOP.value
    FINISHED_LENGTH = FinishReason.LENGTH.value
    FINISHED_CANCELLED = FinishReason.CANCELLED.value
    FINISHED_ERROR = FinishReason.ERROR.value
    FINISHED_QUOTA = FinishReason.QUOTA.value

    @property
    def finished(self) -> bool:
        return self in FINISHED

    @property
    def running(self) -> bool:
        return self is RequestState.PREFILLING or self is RequestState.DECODING


FINISHED: frozenset[RequestState] = frozenset({
    RequestState.FINISHED_STOP,
    RequestState.FINISHED_LENGTH,
    RequestState.FINISHED_CANCELLED,
    RequestState.FINISHED_ERROR,
    RequestState.FINISHED_QUOTA,
})

_ANY_FINISH = FINISHED
ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    # A queued request can be admitted, or end without running (cancelled, error, quota).
    RequestState.QUEUED: frozenset({RequestState.PREFILLING} | _ANY_FINISH),
    # Prefill ends in the first token (decoding) or at once (stop/length after one token).
    # Preemption sends a running request back to the queue with its tokens kept.
    RequestState.PREFILLING: frozenset(
        {RequestState.DECODING, RequestState.QUEUED} | _ANY_FINISH),
    RequestState.DECODING: frozenset({RequestState.QUEUED} | _ANY_FINISH),
    **{s: frozenset() for s in FINISHED},
}


class InvalidTransition(RuntimeError):
    pass


def check_transition(old: RequestState, new: RequestState) -> None:
    if new not in ALLOWED[old]:
        raise InvalidTransition(f"{old.value} -> {new.value} is not allowed")


def finish_state(reason: FinishReason) -> RequestState:
    """The finished state for an engine's finish reason (not DEADLINE or TOOL_CALLS, which
    only the APIs use)."""
    return RequestState(reason.value)
