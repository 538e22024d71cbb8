"""The sync work an island does off its training thread (docs/design.md §5.5).

Owns `SyncWorker`, one thread on the island's sync rank that reads landed versions (fetch, chunk checks,
the copy into staging) and publishes pushes (packing, flow control, acks) while the loop trains, leaving
the boundary only what it alone can do: take a push's snapshot and install a staged version.
May touch: the wire (it owns it while it runs, handing it the worker's mode and back) and, through its
mode, the staging group (learner/stager.py, learner/island_modes.py).
Invariants: a version read whole is *parked* (staged, digest checked, not installed) until the next
boundary installs it, and its fragment is not read again meanwhile; one lock keeps every reading of the
wire one at a time (installing a parked version does not take it); an error the wire does not count and
retry is raised at the next boundary; the final cut is read on the training thread.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Callable

from .inbox import PublishHandle

log = logging.getLogger("yeto.island")

# A reading left fragments unread (a fetch failed, or a version still arriving with no new notice
# yet): read them again after this long, as the boundary after a step did before.
RETRY_S = 0.5
POLL_S = 0.05  # wake to look at the inbox at least this often (its flag is the training thread's)


class SyncWorker:
    """Owns the wire while it runs: hands it the worker's mode (`mode(submit)`, learner/island_modes.py) before
    its thread starts, and the training thread's back when it stops.

    * **Reading**: whenever cut notices arrive, it runs the wire's BCAST reading (`IslandWire.read_broadcasts`).
      A version that completes is parked: the next boundary installs it (`take_ready`; the boundary machine
      decides how), and until then that fragment is not read again, whatever lands for it meanwhile. In an
      island of several ranks staging is a collective: the worker runs it on a staging group of its own while
      the ranks train (learner/stager.py) or, without one (a group that is not the whole world), keeps the
      version's stage operations with their chunks (`StageDeferred`, one fragment at a time) for the
      installing boundary to hand to the ranks first.
    * **Pushing**: the boundary hands over the snapshot (`submit_push`); the worker packs it in the session's
      push dtype and publishes it; the boundary after the acks reaps the outcome as for a push published at
      the boundary (`PublishHandle`). In an island of several ranks the boundary gathers the snapshot to rank 0
      first; a q4 push stays at the boundary (its residual scatter is collective too).
    Lockstep mode uses the worker too (its boundary waits for a parked version as it waited for a read one).
    """

    def __init__(self, wire, mode: Callable[..., object], *, name: str = "yeto-sync"):
        self.wire = wire
        wire.use(mode(submit=self.submit_push))
        self.lock = threading.Lock()   # one reading of the wire at a time
        self._pushes: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._retry_at: float | None = None
        self.busy_s = 0.0   # seconds spent reading and pushing (the step log's `background_s`)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the training thread's side ---------------------------------------------------------------

    def raise_error(self) -> None:
        """Raise what the worker met that was not the wire's to count and retry (once)."""
        err, self._error = self._error, None
        if err is not None:
            raise err

    def take_ready(self, commit: Callable[[int, int, str], None]) -> list[int]:
        """Install the versions parked since the last boundary (`commit` each, in fragment order);
        the fragments installed."""
        self.raise_error()
        done = []
        for fid in sorted(self.wire.ready):
            version, digest = self.wire.ready[fid]
            commit(fid, version, digest)
            done.append(fid)
        if done:
            self.kick()   # what landed for them while they were parked is read now
        return done

    def submit_push(self, publish: Callable[[], PublishHandle]) -> PublishHandle:
        """Run `publish` (pack and send a snapshot) on the worker; its outcome is the handle's."""
        handle = PublishHandle(concurrent.futures.Future(), 0)
        self._pushes.append((publish, handle))
        self.kick()
        return handle

    @property
    def alive(self) -> bool:
        """The thread still runs (after `stop`: a push outlived its join, still on the wire's groups)."""
        return self._thread.is_alive()

    def kick(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the job in hand and stop; reading goes back to the training thread. A push not
        started yet fails (its pull is answered again at a later boundary)."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        with self.lock:   # a reading still in hand (a fetch outlived the join) ends before the caller reads
            pass
        if self._thread.is_alive():
            log.warning("island %s: the sync worker did not stop within %.0fs (a push still being handed over)",
                        self.wire.config.island, timeout)
        self.wire.use(self.wire.foreground)   # the training thread reads now: it stages on the ranks itself
        while self._pushes:
            _, handle = self._pushes.popleft()
            handle.future.set_exception(ConnectionError("the island's sync worker stopped before this push"))

    # ---- the worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        w = self.wire
        while not self._stopping:
            try:
                if self._pushes:
                    self._push(*self._pushes.popleft())
                    continue
                due = self._retry_at is not None and time.monotonic() >= self._retry_at
                if len(w.client.bcast) or due or self._wake.is_set():
                    self._wake.clear()
                    self._read()
                    continue
                self._wake.wait(POLL_S)
            except BaseException as exc:   # noqa: BLE001 - handed to the training thread
                log.error("island %s: sync worker: %r", w.config.island, exc)
                self._error = exc
                self._wake.wait(1.0)

    def _read(self) -> None:
        t = time.perf_counter()
        with self.lock:
            if self._stopping:
                return
            self.wire.read_broadcasts(self.wire.park)
            left = self.wire.unread()
        self.busy_s += time.perf_counter() - t
        if self.wire.ready:
            self.wire.client.arrivals.notify()   # a boundary waiting for a version looks again
        self._retry_at = time.monotonic() + RETRY_S if left else None

    def _push(self, publish: Callable[[], PublishHandle], handle: PublishHandle) -> None:
        t = time.perf_counter()
        try:
            inner = publish()
        except BaseException as exc:   # noqa: BLE001 - the push's outcome, reaped at a boundary
            handle.future.set_exception(exc)
            return
        finally:
            self.busy_s += time.perf_counter() - t
        handle.sized(inner.nbytes)

        def settle(f: concurrent.futures.Future) -> None:
            if f.cancelled():
                handle.future.cancel()
            elif f.exception() is not None:
                handle.future.set_exception(f.exception())
            else:
                handle.future.set_result(None)
            self.wire.client.arrivals.notify()   # a boundary waiting for push outcomes looks again

        inner.future.add_done_callback(settle)


__all__ = ["RETRY_S", "SyncWorker"]
