"""Safe Markdown (markdown-it-py, raw HTML off) and SSE framing (pure functions of web/)."""

from __future__ import annotations

from tests.browser.support import HOSTILE, sse_events
from web import markdown, sse


def test_markdown_escapes_markup_before_anything_else() -> None:
    html = markdown.render(HOSTILE + "\n\n**bold " + HOSTILE + "**")
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;" in html and "&lt;img src=x onerror=" in html
    assert "<strong>bold &lt;script&gt;" in html


def test_markdown_renders_commonmark_with_tables() -> None:
    html = markdown.render("# Plan\nSome *quiet* and **loud** words with `x < y`.\n\n"
                           "- one\n- two\n\n1. first\n2. second\n\n```py\nif a < b:\n"
                           "    pass\n```\nafter\n\n| a | b |\n|---|---|\n| 1 | <b>2</b> |")
    assert "<h1>Plan</h1>" in html
    assert "<em>quiet</em>" in html and "<strong>loud</strong>" in html
    assert "<code>x &lt; y</code>" in html
    assert "<li>one</li>" in html and "<ol>" in html
    assert '<pre><code class="language-py">if a &lt; b:\n    pass\n</code></pre>' in html
    assert "<table>" in html and "<td>&lt;b&gt;2&lt;/b&gt;</td>" in html


def test_links_are_safe_and_images_and_raw_html_are_text() -> None:
    html = markdown.render("[x](javascript:alert(1)) [y](JaVaScRiPt:alert(1)) "
                           "[z](data:text/html,hi) ![i](http://e/x.png) <b>b</b> "
                           "<a href=x>a</a> [ok](https://example.org/a?b=1&c=2) "
                           "snake_case_name")
    assert "javascript" not in html.split("[x](")[0]
    assert 'href="javascript' not in html.lower() and 'href="data' not in html
    assert "<img" not in html and "<b>" not in html and "<a href=x>" not in html
    assert ('<a href="https://example.org/a?b=1&amp;c=2" rel="noopener noreferrer" '
            'target="_blank">ok</a>') in html
    assert "snake_case_name" in html  # no emphasis inside a word


def test_a_code_block_language_cannot_break_out_of_its_class() -> None:
    html = markdown.render('```"><script>alert(1)</script>\nx\n```')
    assert "<script" not in html and 'class="language-&quot;&gt;&lt;script&gt;' in html


def test_an_unfinished_code_block_stays_code() -> None:
    assert markdown.render("```\nhalf <b").strip() == "<pre><code>half &lt;b</code></pre>"


def test_sse_events_keep_newlines_inside_one_event() -> None:
    raw = sse.event("token", "a\nb\r\nc\rd") + sse.event("done", "<p>x</p>")
    assert raw.decode().count("event: ") == 2
    assert sse_events(raw.decode()) == [("token", "a\nb\nc\nd"), ("done", "<p>x</p>")]
    assert sse.event("token", " lead").decode() == "event: token\ndata:  lead\n\n"
