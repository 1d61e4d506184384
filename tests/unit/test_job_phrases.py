"""Schedules as a household types them."""

from __future__ import annotations

import pytest

from appliance.jobs.phrases import Schedule, parse_schedule


@pytest.mark.parametrize("text, cron", [
    ("0 7 * * *", "0 7 * * *"),
    ("  30  8 * *  mon-fri ", "30 8 * * mon-fri"),
    ("@daily", "0 0 * * *"), ("@hourly", "0 * * * *"), ("@weekly", "0 0 * * 0"),
    ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"), ("@midnight", "0 0 * * *"),
    ("Daily", "0 0 * * *"), ("hourly", "0 * * * *"),
    ("every day at 7", "0 7 * * *"),
    ("Every day at 7:30pm", "30 19 * * *"),
    ("daily at 07:00", "0 7 * * *"),
    ("every morning at 6.45", "45 6 * * *"),
    ("every monday at 8:30", "30 8 * * 1"),
    ("every Mondays at 8:30 am", "30 8 * * 1"),
    ("on sundays at noon", "0 12 * * 0"),
    ("every mon and thu at 18:00", "0 18 * * 1,4"),
    ("every tuesday, thursday at 9pm", "0 21 * * 2,4"),
    ("every weekday at 7:30am", "30 7 * * 1-5"),
    ("every weekend at 10", "0 10 * * 0,6"),
    ("every saturday", "0 0 * * 6"),
    ("at 7 every day", "0 7 * * *"),
    ("every day at midnight", "0 0 * * *"),
    ("every day at 12am", "0 0 * * *"), ("every day at 12pm", "0 12 * * *"),
    ("every day", "0 0 * * *"), ("every hour", "0 * * * *"),
    ("every minute", "* * * * *"), ("every 2 hours", "0 */2 * * *"),
    ("every 15 minutes", "*/15 * * * *"), ("every 6 hrs", "0 */6 * * *"),
])
def test_common_forms_become_a_cron(text: str, cron: str) -> None:
    assert parse_schedule(text) == Schedule("cron", cron)


@pytest.mark.parametrize("text, seconds", [
    ("every 90 minutes", 5400), ("every 5 hours", 18000), ("every 3 days", 259200)])
def test_steps_that_do_not_divide_the_hour_or_day_become_intervals(text: str,
                                                                   seconds: int) -> None:
    assert parse_schedule(text) == Schedule("interval", interval_s=seconds)


@pytest.mark.parametrize("text, words", [
    ("fortnightly", "not understood; use a 5-field cron"),
    ("7am", "'every day at 7'"),
    ("every day at 25", "not a time of day"),
    ("every day at 13pm", "1 to 12"),
    ("every funday at 7", "not understood"),
    ("every day at teatime", "'7:30'"),
    ("every 0 hours", "at least 1"),
    ("", "not understood"),
])
def test_anything_else_is_a_clear_error_naming_what_is_accepted(text: str,
                                                                words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        parse_schedule(text)
