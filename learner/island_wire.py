"""The sync rank's side of the wire (docs/design.md §3.6, §5.5, §6): reading cuts (BCAST and FINAL) in chunk
order into the ranks' staging, and exporting (INIT, pushes) chunk by chunk.

Owns `IslandWire`'s state: the BCAST reader, which fragments have news, what the ranks are staging, the
pushes in flight, the counters (`stats.rejected` for the step log). Held by `learner.island.Island`,
which carries out the boundary machine's operations with it. May touch: the client's fetch and publish
calls, and the ranks only through the `lead` it is given (announce, then run rank 0's part) and the
`Mode` it was handed (`use`; learner/island_modes.py), never asking which one it is.
Invariants: chunks are fetched in order in batches of at most `fetch_batch_bytes` (rank 0 never holds a
fragment); a version completes only through `cut_reader.CutReader`; a version overwritten mid-read is
dropped and read again from chunk 0; refused chunks are counted and training goes on.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Callable

import nats.errors
import torch

from yeto.schemas import codec
from yeto.schemas import outer_mode as OM
from yeto.schemas import subjects as S
from yeto.schemas.dtypes import as_bytes_view
from yeto.schemas.errors import WireError
from yeto.schemas.messages import BcastChunk, FinalChunk, PushStream, read_chunk
from yeto.schemas.publish import PublishFailed

from .boundary_ops import Commit, Push
from .errors import NotConnected
from .cut_reader import CutReader
from .inbox import PublishHandle
from .init_export import stream_init
from .island_modes import Mode, foreground_mode
from .island_ranks import RankOps
from .pulls import PendingPull
from .rank_ops import CommitOp, ExportOp, ResidualOp, StageOp
from .sparse_push import SparsePushes
from .update_reader import UpdateReader

log = logging.getLogger("yeto.island")

# Errors that mean "this push / fetch did not get through now": retried at a later boundary.
TRANSIENT = (NotConnected, TimeoutError, PublishFailed, nats.errors.Error, ConnectionError, OSError)
MAX_RESTARTS = 3  # re-reads of one fragment per boundary when newer versions keep overwriting it


@dataclass
class WireStats:
    """What the wire did since the last step-log event (the shell adds the times it measured)."""

    export_s: float = 0.0
    apply_s: float = 0.0
    bytes_in: int = 0
    rejected: int = 0

    def add(self, *, export_s: float = 0.0, apply_s: float = 0.0, bytes_in: int = 0, rejected: int = 0) -> None:
        self.export_s += export_s
        self.apply_s += apply_s
        self.bytes_in += bytes_in
        self.rejected += rejected


class IslandWire:
    """Rank 0's reading and exporting.

    Reading: a fragment is read when notices arrived for it; chunks are fetched in order by direct get in
    batches of at most `fetch_batch_bytes`, checked by `cut_reader.CutReader` and scattered to the ranks'
    staging as they pass; when a version's last chunk passed and the whole version digest matched,
    `complete(fid, version, digest)` runs before the next fragment is read (at the boundary: the machine
    decides how, every rank installs; in the sync worker: parked in `ready` for the next boundary). After
    each read, the chunks that notices claimed a newer version at and that the read did not look at (chunk 0
    held nothing new, the reading waited or was refused at an earlier chunk) are fetched on their own and
    checked (`_probe`), so garbage on the stream is refused when it lands.

    Exports: the owners' values gathered to rank 0 one chunk at a time (`RankOps.export`), packed there and
    published as they fill; INIT publishes on a background thread from a short queue; a push's acks are
    awaited in the background (`reap` reports the outcome at a later boundary).
    """

    def __init__(self, *, client, config, session: dict, gen: str, ops: RankOps, lead: Callable):
        self.client, self.config, self.session, self.gen, self.ops = client, config, session, gen, ops
        self._lead = lead
        self.frags = {f["id"]: f for f in session["fragments"]}
        outer = OM.from_session(session)   # sparse outer mode: pushes are error-feedback messages (sparse_push.py)
        self.sparse = None if outer is None else SparsePushes(session, outer)
        self.updates = UpdateReader.of(session, config.run)   # BCAST's sparse updates, applied on rank 0
        self.reader = CutReader(session)  # BCAST
        self.counters: Counter[str] = Counter()
        self.stats = WireStats()
        self._dirty: set[int] = set()  # fragments with BCAST notices since their last read
        self._noticed: dict[int, dict[int, int]] = {}  # fragment -> {chunk: version} those notices claim
        # fragment -> {chunk: newest version a notice named there}, kept across reads (bounded by the chunk
        # plan): which chunks of the version being read have landed (see _read_fragment)
        self._landed: dict[int, dict[int, int]] = {}
        self._staged: dict[int, int] = {}  # fragment -> version the ranks are staging
        self._pushing: dict[int, tuple[PendingPull, PublishHandle]] = {}  # fragment -> push awaiting acks
        # The final cut being read (FINAL): its reader, the manifest's final step, what to read, what was read.
        self._final: CutReader | None = None
        self._final_step: int | None = None
        self._final_dirty: set[int] = set()
        self._final_got: set[int] = set()
        # Versions the sync worker (learner.background) read whole wait in `ready` {fragment: (version,
        # digest)} for the next boundary.
        self.ready: dict[int, tuple[int, str]] = {}
        # How what is read reaches the ranks and how pushes go out (learner/island_modes.py): the
        # training thread's until the sync worker hands its own (`use`), and again once it stopped.
        # A push's chunks published, the acks awaited in the background (`reap`): the client's, so a mode's
        # sender publishes without holding the wire.
        self.publish = functools.partial(client.publish_stream, timeout=config.push_timeout_s, detach=True)
        self.foreground = foreground_mode(lead, self.publish)
        self.mode = self.foreground
        self._stats_lock = threading.Lock()   # the worker counts into the stats the boundary takes

    def has_input(self, kinds) -> bool:
        """Something a waiting boundary would read now: "control", "pulls", "bcast", "final" (in the
        client's inboxes), "pushes" (a push's outcome)."""
        c = self.client
        inboxes = {"control": c.control, "pulls": c.pulls, "bcast": c.bcast, "final": c.final}
        if self.mode.background and "bcast" in kinds:
            inboxes["bcast"] = self.ready   # the worker drains the notices; what it read whole is the news
        return any(len(inboxes[k]) for k in kinds if k in inboxes) or \
            ("pushes" in kinds and any(h.done() for _, h in self._pushing.values()))

    def _reject(self, what: str, exc: Exception) -> None:
        with self._stats_lock:
            self.stats.add(rejected=1)
            self.counters[f"rejected.{getattr(exc, 'code', type(exc).__name__)}"] += 1
        log.warning("island %s: rejected %s: %s", self.config.island, what, exc)

    def _bytes_in(self, n: int) -> None:
        with self._stats_lock:
            self.stats.add(bytes_in=n)

    def add_time(self, export_s: float = 0.0, apply_s: float = 0.0) -> None:
        with self._stats_lock:
            self.stats.add(export_s=export_s, apply_s=apply_s)

    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.counters[key] += n

    def take_stats(self) -> WireStats:
        """What the wire did since the last call (counted into `counters`), for a step-log event."""
        with self._stats_lock:
            stats, self.stats = self.stats, WireStats()
            self.counters.update({"bytes_in": stats.bytes_in, "rejected": stats.rejected})
        return stats

    def counters_now(self) -> Counter:
        """A copy of `counters` and the BCAST reader's (prefixed bcast.), taken while the worker may count."""
        with self._stats_lock:
            for _ in range(10):
                try:
                    out = Counter(self.counters)
                    out.update({f"bcast.{k}": v for k, v in self.reader.counters.items()})
                    out.update({f"bcast.update.{k}": v for k, v in (self.updates.counters if self.updates else {}).items()})
                    return out
                except RuntimeError:   # the worker's reader added a key mid-copy: copy again
                    continue
        return out

    def stream_init(self) -> None:
        """INIT (learner/init_export.py)."""
        stream_init(self, self._lead)

    def use(self, mode: Mode) -> None:
        """Read and push in `mode` from now on: the sync worker hands the wire its own as it starts, the
        training thread's as it stops (before the final cut, or at close). Stagings the old mode kept
        back from the ranks go with it: a reading in progress starts again at chunk 0, a version read
        whole is dropped (nothing but the final cut is installed after the worker stopped)."""
        for fid in self.mode.staging.release():
            self.reader.forget(fid)
            self._staged.pop(fid, None)
            self.ready.pop(fid, None)
            self._dirty.add(fid)
        self.mode = mode

    # ---- reading cuts (BCAST, FINAL) ------------------------------------------------------------

    def read_broadcasts(self, complete: Callable[[int, int, str], None]) -> list[int]:
        """Read the fragments with new BCAST notices; hand every version read whole to `complete` (the boundary
        installs it, the sync worker parks it). Returns those fragments."""
        self._take_notices()
        applied: list[int] = []
        if not self.client.connected:
            return applied  # a request now would only wait out its timeout: fetch after the reconnect
        for fid in sorted(self._dirty):
            if fid in self.ready or self.mode.staging.holds_other(fid):
                # its staging holds a version waiting for the boundary (read after that: dirty), or rank 0
                continue   # keeps another fragment's bytes for the ranks (one at a time: StageDeferred)
            examined: set[int] = set()
            res = self._read_update(fid) if self.updates is not None else None
            # a full cut only when a newer one was announced or is half-read (the slot mostly holds an old one)
            ahead = self.reader.announced.get(fid, -1) > self.reader.held_version(fid) or self.reader.reading(fid)
            res = res or (self._read_fragment(self.reader, "BCAST", fid, examined) if ahead else None)
            res = (self._read_update(fid) or "restart") if res == "update" else res
            updated = res == "complete" and self.updates is not None   # stays dirty: the next read looks for the update after it
            if res == "transient":
                break  # the rest waits for the next boundary (still dirty)
            if res == "complete":
                version, vdigest = self.reader.held[fid]
                complete(fid, version, vdigest)
                applied.append(fid)
            if res == "restart" or updated:
                continue  # read again at the next boundary (still dirty, its notices kept for the probe)
            # Whatever the reading did (waited at a chunk the version read has not reached, was refused at a bad
            # chunk, completed), the chunks noticed that it did not look at are checked now: a bad one is refused
            # (and counted) when it lands, not when a later reading meets it, maybe never (the real one overwrites it).
            if not self._probe(fid, examined):
                break  # a fetch failed: read and probe again at the next boundary (still dirty)
            self._noticed.pop(fid, None)
            self._dirty.discard(fid)
        return applied

    def _read_update(self, fid: int) -> str | None:
        """The next version from its update (learner/update_reader.py), staged whole: "complete", "transient", None."""
        try:
            got = self.updates.read(fid, self.reader.held_version(fid), functools.partial(self.client.fetch_last, "BCAST"))
        except TRANSIENT as exc:
            log.warning("island %s: fetching the update of fragment %d: %r", self.config.island, fid, exc)
            return "transient"
        except WireError as exc:
            return self._reject(f"bcast update of fragment {fid}", exc)
        if got is not None:
            self._bytes_in(got[3])
            self._abort_staging(fid, self.reader)   # a full cut half-read: its staging is replaced
            self._stage(fid, got[0], "f32", UpdateReader.chunks(got[2], self.reader.spans[fid]))
            self.reader.hold(fid, got[0], got[1])
            return "complete"

    def park(self, fid: int, version: int, digest: str) -> None:
        """The worker's `complete`: a version read whole waits in `ready` for the boundary to install it."""
        self.ready[fid] = (version, digest)

    def unread(self) -> bool:
        """Fragments with notices not read through yet (not counting the ones waiting in `ready`)."""
        return any(f not in self.ready for f in self._dirty)

    def _take_notices(self) -> None:
        """Take the BCAST notices that arrived: mark their fragments dirty and note which chunk holds
        which version (what `_read_fragment` batches by). Also called between a reading's batches, so
        a version landing while it is read is fetched many chunks per request, not one by one."""
        for n in self.client.bcast.drain():
            if n.meta.get("encoding") is not None:   # a sparse update's chunk (learner/update_reader.py)
                try:
                    self._dirty.update([n.fragment] if UpdateReader.notice(self.updates, n, self.session) else [])
                except WireError as exc:
                    self._reject(f"bcast update notice {n.subject}", exc)
                continue
            try:
                # A reading is (version, chunk 0's chunk digest): only the last chunk (the seal)
                # carries a version digest, so chunk digests tell a re-issued version apart.
                if self.reader.chunk_changed(n.fragment, n.chunk, n.version, n.meta.get("digest")):
                    self._abort_staging(n.fragment, self.reader)
                    self._dirty.add(n.fragment)
                if self.reader.announce(n.fragment, n.version, n.meta.get("version_digest")):
                    if not 0 <= n.chunk < len(self.reader.spans[n.fragment]):
                        raise WireError(f"fragment {n.fragment} has {len(self.reader.spans[n.fragment])} chunks",
                                        field="chunk", value=n.chunk)
                    self._dirty.add(n.fragment)
                    self._noticed.setdefault(n.fragment, {})[n.chunk] = n.version
                    landed = self._landed.setdefault(n.fragment, {})
                    landed[n.chunk] = max(n.version, landed.get(n.chunk, -1))
            except WireError as exc:  # garbage someone published on BCAST: counted, training goes on
                self._reject(f"bcast notice {n.subject}", exc)

    def _probe(self, fid: int, examined: set[int]) -> bool:
        """Notices claimed a version newer than the one held at chunks the reading just done did not
        look at (`examined`: the chunks it fetched): chunk 0 held nothing new, or the reading waited
        at an earlier chunk (the syncer between two publishes) or was refused there. Fetch those and
        check them on their own, so a corrupted or forged chunk is refused (and counted) now rather
        than whenever a reading reaches it, which may be never: the real chunk may overwrite it first
        (tests/test_island_badinput_e2e.py flaked so: a forged seal landed while a reading waited
        at chunk 2 of 4 with the syncer stopped, and was never counted). A bad chunk ahead of the
        reading in progress leaves it (CutReader.refuse): the reading meets that message later as
        "wait", or the real chunk that overwrote it. Real chunks pass and are read in order later.
        Normally every chunk noticed was examined, and this fetches nothing. False when the fetch
        failed (later)."""
        held = self.reader.held_version(fid)
        cand = sorted(k for k, v in self._noticed.get(fid, {}).items() if k not in examined and v > held)
        if not cand:
            return True
        try:
            msgs = self.client.fetch_last("BCAST", [S.bcast(self.config.run, fid, k) for k in cand])
        except TRANSIENT as exc:
            log.warning("island %s: fetching broadcast chunks of fragment %d: %r", self.config.island, fid, exc)
            return False
        for k, m in zip(cand, msgs):
            if m is None:
                continue
            self._bytes_in(len(m.data or b""))
            if self.reader.known_bad(fid, k, m.seq):
                continue
            try:
                meta = self._chunk_meta("bcast_chunk", m, self.reader, fid, k)
                if meta["version"] > held:
                    self.reader.check(fid, k, meta, m.data or b"", m.seq)
            except WireError as exc:
                self._reject(f"bcast_chunk {fid}/{k}", exc)
                if self.reader.reading(fid) is None:
                    self._abort_staging(fid, self.reader)  # the reader dropped it: so do the ranks
        return True

    def _read_fragment(self, reader: CutReader, kind: str, fid: int, examined: set[int] | None = None) -> str:
        """Fetch the fragment's next chunks in order (bounded batches) and stage them on the ranks.
        Returns "complete" (staged whole, digest verified: commit it), "wait", "restart" (newer
        versions kept overwriting it), "update" (its sparse update can be applied instead: the reading
        dropped), "failed" (a bad chunk: that version is dropped) or
        "transient" (a fetch failed: later). `examined` collects the chunks handed to the reader
        (the others noticed are probed, see _probe)."""
        header = "bcast_chunk" if kind == "BCAST" else "final_chunk"
        subject = S.bcast if kind == "BCAST" else S.final
        restarts = 0
        ahead = None  # (the next batch, its Fetch): on the wire while this batch is checked and staged
        try:
            while True:
                if kind == "BCAST":
                    self._take_notices()  # the chunks that landed since the last batch join the next one
                    if self.updates is not None and self.updates.next_update(fid, reader.held_version(fid)):
                        return self._abort_staging(fid, reader) or "update"   # its update sealed meanwhile: cheaper
                landed = self._landed.get(fid, {}) if kind == "BCAST" else {}
                rd = reader.reading(fid)
                # A cut-through broadcast lands chunk by chunk while the syncer merges: past the next chunk,
                # fetch only those a notice says hold the version being read (or, before a reading, the one
                # noticed at chunk 0). Without this each wake fetched a whole batch of chunks still holding
                # the older version to read the one new chunk (16x the bytes, and a broker kept busy). The
                # next chunk is always fetched: a missed notice costs one chunk, never a stall. FINAL is
                # written whole before its manifest: nothing to wait for there.
                target = None if kind != "BCAST" else rd[0] if rd is not None else landed.get(0)
                batch = self._batch(reader.next_chunks(fid), landed, target)
                if not batch:
                    return "wait"
                pending = None
                if ahead is not None:
                    if ahead[0][0].index == batch[0].index:  # the reading went on where it was expected to
                        batch, pending = ahead
                    else:
                        ahead[1].cancel()
                    ahead = None
                try:
                    if pending is None:
                        msgs = self.client.fetch_last(kind, [subject(self.config.run, fid, s.index) for s in batch])
                    else:
                        msgs = pending.result()
                    # The batch after this one, if it has landed, is fetched while this one is checked
                    # and staged (the checks and copies here and the direct gets on the loop thread
                    # overlap instead of taking turns): at most two batches' bytes are held.
                    rest = reader.spans[fid][batch[-1].index + 1:]
                    if rest and (target is None or landed.get(rest[0].index, -1) >= target):
                        nxt = self._batch(rest, landed, target)
                        ahead = (nxt, self.client.fetch_last_ahead(
                            kind, [subject(self.config.run, fid, s.index) for s in nxt]))
                except TRANSIENT as exc:
                    log.warning("island %s: fetching %s chunks of fragment %d: %r (retried at the next boundary)",
                                self.config.island, kind, fid, exc)
                    return "transient"
                staged: dict[int, bytes] = {}
                version = None
                for s, m in zip(batch, msgs):
                    data = None if m is None else (m.data or b"")
                    self._bytes_in(0 if data is None else len(data))
                    if examined is not None:
                        examined.add(s.index)
                    try:
                        meta = None if m is None else self._chunk_meta(header, m, reader, fid, s.index)
                        verdict = reader.take(fid, s.index, meta, data, None if m is None else m.seq)
                    except WireError as exc:
                        self._reject(f"{header} {fid}/{s.index}", exc)
                        self._abort_staging(fid, reader)
                        return "failed"
                    if verdict in ("accept", "complete"):
                        staged[s.index] = data
                        version = meta["version"]
                        if self.updates is not None and reader is self.reader:   # the mirror updates apply to
                            self.updates.capture(fid, s, data, version if verdict == "complete" else None)
                        if verdict == "complete":
                            self._stage(fid, version, reader.dtype, staged)
                            return "complete"
                    elif verdict == "restart":
                        self._abort_staging(fid, reader)
                        restarts += 1
                        if restarts > MAX_RESTARTS:
                            return "restart"
                        break
                    else:
                        self._stage(fid, version, reader.dtype, staged)
                        return "wait"
                else:
                    self._stage(fid, version, reader.dtype, staged)
        finally:
            if ahead is not None:
                ahead[1].cancel()

    def _batch(self, spans: list, landed: dict[int, int], target: int | None) -> list:
        """The next fetch: consecutive `spans` up to `fetch_batch_bytes`, stopping before a chunk no
        notice says holds `target` (the first is always taken)."""
        batch, size = [], 0
        for s in spans:
            if batch and size + s.nbytes > self.config.fetch_batch_bytes:
                break
            if batch and target is not None and landed.get(s.index, -1) < target:
                break
            batch.append(s)
            size += s.nbytes
        return batch

    def _chunk_meta(self, kind: str, m, reader: CutReader, fid: int, index: int) -> dict:
        """The chunk header of a fetched message, as the reader's dict; a message already refused
        yields {} (the reader answers "wait" for it); a header that does not decode refuses the message."""
        if reader.known_bad(fid, index, m.seq):
            return {}
        try:
            meta = read_chunk(BcastChunk if kind == "bcast_chunk" else FinalChunk, m.headers, self.config.run)
        except WireError:
            reader.refuse(fid, index, m.seq)
            raise
        return meta.to_wire()

    def _stage(self, fid: int, version: int | None, dtype: str, staged: dict[int, bytes]) -> None:
        if not staged:
            return
        chunks = sorted(staged)
        self.mode.staging.stage(StageOp(fid, version, dtype, tuple(chunks), chunks[0] == 0), staged)
        self._staged[fid] = version

    def _abort_staging(self, fid: int, reader: CutReader) -> None:
        """Drop the fragment's staging on the ranks, and the reader's position with it (both always
        describe the same chunks)."""
        reader.forget(fid)
        if fid in self.ready:
            return   # no reading: a version read whole waits in that staging for the boundary
        if self.mode.staging.drop(fid):
            self._staged.pop(fid, None)   # kept for the boundary, never handed to the ranks
        elif self._staged.pop(fid, None) is not None:
            self.mode.staging.abort(fid)

    def commit(self, op: Commit) -> None:
        """Every rank installs the version staged (the machine chose the mode); a version kept back
        from the ranks is handed out to them first (StageDeferred)."""
        self.mode.staging.install(op.fragment)
        self._lead(CommitOp(op.fragment, op.version, op.digest, op.mode))
        self._staged.pop(op.fragment, None)
        self.ready.pop(op.fragment, None)

    # ---- pushes ---------------------------------------------------------------------------------

    def push(self, op: Push) -> str | None:
        """Start a push; None once it is handed over (its acks are reaped later), else why it failed."""
        try:
            handle = self._push(op)
        except TRANSIENT as exc:
            return repr(exc)
        self._pushing[op.pull.fragment] = (op.pull, handle)
        return None

    def reap(self) -> list:
        """[(pull, bytes, error or None)] of the pushes whose acks all arrived or that failed."""
        out = []
        for fid in [f for f, (_, h) in self._pushing.items() if h.done()]:
            p, h = self._pushing.pop(fid)
            try:
                nbytes = h.result()
            except (*TRANSIENT, CancelledError) as exc:
                self._settle_push(p, False)
                out.append((p, 0, repr(exc)))
                continue
            self._settle_push(p, True)
            out.append((p, nbytes, None))
        return out

    def _push(self, op: Push) -> PublishHandle:
        """Stream d = local − anchor in the session push dtype, gathered from the owners chunk by
        chunk. Returns the PublishHandle of the chunks' acks once every chunk is handed over (done
        unless the connection dropped meanwhile: then the acks are awaited in the background and
        `reap` reports the outcome at a later boundary). Raises (TRANSIENT) when the push could not
        even be handed over; q4 then drops its working residual at once. Where the values are gathered
        and who publishes them is the mode's sender (learner/island_modes.py)."""
        p = op.pull
        fid = p.fragment
        dtype = p.push_dtype or self.session["push_dtype"]   # a round's own after `yeto run set push_dtype`
        run, island, gen = self.config.run, self.config.island, self.gen
        if self.sparse is not None:
            return self._push_sparse(op, dtype)
        stream = PushStream(self.ops.spans(fid, dtype), run=run, island=island, gen=gen, fragment=fid, step=p.step,
                            attempt=p.attempt, try_=p.try_, base_version=op.base_version, local_step=op.local_step,
                            c_steps=op.c_steps, c_tokens=op.c_tokens, dtype=dtype)
        subject = S.push(run, island, fid)

        def items(chunks):
            for s, packed in chunks:
                payload = as_bytes_view(packed)
                yield (subject, payload, S.push_msg_id(island, gen, fid, p.step, p.attempt, p.try_, s.index),
                       {codec.CHUNK_HEADER: stream.chunk(s.index, payload).header()})

        return self.mode.sender.send(ExportOp(fid, dtype, "push"), items)

    def _push_sparse(self, op: Push, dtype: str) -> PublishHandle:
        """A sparse run's push: d gathered in f32 as a dense push's (the same senders, so off the training
        thread where they are), then, where the chunks are published, the whole fragment's error-feedback
        message (learner/sparse_push.py) sent as opaque byte chunks with `encoding` sparseloco. The header's
        `dtype` is the one the round asks for (the syncer checks it as for any push); the payload is the message."""
        p = op.pull
        fid = p.fragment
        run, island, gen = self.config.run, self.config.island, self.gen
        spans = self.sparse.spans(fid)
        stream = PushStream(spans, run=run, island=island, gen=gen, fragment=fid, step=p.step, attempt=p.attempt,
                            try_=p.try_, base_version=op.base_version, local_step=op.local_step, c_steps=op.c_steps,
                            c_tokens=op.c_tokens, dtype=dtype, encoding=OM.SPARSE)
        subject = S.push(run, island, fid)
        numel = self.frags[fid]["numel"]

        def items(chunks):
            d = torch.empty(numel, dtype=torch.float32)
            for s, packed in chunks:   # f32 bytes of d = local − anchor, chunk by chunk in order
                d[s.elem_offset: s.elem_offset + s.elem_count] = packed.view(torch.float32)
            msg = memoryview(self.sparse.encode(fid, d))
            for s in spans:
                payload = msg[s.byte_offset: s.byte_offset + s.nbytes]
                yield (subject, payload, S.push_msg_id(island, gen, fid, p.step, p.attempt, p.try_, s.index),
                       {codec.CHUNK_HEADER: stream.chunk(s.index, payload).header()})

        return self.mode.sender.send(ExportOp(fid, "f32", "push"), items)

    def _settle_push(self, p: PendingPull, ok: bool) -> None:
        """A push's acks are all in (ok) or it failed: q4 keeps its working residual only if ok, the
        sparse mode its accumulators."""
        if self.sparse is not None:
            self.sparse.settle(p.fragment, ok)
            return
        if self.session["push_dtype"] == "q4":
            self._lead(ResidualOp(p.fragment, ok))

    # ---- the final cut -----------------------------------------------------------------------------

    def final_heads(self, fids: list[int]) -> list | None:
        """Chunk 0's header on FINAL of each fragment (None where absent or undecodable); None when
        FINAL could not be read now (disconnected, a failed fetch)."""
        if not self.client.connected:
            return None
        try:
            got = self.client.fetch_last("FINAL", [S.final(self.config.run, fid, 0) for fid in fids])
        except TRANSIENT as exc:
            log.warning("island %s: checking the final cut of a manifest: %r", self.config.island, exc)
            return None
        heads = []
        for m in got:
            try:
                heads.append(None if m is None else codec.decode_header(
                    "final_chunk", (m.headers or {}).get(codec.CHUNK_HEADER, b"")))
            except WireError:
                heads.append(None)
        return heads

    def begin_final(self, final_step: int, want: dict) -> None:
        """Read exactly `want` {fragment: (version, digest)} (f32) from FINAL from now on."""
        self.ready.clear()
        for fid in list(self._staged):  # a broadcast half-read, or read whole and not installed, is moot now
            self._abort_staging(fid, self.reader)
        self._final = CutReader(self.session, dtype="f32", fixed=True)
        for fid, (v, d) in want.items():
            self._final.want(fid, v, d)
        self._final_step = final_step
        self._final_dirty = set(want)  # look once at every wanted fragment, then on notices
        self._final_got = set()

    def read_final(self, commit: Callable[[int, int, str], None]) -> tuple[list[int], bool]:
        """Read the final cut's fragments with news; `commit` each that completes. Returns (the
        fragments committed, whether anything was read)."""
        reader, want = self._final, self._final.wanted
        for n in self.client.final.drain():
            if n.fragment in want and n.fragment not in self._final_got and n.meta["final_step"] == self._final_step \
                    and n.version == want[n.fragment][0]:
                self._final_dirty.add(n.fragment)
            else:
                self.counters["final_chunk.ignored"] += 1
        completed, progressed = [], False
        for fid in reader.pending() if self.client.connected else ():
            if fid not in self._final_dirty:
                continue
            res = self._read_fragment(reader, "FINAL", fid)
            if res == "transient":
                break
            progressed = True
            if res != "restart":
                self._final_dirty.discard(fid)
            if res == "complete":
                version, vdigest = reader.held[fid]
                commit(fid, version, vdigest)
                self._final_got.add(fid)
                completed.append(fid)
        return completed, progressed


__all__ = ["IslandWire", "MAX_RESTARTS", "TRANSIENT", "WireStats"]
