"""What the GGUF importer's parts share: its one error, and reading one metadata value."""

from __future__ import annotations

from typing import Any


class ImportRefused(ValueError):
    """The file cannot be imported; the message says what is missing or wrong."""


def meta_value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ImportRefused(f"the file's metadata has no {key}")
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    return value
