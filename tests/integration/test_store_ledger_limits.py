"""Ledger sums, quotas and persisted fairness counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.store import ledger, limits
from appliance.store.db import Store, open_store
from appliance.store.ledger import LedgerRecord
from appliance.store.limits import QuotaLimits

NOW = 1_800_000_000.0






def record(
    request_id: str, user_id: int, finished_at: float, prompt: int, output: int, cached: int = 0,
    ttft_ms: float | None = 100.0, preemptions: int = 0,
) -> LedgerRecord:
    return LedgerRecord(
        request_id=request_id, user_id=user_id, api_key_id=None, klass="interactive",
        endpoint="/v1/chat/completions", model="demo", prompt_tokens=prompt,
        cached_tokens=cached, output_tokens=output, queued_at=finished_at - 2.0,
        admitted_at=finished_at - 1.5, first_token_at=finished_at - 1.0,
        finished_at=finished_at, finish_reason="stop", preemptions=preemptions,
        ttft_ms=ttft_ms, itl_mean_ms=20.0, itl_p95_ms=35.0,
    )


def test_usage_sums_tokens_per_user_over_the_last_hour_and_day(
    store: Store, ids: dict[str, int]
) -> None:
    alice, bob = ids["alice"], ids["bob"]
    with store.sessions.begin() as s:
        ledger.insert_records(s, [
            record("a1", alice, NOW - 60, prompt=100, output=50, cached=40, ttft_ms=100.0),
            record("a2", alice, NOW - 1800, prompt=10, output=5, ttft_ms=300.0, preemptions=2),
            record("a3", alice, NOW - 7200, prompt=1000, output=500),  # day, not hour
            record("a4", alice, NOW - 90000, prompt=9999, output=9999),  # older than a day
            record("b1", bob, NOW - 10, prompt=7, output=3),
        ])
    with store.read_sessions() as s:
        hour = ledger.usage_last_hour(s, NOW)
        day = ledger.usage_last_day(s, NOW)
        assert hour[alice].requests == 2
        assert (hour[alice].prompt_tokens, hour[alice].output_tokens) == (110, 55)
        assert hour[alice].cached_tokens == 40
        assert hour[alice].total_tokens == 165
        assert hour[alice].computed_tokens == 125
        assert hour[alice].preemptions == 2
        assert hour[alice].ttft_ms_mean == pytest.approx(200.0)
        assert day[alice].total_tokens == 165 + 1500
        assert hour[bob].total_tokens == day[bob].total_tokens == 10
        assert ids["carol"] not in day


def test_resubmitting_a_request_id_does_not_count_it_twice(
    store: Store, ids: dict[str, int]
) -> None:
    row = record("same", ids["bob"], NOW, prompt=10, output=10)
    for _ in range(2):
        with store.sessions.begin() as s:
            ledger.insert_records(s, [row])
    with store.read_sessions() as s:
        assert ledger.usage_last_day(s, NOW)[ids["bob"]].requests == 1


def test_users_without_quota_rows_are_unlimited(store: Store, ids: dict[str, int]) -> None:
    with store.read_sessions() as s:
        assert limits.get_quota(s, ids["bob"]) == limits.UNLIMITED
        assert limits.load_quotas(s) == {}


def test_admin_sets_and_clears_carols_quota(store: Store, ids: dict[str, int]) -> None:
    carol = ids["carol"]
    tight = QuotaLimits(tokens_per_day=5000, max_concurrent=1, max_output_tokens=256)
    with store.sessions.begin() as s:
        limits.set_quota(s, carol, tight)
    with store.read_sessions() as s:
        assert limits.get_quota(s, carol) == tight
        assert limits.load_quotas(s) == {carol: tight}
    with store.sessions.begin() as s:
        limits.set_quota(s, carol, QuotaLimits(tokens_per_day=9000))
    with store.read_sessions() as s:
        assert limits.get_quota(s, carol) == QuotaLimits(tokens_per_day=9000)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_quota_limits_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ValueError):
        QuotaLimits(tokens_per_day=bad)  # type: ignore[arg-type]


def test_counters_survive_a_restart(store: Store, ids: dict[str, int], tmp_path: Path) -> None:
    with store.sessions.begin() as s:
        limits.save_counters(s, {ids["alice"]: 12.5, ids["bob"]: 3.0}, now=NOW)
    with store.sessions.begin() as s:
        limits.save_counters(s, {ids["bob"]: 40.25}, now=NOW + 1)
    store.close()
    reopened = open_store(tmp_path / "appliance.db")
    try:
        with reopened.read_sessions() as s:
            assert limits.load_counters(s) == {ids["alice"]: 12.5, ids["bob"]: 40.25}
    finally:
        reopened.close()
