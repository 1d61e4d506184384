"""The failed-login throttle as a pure object: who is limited, and how much memory it keeps."""

from __future__ import annotations

from appliance.service.throttle import LoginThrottle


def test_five_failures_block_that_account_from_that_address_only() -> None:
    t = LoginThrottle()
    for i in range(5):
        assert t.retry_after("alice", "10.0.0.66", i) is None
        t.failed("alice", "10.0.0.66", i)
    wait = t.retry_after("alice", "10.0.0.66", 5)
    assert wait is not None and 0 < wait <= 15 * 60
    # the real alice, at home on another address, is not locked out by the attacker
    assert t.retry_after("alice", "10.0.0.2", 5) is None
    assert t.retry_after("ALICE", "10.0.0.66", 5) is not None  # names are case-insensitive


def test_an_address_trying_many_names_is_limited_per_address() -> None:
    t = LoginThrottle(per_address=20)
    for i in range(20):
        t.failed(f"name{i}", "10.0.0.66", i)
    assert t.retry_after("someone-new", "10.0.0.66", 21) is not None
    assert t.retry_after("someone-new", "10.0.0.2", 21) is None


def test_a_small_global_ceiling_holds_back_failing_addresses_for_a_minute_only() -> None:
    t = LoginThrottle(global_per_minute=30)
    for i in range(30):
        t.failed("alice", f"10.0.{i}.1", 0.0)
    wait = t.retry_after("bob", "10.0.3.1", 1.0)  # an address that failed: held back
    assert wait is not None and wait <= 60
    assert t.retry_after("bob", "10.0.3.1", 61.0) is None


def test_failures_elsewhere_never_lock_out_an_address_with_a_clean_record() -> None:
    """Issue 37: 15 failures for made-up names from each of two addresses (each under its
    own limit) reached the global ceiling, and the real user at a third got 429."""
    t = LoginThrottle()
    for i in range(15):
        for address in ("10.6.0.1", "10.6.0.2"):
            t.failed(f"made-up-{i}", address, float(i))
    assert t.retry_after("carol", "10.6.0.3", 16.0) is None
    assert t.retry_after("made-up-99", "10.6.0.1", 16.0) is not None  # the guessers wait


def test_asking_creates_no_entry_and_refused_attempts_cost_nothing() -> None:
    t = LoginThrottle()
    for i in range(10_000):
        assert t.retry_after(f"probe{i}" * 8, f"10.1.{i % 250}.{i // 250}", 0.0) is None
    assert len(t) == 0


def test_memory_is_bounded_and_entries_expire() -> None:
    t = LoginThrottle(max_entries=100, global_per_minute=10**9)
    for i in range(5_000):
        t.failed(f"n{i}", f"10.2.{i % 250}.{i // 250}", float(i) / 1000)
    assert len(t) <= 100
    assert all(len(q) <= 20 for q in t._fails.values())
    t.retry_after("x", "10.9.9.9", 16 * 60.0)  # a quarter hour later everything is gone
    assert len(t) == 0


def test_the_right_password_clears_that_pair_but_not_the_address_count() -> None:
    t = LoginThrottle(per_address=6)
    for i in range(4):
        t.failed("bob", "10.0.0.5", i)
    t.succeeded("bob", "10.0.0.5")
    t.failed("bob", "10.0.0.5", 5)
    assert t.retry_after("bob", "10.0.0.5", 6) is None
    t.failed("carol", "10.0.0.5", 7)
    assert t.retry_after("dave", "10.0.0.5", 8) is not None  # 6 from the address in all


def test_the_connection_cap_stays_below_the_open_file_limit() -> None:
    from appliance.httpserver import FD_RESERVE, connection_cap

    assert connection_cap(1000, 4096) == 1000
    assert connection_cap(5000, 2048) == 2048 - FD_RESERVE
    assert connection_cap(1000, 100) == 1
