"""Which versions a process speaks and which it accepts (docs/syncer.md "Versions and upgrades", docs/design.md §3.10).

- **protocol** (`v` in every message, `PROTOCOL_VERSION`): the compatibility gate. A syncer admits islands
  whose hello speaks a protocol in `ACCEPTED_PROTOCOLS`; an island joins a session whose `v` is in it.
  Anything else is refused before the schema is applied (`check_protocol`, called by the codec), in one line
  naming both sides' protocol and software, so an operator knows which side to upgrade.
- **software** (`software()`, e.g. "yeto-nats 0.1.0"): stated, never gated on (hello, session, the state
  written, the tape, the refusal line).
- **state format** (`STATE_FORMAT`): what a syncer writes to its checkpoint directory, the ckpt KV and the
  state KV's commit record. A syncer resumes any format in `READABLE_STATE_FORMATS`, migrating older ones
  in memory (`migrate_state`); a newer one is refused naming both formats. 1 = no `software` on the records
  (tests/fixtures/state-format-1/ as that code wrote it); 2 = `software` on every record and `format` on
  the commit record.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from yeto.schemas.errors import SchemaError

PACKAGE = "yeto-nats"
PROTOCOL_VERSION = 1
# The protocols this release reads, lowest..highest: admitting another one is this one edit (plus the
# schemas of that protocol, whose `v` const names the version they describe).
ACCEPTED_PROTOCOLS = (1, 1)

STATE_FORMAT = 2
# Resumable state formats, lowest..highest (the module doc says what each one is).
READABLE_STATE_FORMATS = (1, 2)
# A record without a `format` field was written before state was versioned.
UNVERSIONED_STATE_FORMAT = 1

# What `software` may hold on the wire (the schemas say the same): printable ASCII, short.
SOFTWARE_RE = re.compile(r"^[ -~]{1,64}$")


@functools.cache
def software() -> str:
    """This process's release, "yeto-nats X.Y.Z": the installed distribution's version, else (a checkout
    run without installing it) pyproject.toml's beside this package, else "unknown"."""
    try:
        return f"{PACKAGE} {metadata.version(PACKAGE)}"
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.MULTILINE)
    except OSError:
        found = None
    return f"{PACKAGE} {found.group(1) if found else 'unknown'}"


def accepts_protocol(v: int) -> bool:
    lo, hi = ACCEPTED_PROTOCOLS
    return lo <= v <= hi


def _stated(value: Any) -> str:
    # The peer's `software` comes from the wire unchecked (the schema has not run): show it only when it
    # is what the schema would allow, so a refusal line never carries a control character or a megabyte.
    return value if isinstance(value, str) and SOFTWARE_RE.fullmatch(value) else "software not stated"


class VersionError(SchemaError):
    """A peer speaks a protocol this release does not accept. `island` / `gen` are the message's own (when
    they are strings), so the syncer can answer the island that sent it; the caller checks them."""

    code = "protocol_version"

    def __init__(self, message: str, *, value: Any, island: Any = None, gen: Any = None):
        super().__init__(message, field="v", value=value)
        self.island, self.gen = island, gen


def protocol_refusal(v: int, their_software: Any, *, sender: str, reader: str) -> str:
    """The one line of a protocol refusal, naming both sides' protocol and release."""
    lo, hi = ACCEPTED_PROTOCOLS
    return (f"{sender} speaks protocol {v} ({_stated(their_software)}), this {reader} accepts {lo}..{hi} "
            f"({software()})")


def check_protocol(kind: str, msg: Any, *, from_island: bool) -> None:
    """Raise VersionError when `msg` (parsed, not yet validated) states an integer `v` outside
    ACCEPTED_PROTOCOLS. Runs before the schema: the schema's `v` const would refuse it too, but as a
    generic schema error. A `v` that is not an integer is left to the schema."""
    if not isinstance(msg, Mapping):
        return
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or accepts_protocol(v):
        return
    sender, reader = ("island", "syncer") if from_island else ("syncer", "island")
    err = VersionError(f"{kind}: " + protocol_refusal(v, msg.get("software"), sender=sender, reader=reader),
                       value=v, island=msg.get("island"), gen=msg.get("gen"))
    err.kind, err.rule = kind, "protocol"
    raise err


# ---------------------------------------------------------------------------------------------------- state

class StateFormatError(ValueError):
    """State this release cannot resume (a later release wrote it); the message names both sides."""


def state_format(record: Mapping) -> int:
    """The state format of a record a syncer wrote (checkpoint manifest, commit record, merge intent)."""
    fmt = record.get("format", UNVERSIONED_STATE_FORMAT)
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        raise StateFormatError(f"state format {fmt!r} is not an integer (field 'format')")
    return fmt


def check_state_format(record: Mapping, what: str) -> int:
    """The record's state format, if this release can resume it; else StateFormatError naming both."""
    fmt = state_format(record)
    lo, hi = READABLE_STATE_FORMATS
    if not lo <= fmt <= hi:
        raise StateFormatError(
            f"{what} is state format {fmt} (written by {_stated(record.get('software'))}), this syncer resumes "
            f"formats {lo}..{hi} ({software()}): resume it with a release that reads format {fmt}")
    return fmt


def migrate_state(record: Mapping, what: str) -> dict:
    """A copy of a readable record in today's format (in memory; the next write stores it so). Format 1 -> 2:
    `software` becomes None (not stated) and `migrated_from` says which format it was read from."""
    fmt = check_state_format(record, what)
    out = dict(record)
    if fmt < STATE_FORMAT:
        out.setdefault("software", None)
        out["migrated_from"] = fmt
    out["format"] = STATE_FORMAT
    return out


def stamp(record: dict) -> dict:
    """`record` with this release's state format and software (the fields every state record carries)."""
    mine = {"format": STATE_FORMAT, "software": software()}
    return {**mine, **record, **mine}   # first in the record's order, and never a stale pair from `record`


__all__ = ["ACCEPTED_PROTOCOLS", "PACKAGE", "PROTOCOL_VERSION", "READABLE_STATE_FORMATS", "SOFTWARE_RE",
           "STATE_FORMAT", "StateFormatError", "UNVERSIONED_STATE_FORMAT", "VersionError", "accepts_protocol",
           "check_protocol", "check_state_format", "migrate_state", "protocol_refusal", "software", "stamp",
           "state_format"]
