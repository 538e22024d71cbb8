"""Why the island stops or a network call did not happen now (raised by the client, read by the
shell)."""
from __future__ import annotations


class IslandUnhealthy(RuntimeError):
    """The island cannot go on: the connection is gone for good, or the syncer refused it."""


class SyncerRefused(IslandUnhealthy):
    """The syncer sent a fatal error (e.g. layout or dtype mismatch at hello)."""

    def __init__(self, msg: dict):
        self.code, self.field = msg.get("code"), msg.get("field")
        super().__init__(f"syncer refused this island: {msg.get('code')}: {msg.get('message')}"
                         + (f" (field {msg['field']})" if msg.get("field") else ""))


class Superseded(IslandUnhealthy):
    """A newer process of this island (another generation) took over its CTL consumers."""


class NotConnected(RuntimeError):
    """The connection is down right now (nats-py is reconnecting)."""


__all__ = ["IslandUnhealthy", "NotConnected", "Superseded", "SyncerRefused"]
