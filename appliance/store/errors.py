"""Errors raised by the store's functions (besides ``ValueError`` for invalid input)."""

from __future__ import annotations


class StoreError(Exception):
    """Base class for store errors that callers turn into user-facing messages."""


class NotFound(StoreError, LookupError):
    """The row does not exist, or it belongs to someone else (the two are not told apart)."""


class AlreadyExists(StoreError):
    """A row with the same unique name already exists."""


class LastAdmin(StoreError):
    """The change would leave the appliance without an enabled admin."""
