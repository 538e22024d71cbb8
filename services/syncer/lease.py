"""One owner per run (per shard): the syncer's lease in the run's state KV (docs/design.md §11).

A run's rounds, commits and seals come from exactly one syncer process at a time. The owner holds the
state KV key `lease` (`lease.<K>` for shard K) and rewrites it every `ttl/3` with a revision-checked
update (`Nats-Expected-Last-Subject-Sequence`). A syncer that finds the key held by another process
becomes a **standby**: it says so once (owner, host, pid, since when), watches the key, and takes over
when the key's revision has not moved for a whole TTL *on its own clock*.
Invariants: two writers can never both succeed from the same revision, and only the update that names
the revision a standby watched wins, so two standbys never both take over; no wall clocks are compared
across hosts. The owner trusts its lease only for `OWNER_TRUST` x TTL after it *sent* the refresh last
acknowledged (`LeaseBook.valid`), so an owner that was paused (SIGSTOP, a GC pause, a VM migration, a
partition) publishes nothing until a revision-checked refresh succeeds, and stops when that refresh
finds the key moved (`Fenced`); the commit record is itself written revision-checked (cut.py) and a new
owner rewrites it first. `LeaseBook` is the pure part (what the key holds, what this process may do,
when a standby takes over), tested directly; `RunLease` is its I/O shell on a nats-py KeyValue handle.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import orjson

log = logging.getLogger("yeto.syncer")

DEFAULT_TTL_S = 10.0
# Of a TTL after the last acknowledged refresh was sent: a standby cannot take over before a TTL has passed
# since it *saw* that revision, which is later; the rest is margin for a slow ack.
OWNER_TRUST = 0.75
REFRESHES_PER_TTL = 3   # the owner rewrites the key this often per TTL (two lost refreshes cost nothing)


class Fenced(Exception):
    """This process no longer owns the run (another syncer took over): it must publish nothing more."""


class FlagMismatch(Exception):
    """A syncer started for a run whose owner runs with other run flags."""


@dataclass
class LeaseBook:
    """The pure lease logic. Times are this process's monotonic seconds; revisions the KV's."""
    me: str                       # this process's owner id
    ttl_s: float = DEFAULT_TTL_S
    role: str = "new"             # new | owner | standby | fenced
    rev: int | None = None        # the key's revision as last written (owner) or seen (standby); 0: absent
    seen_at: float | None = None  # standby: when `rev` was first seen
    trusted_until: float = 0.0    # owner: the lease is ours until then without asking the KV
    holder: dict = field(default_factory=dict)   # the record last seen (standby) or written (owner)
    absent: bool = True           # the key holds no lease (never written, or deleted: released)

    def saw(self, rev: int, record: dict | None, now: float) -> None:
        """A standby read the key: revision `rev` (0 when never written; a delete marker's revision when
        deleted), `record` None when it holds no lease."""
        self.absent = record is None
        if rev != self.rev:
            self.rev, self.seen_at = rev, now
            self.holder = dict(record or {})

    def lapsed(self, now: float) -> bool:
        """Standby: the key holds no lease, or its revision has not moved for a whole TTL since it was seen."""
        if self.absent:
            return True
        return self.seen_at is not None and now - self.seen_at >= self.ttl_s

    def won(self, rev: int, sent_at: float, record: dict) -> None:
        """An update (or create) sent at `sent_at` was acknowledged as revision `rev`: we own the key."""
        self.role, self.rev, self.holder = "owner", rev, dict(record)
        self.trusted_until = sent_at + OWNER_TRUST * self.ttl_s

    def lost(self) -> None:
        """A revision-checked update found the key moved on: another process owns the run."""
        self.role = "fenced"
        self.trusted_until = 0.0

    def valid(self, now: float) -> bool:
        """The owner may act without asking the KV."""
        return self.role == "owner" and now < self.trusted_until

    def refresh_due(self, now: float, last_sent: float) -> bool:
        return self.role == "owner" and now - last_sent >= self.ttl_s / REFRESHES_PER_TTL


def flag_mismatches(mine: dict, theirs: dict) -> list[str]:
    """The run flags in which a syncer differs from the owner's, as "--flag: owner X, this Y" lines."""
    out = []
    for k in sorted(set(mine) | set(theirs)):
        if k in mine and k in theirs and mine[k] != theirs[k]:
            out.append(f"--{k.replace('_', '-')}: the owner runs with {theirs[k]!r}, this syncer with {mine[k]!r}")
    return out


async def read_key(kv, key: str) -> tuple[int, bytes | None]:
    """(revision of the key's last entry, its value) — (delete marker's revision, None) when deleted, (0, None)
    when never written: the revision a revision-checked write over it must name."""
    from nats.js.errors import KeyNotFoundError
    try:
        e = await kv.get(key)
    except KeyNotFoundError as exc:   # nats-py raises this for a deleted key too, with the marker's entry
        entry = getattr(exc, "entry", None)
        return (entry.revision if entry is not None and entry.revision else 0), None
    return e.revision, (e.value if e.value else None)


def lease_key(shard: int, shards: int) -> str:
    return "lease" if shards <= 1 else f"lease.{shard}"


# Owner ids of the leases this process holds open (several syncers may run in one process: tests, tools).
_OPEN: set[str] = set()


_FINISHED = object()   # RunLease._poll_once: the run is over
SLOW_POLL_S = 2.0
LOOK_S = 1.5   # a standby's longest wait for one answer (run finished? the key)
RELEASE_ATTEMPTS = 3


class RunLease:
    """The lease's I/O shell on the run's state KV (nats-py KeyValue). `close()` when its syncer ends."""

    def __init__(self, kv, key: str, *, ttl_s: float, flags: dict, label: str = "syncer"):
        self.kv, self.key, self.flags, self.label = kv, key, dict(flags), label
        self.me = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        _OPEN.add(self.me)
        self.book = LeaseBook(self.me, ttl_s)
        self.since = time.time()
        self._last_sent = 0.0

    def record(self) -> dict:
        return {"owner": self.me, "host": socket.gethostname(), "pid": os.getpid(), "since": self.since,
                "refreshed_at": time.time(), "ttl_s": self.book.ttl_s, "flags": self.flags}

    async def _read(self) -> tuple[int, dict | None]:
        rev, value = await read_key(self.kv, self.key)
        if value is None:
            return rev, None
        try:
            return rev, orjson.loads(value)
        except orjson.JSONDecodeError:
            return rev, {}

    async def _write(self, last: int) -> bool:
        """A revision-checked write of our record over revision `last` (0: the key must be absent).
        True when it landed; False when the key had moved on (someone else's). A lost ack is checked by
        reading the key back: our own id there is a success."""
        from nats.js.errors import KeyWrongLastSequenceError
        rec = self.record()
        sent = time.monotonic()
        try:
            rev = await self.kv.update(self.key, orjson.dumps(rec), last=last)
        except KeyWrongLastSequenceError:
            rev_now, held = await self._read()
            if held and held.get("owner") == self.me:
                rev = rev_now   # an earlier write of ours landed (its ack was lost): nobody else writes our id
            else:
                return False
        self._last_sent = sent
        self.book.won(rev, sent, rec)
        return True

    async def acquire(self) -> bool:
        """Try once to own the run: True when this process is the owner now. Otherwise the holder's
        record is in `book.holder` (a standby); FlagMismatch when the owner runs with other run flags."""
        rev, held = await self._read()
        self.book.saw(rev, held, time.monotonic())
        died = self._holder_died_here()
        if self.book.lapsed(time.monotonic()) or died:
            # nobody to agree with: the resume checks the flags against the run
            won = await self._write(rev)
            if won and not self.book.absent and held:
                log.warning("%s: took over run %s from %s (host %s, pid %s: %s)", self.label, self.key,
                            held.get("owner", "?"), held.get("host", "?"), held.get("pid", "?"),
                            "a process gone from this host" if died else "its lease had lapsed")
            return won
        if held and held.get("flags"):
            bad = flag_mismatches(self.flags, held["flags"])
            if bad:   # a standby that could never continue the owner's run
                raise FlagMismatch("; ".join(bad))
        return False

    async def wait_for_holder(self, finished: Callable[[], Awaitable[bool]]) -> bool:
        """A standby that must not take a lease nobody held (`--cover-coordinator`): wait until some process
        holds the key (True; then `wait_for_lapse`), or the run is finished (False). FlagMismatch as in
        `acquire`."""
        while True:
            got = await self._poll_once(finished)
            if got is _FINISHED:
                return False
            rev, held = got if got is not None else (0, None)
            if held:
                self.book.saw(rev, held, time.monotonic())
                if held.get("flags"):
                    bad = flag_mismatches(self.flags, held["flags"])
                    if bad:
                        raise FlagMismatch("; ".join(bad))
                return True
            await asyncio.sleep(self._poll_s)

    @property
    def _poll_s(self) -> float:
        # A released key (a planned hand-over, a finished run) is seen within a quarter second; a KV get
        # that often costs the server nothing.
        return max(0.05, min(0.25, self.book.ttl_s / 10))

    async def _poll_once(self, finished: Callable[[], Awaitable[bool]]):
        """_FINISHED when the run is finished; None after a failed read (a broker away: the caller sleeps
        and looks again, its clock running on); else the key as read, (revision, record)."""
        # Each question bounded by LOOK_S: a request whose reply was lost (a broker node restarting) would
        # otherwise hold the standby for the client's whole JetStream timeout (30 s) while the key is free.
        t0 = time.monotonic()
        try:
            if await asyncio.wait_for(finished(), LOOK_S):
                return _FINISHED
        except asyncio.TimeoutError:
            pass   # no answer now: ask again at the next poll, look at the key meanwhile
        t1 = time.monotonic()
        try:
            return await asyncio.wait_for(self._read(), LOOK_S)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.debug("lease read failed: %r", exc)
            return None
        finally:
            if time.monotonic() - t0 > SLOW_POLL_S:   # a standby that sees a release late: say where it waited
                log.warning("%s: a look at the lease took %.1f s (run finished? %.1f s, the key %.1f s)", self.label,
                            time.monotonic() - t0, t1 - t0, time.monotonic() - t1)

    def _holder_died_here(self) -> bool:
        """The holder ran on this host and its process is gone (a syncer restarted after a kill): no TTL
        to wait out. Another host's holder is judged by its revision only."""
        h = self.book.holder
        if h.get("host") != socket.gethostname() or not isinstance(h.get("pid"), int) or h.get("owner") == self.me:
            return False
        if h["pid"] == os.getpid():   # a syncer of this very process: gone once it was closed
            return h.get("owner") not in _OPEN
        try:
            os.kill(h["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:   # alive (another user's process, say): wait for the lease as usual
            return False
        return False

    async def wait_for_lapse(self, finished: Callable[[], Awaitable[bool]]) -> bool:
        """As a standby: watch the key until its holder's lease lapses and we take it over (True), or the
        run is finished (False). Says once who holds it."""
        h = self.book.holder
        log.warning("%s: standby for run %s: the owner is %s (host %s, pid %s, since %s); taking over if its "
                    "lease (TTL %.0f s) lapses", self.label, self.key, h.get("owner", "?"), h.get("host", "?"),
                    h.get("pid", "?"), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0))),
                    self.book.ttl_s)
        while True:
            got = await self._poll_once(finished)
            if got is _FINISHED:
                return False
            if got is None:
                await asyncio.sleep(self._poll_s)
                continue
            rev, held = got
            now = time.monotonic()
            before = self.book.holder.get("owner")
            self.book.saw(rev, held, now)
            if held and held.get("owner") not in (before, None):
                log.warning("%s: run %s has a new owner: %s (host %s)", self.label, self.key, held.get("owner"),
                            held.get("host"))
            if self.book.lapsed(now) or self._holder_died_here():
                try:
                    if await self._write(rev):
                        why = ("it released the lease: a planned hand-over" if held is None else
                               f"its lease revision {rev} did not move for {self.book.ttl_s:.1f} s")
                        log.warning("%s: took over run %s from %s (%s)", self.label, self.key, h.get("owner", "?"), why)
                        return True
                except Exception as exc:  # noqa: BLE001
                    log.debug("lease takeover write failed: %r", exc)
            await asyncio.sleep(self._poll_s)

    def valid(self) -> bool:
        return self.book.valid(time.monotonic())

    async def confirm(self) -> None:
        """Make sure we still own the run, asking the KV when the trust has lapsed (after a pause);
        raises Fenced when another process holds it."""
        if self.book.role == "fenced":
            raise Fenced(self.fenced_reason())
        if self.valid():
            return
        while True:
            try:
                ok = await self._write(self.book.rev or 0)
                break
            except Exception as exc:  # noqa: BLE001 - no answer: we cannot know, so we do nothing
                log.debug("lease refresh failed: %r", exc)
                await asyncio.sleep(0.2)
        if not ok:
            self.book.lost()
            raise Fenced(self.fenced_reason())

    def fenced_reason(self) -> str:
        return (f"another syncer took over this run's lease (state KV key {self.key!r}) while this process "
                f"could not refresh it (paused, partitioned or too slow): it publishes nothing more")

    async def keep(self, on_lost: Callable[[Fenced], None]) -> None:
        """As the owner: refresh the lease every TTL/3 until cancelled; call `on_lost` once it is gone."""
        while True:
            await asyncio.sleep(max(0.02, self.book.ttl_s / REFRESHES_PER_TTL / 2))
            if not self.book.refresh_due(time.monotonic(), self._last_sent):
                continue
            try:
                ok = await self._write(self.book.rev or 0)
            except Exception as exc:  # noqa: BLE001 - the trust lapses by itself if this goes on
                log.debug("lease refresh failed: %r", exc)
                continue
            if not ok:
                self.book.lost()
                on_lost(Fenced(self.fenced_reason()))
                return

    def close(self) -> None:
        _OPEN.discard(self.me)

    async def release(self) -> None:
        """At a clean exit: leave the key to a standby at once (a revision-checked delete). The revision held
        may be stale (a refresh that landed while its ack was lost, as around a broker node's restart): then
        the key is read and, still ours, deleted at the revision read. A release that fails leaves the standby
        the TTL to wait out, so it is said (a hand-over that costs a TTL looks like a slow standby)."""
        if self.book.role != "owner":
            return
        last, err = self.book.rev, None
        for _ in range(RELEASE_ATTEMPTS):
            try:
                await self.kv.delete(self.key, last=last)
                return
            except Exception as exc:  # noqa: BLE001 - a wrong revision, or no answer: look at the key
                err = exc
            try:
                rev, held = await self._read()
            except Exception as exc:  # noqa: BLE001
                err = exc
                await asyncio.sleep(0.2)
                continue
            if not held or held.get("owner") != self.me:
                return   # gone already (an earlier delete whose ack was lost), or not ours to release
            last = rev
        log.warning("%s: releasing the lease of run %s failed (%r): a standby takes over once its TTL (%.0f s) "
                    "lapses", self.label, self.key, err, self.book.ttl_s)
