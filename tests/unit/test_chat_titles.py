"""A generated conversation title is cleaned to a few words (issue 54)."""

from __future__ import annotations

from web.titles import clean


def test_a_generated_title_is_its_first_line_without_quotes_or_labels() -> None:
    assert clean('Title: "Leek soup for four."\nMore words') == "Leek soup for four"
    assert clean("\n\n**Weekend bread plans**") == "Weekend bread plans"
    assert clean("  !!  ") == ""
    assert clean("<tool_call>\n") == ""  # a model's markup is no title
    assert clean('Turned off the porch", "arguments": {"name"') == "Turned off the porch"
    assert clean('The "best" soup') == 'The "best" soup'
    assert clean("word " * 30).endswith("…")
