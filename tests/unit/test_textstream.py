"""Stop strings never leak a partial match into the stream."""

from __future__ import annotations

from appliance.engine.textstream import TextStream


class CharDetok:
    """A fake detokenizer where token i is the i-th character of a script."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.text = ""
        self.offset = 0

    def add_token(self, token: int) -> None:
        self.text += self.script[token]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        seg, self.offset = self.text[self.offset:], len(self.text)
        return seg


def run(script: str, stops: tuple[str, ...]) -> tuple[list[str], str, bool]:
    ts = TextStream(CharDetok(script), stops)
    out = []
    for i in range(len(script)):
        out.append(ts.push(i))
        if ts.stopped:
            break
    return out, ts.finish(), ts.stopped


def test_text_before_a_stop_string_is_shown_and_the_stop_is_not() -> None:
    out, tail, stopped = run("hello END more", ("END",))
    assert "".join(out) + tail == "hello "
    assert stopped


def test_a_partial_match_is_held_back_then_released() -> None:
    out, tail, stopped = run("a EN b", ("END",))
    assert out[2] == ""  # 'E' held
    assert out[3] == ""  # 'EN' held
    assert out[4] == "EN "  # released once it cannot be a stop any more
    assert "".join(out) + tail == "a EN b"
    assert not stopped


def test_without_stops_every_token_is_released_at_once() -> None:
    out, tail, _ = run("abc", ())
    assert out == ["a", "b", "c"] and tail == ""
