"""Quota checks: which limit, what the message says, when to retry."""

from __future__ import annotations

import pytest

from appliance.sched.quota import (
    DAY_S,
    QuotaLimits,
    QuotaVerdict,
    check_admission,
    effective_max_tokens,
    exhausted,
    format_duration,
    reset_after,
)
from appliance.store import limits as store_limits
from appliance.vocab import Klass

NOW = 1_000_000.0
IA, VO = Klass.INTERACTIVE, Klass.VOICE


def check(limits: QuotaLimits, usage: int = 0, running: int = 0, prompt: int = 100,
          max_tokens: int = 100, klass: Klass = IA, max_class: Klass = VO,
          events: list[tuple[float, int]] | None = None) -> QuotaVerdict | None:
    return check_admission(limits, usage, running, prompt, max_tokens, klass, max_class,
                           NOW, NOW - DAY_S, events)


def test_the_scheduler_and_the_store_share_one_limits_type() -> None:
    assert QuotaLimits is store_limits.QuotaLimits
    with pytest.raises(ValueError, match="tokens_per_day"):
        QuotaLimits(tokens_per_day=0)


def test_alice_without_limits_is_never_refused() -> None:
    assert check(QuotaLimits(), usage=10**9, running=100, prompt=10**6) is None


def test_carol_over_her_daily_tokens_is_told_when_it_resets() -> None:
    events = [(NOW - DAY_S + 3 * 3600 + 11 * 60 + 30, 15_000), (NOW - 60, 5_000)]
    v = check(QuotaLimits(tokens_per_day=20_000), usage=20_000, events=events)
    assert v is not None and v.limit == "tokens_per_day"
    assert v.message == "daily token quota of 20000 tokens used; resets in 3h12m"
    assert v.retry_after_s == 3 * 3600 + 11 * 60 + 30


def test_without_ledger_rows_the_reset_is_a_conservative_full_day() -> None:
    v = check(QuotaLimits(tokens_per_day=20_000), usage=20_000)
    assert v is not None and v.retry_after_s == int(DAY_S)
    assert "resets in 24h0m" in v.message


def test_a_prompt_that_does_not_fit_in_what_is_left_today_is_refused() -> None:
    events = [(NOW - DAY_S + 600, 19_000), (NOW - 10, 500)]
    v = check(QuotaLimits(tokens_per_day=20_000), usage=19_500, prompt=1000, events=events)
    assert v is not None
    assert v.message.startswith("prompt of 1000 tokens does not fit in the 500 tokens left")
    assert v.retry_after_s == 600


def test_a_prompt_larger_than_the_whole_daily_quota_can_never_run() -> None:
    v = check(QuotaLimits(tokens_per_day=500), prompt=1000)
    assert v is not None and v.retry_after_s is None


def test_a_prompt_that_fits_exactly_is_admitted() -> None:
    assert check(QuotaLimits(tokens_per_day=1000), usage=899, prompt=100) is None


def test_bob_at_his_concurrency_limit_is_told_to_retry_shortly() -> None:
    v = check(QuotaLimits(max_concurrent=2), running=2)
    assert v is not None and v.limit == "max_concurrent" and v.retry_after_s == 1
    assert check(QuotaLimits(max_concurrent=2), running=1) is None


def test_per_request_limits_say_retrying_will_not_help() -> None:
    v = check(QuotaLimits(max_prompt_tokens=50), prompt=51)
    assert v is not None and v.limit == "max_prompt_tokens" and v.retry_after_s is None
    assert "51 tokens" in v.message and "50" in v.message
    v = check(QuotaLimits(max_output_tokens=50), max_tokens=51)
    assert v is not None and v.limit == "max_output_tokens" and v.retry_after_s is None


def test_a_class_above_the_users_maximum_is_refused() -> None:
    v = check(QuotaLimits(), klass=VO, max_class=IA)
    assert v is not None and v.limit == "max_class"
    assert v.message == ("class voice is above your maximum class interactive; "
                         "ask for interactive or lower")
    assert check(QuotaLimits(), klass=Klass.BACKGROUND, max_class=IA) is None


def test_per_request_limits_are_reported_before_the_daily_one() -> None:
    v = check(QuotaLimits(tokens_per_day=10, max_prompt_tokens=5), usage=10, prompt=6)
    assert v is not None and v.limit == "max_prompt_tokens"


def test_the_server_default_max_tokens_is_clamped_not_refused() -> None:
    limits = QuotaLimits(max_output_tokens=256)
    assert effective_max_tokens(limits, None, 512) == 256
    assert effective_max_tokens(limits, 1000, 512) == 1000  # explicit: check refuses it
    assert effective_max_tokens(QuotaLimits(), None, 512) == 512


def test_a_running_request_stops_once_the_days_tokens_are_used() -> None:
    assert not exhausted(QuotaLimits(tokens_per_day=100), 99)
    assert exhausted(QuotaLimits(tokens_per_day=100), 100)
    assert not exhausted(QuotaLimits(), 10**12)


def test_rows_older_than_the_window_are_ignored() -> None:
    rows = [(NOW - DAY_S - 5, 10_000), (NOW - 100, 50)]
    assert reset_after(100, 100, 1, NOW, rows, NOW - DAY_S) == DAY_S - 100


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (45, "45s"), (60, "1m"), (61, "2m"), (3 * 3600 + 11 * 60 + 1, "3h12m"),
    (DAY_S, "24h0m")])
def test_durations_read_like_a_person_wrote_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
