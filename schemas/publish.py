"""JetStream publishing with backpressure handled the same way on both sides.

A publish refused with 10077 (stream full: PUSH's max_bytes + discard-new) or 10167 (too many
requests), or one that times out (e.g. right after a reconnect, NATS-NOTES trap 7), is retried with
backoff and the SAME `Nats-Msg-Id`: JetStream's duplicate window makes a retry of a publish that did
land harmless. Every retry is counted. `publish_async` futures can hang forever when the server answers
with an error (trap 2), so everything here waits with a timeout.
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Callable

from .dtypes import as_bytes_view
from .subjects import MSG_ID

BACKPRESSURE_CODES = {10077: "stream_full", 10167: "too_many_requests"}


class PublishFailed(RuntimeError):
    def __init__(self, subject: str, msg_id: str, attempts: int, last: BaseException | None):
        self.subject, self.msg_id, self.attempts, self.last = subject, msg_id, attempts, last
        super().__init__(f"publish to {subject} (Nats-Msg-Id {msg_id}) failed after {attempts} attempts: {last!r}")


def _reason(exc: BaseException) -> str | None:
    import nats.errors
    from nats.js.errors import APIError

    if isinstance(exc, APIError):
        return BACKPRESSURE_CODES.get(getattr(exc, "err_code", None) or 0)
    if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError,
                        nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError)):
        return "timeout"
    from nats.js.errors import NoStreamResponseError

    if isinstance(exc, NoStreamResponseError):
        return "no_stream_response"
    return None


async def publish_retry(
    js,
    subject: str,
    payload: bytes | memoryview,
    msg_id: str,
    headers: dict | None = None,
    *,
    timeout: float = 10.0,
    attempts: int = 8,
    backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    counters: Counter | None = None,
    should_continue: Callable[[], bool] | None = None,
):
    """Publish and wait for the PubAck; retry transient refusals with the same msg id. Returns the PubAck.

    Raises PublishFailed after `attempts`, or at once for a non-transient error.
    """
    hdrs = dict(headers or {})
    hdrs[MSG_ID] = msg_id
    last: BaseException | None = None
    delay = backoff_s
    data = bytes(payload) if isinstance(payload, memoryview) else payload
    for i in range(attempts):
        try:
            return await js.publish(subject, data, timeout=timeout, headers=hdrs)
        except Exception as exc:  # classify: transient ones are retried
            reason = _reason(exc)
            if reason is None:
                raise
            last = exc
            if counters is not None:
                counters[f"publish_retry.{reason}"] += 1
            if should_continue is not None and not should_continue():
                break
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_backoff_s)
    raise PublishFailed(subject, msg_id, attempts, last)


class Pipeline:
    """Pipelined publishes with bounded bytes in flight (NATS-NOTES traps 5 and 9).

    `await put(...)` sends at once with js.publish_async and only waits when `max_bytes` are unacked;
    `await flush()` waits for every ack. A refused or timed-out publish is redone with publish_retry
    (same msg id), so the result is the same as sequential publishes, only faster.
    """

    def __init__(self, js, *, max_bytes: int = 32 << 20, max_msgs: int = 64, timeout: float = 30.0,
                 counters: Counter | None = None):
        self.js, self.max_bytes, self.max_msgs, self.timeout = js, max_bytes, max_msgs, timeout
        self.counters = counters
        self._inflight: list[tuple[asyncio.Future, str, bytes, str, dict, int]] = []
        self._bytes = 0

    async def put(self, subject: str, payload, msg_id: str, headers: dict | None = None) -> None:
        # One memcpy for any buffer (memoryview, NumPy array, CPU torch tensor of any dtype): bytes() of a
        # tensor would iterate it element by element. nats-py needs bytes, so one copy is unavoidable.
        data = payload if isinstance(payload, bytes) else as_bytes_view(payload).tobytes()
        while self._inflight and (self._bytes + len(data) > self.max_bytes or len(self._inflight) >= self.max_msgs):
            await self._settle_one()
        hdrs = dict(headers or {})
        hdrs[MSG_ID] = msg_id
        fut = await self.js.publish_async(subject, data, headers=hdrs, wait_stall=self.timeout)
        self._inflight.append((fut, subject, data, msg_id, headers or {}, len(data)))
        self._bytes += len(data)

    async def _settle_one(self) -> None:
        fut, subject, data, msg_id, headers, n = self._inflight.pop(0)
        self._bytes -= n
        try:
            await asyncio.wait_for(fut, self.timeout)
        except Exception as exc:
            if _reason(exc) is None and not isinstance(exc, asyncio.TimeoutError):
                raise
            if self.counters is not None:
                self.counters["publish_retry.pipeline"] += 1
            await publish_retry(self.js, subject, data, msg_id, headers, counters=self.counters)

    async def flush(self) -> None:
        while self._inflight:
            await self._settle_one()
