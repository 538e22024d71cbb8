"""Errors raised by the wire contract.

Every error that comes from bad input names the field and the offending value, so an operator reading
a log line or a tape record knows what to fix without a debugger.
"""
from __future__ import annotations

from typing import Any


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WireError(ValueError):
    """A message, header or chunk from the wire (or about to go on it) is not acceptable.

    `code` is a stable machine-readable reason (used as a counter label and in tape records),
    `field` the dotted path of the offending field (or None), `value` the offending value.
    """

    code = "invalid"

    def __init__(self, message: str, *, field: str | None = None, value: Any = None, code: str | None = None):
        if code is not None:
            self.code = code
        self.field = field
        self.value = value
        detail = message
        if field is not None:
            detail = f"{message} (field {field!r}, value {_short(value)})"
        super().__init__(detail)


class SchemaError(WireError):
    code = "schema"


class DecodeError(WireError):
    code = "malformed"


class IdError(WireError):
    code = "bad_id"


class ChunkError(WireError):
    """Base of the chunk reassembly errors; each case has its own subclass and code."""

    code = "chunk"
