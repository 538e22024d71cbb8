"""Errors raised for bad input: `WireError` for what comes from the wire (or is about to go on it),
`ConfigError` for an operator's settings (flags, `YETO_*` variables, keyword arguments).

Both name the field and the offending value, so an operator reading a log line or a tape record knows
what to fix without a debugger. Both are ValueErrors; they are separate classes because a receiver
counts and drops a WireError and keeps running, while a ConfigError is the operator's to fix and is
raised where the setting is read, before the process joins a run.
"""
from __future__ import annotations

from typing import Any


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class FieldError(ValueError):
    """A value refused, with where it was and what it was.

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


class WireError(FieldError):
    """A message, header or chunk from the wire (or about to go on it) is not acceptable."""


class ConfigError(FieldError):
    """A setting (CLI flag, `YETO_*` variable, constructor argument) is not acceptable; `field` names it."""

    code = "config"


class SchemaError(WireError):
    code = "schema"


class DecodeError(WireError):
    code = "malformed"


class IdError(WireError):
    code = "bad_id"


class ChunkError(WireError):
    """Base of the chunk reassembly errors; each case has its own subclass and code."""

    code = "chunk"


class ConnectError(ConnectionError):
    """The broker could not be reached (or refused us) when a command started: the message names the URL,
    what went wrong and what to do. Commands exit 1 on it with that one line (no traceback)."""
