"""Decisions are short records, each with a status, all indexed (issue 53 item 8)."""

from __future__ import annotations

import re
from pathlib import Path

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "decisions"
STATUS = re.compile(r"^\**Status:\**\s*(accepted|superseded)\b", re.MULTILINE)


def records() -> list[Path]:
    return sorted(p for p in RECORDS.glob("*.md") if p.name != "README.md")


def test_every_record_says_its_status() -> None:
    missing = [p.name for p in records() if not STATUS.search(p.read_text())]
    assert missing == []


def test_every_record_is_in_the_index_and_every_index_link_opens() -> None:
    index = (RECORDS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    assert {p.name for p in records()} <= linked
    assert [n for n in linked if not (RECORDS / n).is_file()] == []


def test_records_stay_short() -> None:
    long = {p.name: n for p in records() if (n := len(p.read_text().splitlines())) > 60}
    assert long == {}
