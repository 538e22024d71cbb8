"""JetStream publishing with backpressure handled the same way on both sides (docs/design.md §3.5, §3.8).

Owns `publish_retry` (one publish and its PubAck) and `Pipeline` (many, with bounded bytes in flight),
and the message-id bookkeeping against squatting (`first_send`, `fresh_msg_id`, `note_taken`).
Invariants: a retry keeps the *same* `Nats-Msg-Id` (JetStream's duplicate window makes a retry of a
publish that did land harmless), except a first publish into a shared stream answered `duplicate`: that
id was someone else's, and it is re-sent at once under a fresh unguessable one (`publish.msg_id_taken`);
every wait has a timeout (`publish_async` futures can hang, §15.2) and watches the connection and, where
there is one, the stream leader elections (`leader_watch.LeaderWatch`), so a PubAck lost with its
connection or its leader is re-sent at once, not after a whole ack timeout; every retry is counted.
"""
from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections import Counter, OrderedDict
from typing import Callable

from nats.js.errors import NoStreamResponseError

from .dtypes import as_bytes_view
from .leader_watch import watch_of
from .subjects import MSG_ID, in_shared_stream

log = logging.getLogger("yeto.publish")

BACKPRESSURE_CODES = {10077: "stream_full", 10167: "too_many_requests"}


# A stream without a leader (its node died; the others elect one) answers "no responders" at once. nats-
# server's RAFT elects within its election timeout (4-9 s; more on a loaded host): such refusals are
# retried for at least this long, whatever `attempts` says, so a node's death does not fail a publish.
ELECTION_S = 20.0
# A publish that needed retries and took at least this long is logged (WARNING) with its reasons.
SLOW_PUBLISH_S = 2.0


# Ids this process sent into shared streams, newest last: a duplicate answer to one of them is our own
# message landing twice (a retry, a re-sent push), not a taken id. A push of 256 MiB in 1 MiB chunks is
# 256 ids; this holds the last few hundred pushes' worth at ~100 bytes an id.
SENT_MEMORY = 1 << 17
_SENT: "OrderedDict[str, None]" = OrderedDict()


def first_send(subject: str, msg_id: str) -> bool:
    """Note that this process sends `msg_id` on `subject`; True when it is the first time for an id in a
    shared stream (a `duplicate` answer then means someone else took the id)."""
    if not in_shared_stream(subject):
        return False
    if msg_id in _SENT:
        _SENT.move_to_end(msg_id)
        return False
    _SENT[msg_id] = None
    if len(_SENT) > SENT_MEMORY:
        _SENT.popitem(last=False)
    return True


def fresh_msg_id(msg_id: str) -> str:
    """An id no other publisher can have guessed, for a message whose own id was taken."""
    return f"{msg_id}.x{secrets.token_hex(8)}"


_taken_logged = 0


def note_taken(subject: str, msg_id: str, counters: Counter | None) -> str:
    """Count and log a taken id (the first few at WARNING, the rest at DEBUG); the fresh id to use."""
    global _taken_logged
    fresh = fresh_msg_id(msg_id)
    _SENT[fresh] = None
    if counters is not None:
        counters["publish.msg_id_taken"] += 1
    _taken_logged += 1
    (log.warning if _taken_logged <= 10 else log.debug)(
        "Nats-Msg-Id %s on %s was already used by another publisher (a hostile or confused client): "
        "re-sent as %s", msg_id, subject, fresh)
    return fresh


class _Reconnected(Exception):
    """The connection a publish went out on is gone: its PubAck will never come."""


class _LeaderElected(Exception):
    """A stream elected a new leader since the publish went out: its PubAck may never come (the old
    leader's node died with it); re-sent with the same Nats-Msg-Id, a publish that did land collapses."""


def _elections(js) -> int | None:
    """The connection's leader-election count now (None: no watch on it)."""
    w = watch_of(js)
    return None if w is None else w.elections


async def _backoff(js, seconds: float) -> None:
    """Sleep `seconds`, or less when a stream leader is elected meanwhile (a refusal for want of a
    leader is then worth retrying at once)."""
    w = watch_of(js)
    if w is None:
        await asyncio.sleep(seconds)
    else:
        await w.wait(seconds)


# How often a wait for a PubAck looks at the connection. Cheap (two attribute reads); short enough that
# a lost ack costs a fraction of a second after the reconnect.
_WATCH_S = 0.1


def _sent_on(js) -> int | None:
    """The connection a publish made now travels on, as nats-py's reconnect count: the current one, or,
    while disconnected, the next one (the client buffers the publish and sends it after reconnecting).
    None when the client does not expose it (then only the timeout ends a wait)."""
    nc = getattr(js, "_nc", None)  # JetStreamContext keeps its Client there (nats-py 2.x)
    stats = getattr(nc, "stats", None)
    if not isinstance(stats, dict) or "reconnects" not in stats:
        return None
    return stats["reconnects"] + (0 if nc.is_connected else 1)


async def _await_ack(js, fut: asyncio.Future, timeout: float, sent_on: int | None, elected: int | None = None):
    """The PubAck of `fut` (a publish_async future or a js.publish task), or asyncio.TimeoutError after
    `timeout`, or _Reconnected as soon as the client has reconnected since the publish went out, or
    _LeaderElected once a stream elected a leader since then (`elected`: the election count at the send).
    A future given up is cancelled (for publish_async that returns its slot in nats-py's pending
    semaphore)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    nc = getattr(js, "_nc", None)
    w = watch_of(js) if elected is not None else None
    try:
        while True:
            if fut.done():  # an ack already in (a pipeline may wait with no time left)
                return fut.result()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait({fut}, timeout=min(_WATCH_S, remaining) if sent_on is not None else remaining)
            if fut.done():
                return fut.result()
            if sent_on is not None and nc.stats["reconnects"] > sent_on:
                raise _Reconnected
            if w is not None and w.elections > elected:
                raise _LeaderElected
    finally:
        if not fut.done():
            fut.cancel()


async def _until_connected(js, timeout: float) -> None:
    """Wait (at most `timeout`) for the client to be connected again, so an outage longer than the
    backoff does not use up a publish's attempts while nothing can be sent."""
    nc = getattr(js, "_nc", None)
    if nc is None or not hasattr(nc, "is_connected"):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not nc.is_connected and not nc.is_closed and loop.time() < deadline:
        await asyncio.sleep(_WATCH_S)


class PublishFailed(RuntimeError):
    def __init__(self, subject: str, msg_id: str, attempts: int, last: BaseException | None):
        self.subject, self.msg_id, self.attempts, self.last = subject, msg_id, attempts, last
        super().__init__(f"publish to {subject} (Nats-Msg-Id {msg_id}) failed after {attempts} attempts: {last!r}")


def _reason(exc: BaseException) -> str | None:
    import nats.errors
    from nats.js.errors import APIError

    if isinstance(exc, APIError):
        return BACKPRESSURE_CODES.get(getattr(exc, "err_code", None) or 0)
    if isinstance(exc, _Reconnected):
        return "reconnected"
    if isinstance(exc, _LeaderElected):
        return "leader_elected"
    if isinstance(exc, (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError)):
        # Disconnected, and the client's reconnect buffer (2 MiB, docs/design.md §15.7) is full: wait for the reconnect.
        return "disconnected"
    if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError,
                        nats.errors.ConnectionClosedError)):
        return "timeout"

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
    election_s: float = ELECTION_S,
):
    """Publish and wait for the PubAck; retry transient refusals with the same msg id. Returns the PubAck.

    Transient: 10077 (stream full: PUSH's max_bytes + discard-new), 10167 (too many requests), a timeout
    (e.g. right after a reconnect, docs/design.md §15.7), "no responders" (a leader election). A PubAck is
    lost for good when the connection that carried the publish dies, so the wait also watches the
    connection: once the client reconnected after the publish went out, it is re-sent at once
    (`publish_retry.reconnected`). A first publish into a shared stream (`subjects.in_shared_stream`)
    answered `duplicate` was not ours (the ids are predictable and de-duplication is per stream): it is
    re-sent at once under `fresh_msg_id` (`publish.msg_id_taken`, logged); a re-send of our own message
    (a retry, or an id this process sent before: `_SENT` remembers the last `SENT_MEMORY`) takes the
    duplicate as its own. Consumers never read the id, so a fresh one changes nothing downstream.

    Raises PublishFailed after `attempts` (and, when the stream answered "no responders", not before
    `election_s`, default ELECTION_S), or at once for a non-transient error.
    """
    hdrs = dict(headers or {})
    hdrs[MSG_ID] = msg_id
    last: BaseException | None = None
    delay = backoff_s
    data = bytes(payload) if isinstance(payload, memoryview) else payload
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    i = 0
    reasons: list[str] = []
    first = first_send(subject, msg_id)
    while i < attempts or (isinstance(last, NoStreamResponseError) and loop.time() - t0 < election_s):
        i += 1
        try:
            sent_on, elected = _sent_on(js), _elections(js)
            # js.publish (a request), not publish_async: nats-py 2.16 loses a publish_async future's
            # JetStream error (APIError.from_error raises 503s inside the reply callback), so 10077 would
            # look like a timeout. The request, run as a task, can still be given up on a reconnect.
            req = asyncio.ensure_future(js.publish(subject, data, timeout=timeout, headers=hdrs))
            ack = await _await_ack(js, req, timeout, sent_on, elected)
            if first and i == 1 and getattr(ack, "duplicate", False):
                # our first try of an id never sent before, answered "duplicate": another publisher holds it
                return await publish_retry(
                    js, subject, data, note_taken(subject, msg_id, counters), headers, timeout=timeout,
                    attempts=attempts, backoff_s=backoff_s, max_backoff_s=max_backoff_s, counters=counters,
                    should_continue=should_continue, election_s=election_s)
            if reasons and loop.time() - t0 >= SLOW_PUBLISH_S:
                # an operator sees what a node's death or a full stream cost, and why
                log.warning("publish to %s took %.1fs (%d retries: %s)", subject, loop.time() - t0, len(reasons),
                            ", ".join(f"{r} x{n}" for r, n in Counter(reasons).items()))
            return ack
        except Exception as exc:  # classify: transient ones are retried
            reason = _reason(exc)
            if reason is None:
                raise
            reasons.append(reason)
            log.debug("publish to %s (Nats-Msg-Id %s) attempt %d: %s after %.1fs; retrying", subject, msg_id, i,
                      reason, loop.time() - t0)
            last = exc
            if counters is not None:
                counters[f"publish_retry.{reason}"] += 1
            if should_continue is not None and not should_continue():
                break
            if reason == "disconnected":
                await _until_connected(js, timeout)
            # a new leader elected (now, or while this attempt failed): re-send at once
            if reason != "leader_elected" and (elected is None or _elections(js) == elected):
                await _backoff(js, delay * (0.5 + random.random()))
            delay = min(delay * 2, max_backoff_s)
    raise PublishFailed(subject, msg_id, i, last)


class Pipeline:
    """Pipelined publishes with bounded bytes in flight (docs/design.md §15.5, §15.9).

    `await put(...)` sends at once with js.publish_async and only waits when `max_bytes` are unacked;
    `await flush()` waits for every ack. A refused or timed-out publish is redone with publish_retry
    (same msg id), so the result is the same as sequential publishes, only faster.

    A cluster node's death (or a hung node) loses PubAcks without a reconnect: the client sits on a live
    node, the stream's leader was on the dead one. So a publish's timeout runs from its send (or from the
    previous ack, whichever is later: publishes leave in order, so on a slow link the queue ahead of a
    publish is not counted against it), and once one ack of a batch is found lost, every publish sent
    before that moment is presumed lost too and re-sent at once, rather than each costing a whole timeout
    one after another. With a `leader_watch.LeaderWatch` on the connection, a leader election after a
    publish left presumes it lost at once (one election, not one ack timeout, docs/design.md §3.8).
    """

    def __init__(self, js, *, max_bytes: int = 32 << 20, max_msgs: int = 64, timeout: float = 30.0,
                 counters: Counter | None = None):
        self.js, self.max_bytes, self.max_msgs, self.timeout = js, max_bytes, max_msgs, timeout
        self.counters = counters
        # (future, subject, data, msg id, headers, size, connection it went out on, loop time it went out,
        #  whether this process sent that id for the first time, leader elections seen when it went out)
        self._inflight: list[tuple[asyncio.Future, str, bytes, str, dict, int, int | None, float, bool,
                                   int | None]] = []
        self._bytes = 0
        self._warned = False
        self._acked_at = 0.0              # loop time of the last ack in
        self._lost_at: float | None = None  # loop time an ack of this pipeline was last found lost

    async def put(self, subject: str, payload, msg_id: str, headers: dict | None = None) -> None:
        # One memcpy for any buffer (memoryview, NumPy array, CPU torch tensor of any dtype): bytes() of a
        # tensor would iterate it element by element. nats-py needs bytes, so one copy is unavoidable.
        data = payload if isinstance(payload, bytes) else as_bytes_view(payload).tobytes()
        while self._inflight and (self._bytes + len(data) > self.max_bytes or len(self._inflight) >= self.max_msgs):
            await self._settle_one()
        hdrs = dict(headers or {})
        hdrs[MSG_ID] = msg_id
        sent_on, elected = _sent_on(self.js), _elections(self.js)
        first = first_send(subject, msg_id)
        try:
            fut = await self.js.publish_async(subject, data, headers=hdrs, wait_stall=self.timeout)
        except Exception as exc:
            if _reason(exc) is None:
                raise
            # Disconnected with a full reconnect buffer: what is in flight is settled first (in order), then
            # this one goes through publish_retry's backoff until the client is back.
            self._count(exc)
            await self.flush()
            await publish_retry(self.js, subject, data, msg_id, headers, timeout=self.timeout, counters=self.counters)
            return
        self._inflight.append((fut, subject, data, msg_id, headers or {}, len(data), sent_on,
                               asyncio.get_running_loop().time(), first, elected))
        self._bytes += len(data)

    def _count(self, exc: BaseException) -> None:
        if self.counters is not None:
            self.counters[f"publish_retry.{_reason(exc) or 'pipeline'}"] += 1

    async def _settle_one(self) -> None:
        fut, subject, data, msg_id, headers, n, sent_on, sent_at, first, elected = self._inflight.pop(0)
        self._bytes -= n
        try:
            now = asyncio.get_running_loop().time()
            if self._lost_at is not None and sent_at <= self._lost_at:
                left = 0.0  # sent before an earlier ack of this batch was lost: presumed lost with it
            else:
                # Publishes leave in order: this one's bytes went out after the previous ack came (a slow
                # link with a full pipeline is not a lost ack), and acks lost together time out together.
                left = max(sent_at, self._acked_at) + self.timeout - now
            ack = await _await_ack(self.js, fut, max(left, 0.0), sent_on, elected)
            self._acked_at = asyncio.get_running_loop().time()
        except Exception as exc:
            if _reason(exc) is None:
                raise
            self._count(exc)
            self._lost_at = asyncio.get_running_loop().time()
            if not self._warned:  # once per pipeline: a node's death loses many acks at once
                self._warned = True
                log.warning("publish to %s: %s %.1fs after it was sent; re-sending it (and any other lost ack of "
                            "this batch) with the same Nats-Msg-Id", subject, _reason(exc),
                            asyncio.get_running_loop().time() - sent_at)
            await publish_retry(self.js, subject, data, msg_id, headers, timeout=self.timeout, counters=self.counters)
            self._acked_at = asyncio.get_running_loop().time()
            return
        if first and getattr(ack, "duplicate", False):   # the id was taken by another publisher (module docstring)
            await publish_retry(self.js, subject, data, note_taken(subject, msg_id, self.counters), headers,
                                timeout=self.timeout, counters=self.counters)

    async def flush(self) -> None:
        while self._inflight:
            await self._settle_one()
