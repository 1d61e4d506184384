"""Errors raised by the store's functions; the app maps each to its HTTP status."""

from __future__ import annotations

from appliance.vocab import Refused


class StoreError(Exception):
    """Base class for store errors that callers turn into user-facing messages."""


class NotFound(StoreError, LookupError):
    """The row does not exist, or it belongs to someone else (the two are not told apart)."""


class AlreadyExists(StoreError):
    """A row with the same unique name already exists."""


class LastAdmin(StoreError):
    """The change would leave the appliance without an enabled admin."""


class Invalid(StoreError, Refused):
    """Input refused, in words for the person who typed it (a 400). A ``ValueError`` so
    that callers catching that keep working; any other ``ValueError`` is a bug (a 500)."""
