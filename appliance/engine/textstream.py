"""Token ids to streamed text, with stop strings that never leak a partial match."""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, detokenizer: Any, stops: tuple[str, ...] = (),
                 keep_leading_space: bool = False) -> None:
        if keep_leading_space:
            _keep_leading_space(detokenizer)
        self._detok = detokenizer
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to show.

        After a stop string completes, ``stopped`` is set and the text before it is returned.
        """
        self._detok.add_token(token)
        _release_space(self._detok)
        self._held += self._detok.last_segment
        return self._release()

    def finish(self) -> str:
        """Flush what is left at the end of generation."""
        if self.stopped:
            return ""
        self._detok.finalize()
        self._held += self._detok.last_segment
        out = self._release()
        if not self.stopped:
            out, self._held = out + self._held, ""
        return out

    def _release(self) -> str:
        if not self._stops:
            out, self._held = self._held, ""
            return out
        first = min((i for i in (self._held.find(s) for s in self._stops) if i >= 0),
                    default=-1)
        if first >= 0:
            self.stopped = True
            out, self._held = self._held[:first], ""
            return out
        keep = self._partial_suffix()
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest tail of the held text that starts some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:n]):
                    best = n
                    break
        return best


def _keep_leading_space(detok: Any) -> None:
    """mlx-lm's SentencePiece and byte-level detokenizers drop the space a text begins
    with (an answer's first word follows the template); a text that carries on an answer
    needs it, or Continue glues "measure" and "out". Set on this request's own copy."""
    if hasattr(detok, "trim_space"):  # SentencePiece
        detok.trim_space = False
    if hasattr(detok, "_maybe_trim_space"):  # byte-level BPE trims whenever text is empty
        detok._maybe_trim_space = lambda text: text


def _release_space(detok: Any) -> None:
    """mlx-lm's byte-level detokenizer holds a token that is one space back until the next
    one, so that it can drop it if it begins the text; past the beginning it drops nothing,
    so the space is text now. Held, it reached the client with the next token: a gap of two
    decode steps in the stream wherever the model wrote a lone space."""
    held = getattr(detok, "_unflushed", None)
    if held and detok.text and getattr(detok, "_decode_bytes", None) is not None \
            and detok._decode_bytes(held) == " ":
        detok.text += " "
        detok._unflushed = ""
