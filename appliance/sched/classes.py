"""Priority classes: voice > interactive > background."""

from __future__ import annotations

import enum


class Klass(enum.IntEnum):
    """Higher value goes first."""

    BACKGROUND = 0
    INTERACTIVE = 1
    VOICE = 2

    @classmethod
    def parse(cls, name: str) -> Klass:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(
                f"unknown class {name!r}; use voice, interactive or background") from None

    @property
    def label(self) -> str:
        return self.name.lower()
