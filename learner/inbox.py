"""What the NATS thread hands the training thread: thread-safe inboxes (filled by the loop thread,
drained at step boundaries), the cut notices they hold, and the handle of a publish whose acks are
still coming. Each inbox raises an `Arrivals` flag on put, so a waiting boundary wakes at once.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

from .waiting import Arrivals


@dataclass(frozen=True, slots=True)
class ChunkNotice:
    """A BCAST / FINAL chunk's header as seen by the cut watcher (the bytes stay in JetStream)."""

    kind: str  # "bcast_chunk" or "final_chunk"
    subject: str
    fragment: int
    chunk: int
    version: int
    nbytes: int
    meta: dict


@dataclass(slots=True)
class PublishHandle:
    """A detached publish (see publisher.StreamPublisher.publish): every item was handed over; `future`
    resolves once JetStream acked them all (None) or the stream failed (its exception)."""

    future: concurrent.futures.Future
    nbytes: int

    def done(self) -> bool:
        return self.future.done()

    def sized(self, nbytes: int) -> None:
        """A handle given out before its publish ran (learner/background.py): the bytes it handed over."""
        self.nbytes = nbytes

    def result(self) -> int:
        """The payload bytes sent; raises the stream's error (or CancelledError). Only once done()."""
        self.future.result(0)
        return self.nbytes


class Inbox:
    """A thread-safe FIFO the loop fills and the training thread drains at step boundaries."""

    def __init__(self, arrivals: Arrivals | None = None) -> None:
        self._q: collections.deque = collections.deque()
        self._arrivals = arrivals

    def put(self, item: Any) -> None:
        self._q.append(item)  # deque append/popleft are atomic
        if self._arrivals is not None:
            self._arrivals.notify()

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self._q.popleft())
            except IndexError:
                return out

    def __len__(self) -> int:
        return len(self._q)


class CutInbox:
    """The newest notice per chunk subject, for BCAST / FINAL.

    A chunk subject holds one message, so an older notice of the same subject is obsolete: keeping
    only the newest bounds the inbox by the number of chunks of the model, however many versions
    land between two boundaries (a long evaluation, a slow step). Newest means the last to arrive
    (the ordered consumer delivers in stream order), not the highest version: a forged chunk
    claiming version 10^4 must not hide the real chunk that overwrote it."""

    def __init__(self, arrivals: Arrivals | None = None) -> None:
        self._d: dict[str, ChunkNotice] = {}
        self._lock = threading.Lock()
        self._arrivals = arrivals

    def put(self, n: ChunkNotice) -> None:
        key = n.subject   # one per chunk subject: a full cut's (fragment, chunk), or a sparse update's slot chunk
        with self._lock:
            self._d[key] = n
        if self._arrivals is not None:
            self._arrivals.notify()

    def drain(self) -> list[ChunkNotice]:
        with self._lock:
            d, self._d = self._d, {}
        return list(d.values())

    def __len__(self) -> int:
        return len(self._d)


__all__ = ["ChunkNotice", "CutInbox", "Inbox", "PublishHandle"]
