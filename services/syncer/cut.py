"""The global model as the syncer holds it: every fragment's f32 params and momentum, their durable
commits (checkpoint directory, then the state KV `commit` record, then the broadcast: durable before
broadcast), re-broadcasts, and the f32 final cut with its manifests and the state KV `final` record.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import orjson
import torch

from schemas import codec, subjects as S
from schemas.chunks import VersionDigest, chunk_header, chunk_plan
from schemas.dtypes import pack
from schemas.provision import kv_put
from schemas.publish import Pipeline, publish_retry
from services.syncer import rounds as R
from services.syncer.checkpoint import CheckpointDir, CheckpointState
from services.syncer.tape import TapeWriter

log = logging.getLogger("yeto.syncer")
# Per-chunk ack wait of a broadcast (seconds): after a cluster node's death an ack can be lost without a
# reconnect; each lost wait stalls the round (30 s, nats-py's default, was seen in bench/chaos.py --cluster).
BCAST_ACK_S = 10.0
# Control publishes (pulls, errors, shutdown, manifests) ride out a cluster leader election (seconds;
# publish_retry's default 8 attempts last about 7 s): a PublishFailed here stops the syncer.
CTL_PUBLISH_ATTEMPTS = 40


class CutError(RuntimeError):
    pass


@dataclass
class Frag:
    numel: int
    params: torch.Tensor | None = None
    momentum: torch.Tensor | None = None


class Cut:
    def __init__(self, js, run_id: str, counters: Counter, ckpt: CheckpointDir, tape: TapeWriter):
        self.js, self.run_id, self.counters, self.ckpt, self.tape = js, run_id, counters, ckpt, tape
        self.session: dict | None = None
        self.frags: dict[int, Frag] = {}
        self.final_digests: dict[int, str] = {}   # fragment -> f32 version digest of the final cut

    def set_session(self, session: dict) -> None:
        self.session = session
        for f in session["fragments"]:
            self.frags.setdefault(f["id"], Frag(numel=f["numel"]))

    def bulk_digest(self, fid: int, dtype: str) -> str:
        fr = self.frags[fid]
        h = VersionDigest()
        for s in chunk_plan(fr.numel, dtype, self.session["chunk_bytes"]):
            h.update(pack(fr.params[s.elem_offset: s.elem_offset + s.elem_count], dtype))
        return h.hexdigest()

    async def commit_v0(self, a: R.CommitV0, attempts: dict[int, int]) -> None:
        for fid in a.fragments:
            fr = self.frags[fid]
            if fr.params is None:
                raise CutError(f"version 0: fragment {fid} has no INIT data")
        await self.commit({fid: 0 for fid in a.fragments}, step=0, attempts=attempts)
        log.info("version 0 committed and broadcast for %d fragments", len(a.fragments))

    async def commit(self, new_versions: dict[int, int], *, step: int, attempts: dict[int, int],
                     records: list[dict] = ()) -> None:
        """Durable (checkpoint files + state KV) before broadcast. The commit's tape records (`records`
        plus one `commit` record per fragment) are written with the checkpoint and taped after the
        broadcast under Nats-Msg-Ids keyed by fragment and version (see _retape)."""
        bulk = self.session["bulk_dtype"]
        digests = {}
        for fid in new_versions:
            digests[fid] = await asyncio.to_thread(self.bulk_digest, fid, bulk)
        prev = self.ckpt.read_state() if self.ckpt.exists() else None
        versions = dict(prev.versions) if prev else {}
        vdig = dict(prev.version_digests) if prev else {}
        versions.update(new_versions)
        vdig.update(digests)
        state = CheckpointState(
            run=self.run_id, session_fingerprint=self.session["session_fingerprint"],
            layout_fingerprint=self.session["layout_fingerprint"],
            committed_step=max(step, prev.committed_step if prev else 0), versions=versions, version_digests=vdig,
            attempts={s: a for s, a in attempts.items() if s > step},
            tape=list(records) + [{"kind": "commit", "t": time.time(), "step": step, "fragment": fid, "version": v,
                                   "detail": {"version_digest": digests[fid]}} for fid, v in new_versions.items()],
        )
        frags = {fid: (self.frags[fid].params, self.frags[fid].momentum) for fid in new_versions}
        await asyncio.to_thread(self.ckpt.commit, state, frags)
        await self.write_commit_record(state)
        for fid, v in new_versions.items():
            await self.broadcast(fid, v, digests[fid])
        for rec in state.tape:
            await self.tape.write(dict(rec), kind=rec["kind"], msg_id=TapeWriter.record_msg_id(rec))

    async def write_commit_record(self, state: CheckpointState) -> None:
        rec = {"committed_step": state.committed_step,
               "versions": {str(k): v for k, v in state.versions.items()},
               "version_digests": {str(k): v for k, v in state.version_digests.items()}}
        await kv_put(self.js, self.run_id, "state", "commit", orjson.dumps(rec), counters=self.counters)

    async def broadcast(self, fid: int, version: int, vdigest: str, *, final_step: int | None = None,
                         resend: int | None = None) -> int:
        fr = self.frags[fid]
        dtype = "f32" if final_step is not None else self.session["bulk_dtype"]
        kind = "final_chunk" if final_step is not None else "bcast_chunk"
        spans = chunk_plan(fr.numel, dtype, self.session["chunk_bytes"])
        # The syncer sits next to the hub: an ack slower than BCAST_ACK_S is lost (a stream leader's node
        # died); a re-send with the same Nats-Msg-Id is deduplicated, so waiting less costs nothing.
        pipe = Pipeline(self.js, timeout=BCAST_ACK_S, counters=self.counters)
        sent = 0
        for s in spans:
            payload = pack(fr.params[s.elem_offset: s.elem_offset + s.elem_count], dtype)
            buf = payload.numpy().tobytes()
            meta = {"v": codec.PROTOCOL_VERSION, "run": self.run_id, "fragment": fid, "version": version, "dtype": dtype,
                    **chunk_header(spans, s.index, buf), "version_digest": vdigest}
            if final_step is not None:
                meta["final_step"] = final_step
                subject, msg_id = S.final(self.run_id, fid, s.index), S.final_msg_id(fid, version, s.index)
            else:
                subject, msg_id = S.bcast(self.run_id, fid, s.index), S.bcast_msg_id(fid, version, s.index, resend)
            await pipe.put(subject, buf, msg_id, {codec.CHUNK_HEADER: codec.encode_header(kind, meta)})
            sent += len(buf)
        await pipe.flush()
        self.counters["bytes_broadcast"] += sent
        return sent

    async def rebroadcast(self, a: R.Rebroadcast) -> None:
        """The committed bytes of a version again (the machine saw a sign that BCAST lost them). Awaited
        in the loop, not spawned: no merge of this fragment starts (changing its params, broadcasting
        the next version on the same subjects) before it is out. A failure is counted, never fatal."""
        t0 = time.time()
        try:
            st = await asyncio.to_thread(self.ckpt.read_state)
            if st.versions.get(a.fragment) != a.version or self.frags[a.fragment].params is None:
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

    async def publish_final(self, a: R.PublishFinal) -> None:
        """The f32 final cut (the machine emits PublishFinal once); its digests hash the f32 bytes and
        are checked against the manifest. The checkpoint is marked final (with the machine's
        finalization record) before FinalPublished lets the manifests go out."""
        digests = {}
        for fid in sorted(self.frags):
            digests[fid] = await asyncio.to_thread(self.bulk_digest, fid, "f32")
            await self.broadcast(fid, int(a.versions[fid]), digests[fid], final_step=a.final_step)
        self.final_digests = digests
        await self.record_final(a.record)
        log.info("final cut published (step %d)", a.final_step)

    async def record_final(self, record: dict) -> None:
        def write():
            st = self.ckpt.read_state()
            st.final, st.final_record = True, dict(record)
            self.ckpt.commit(st, {})
        await asyncio.to_thread(write)
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

    async def send_manifest(self, a: R.SendManifest) -> None:
        versions = {str(k): int(v) for k, v in a.versions.items()}
        msg = codec.make("manifest", run=self.run_id, final_step=a.final_step, versions=versions,
                         version_digests={str(k): v for k, v in sorted(self.final_digests.items())}, gen=a.gen)
        await publish_retry(self.js, S.to_island(self.run_id, a.island), codec.encode("manifest", msg),
                            S.to_island_msg_id(a.island, "manifest", a.gen), counters=self.counters,
                            attempts=CTL_PUBLISH_ATTEMPTS)
        log.info("manifest (final step %d) sent to %s/%s", a.final_step, a.island, a.gen)
