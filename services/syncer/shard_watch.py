"""Syncer shards: what one shard reads of the others through the KV buckets (schemas/shards.py says who
owns what; services/syncer/sharding.py is what the round machine does with it).

- **A follower** (shard K > 0) polls, every `poll_s` (0.5 s), the state KV's `session` key until its
  machine has pinned a session (-> `SessionSeen`) and the members KV (-> `MemberSeen`, one per record
  that changed since it last fed that island's record; `_poll_members` reads them cheaply).
- **The coordinator** (shard 0) polls `final.<K>` of every other shard (-> `ShardFinal` per new
  revision, after adding that shard's digests to the cut publisher's `final_digests`) and, every status
  interval, `syncer.<K>`: a shard with no status record, one whose record stopped changing, or one that
  exited before its final cut, for `missing_after_s` (3 x --status-every, at least 15 s) is *missing*:
  taped once as an `error` record `shard K missing: ...`, `shard K back` when it returns (`missing`).
Invariants: freshness is judged by the record's KV revision on this process's clock (monotonic), never
by the other host's `updated_at`, so clock skew between shard hosts cannot make a shard look missing.
Everything read is checked; a record that is not what the writer writes is counted, taped once per
revision, and not fed. Errors of one poll are counted and the next poll tries again.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from typing import Any

import orjson

from yeto.schemas import codec, shards as SH
from yeto.schemas.errors import WireError
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.cut import CutPublisher
from yeto.services.syncer.events import MemberSeen, SessionSeen, ShardFinal
from yeto.services.syncer.rounds import RoundMachine

log = logging.getLogger("yeto.syncer")

POLL_S = 0.5
MISSING_MIN_S = 15.0
MEMBERS_BY_SEQ_MAX = 64        # more changes than this since the last poll: list the keys instead
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ShardRecordError(ValueError):
    pass


def parse_shard_final(k: int, value: bytes, *, fragments: int, shards: int) -> tuple[int, dict[int, int], dict[int, str]]:
    """(final_step, versions, digests) of a `final.<K>` record (cut.CutPublisher.shard_final_record), checked:
    the shard named is K, the fragments are exactly K's, versions are counts, digests sha256 hex."""
    try:
        rec = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ShardRecordError(f"not JSON ({exc})") from None
    if not isinstance(rec, dict):
        raise ShardRecordError(f"a {type(rec).__name__}, not an object")
    if rec.get("shard") != k:
        raise ShardRecordError(f"shard {rec.get('shard')!r}, the key names shard {k}")
    step = rec.get("final_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ShardRecordError(f"final_step {step!r} is not a step")
    versions, digests = rec.get("versions"), rec.get("version_digests")
    if not isinstance(versions, dict) or not isinstance(digests, dict):
        raise ShardRecordError("versions / version_digests are not objects")
    own = [str(f) for f in SH.own_fragments(fragments, k, shards)]
    if sorted(versions, key=int) != own or sorted(digests, key=lambda x: int(x) if x.isdigit() else -1) != own:
        raise ShardRecordError(f"fragments {sorted(versions)} / {sorted(digests)}, shard {k} owns {own}")
    vers, digs = {}, {}
    for f in own:
        v, d = versions[f], digests[f]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ShardRecordError(f"version {v!r} of fragment {f} is not a version")
        if not isinstance(d, str) or not _HEX64.match(d):
            raise ShardRecordError(f"version digest {d!r} of fragment {f} is not sha256 hex")
        vers[int(f)], digs[int(f)] = v, d
    return step, vers, digs


class ShardWatch:
    def __init__(self, *, js, run_id: str, config: SyncerConfig, state_kv, members_kv, queue: asyncio.Queue,
                 publisher: CutPublisher, tape, counters: Counter, machine: RoundMachine | None, status_every_s: float,
                 members_seen: dict[str, int] | None = None, poll_s: float = POLL_S):
        """`machine`: the follower's (whether it has pinned a session yet); `members_seen`: the revisions of
        the members records a restored machine already holds (not fed again)."""
        self.js, self.run_id, self.cfg = js, run_id, config
        self.state_kv, self.members_kv, self.queue = state_kv, members_kv, queue
        self.publisher, self.tape, self.counters, self.machine = publisher, tape, counters, machine
        self.poll_s = poll_s
        self.status_every_s = status_every_s
        self.missing_after_s = max(MISSING_MIN_S, 3 * status_every_s)
        self._session_rev = 0
        self._members_seq = 0                      # members stream's last sequence read
        self._members_rev: dict[str, int] = dict(members_seen or {})   # island -> revision last fed (or skipped as bad)
        self._final_rev: dict[int, int] = {}       # shard -> final.<K> revision last read
        self._final_in: set[int] = set()           # shards whose final cut was taken: never missing after it
        self._started = time.monotonic()
        self._status_seen: dict[int, tuple[int, float]] = {}   # shard -> (revision, when it changed)
        self.missing: dict[int, str] = {}          # shard -> why (coordinator)
        self._status_t = 0.0
        self._bad_taped: set[tuple[str, int]] = set()

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a reconnect, a timeout: the next poll tries again
                self.counters["shard_watch_error"] += 1
                log.warning("reading the other shards' records failed: %r", exc)
            await asyncio.sleep(self.poll_s)

    async def poll_once(self) -> None:
        if self.cfg.coordinator:
            await self._poll_finals()
            now = time.monotonic()
            if now - self._status_t >= min(self.status_every_s, 1.0):
                self._status_t = now
                await self._poll_status()
        else:
            if self.machine.session is None:
                await self._poll_session()
            await self._poll_members()

    # ---- follower ---------------------------------------------------------------------------------

    async def _entry(self, kv, key: str):
        from nats.js.errors import KeyNotFoundError

        try:
            e = await kv.get(key)
        except KeyNotFoundError:
            return None
        return e if e is not None and e.value else None   # an empty value is a delete marker

    async def _bad(self, what: str, key: str, rev: int, why: str) -> None:
        self.counters[f"rejected.{what}"] += 1
        if (key, rev) in self._bad_taped:
            return
        self._bad_taped.add((key, rev))
        log.warning("%s record %r (revision %d) ignored: %s", what, key, rev, why)
        await self.tape.write({"kind": "error", "reason": f"{what} record {key!r} ignored: {why}"[:2000],
                               "detail": {"code": "invalid", "field": key, "revision": rev}}, kind="error")

    async def _poll_session(self) -> None:
        e = await self._entry(self.state_kv, "session")
        if e is None or e.revision == self._session_rev:
            return
        self._session_rev = e.revision
        try:
            session = codec.decode("session", e.value)
        except WireError as exc:
            await self._bad("session", "session", e.revision, str(exc))
            return
        await self.queue.put(SessionSeen(session=session, now=time.time()))
        # The members the coordinator admitted so far come right after (the machine keeps records
        # read before the session until it has one).

    async def _poll_members(self) -> None:
        """Members are read cheaply: the bucket's stream last sequence says whether anything changed; a
        few changes are read by sequence, many (or a first read) by listing the keys."""
        kv = self.members_kv
        info = await self.js.stream_info(kv._stream)
        last = info.state.last_seq
        if last == self._members_seq:
            return
        changed: dict[str, Any] = {}
        if self._members_seq and 0 < last - self._members_seq <= MEMBERS_BY_SEQ_MAX:
            from nats.js.errors import NotFoundError

            for seq in range(self._members_seq + 1, last + 1):
                try:
                    msg = await self.js.get_msg(kv._stream, seq=seq)
                except NotFoundError:   # replaced by a newer revision of its key (read further on)
                    continue
                if not msg.subject.startswith(kv._pre):
                    continue
                op = (msg.headers or {}).get("KV-Operation")
                if op in ("DEL", "PURGE") or not msg.data:
                    continue
                changed[msg.subject[len(kv._pre):]] = (seq, msg.data)
        else:
            listing = await self.js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
            for subject in sorted(listing.state.subjects or {}):
                key = subject[len(kv._pre):]
                e = await self._entry(kv, key)
                if e is not None:
                    changed[key] = (e.revision, e.value)
        self._members_seq = last
        # in the order the coordinator wrote them
        for island, (rev, data) in sorted(changed.items(), key=lambda kv_: kv_[1][0]):
            if self._members_rev.get(island, 0) >= rev:
                continue
            self._members_rev[island] = rev
            try:
                record = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                await self._bad("members", island, rev, f"not JSON ({exc})")
                continue
            if not isinstance(record, dict):
                await self._bad("members", island, rev, f"a {type(record).__name__}, not an object")
                continue
            # The machine checks the fields (sharding._member_fields) and tapes a bad record itself.
            await self.queue.put(MemberSeen(island=island, record=record, now=time.time()))

    # ---- coordinator ------------------------------------------------------------------------------

    async def _poll_finals(self) -> None:
        """Each shard's final cut: its digests go to the cut publisher (the manifests and the run's `final`
        key need every fragment's)."""
        for k in range(1, self.cfg.shards):
            e = await self._entry(self.state_kv, SH.final_key(k))
            if e is None or e.revision == self._final_rev.get(k):
                continue
            self._final_rev[k] = e.revision
            if await self.feed_final(k, e.value, e.revision):
                self._final_in.add(k)

    async def feed_final(self, k: int, value: bytes, revision: int = 0) -> bool:
        try:
            step, versions, digests = parse_shard_final(k, value, fragments=self.cfg.fragments, shards=self.cfg.shards)
        except ShardRecordError as exc:
            await self._bad("final", SH.final_key(k), revision, str(exc))
            return False
        # Digests first: the machine's manifests (after the last ShardFinal) carry every fragment's.
        self.publisher.add_final_digests(digests)
        log.info("shard %d/%d: final cut in (step %d, versions %s)", k, self.cfg.shards, step, versions)
        await self.queue.put(ShardFinal(shard=k, final_step=step, versions=versions, now=time.time()))
        return True

    async def _poll_status(self) -> None:
        now = time.monotonic()
        for k in range(1, self.cfg.shards):
            key = SH.state_key("syncer", k, self.cfg.shards)
            e = await self._entry(self.state_kv, key)
            why = None
            if e is None:
                if now - self._started >= self.missing_after_s:
                    why = f"no status record ({key}) after {now - self._started:.0f}s"
            else:
                rev, since = self._status_seen.get(k, (None, now))
                if rev != e.revision:
                    self._status_seen[k] = (e.revision, now)
                    since = now
                try:
                    rec = orjson.loads(e.value)
                except orjson.JSONDecodeError:
                    rec = {}
                rec = rec if isinstance(rec, dict) else {}
                if k in self._final_in:
                    why = None      # its final cut is in: it may exit (slowly, or killed) with nothing left to do
                elif rec.get("exited") and rec.get("phase") != "done":
                    why = f"exited in phase {rec.get('phase')!r}"
                elif rec.get("exited"):
                    why = None      # done: its final cut is out, it has nothing left to do
                elif now - since >= self.missing_after_s:
                    why = f"no status update for {now - since:.0f}s"
            await self._set_missing(k, why)

    async def _set_missing(self, k: int, why: str | None) -> None:
        label = f"shard {k}/{self.cfg.shards}"
        if why is not None and k not in self.missing:
            self.missing[k] = why
            self.counters["shard_missing"] += 1
            log.warning("shard %d missing: %s (its fragments' rounds wait for it)", k, why)
            await self.tape.write({"kind": "error", "reason": f"shard {k} missing: {why}",
                                   "detail": {"code": "shard_missing", "shard": k, "label": label,
                                              "fragments": list(SH.own_fragments(self.cfg.fragments, k, self.cfg.shards))}},
                                  kind="error")
        elif why is None and k in self.missing:
            del self.missing[k]
            log.info("shard %d back", k)
            await self.tape.write({"kind": "error", "reason": f"shard {k} back",
                                   "detail": {"code": "shard_back", "shard": k, "label": label}}, kind="error")
