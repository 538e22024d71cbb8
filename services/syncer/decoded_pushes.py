"""Decoded sparse pushes kept from intake to the merge (docs/design.md §4.10) — pure, no I/O.

Intake decodes every complete sparse try once (its norm for the quarantine rules); the decoded tensors
are kept here so the merge aggregates them without reading and decoding the bytes again. An entry is the
try object it was decoded from: `take` hands it out only for that very object, so a try replaced by a
newer one (another key), a try the ledger forgot and reopened, or one restored from a merge intent (a new
object) never gets a decode of other bytes. The ledger (intake.py) decides the room (its byte budget) and
drops an entry with its try (merged, released, swept); the merge falls back to reading PUSH when none.
"""
from __future__ import annotations

from typing import Sequence

from yeto.schemas.sparse import SparseTensor


def push_nbytes_decoded(push: Sequence[SparseTensor]) -> int:
    """The memory the decoded tensors of one push take (indices and values)."""
    return sum(t.indices.numel() * t.indices.element_size() + t.values.numel() * t.values.element_size()
               for t in push)


class DecodedPushes:
    """PushKey -> (the try object, its decoded tensors, their bytes)."""

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[object, list[SparseTensor], int]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: tuple) -> bool:
        return key in self._kept

    def keep(self, t, push: Sequence[SparseTensor], room: int) -> bool:
        """Keep try `t`'s decoded tensors if they take at most `room` bytes (replacing what its key held)."""
        self.drop(t.key)
        n = push_nbytes_decoded(push)
        if n > room:
            return False
        self._kept[t.key] = (t, list(push), n)
        self.nbytes += n
        return True

    def take(self, t) -> tuple[list[SparseTensor] | None, int]:
        """Try `t`'s decoded tensors, handed over once and forgotten, and the bytes they freed; (None, 0)
        when none were kept for this very try object."""
        entry = self._kept.get(t.key)
        if entry is None or entry[0] is not t:
            return None, 0
        del self._kept[t.key]
        self.nbytes -= entry[2]
        return entry[1], entry[2]

    def drop(self, key: tuple) -> int:
        """Forget whatever is kept under `key`; returns the bytes freed."""
        entry = self._kept.pop(key, None)
        if entry is None:
            return 0
        self.nbytes -= entry[2]
        return entry[2]


__all__ = ["DecodedPushes", "push_nbytes_decoded"]
