"""The cut as the islands read it, published by the syncer: each committed version on BCAST (durable
before its seal: `commit` asks the model store, services/syncer/model_store.py, to make it durable first,
then seals or broadcasts it), re-broadcasts, the f32 final cut on FINAL with its manifests, and the state
KV's `final` records. It reads the params from the model store and writes nothing there; it owns what only
the wire needs: the message ids of re-issued versions (`reissue_version`) and the final cut's digests.

Syncer shards (schemas/shards.py): a shard publishes its own fragments only; its final cut is published by
`publish_shard_final` (the checkpoint marked {"shard_final": true, ...}, the f32 digests in the state KV
`final.<K>`). The coordinator's `final_digests` hold every fragment's f32 digest once the other shards'
`final.<K>` records are in (services/syncer/shard_watch.py adds them), for the manifests and the run's
`final` key.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Awaitable, Callable

import orjson
import torch

from yeto.schemas import codec, outer_mode as OM, shards as SH, sparse_bcast as SB, subjects as S
from yeto.schemas.chunks import VersionDigest, chunk_plan
from yeto.schemas.dtypes import pack, packed_nbytes
from yeto.schemas.messages import cut_chunk
from yeto.schemas.provision import kv_put
from yeto.schemas.publish import Pipeline, publish_retry
from yeto.services.syncer.actions import CommitV0, PublishFinal, PublishShardFinal, Rebroadcast, SendManifest
from yeto.services.syncer.checkpoint import VersionFiles
from yeto.services.syncer.model_store import ModelStore
from yeto.services.syncer.tape import TapeWriter

log = logging.getLogger("yeto.syncer")
# Per-chunk ack wait of a broadcast (seconds): after a cluster node's death an ack can be lost without a
# reconnect; each lost wait stalls the round (30 s, nats-py's default, was seen in soak/chaos.py --cluster).
BCAST_ACK_S = 10.0
# Control publishes (pulls, errors, shutdown, manifests) ride out a cluster leader election (seconds;
# publish_retry's default 8 attempts last about 7 s): a PublishFailed here stops the syncer.
CTL_PUBLISH_ATTEMPTS = 40


class CutError(RuntimeError):
    pass


class BulkBytes:
    """A fragment's params packed once in the bulk dtype: the version digest hashes exactly these bytes
    and the broadcast sends them (the same bytes, no second pack). f32 bytes are views of the params
    (no copy; the params must not change until the broadcast is out, which the commit order ensures);
    bf16 is packed into one buffer of the fragment's bf16 size, held until the broadcast is out.
    `add` takes element ranges in order (any partition: sha256 streams over the concatenation), so the
    merge can pack and hash each chunk right after its outer step."""

    _ELEM_BYTES = {"f32": 4, "bf16": 2}

    def __init__(self, params: torch.Tensor, dtype: str):
        if dtype not in self._ELEM_BYTES:
            raise CutError(f"bulk dtype {dtype!r} cannot be packed here (f32 or bf16)")
        self.params, self.dtype, self.esize = params, dtype, self._ELEM_BYTES[dtype]
        self.buf = None if dtype == "f32" else torch.empty(packed_nbytes(dtype, params.numel()), dtype=torch.uint8)
        self._h = VersionDigest()
        self.done = 0            # elements packed and hashed so far
        self.seconds = 0.0       # time spent packing and hashing

    def add(self, elem_offset: int, elem_count: int) -> None:
        if elem_offset != self.done:
            raise CutError(f"bulk bytes packed out of order: elements from {elem_offset}, expected {self.done}")
        t0 = time.perf_counter()
        b = self._bytes(elem_offset, elem_count)
        if self.buf is not None:
            # the same rounding as schemas.dtypes.pack (torch's f32 -> bf16 cast), written in place
            b.view(torch.bfloat16).copy_(self.params[elem_offset: elem_offset + elem_count])
        self._h.update(b)
        self.done += elem_count
        self.seconds += time.perf_counter() - t0

    def _bytes(self, elem_offset: int, elem_count: int) -> torch.Tensor:
        if self.buf is None:
            return pack(self.params[elem_offset: elem_offset + elem_count], "f32")
        return self.buf[elem_offset * self.esize: (elem_offset + elem_count) * self.esize]

    def chunk(self, elem_offset: int, elem_count: int) -> torch.Tensor:
        if elem_offset + elem_count > self.done:
            raise CutError(f"bulk bytes of elements {elem_offset}..{elem_offset + elem_count} not packed yet")
        return self._bytes(elem_offset, elem_count)

    def hexdigest(self) -> str:
        if self.done != self.params.numel():
            raise CutError(f"version digest of a partly packed fragment ({self.done} of {self.params.numel()} elements)")
        return self._h.hexdigest()


class BroadcastStream:
    """A new version's BCAST chunks sent before it is durable (`yeto syncer --broadcast cut-through`
    or `with-commit`): `put_ready` sends every chunk whose elements the merge has packed
    (`BulkBytes.done`), except the last (cut-through calls it after each merged chunk; `flush`, which
    the commit runs beside the checkpoint's fsync, sends what is left); `seal` sends the last chunk with the version digest, which
    the commit calls only once the version is durable (checkpoint files, manifest, state KV). An island
    completes a version only at its seal, after checking the digest over every chunk, so nothing it
    installs was not durable first; the early chunks wait in BCAST (and the islands' staging) until
    then. The chunks go out in order on one pipeline, and `flush` waits for their acks before the seal,
    so the seal is the version's last message in the stream."""

    def __init__(self, publisher: "CutPublisher", fid: int, version: int, packed: BulkBytes):
        session = publisher.model.session
        if packed.dtype != session["bulk_dtype"]:
            raise CutError(f"broadcast in {session['bulk_dtype']} of bytes packed in {packed.dtype}")
        self.publisher, self.fid, self.version, self.packed = publisher, fid, version, packed
        self.counters = publisher.counters
        self.spans = chunk_plan(packed.params.numel(), packed.dtype, session["chunk_bytes"])
        self.pipe = publisher.pipeline()
        self.next = 0          # index of the next chunk to send
        self.early = 0         # chunks sent before the seal
        self.sent = 0          # bytes sent
        self.seconds = 0.0     # time spent sending (copies and publishes; not waiting for acks at the seal)

    async def _put(self, s, vdigest: str | None) -> None:
        await self.publisher.guard()   # a deposed owner sends no chunk (lease.py)
        t0 = time.perf_counter()
        buf = self.packed.chunk(s.elem_offset, s.elem_count)
        subject, msg_id, hdrs = self.publisher.chunk_message(self.fid, self.version, self.packed.dtype, self.spans, s, buf,
                                                       vdigest)
        await self.pipe.put(subject, buf, msg_id, hdrs)
        self.sent += buf.numel()
        self.next += 1
        self.seconds += time.perf_counter() - t0

    async def put_ready(self) -> None:
        last = len(self.spans) - 1
        while self.next < last:
            s = self.spans[self.next]
            if s.elem_offset + s.elem_count > self.packed.done:
                return
            await self._put(s, None)
            self.early += 1

    async def flush(self) -> None:
        """Every chunk but the seal sent (those the merge did not send already) and acknowledged."""
        await self.put_ready()
        await self.pipe.flush()

    async def seal(self, vdigest: str) -> int:
        """The rest of the version (normally its last chunk only) with the version digest on the last
        chunk; returns the bytes sent in all."""
        while self.next < len(self.spans):
            s = self.spans[self.next]
            await self._put(s, vdigest if self.next == len(self.spans) - 1 else None)
        await self.pipe.flush()
        self.counters["bytes_broadcast"] += self.sent
        return self.sent


async def _no_guard() -> None:
    """No lease (a publisher used on its own: tests, tools)."""


class CutPublisher:
    def __init__(self, js, run_id: str, counters: Counter, model: ModelStore, tape: TapeWriter, *,
                 guard: Callable[[], Awaitable[None]] = _no_guard):
        self.js, self.run_id, self.counters, self.model, self.tape = js, run_id, counters, model, tape
        # Before every chunk: raises Fenced once the lease is not ours to trust (services/syncer/lease.py).
        self.guard = guard
        self.final_digests: dict[int, str] = {}   # fragment -> f32 version digest of the final cut
        # fragment -> (version, resend id): a version number whose first chunks a killed syncer had sent with
        # other bytes (its redo failed and the round restarted). Its new chunks need ids of their own, or
        # JetStream drops them as duplicates of the old ones within the duplicate window (120 s).
        self.reissue: dict[int, tuple[int, int]] = {}

    def reissue_version(self, fid: int, version: int, resend: int) -> None:
        """Fragment `fid`'s `version` gets other bytes than a killed syncer had begun to send (its redo
        failed, or a redo of a re-issued version): its chunks go under the resend id `resend`."""
        self.reissue[fid] = (version, resend)

    def resend_id(self, fid: int, version: int) -> int | None:
        """The resend id `version` of `fid` goes out under when it was re-issued (None: its first ids)."""
        reissued = self.reissue.get(fid)
        return reissued[1] if reissued is not None and reissued[0] == version else None

    def add_final_digests(self, digests: dict[int, str]) -> None:
        """f32 version digests of final-cut fragments: this shard's, computed again on a resume, and (on
        the coordinator) the other shards' from their `final.<K>` records, for the manifests."""
        self.final_digests.update(digests)

    def packer(self, fid: int) -> BulkBytes:
        """An empty BulkBytes over the fragment's params in the session's bulk dtype: the merge packs and
        hashes each span right after its outer step (the broadcast then sends those bytes)."""
        return BulkBytes(self.model.frags[fid].params, self.model.session["bulk_dtype"])

    def bulk_bytes(self, fid: int) -> BulkBytes:
        """The fragment's current params packed once in the session's bulk dtype (see BulkBytes)."""
        bb = self.packer(fid)
        for s in chunk_plan(bb.params.numel(), bb.dtype, self.model.session["chunk_bytes"]):
            bb.add(s.elem_offset, s.elem_count)
        return bb

    async def final_cut_digests(self) -> dict[int, str]:
        """f32 version digests of this shard's fragments as they are now (the final cut's bytes)."""
        return {fid: await asyncio.to_thread(self.model.bulk_digest, fid, "f32") for fid in sorted(self.model.frags)}

    def stream(self, fid: int, version: int, packed: BulkBytes) -> "BroadcastStream":
        """A new version's chunks sent before it is durable (cut-through, with-commit): see BroadcastStream."""
        return BroadcastStream(self, fid, version, packed)

    async def commit_v0(self, a: CommitV0, attempts: dict[int, int]) -> None:
        for fid in a.fragments:
            if self.model.frags[fid].params is None:
                raise CutError(f"version 0: fragment {fid} has no INIT data")
        await self.commit({fid: 0 for fid in a.fragments}, step=0, attempts=attempts)
        log.info("version 0 committed and broadcast for %d fragments", len(a.fragments))

    async def commit(self, new_versions: dict[int, int], *, step: int, attempts: dict[int, int],
                     records: list[dict] = (), packed: dict[int, BulkBytes] | None = None,
                     streamed: dict[int, VersionFiles] | None = None,
                     streams: dict[int, BroadcastStream] | None = None,
                     stored: dict | None = None, updates: dict[int, bytes] | None = None) -> dict[str, float]:
        """Durable (checkpoint files + state KV) before broadcast. The commit's tape records (`records`
        plus one `commit` record per fragment) are written with the checkpoint and taped after the
        broadcast under Nats-Msg-Ids keyed by fragment and version (see _retape). `packed`: fragments
        whose bulk bytes the caller already packed and hashed (the merge does, chunk by chunk); the
        others are packed here. `streamed`: fragments whose new version's checkpoint files the merge
        already wrote chunk by chunk (VersionFiles): the checkpoint stage only fsyncs and renames them
        (the others are written whole here: version 0, a commit without a merge). Returns the stage
        timings (seconds), which are also added to the `detail` of the `merge` records as taped (the
        checkpoint's copy has none: they are not known yet when it is written). `streams`: fragments
        whose chunks already went out before the seal (cut-through, BroadcastStream): only the seal is
        sent here, once the version is durable. `stored`: fragments whose chunks the merge already put into
        the state KV (state_store.StateStream): the state save only waits for their acks. `updates` (the
        sparse mode): fragments whose version goes out as an update message (schemas/sparse_bcast.py), sealed
        like the full cut; the full cut then only at a `full_every`-th version (`needs_full`)."""
        t0 = time.perf_counter()
        packed = dict(packed or {})
        for fid in new_versions:
            if fid not in packed:
                packed[fid] = await asyncio.to_thread(self.bulk_bytes, fid)
        digests = {fid: packed[fid].hexdigest() for fid in new_versions}
        t_digest = time.perf_counter()
        streamed = dict(streamed or {})
        # a version whose params the merge streamed into its file is kept full in the directory
        state, prev = self.model.next_state(new_versions, digests, step=step, attempts=attempts, records=records,
                                            updates={f: u for f, u in (updates or {}).items() if f not in streamed})
        streams = dict(streams or {})
        # While the version is made durable, the chunks before the seal go out (with-commit; cut-through sent
        # them during the merge) and their acks come in: they must be in BCAST before the seal (which makes
        # the version whole for the islands) goes out.
        await self.guard()   # a deposed owner writes no checkpoint and sends no chunk (lease.py)
        await asyncio.gather(self.model.save_checkpoint(state, new_versions, streamed, updates),
                             *(st.flush() for st in streams.values()))
        store_s = await self.model.save_state_store(state, new_versions, prev, stored, updates)
        t_ckpt = time.perf_counter()
        await self.model.write_commit_record(state)
        t_kv = time.perf_counter()
        updates = dict(updates or {})
        for fid, v in new_versions.items():
            if fid in updates:
                await self.broadcast_update(fid, v, digests[fid], updates[fid])
            if fid in streams:
                await streams[fid].seal(digests[fid])
            elif self.needs_full(v, fid in updates):
                await self.broadcast(fid, v, digests[fid], packed=packed[fid])
        t_bcast = time.perf_counter()
        timings = {"digest_s": t_digest - t0, "pack_s": sum(packed[fid].seconds for fid in new_versions),
                   "checkpoint_s": t_ckpt - t_digest - store_s, "state_store_s": store_s, "commit_kv_s": t_kv - t_ckpt, "broadcast_s": t_bcast - t_kv,
                   # streamed: the writes into the page cache during the merge (checkpoint_s is then the
                   # fsync + rename + manifest, with ckpt_wait_s of it waiting for a writer thread still behind)
                   "ckpt_write_s": sum(vf.seconds for vf in streamed.values()),
                   "ckpt_wait_s": sum(vf.wait_s for vf in streamed.values()),
                   # cut-through: chunks sent before the seal, and the time the merge loop spent sending them
                   "early_chunks": sum(st.early for st in streams.values()),
                   "early_send_s": sum(st.seconds for st in streams.values()),
                   # the state KV's chunks put during the merge (state_store.StateStream), and the time it took
                   "state_streamed_s": sum(st.seconds for st in (stored or {}).values())}
        for rec in state.tape:
            rec = dict(rec)
            if rec["kind"] == "merge":
                rec["detail"] = {**rec.get("detail", {}), **timings}
            await self.tape.write(rec, kind=rec["kind"], msg_id=TapeWriter.record_msg_id(rec))
        # The older files go once the version is out (deleting 2 x 256 MiB took ~0.1 s before the KV
        # record); before the fragment's next merge streams its files, which the glob would match.
        await self.model.prune(state, new_versions)
        return timings

    def chunk_message(self, fid: int, version: int, dtype: str, spans, s, buf, vdigest: str | None, *,
                      final_step: int | None = None, resend: int | None = None) -> tuple[str, str, dict]:
        """(subject, Nats-Msg-Id, headers) of one BCAST (or, with final_step, FINAL) chunk."""
        meta = cut_chunk(spans, s.index, buf, run=self.run_id, fragment=fid, version=version, dtype=dtype,
                         version_digest=vdigest, final_step=final_step)
        if final_step is not None:
            subject, msg_id = S.final(self.run_id, fid, s.index), S.final_msg_id(fid, version, s.index)
        else:
            if resend is None:
                resend = self.resend_id(fid, version)
            subject, msg_id = S.bcast(self.run_id, fid, s.index), S.bcast_msg_id(fid, version, s.index, resend)
        return subject, msg_id, {codec.CHUNK_HEADER: meta.header()}

    def needs_full(self, version: int, updated: bool) -> bool:
        """Whether committed `version` goes out as a full cut too: always, unless it went out as a sparse update
        and is not a `full_every`-th version (schemas/sparse_bcast.py)."""
        outer = OM.from_session(self.model.session)
        return not updated or outer is None or SB.sends_full(version, outer.full_every)

    async def broadcast_update(self, fid: int, version: int, vdigest: str, message: bytes) -> int:
        """The sparse update that makes `version` from the one before, on its slot's update subjects, sealed
        with the full params' version digest (schemas/sparse_bcast.py); counted in `bytes_broadcast`."""
        outer = OM.from_session(self.model.session)
        pipe = self.pipeline()
        sent = 0
        for subject, msg_id, payload, meta in SB.update_chunks(
                message, run=self.run_id, fragment=fid, version=version, version_digest=vdigest,
                chunk_bytes=self.model.session["chunk_bytes"], full_every=outer.full_every,
                resend=self.resend_id(fid, version)):
            await self.guard()   # a deposed owner sends no chunk (lease.py)
            await pipe.put(subject, payload, msg_id, {codec.CHUNK_HEADER: meta.header()})
            sent += payload.nbytes
        await pipe.flush()
        self.counters["bytes_broadcast"] += sent
        self.counters["bytes_broadcast.update"] += sent
        return sent

    def pipeline(self) -> Pipeline:
        # The syncer sits next to the hub: an ack slower than BCAST_ACK_S is lost (a stream leader's node
        # died); a re-send with the same Nats-Msg-Id is deduplicated, so waiting less costs nothing.
        return Pipeline(self.js, timeout=BCAST_ACK_S, counters=self.counters)

    async def broadcast(self, fid: int, version: int, vdigest: str, *, final_step: int | None = None,
                         resend: int | None = None, packed: BulkBytes | None = None) -> int:
        """Every chunk of the fragment (`packed`: the bytes the version digest hashed; else packed here).
        Pipeline.put makes the one copy nats-py needs (bytes); nothing here copies."""
        fr = self.model.frags[fid]
        dtype = "f32" if final_step is not None else self.model.session["bulk_dtype"]
        spans = chunk_plan(fr.numel, dtype, self.model.session["chunk_bytes"])
        pipe = self.pipeline()
        sent = 0
        if packed is not None and packed.dtype != dtype:
            raise CutError(f"broadcast in {dtype} of bytes packed in {packed.dtype}")
        for s in spans:
            await self.guard()   # a deposed owner sends no chunk (lease.py)
            if packed is not None:
                buf = packed.chunk(s.elem_offset, s.elem_count)
            else:
                buf = pack(fr.params[s.elem_offset: s.elem_offset + s.elem_count], dtype)
            subject, msg_id, hdrs = self.chunk_message(fid, version, dtype, spans, s, buf, vdigest,
                                                       final_step=final_step, resend=resend)
            await pipe.put(subject, buf, msg_id, hdrs)
            sent += buf.numel()
        await pipe.flush()
        self.counters["bytes_broadcast"] += sent
        return sent

    async def rebroadcast(self, a: Rebroadcast) -> None:
        """The committed bytes of a version again (the machine saw a sign that BCAST lost them). Awaited
        in the loop, not spawned: no merge of this fragment starts (changing its params, broadcasting
        the next version on the same subjects) before it is out. A failure is counted, never fatal."""
        t0 = time.time()
        try:
            st = await asyncio.to_thread(self.model.read_state)
            if st.versions.get(a.fragment) != a.version or self.model.frags[a.fragment].params is None:
                self.counters["rebroadcast.skipped"] += 1
                log.warning("re-broadcast of fragment %d version %d skipped: the checkpoint holds version %s",
                            a.fragment, a.version, st.versions.get(a.fragment))
                return
            vdigest = st.version_digests[a.fragment]
            # Milliseconds: unique per re-send across syncer restarts (re-sends of one fragment are a
            # quorum timeout apart), so the duplicate window never drops one.
            resend = time.time_ns() // 1_000_000
            sent = await self.broadcast(a.fragment, a.version, vdigest, resend=resend)
        except Exception as exc:
            self.counters["rebroadcast_error"] += 1
            log.warning("re-broadcast of fragment %d version %d failed: %r", a.fragment, a.version, exc)
            return
        self.counters["rebroadcast"] += 1
        log.warning("fragment %d version %d broadcast again (%s)", a.fragment, a.version, a.reason)
        await self.tape.write({"kind": "rebroadcast", "t": time.time(), "fragment": a.fragment, "version": a.version,
                          "reason": a.reason, "detail": {"version_digest": vdigest, "resend": resend, "bytes": sent,
                                                         "seconds": time.time() - t0}}, kind="rebroadcast")

    async def publish_final(self, a: PublishFinal) -> None:
        """The f32 final cut (the machine emits PublishFinal once); its digests hash the f32 bytes and
        are checked against the manifest. The checkpoint is marked final (with the machine's
        finalization record) before FinalPublished lets the manifests go out."""
        digests = {}
        for fid in sorted(self.model.frags):
            digests[fid] = await asyncio.to_thread(self.model.bulk_digest, fid, "f32")
            await self.broadcast(fid, int(a.versions[fid]), digests[fid], final_step=a.final_step)
        self.final_digests = digests
        await self.record_final(a.record)
        log.info("final cut published (step %d)", a.final_step)

    async def publish_shard_final(self, a: PublishShardFinal) -> dict[int, str]:
        """Sharded: this shard's fragments' f32 final cut to FINAL, then the checkpoint marked final
        with {"shard_final": true, final_step, versions} (a restarted shard then only re-writes
        `final.<K>`), then `final.<K>` in the state KV (what the coordinator waits for). A crash before
        the checkpoint is marked publishes the same bytes again (same Nats-Msg-Ids). Returns the
        digests (fragment -> f32 version digest)."""
        versions = {int(k): int(v) for k, v in a.versions.items()}
        if sorted(versions) != sorted(self.model.frags):
            raise CutError(f"final cut of fragments {sorted(versions)}, this shard holds {sorted(self.model.frags)}")
        digests = {}
        for fid in sorted(self.model.frags):
            digests[fid] = await asyncio.to_thread(self.model.bulk_digest, fid, "f32")
            await self.broadcast(fid, versions[fid], digests[fid], final_step=a.final_step)
        self.final_digests.update(digests)
        # the state store's manifest too: a standby restoring it knows the cut is out
        await self.model.mark_final({"shard_final": True, "final_step": int(a.final_step),
                                     "versions": {str(k): v for k, v in sorted(versions.items())}})
        await self.write_shard_final_kv(int(a.final_step), versions, digests)
        log.info("final cut of fragments %s published (step %d)", sorted(versions), a.final_step)
        return digests

    def shard_final_record(self, final_step: int, versions: dict[int, int], digests: dict[int, str]) -> dict:
        return {"shard": self.model.shard, "final_step": int(final_step),
                "versions": {str(k): int(v) for k, v in sorted(versions.items())},
                "version_digests": {str(k): digests[k] for k in sorted(versions)}}

    async def write_shard_final_kv(self, final_step: int, versions: dict[int, int], digests: dict[int, str]) -> None:
        await kv_put(self.js, self.run_id, "state", SH.final_key(self.model.shard),
                     orjson.dumps(self.shard_final_record(final_step, versions, digests)), counters=self.counters)

    async def record_final(self, record: dict) -> None:
        """The machine's finalization record (RecordFinal): the checkpoint marked final with it, and once the
        run is finished the state KV's `final` key."""
        await self.model.mark_final(record)
        if record.get("finished"):
            await self.write_final_kv(int(record["final_step"]), {int(k): int(v) for k, v in record["versions"].items()})

    async def write_final_kv(self, final_step: int, versions: dict) -> None:
        """The run is finished and this syncer exits: leave the final manifest (no `gen`) in the state
        KV under `final`, so an island that (re)starts or was away finds the run over, installs the
        final cut from FINAL (checked against these digests) and stops instead of training on with
        nobody to sync with. Never raises (the checkpoint is the record; this is for islands)."""
        if sorted(self.final_digests) != sorted(int(k) for k in versions):
            self.counters["final_record_error"] += 1
            log.error("final record not written: digests of fragments %s, versions of %s",
                      sorted(self.final_digests), sorted(versions))
            return
        msg = codec.make("manifest", run=self.run_id, final_step=final_step,
                         versions={str(k): int(v) for k, v in sorted(versions.items())},
                         version_digests={str(k): v for k, v in sorted(self.final_digests.items())})
        try:
            await kv_put(self.js, self.run_id, "state", "final", codec.encode("manifest", msg), counters=self.counters)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.counters["final_record_error"] += 1
            log.error("writing the final record to the state KV failed: %r", exc)

    async def send_manifest(self, a: SendManifest) -> None:
        versions = {str(k): int(v) for k, v in a.versions.items()}
        msg = codec.make("manifest", run=self.run_id, final_step=a.final_step, versions=versions,
                         version_digests={str(k): v for k, v in sorted(self.final_digests.items())}, gen=a.gen)
        await publish_retry(self.js, S.to_island(self.run_id, a.island), codec.encode("manifest", msg),
                            S.to_island_msg_id(a.island, "manifest", a.gen), counters=self.counters,
                            attempts=CTL_PUBLISH_ATTEMPTS)
        log.info("manifest (final step %d) sent to %s/%s", a.final_step, a.island, a.gen)
