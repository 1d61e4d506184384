"""Issue 53's leftovers: the data folder's secret, words refused as ``Refused`` (a 400; any
other ValueError is a bug and a 500), and fault hooks only for the test suite."""

from __future__ import annotations

import os
import stat
from datetime import UTC
from pathlib import Path

import pytest

from appliance.vocab import Refused


def test_the_secret_is_made_private_from_its_first_byte(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.app import app_secret

    def no_chmod(*_: object, **__: object) -> None:
        raise AssertionError("made readable first, then chmodded")

    monkeypatch.setattr(os, "chmod", no_chmod)
    old = os.umask(0)
    try:
        secret = app_secret(tmp_path / "data")
    finally:
        os.umask(old)
    path = tmp_path / "data" / "secret.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret) >= 32 and app_secret(tmp_path / "data") == secret
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret.key"]  # no temp left


@pytest.mark.parametrize("text", ["teatime", "every 0 hours", "every day at 25"])
def test_a_schedule_in_words_is_refused_in_words(text: str) -> None:
    from appliance.jobs.phrases import parse_schedule

    with pytest.raises(Refused):
        parse_schedule(text)


@pytest.mark.parametrize("kind, cron, interval", [
    ("cron", "* *", None), ("cron", "99 * * * *", None), ("interval", None, None),
    ("sometimes", None, None)])
def test_a_bad_trigger_is_refused_in_words(kind: str, cron: str | None,
                                           interval: int | None) -> None:
    from appliance.jobs.schedule import make_trigger

    with pytest.raises(Refused):
        make_trigger(kind, cron, interval, 0.0, UTC)


def test_the_jobs_page_refuses_an_interval_that_is_not_minutes() -> None:
    from web.jobs import _minutes

    assert _minutes(" ") is None and _minutes("15") == 15
    with pytest.raises(Refused, match="whole number of minutes"):
        _minutes("abc")


def test_fault_hooks_are_ignored_without_the_test_switch(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    from appliance.cli import TEST_HOOKS_ENV, test_hooks
    from appliance.engine.faults import ENV as FAULT_ENV
    from appliance.store.faults import TEST_ENV as STORE_FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "step:1")
    monkeypatch.setenv(STORE_FAULT_ENV, str(tmp_path / "fault"))
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    assert test_hooks() == (None, None)
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    assert test_hooks() == ("step:1", tmp_path / "fault")


def test_an_ollama_name_too_long_is_refused_in_words(tmp_path: Path) -> None:
    from appliance.models import import_source

    with pytest.raises(Refused):
        import_source("ollama:" + "x" * 400, tmp_path)
