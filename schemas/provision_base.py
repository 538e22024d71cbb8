"""What every provisioning shell shares (schemas.provision, schemas.island_consumers): the errors, the
report of what a call found or created, and JetStream lookups that read "not found" as None."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nats.js import api
from nats.js.errors import NotFoundError



# ---- errors --------------------------------------------------------------------------------------

class ProvisionError(RuntimeError):
    """Provisioning failed for a reason other than bad input (the server refused, timed out, ...)."""


class ProvisionConflict(ProvisionError):
    """An existing stream / bucket / consumer differs from what this run wants; it was left unchanged.

    `conflicts` lists every (what, field, existing, wanted); `what`, `stream`, `field`, `existing`,
    `wanted` are those of the first, for callers that only care about one.
    """

    def __init__(self, run: str, conflicts: list[tuple[str, str, str, Any, Any]]):
        # each conflict: (what, stream, field, existing, wanted)
        self.run = run
        self.conflicts = conflicts
        self.what, self.stream, self.field, self.existing, self.wanted = conflicts[0]
        lines = [f"{w}: {f} is {e!r} on the server, this run wants {n!r}" for w, _s, f, e, n in conflicts]
        super().__init__(
            f"run {run}: existing JetStream objects conflict with this run's configuration and were NOT "
            f"changed: " + "; ".join(lines)
            + f". Start with matching settings, or remove the run with `yeto run rm {run}`."
        )


class RunNotProvisioned(ProvisionError):
    """`check_run` timed out: the named streams / buckets still do not exist."""

    def __init__(self, run: str, missing: list[str], waited_s: float):
        self.run = run
        self.missing = list(missing)
        self.waited_s = waited_s
        super().__init__(
            f"run {run} is not provisioned after {waited_s:.1f}s: missing {', '.join(missing)} "
            f"(the syncer creates them at start: is `yeto syncer --run {run}` running against this NATS?)"
        )


# ---- report --------------------------------------------------------------------------------------

@dataclass
class ProvisionReport:
    """What a provisioning call found: names like 'stream YETO_R_CTL', 'kv yeto_R_state',
    'consumer YETO_R_CTL/syncer-ctl'."""

    run: str
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)

    def note_created(self, what: str) -> None:
        self.created.append(what)

    def note_found(self, what: str) -> None:
        self.existing.append(what)

    @property
    def changed(self) -> bool:
        return bool(self.created)

    def __str__(self) -> str:
        parts = []
        if self.created:
            parts.append("created " + ", ".join(self.created))
        if self.existing:
            parts.append("found " + ", ".join(self.existing))
        return f"run {self.run}: " + ("; ".join(parts) or "nothing")


# ---- lookups ---------------------------------------------------------------------------------------

async def stream_info_or_none(js, name: str) -> api.StreamInfo | None:
    try:
        return await js.stream_info(name)
    except NotFoundError:
        return None


async def consumer_info_or_none(js, stream: str, name: str) -> api.ConsumerInfo | None:
    try:
        return await js.consumer_info(stream, name)
    except NotFoundError:
        return None


def server_refused(what: str, exc: Exception) -> ProvisionError:
    return ProvisionError(f"creating {what} failed: {exc}")
