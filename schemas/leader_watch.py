"""Stream leader elections, as the server announces them, so a lost PubAck costs one election and not an ack
timeout (docs/design.md §3.8, §15.10).

When a cluster node leading a stream dies, what was published to that stream and not yet acknowledged
never will be, and a client connected to a live node sees no reconnect. Until a new leader is elected
every publish is refused ("no responders"); then nats-server announces it on
`$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.<stream>` (timings: bench/README.md "Measured by hand").
`LeaderWatch` subscribes to the run's streams' advisories on one connection and counts elections;
schemas/publish.py notes the count when a publish leaves and, once it moved, presumes the publish lost,
re-sends it at once with the same `Nats-Msg-Id` (the new leader de-duplicates one that landed), and wakes
a retry backing off from "no responders". Best effort by design: a missed advisory (the watch's own
connection down, an advisory not allowed to an identity) leaves the ack timeouts as before.
"""
from __future__ import annotations

import asyncio
import logging
import weakref

from .subjects import KV_KINDS, STREAM_KINDS, kv_bucket, stream

log = logging.getLogger("yeto.leader_watch")

ADVISORY = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED"


def advisory_subject(stream_name: str) -> str:
    return f"{ADVISORY}.{stream_name}"


def run_advisories(run: str) -> list[str]:
    """The advisory subjects of every stream of run `run` (what an identity needs to subscribe to)."""
    return ([advisory_subject(stream(run, k)) for k in STREAM_KINDS]
            + [advisory_subject(f"KV_{kv_bucket(run, k)}") for k in KV_KINDS])


class LeaderWatch:
    """Counts stream leader elections seen on one connection; `changed` is set at each."""

    def __init__(self) -> None:
        self.elections = 0
        self.last: dict[str, int] = {}       # stream -> election count when it last elected
        self._changed = asyncio.Event()
        self._subs: list = []

    def on_elected(self, stream_name: str) -> None:
        self.elections += 1
        self.last[stream_name] = self.elections
        self._changed.set()
        self._changed = asyncio.Event()      # one event per election: waiters of this one are woken

    def keep(self, sub) -> None:
        """A subscription that feeds this watch (`stop` ends it)."""
        self._subs.append(sub)

    async def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`; True when an election came first."""
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        for s in self._subs:
            try:
                await s.unsubscribe()
            except Exception:  # a closed connection drops its subscriptions anyway
                pass
        self._subs.clear()


# One watch per client connection: schemas/publish.py finds it from a JetStream context's client.
_WATCHES: "weakref.WeakKeyDictionary[object, LeaderWatch]" = weakref.WeakKeyDictionary()


def watch_of(js_or_nc) -> LeaderWatch | None:
    nc = getattr(js_or_nc, "_nc", js_or_nc)   # a JetStreamContext keeps its Client in _nc (nats-py 2.x)
    try:
        return _WATCHES.get(nc)
    except TypeError:   # not weak-referenceable: no watch
        return None


async def watch(nc, run: str) -> LeaderWatch:
    """Start (or return) the watch of connection `nc` over run `run`'s streams."""
    w = _WATCHES.get(nc)
    if w is not None:
        return w
    w = LeaderWatch()

    async def on_msg(msg) -> None:
        name = msg.subject[len(ADVISORY) + 1:]
        log.debug("stream %s elected a new leader", name)
        w.on_elected(name)

    for subject in run_advisories(run):
        w.keep(await nc.subscribe(subject, cb=on_msg))
    _WATCHES[nc] = w
    return w
