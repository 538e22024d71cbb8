"""Identifiers that become NATS subject tokens, and connection generations.

Run and island ids are embedded in subjects, stream names and consumer names; a dot, a wildcard or a
space there would silently change which messages a subscription sees, so anything outside
`[A-Za-z0-9_-]+` is refused before it reaches a subject.
"""
from __future__ import annotations

import re
import secrets

from .errors import IdError

TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")
GEN_RE = re.compile(r"^[0-9a-f]{16}$")
# Stream names are limited by the server (and show up in file paths of the store); keep ids short.
MAX_ID_LEN = 64


def check_token(value: object, field: str) -> str:
    """Return `value` if it is a legal subject token, else raise IdError naming `field` and the value."""
    if not isinstance(value, str) or not TOKEN_RE.fullmatch(value):
        raise IdError("must match [A-Za-z0-9_-]+ (it becomes a NATS subject token)", field=field, value=value)
    if len(value) > MAX_ID_LEN:
        raise IdError(f"must be at most {MAX_ID_LEN} characters", field=field, value=value)
    return value


def check_run(run: object) -> str:
    return check_token(run, "run")


def check_island(island: object) -> str:
    return check_token(island, "island")


def new_generation() -> str:
    """A random 64-bit connection generation as 16 hex characters.

    Hex text, not a JSON number: JSON numbers lose bits past 2**53 in many decoders.
    """
    return secrets.token_hex(8)


def check_gen(value: object, field: str = "gen") -> str:
    if not isinstance(value, str) or not GEN_RE.fullmatch(value):
        raise IdError("must be 16 lowercase hex characters", field=field, value=value)
    return value
