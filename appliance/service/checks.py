"""The checks a request passes before it is queued: sampling values, stop strings, the
context and the user's quotas. Each refusal is a domain error (``service.errors``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from appliance.engine.request import SEED_LIMIT, SamplingParams
from appliance.sched.quota import QuotaLimits, QuotaVerdict
from appliance.service.errors import InvalidRequest, OverQuota
from appliance.service.services import ModelInfo
from appliance.store import limits
from appliance.store.db import Store


class SamplingAsk(Protocol):
    """What a caller asks of sampling (OpenAI's fields; the API's bodies have them)."""

    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def stop(self) -> str | list[str] | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def logit_bias(self) -> Mapping[str, float] | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def n(self) -> int: ...
    @property
    def best_of(self) -> int | None: ...
    @property
    def logprobs(self) -> bool | int | None: ...


@dataclass(frozen=True, slots=True)
class Defaults:
    """Ask nothing of sampling: greedy, no stops (the web chat and jobs)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: Mapping[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: bool | int | None = None


DEFAULTS = Defaults()


def _check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}.",
                             param=name)


def sampling_from(body: SamplingAsk, vocab_size: int) -> SamplingParams:
    _check_range("temperature", body.temperature, 0.0, 2.0)
    _check_range("top_p", body.top_p, 0.0, 1.0)
    _check_range("min_p", body.min_p, 0.0, 1.0)
    _check_range("top_k", body.top_k, 0, 1 << 31)
    _check_range("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    _check_range("repetition_penalty", body.repetition_penalty, 0.0, 10.0)
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise InvalidRequest(f"'seed' must be an integer from 0 to 2**64 - 1, got "
                             f"{body.seed}.", param="seed")
    if body.n != 1:
        raise InvalidRequest("Only n=1 is supported.", "unsupported_value", "n")
    if body.best_of not in (None, 1):
        raise InvalidRequest("Only best_of=1 is supported.", "unsupported_value", "best_of")
    if body.logprobs:
        raise InvalidRequest("logprobs are not supported by this server.",
                             "unsupported_value", "logprobs")
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}.",
                                 param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token {token} is outside the vocabulary "
                                 f"(0..{vocab_size - 1}).", param="logit_bias")
        _check_range("logit_bias value", value, -100.0, 100.0)
        bias.append((token, value))
    return SamplingParams(
        temperature=0.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(bias), seed=body.seed)


def stops_from(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise InvalidRequest("At most 4 stop sequences are allowed.", param="stop")
    return tuple(s for s in stops if s)


def max_tokens_from(value: int | None, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise InvalidRequest(f"'max_tokens' must be at least 1, got {value}.",
                             param="max_tokens")
    return value


def check_prompt_size(model: ModelInfo, chars: int, param: str = "messages") -> None:
    """Refuse, before templating or tokenising anything, a prompt whose ``chars`` characters
    cannot fit the context whatever the tokenizer makes of them (at least
    ``chars // max_token_chars`` tokens): a 5 MB prompt costs no tokenizer time."""
    if model.max_token_chars <= 0:
        return
    at_least = chars // model.max_token_chars
    if at_least >= model.ctx_limit:
        raise InvalidRequest(
            f"This model's maximum context length is {model.ctx_limit} tokens. However, "
            f"your prompt has {chars} characters, at least {at_least} tokens, which leaves "
            "no room for an answer. Shorten the prompt or the conversation.",
            "context_length_exceeded", param)


def check_context(n_prompt: int, ctx_limit: int) -> None:
    if n_prompt == 0:
        raise InvalidRequest("The prompt is empty.", param="prompt")
    if n_prompt >= ctx_limit:
        raise InvalidRequest(
            f"This model's maximum context length is {ctx_limit} tokens. However, your "
            f"prompt has {n_prompt} tokens, which leaves no room for an answer. Shorten the "
            "prompt or the conversation.", "context_length_exceeded", "messages")


def quota_of(store: Store, user_id: int) -> QuotaLimits:
    with store.read_sessions() as s:
        return limits.get_quota(s, user_id)


def over_quota(verdict: QuotaVerdict) -> OverQuota:
    return OverQuota(f"Over quota: {verdict.message}.", verdict.limit,
                     retry_after_s=verdict.retry_after_s)
