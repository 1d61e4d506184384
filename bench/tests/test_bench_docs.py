"""docs/PERFORMANCE.md stays a page of current figures whose commands run (issue 53 item 8)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from bench import goodput, prefill, serve
from bench.fairness_config import build_parser as fairness_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "PERFORMANCE.md"
PARSERS = {"serve": serve.build_parser, "fairness": fairness_parser,
           "goodput": goodput.build_parser, "prefill": prefill.build_parser}


def commands(text: str) -> list[tuple[str, list[str]]]:
    """Every `python -m bench.X ...` on the page, code spans and blocks, continuations joined."""
    text = text.replace("\\\n", " ")
    found = []
    for m in re.finditer(r"python -m bench\.(\w+)([^`\n#]*)", text):
        found.append((m.group(1), shlex.split(m.group(2).replace("$GGUF", "F.gguf"))))
    return found


def test_the_page_is_at_most_200_lines() -> None:
    assert len(PAGE.read_text().splitlines()) <= 200


def test_every_harness_command_on_the_page_parses_with_todays_flags() -> None:
    checked = 0
    for module, argv in commands(PAGE.read_text()):
        if module not in PARSERS:
            continue
        parser = PARSERS[module]()
        assert isinstance(parser, argparse.ArgumentParser)
        flags = [a.split("=")[0] for a in argv if a.startswith("--")]
        known = set(parser._option_string_actions)
        assert [f for f in flags if f not in known] == [], f"bench.{module}: {argv}"
        checked += 1
    assert checked >= 5


def test_the_command_finder_sees_a_removed_flag() -> None:
    text = "`python -m bench.serve --json x.json`"
    (module, argv), = commands(text)
    with pytest.raises(SystemExit):
        PARSERS[module]().parse_args(argv)
