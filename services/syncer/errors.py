"""The refusal of a syncer process: a run it cannot serve (`yeto syncer` exits 2 with its line)."""
from __future__ import annotations


class SyncerError(RuntimeError):
    """A run this syncer cannot serve (refused session, incomplete checkpoint, ...): exit 2 with it."""
