"""Continue joins an answer and its continuation with the space the model meant (issue 54:
"measureout", "theflavor"), and a generated title is cleaned to a few words."""

from __future__ import annotations

from appliance.service.continuation import join
from web.titles import clean


def test_the_join_adds_the_dropped_space_and_nothing_else() -> None:
    assert join("Use a measure", "out cup.", spaced=True) == "Use a measure out cup."
    assert join("Use a measure", "ment cup.", spaced=False) == "Use a measurement cup."
    assert join("Use a measure ", "out", spaced=True) == "Use a measure out"  # has one
    assert join("Use a measure", " out", spaced=True) == "Use a measure out"
    assert join("Use a measure", "", spaced=True) == "Use a measure"
    assert join("", "Soup", spaced=True) == "Soup"


def test_a_generated_title_is_its_first_line_without_quotes_or_labels() -> None:
    assert clean('Title: "Leek soup for four."\nMore words') == "Leek soup for four"
    assert clean("\n\n**Weekend bread plans**") == "Weekend bread plans"
    assert clean("  !!  ") == ""
    assert clean("word " * 30).endswith("…")
