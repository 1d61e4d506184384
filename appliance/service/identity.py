"""Who a request is for: the user (and key) every submission is charged to."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.vocab import Klass


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: int
    name: str
    role: str
    max_class: str
    """The highest class this principal may use (user's and key's maximum combined)."""
    key_id: int | None = None
    default_class: str | None = None
    """The class of a request that asks for none (a key's ``default_class``, capped);
    None means ``max_class``."""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def klass(self) -> Klass:
        return Klass.parse(self.max_class)
