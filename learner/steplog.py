"""The island's step log (docs/design.md §5.8): one JSON event per step, published by the sync rank to
`yeto.R.steplog.I` and, with `YETO_DILOCO_STEP_LOG=<path>`, appended to a file.

`StepLog.emit` runs on the training thread: it builds and validates the event (schema `steplog`),
appends the encoded line to the file (a local append, complete: the file is the full record even
while the network is down) and puts the same bytes on a bounded queue that the NATS client drains
in the background. When the queue is full the *oldest* waiting event is dropped and counted: after
an outage a dashboard wants the newest state, not the first minutes of the outage. Each event
carries `dropped`, the number of events dropped before it was built. Nothing here blocks on the
network.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Mapping

import orjson

from yeto.schemas import codec


def make_event(run: str, island: str, gen: str, *, step: int, boundary_s: float, export_s: float, apply_s: float,
               pushes: int, applies: int, bytes_out: int, bytes_in: int, versions: Mapping[str, int],
               pending_pulls: int, rejected: int, dropped: int, loss: float | None = None,
               scatter_bytes: int = 0, gather_bytes: int = 0, t: float | None = None,
               extra: Mapping[str, Any] | None = None) -> dict:
    """A validated step-log event (pure). Durations are clamped at 0 (clock quirks never make one
    invalid); a non-finite loss is sent as null, since JSON has no NaN."""
    fields: dict[str, Any] = dict(
        run=run, island=island, gen=gen, step=step, t=time.time() if t is None else t,
        boundary_s=max(0.0, float(boundary_s)), export_s=max(0.0, float(export_s)), apply_s=max(0.0, float(apply_s)),
        pushes=pushes, applies=applies, bytes_out=bytes_out, bytes_in=bytes_in, scatter_bytes=scatter_bytes,
        gather_bytes=gather_bytes, versions=dict(versions), pending_pulls=pending_pulls, rejected=rejected,
        dropped=dropped,
    )
    if loss is not None:
        loss = float(loss)
        fields["loss"] = loss if loss == loss and abs(loss) != float("inf") else None
    if extra:
        fields["extra"] = dict(extra)
    return codec.make("steplog", fields)


class StepLog:
    """Bounded, thread-safe queue of encoded events plus the optional file (see the module doc)."""

    def __init__(self, run: str, island: str, gen: str, *, maxlen: int = 1024, path: str | os.PathLike | None = None):
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.run, self.island, self.gen = run, island, gen
        self.maxlen = maxlen
        self._q: collections.deque[tuple[int, bytes]] = collections.deque()
        self._lock = threading.Lock()
        self.dropped = 0
        self.emitted = 0
        self.path = None if path is None else os.fspath(path)
        self._file = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "ab", buffering=0)  # one write per line: no partial lines buffered
        self.on_put = None  # set by the client: wakes its sender (called outside the lock)

    def wake_with(self, fn: Callable[[], None] | None) -> None:
        """Call `fn` after each put (the client's sender; None: nobody)."""
        self.on_put = fn

    def emit(self, **kw: Any) -> dict:
        """Build, file and queue one event (keywords of `make_event` but run/island/gen/dropped)."""
        with self._lock:
            dropped = self.dropped
        event = make_event(self.run, self.island, self.gen, dropped=dropped, **kw)
        line = orjson.dumps(event)
        if self._file is not None:
            self._file.write(line + b"\n")
        self.put(event["step"], line)
        return event

    def put(self, step: int, line: bytes) -> None:
        with self._lock:
            if len(self._q) >= self.maxlen:
                self._q.popleft()
                self.dropped += 1
            self._q.append((step, line))
            self.emitted += 1
        cb = self.on_put
        if cb is not None:
            cb()

    def pop_all(self, limit: int | None = None) -> list[tuple[int, bytes]]:
        """Take up to `limit` waiting events, oldest first (the sender)."""
        out = []
        with self._lock:
            while self._q and (limit is None or len(out) < limit):
                out.append(self._q.popleft())
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._q)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["StepLog", "make_event"]
