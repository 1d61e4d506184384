"""Safe Markdown and SSE framing (pure functions of web/)."""

from __future__ import annotations

from tests.browser.support import HOSTILE, sse_events
from web import markdown, sse


def test_markdown_escapes_markup_before_anything_else() -> None:
    html = markdown.render(HOSTILE + "\n\n**bold " + HOSTILE + "**")
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;" in html and "&lt;img src=x onerror=" in html
    assert "<strong>bold &lt;script&gt;" in html


def test_markdown_allows_a_small_subset() -> None:
    html = markdown.render("# Plan\nSome *quiet* and **loud** words with `x < y`.\n\n"
                           "- one\n- two\n\n1. first\n2. second\n\n```py\nif a < b:\n"
                           "    pass\n```\nafter")
    assert '<p class="md-h"><strong>Plan</strong></p>' in html
    assert "<em>quiet</em>" in html and "<strong>loud</strong>" in html
    assert "<code>x &lt; y</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert "<ol><li>first</li><li>second</li></ol>" in html
    assert "<pre><code>if a &lt; b:\n    pass</code></pre><p>after</p>" in html


def test_markdown_has_no_links_images_or_raw_html() -> None:
    html = markdown.render("[x](javascript:alert(1)) ![i](http://e/x.png) <b>b</b> "
                           "<a href=x>a</a> snake_case_name 2*3*4")
    assert "<a" not in html and "<img" not in html and "<b>" not in html
    assert "snake_case_name" in html and "2*3*4" in html


def test_an_unfinished_code_block_stays_code() -> None:
    assert markdown.render("```\nhalf <b") == "<pre><code>half &lt;b</code></pre>"


def test_sse_events_keep_newlines_inside_one_event() -> None:
    raw = sse.event("token", "a\nb\r\nc\rd") + sse.event("done", "<p>x</p>")
    assert raw.decode().count("event: ") == 2
    assert sse_events(raw.decode()) == [("token", "a\nb\nc\nd"), ("done", "<p>x</p>")]
    assert sse.event("token", " lead").decode() == "event: token\ndata:  lead\n\n"
