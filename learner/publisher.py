"""Publishing a stream of chunks from the training thread (pushes, INIT) on the client's loop, with
bounded bytes in flight (docs/design.md §15.5, §15.9), and waiting for its acks without blocking a
boundary on a dying connection.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Awaitable, Callable, Iterable

from yeto.schemas.publish import Pipeline

from .errors import NotConnected
from .inbox import PublishHandle
from .waiting import Arrivals, wait_until

PUSH_PIPELINE_BYTES = 16 << 20  # push bytes unacked at once (docs/design.md §15.5, §15.9)
# A detached publish (a push) waits this long for its last acks before finishing in the background:
# on a healthy broker they are in within milliseconds, so the step log still shows the push at the
# boundary that made it; a full PUSH stream or a dying broker no longer holds the boundary.
ACK_WAIT_S = 1.0


class StreamPublisher:
    """One stream's publish. `submit` runs a coroutine on the client's loop (a future back)."""

    def __init__(self, js, *, submit: Callable[[Awaitable], concurrent.futures.Future],
                 connected: Callable[[], bool], arrivals: Arrivals, counters: Counter):
        self.js, self._submit, self._connected, self.arrivals, self.counters = js, submit, connected, arrivals, counters

    def _call(self, coro: Awaitable, timeout: float) -> Any:
        fut = self._submit(coro)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            if fut.done():
                raise   # the call's own timeout (a NATS request's: the same class on 3.11), not this deadline
            fut.cancel()
            raise TimeoutError(f"NATS call did not finish within {timeout:.1f}s") from None

    def publish(self, items: Iterable[tuple[str, Any, str, dict]], *, timeout: float,
                       detach: bool = False) -> "int | PublishHandle":
        """Publish (subject, payload, msg id, headers) items as they are produced, with bounded bytes
        in flight, and wait until JetStream acked every one. Returns the payload bytes sent. Raises
        NotConnected, TimeoutError or PublishFailed; then the caller treats the whole stream as not
        sent (resends reuse the msg ids, so JetStream drops what did land).

        `detach=True` (pushes; the README promises the boundary never blocks): the items are still
        produced here (the export is collective), but a wait for pipeline room gives up at once when
        the connection drops (NotConnected: the try failed, nothing more is produced); once every
        item is handed over, the acks are awaited only while connected and at most ACK_WAIT_S: a
        PublishHandle is returned, done or not, and the pipeline goes on in the background (same
        msg ids, re-sent after a reconnect) until `timeout`."""
        deadline = time.monotonic() + timeout
        # An ack future can hang when the server answers with an error (docs/design.md §15.2): the
        # pipeline's own wait is a fraction of the budget, so such a publish is redone with
        # publish_retry (same msg id, backoff on 10077 / 10167) before the whole stream times out.
        pipe = Pipeline(self.js, max_bytes=PUSH_PIPELINE_BYTES, timeout=max(0.5, min(10.0, timeout / 4)),
                        counters=self.counters)
        sent = 0

        def left() -> float:
            rem = deadline - time.monotonic()
            if rem <= 0:
                raise TimeoutError(f"publishing did not finish within {timeout:.1f}s")
            return rem

        for subject, payload, msg_id, headers in items:
            if not self._connected():
                raise NotConnected("NATS connection is down")
            if detach:
                self._wait_connected(self._submit(pipe.put(subject, payload, msg_id, headers)), left(), cancel=True)
            else:
                self._call(pipe.put(subject, payload, msg_id, headers), left())
            sent += len(payload)
        if not detach:
            self._call(pipe.flush(), left())
            return sent
        handle = PublishHandle(self._submit(self._flush_within(pipe, left())), sent)
        self._wait_connected(handle.future, min(ACK_WAIT_S, deadline - time.monotonic()), cancel=False)
        return handle

    def _wait_connected(self, fut: "concurrent.futures.Future", timeout: float, *, cancel: bool) -> None:
        """Wait for `fut` (its result or error is left in it) while connected and within `timeout`.
        cancel=True: a wait cut short cancels `fut` and raises (NotConnected / TimeoutError);
        cancel=False: `fut` goes on in the background and this returns."""
        fut.add_done_callback(lambda _: self.arrivals.notify())
        wait_until(lambda: fut.done() or not self._connected(), time.monotonic() + timeout, arrivals=self.arrivals)
        if fut.done():
            if cancel:
                fut.result(0)  # its error (or CancelledError) is this publish's
            return
        if not cancel:
            return
        fut.cancel()
        if not self._connected():
            raise NotConnected("NATS connection lost while publishing")
        raise TimeoutError(f"publishing did not finish within {timeout:.1f}s")

    @staticmethod
    async def _flush_within(pipe: Pipeline, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await pipe.flush()
        except TimeoutError:
            raise TimeoutError(f"acks did not all arrive within {timeout:.1f}s") from None


__all__ = ["ACK_WAIT_S", "PUSH_PIPELINE_BYTES", "StreamPublisher"]
