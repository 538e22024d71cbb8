"""The island's side of sparse broadcasts (docs/design.md §4.10, schemas/sparse_bcast.py): which update an
island can apply, the update's chunks checked and put together, and the new version computed on rank 0.

Owns, per fragment, `mirror`: (version, the exact f32 params of the version the BCAST reader holds), kept on
rank 0 from the full cuts it reads (`capture`, `captured`) and the updates it applies (`apply`); and the
update seals announced (`note`). No I/O: the shell (learner/island_wire.py) fetches the chunks and stages the
new version on the ranks like a full cut read off BCAST, so blending and anchors are as for any version.
Invariants: an update is applied only on the mirror of exactly its base version, and the result only if it
hashes to the seal (`apply_update`); a refused update (bad header or chunk, a malformed message, a digest
mismatch) is a WireError naming the field, remembered so it is not read again, and the island reads a full
cut instead. Memory on rank 0: two f32 copies of the trained fragments (the mirror and a reading's scratch).
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

import torch

from yeto.schemas import outer_mode as OM
from yeto.schemas import sparse_bcast as SB
from yeto.schemas.chunks import ChunkSpan, byte_plan, check_chunk
from yeto.schemas.errors import WireError
from yeto.schemas.messages import BcastChunk, read_chunk
from yeto.schemas.outer_mode import SparseOuter


class UpdateReader:
    """See the module doc. `note` the update notices, `next_update` says what to fetch, `assemble` checks
    the fetched chunks into one message, `apply` makes the version (then the mirror holds it)."""

    def __init__(self, session: Mapping, outer: SparseOuter, run: str):
        self.outer, self.run = outer, run
        self.frags = {f["id"]: f for f in session["fragments"]}
        self.bulk_dtype, self.chunk_bytes = session["bulk_dtype"], session["chunk_bytes"]
        self.mirror: dict[int, tuple[int, torch.Tensor]] = {}
        self._scratch: dict[int, torch.Tensor] = {}
        self.seals: dict[int, dict[int, tuple[int, str]]] = {}   # fragment -> {version: (chunks, version digest)}
        self.refused: set[tuple[int, int, str]] = set()          # (fragment, version, version digest)
        self.counters: Counter[str] = Counter()

    @classmethod
    def of(cls, session: Mapping, run: str) -> "UpdateReader | None":
        """The reader of a run whose BCAST carries sparse updates (sparse mode, f32 bulk), else None."""
        outer = OM.from_session(session)
        return cls(session, outer, run) if outer is not None and SB.sends_update(1, session["bulk_dtype"]) else None

    @staticmethod
    def notice(updates: "UpdateReader | None", n, session: Mapping) -> bool:
        """A BCAST notice of an update chunk: `note` it (True: its fragment has news), or, in a run without
        sparse broadcasts (`updates` None), refuse it naming the field (WireError)."""
        if updates is None:
            SB.check_head(n.meta, sparse=session.get("outer") is not None, bulk_dtype=session["bulk_dtype"])
            raise WireError("this run's broadcasts are full cuts", field="encoding", value=n.meta.get("encoding"))
        return updates.note(n.fragment, n.meta)

    @staticmethod
    def chunks(new: torch.Tensor, spans) -> dict[int, torch.Tensor]:
        """A version computed on rank 0 as the f32 chunks a full cut of it would carry, to stage: views of
        `new` (the mirror), no copy. Staging copies them into the ranks' staging as it runs; a staging
        that keeps them past the call (learner/island_modes.StageDeferred) copies them first, as the
        mirror takes the next update in place."""
        return {s.index: new[s.elem_offset: s.elem_offset + s.elem_count] for s in spans}

    def note(self, fid: int, meta: Mapping) -> bool:
        """An update chunk's notice (its header, checked by `check_head`: WireError naming the field). True
        when it is a seal worth reading (a version after the mirror's, not refused)."""
        if fid not in self.frags:
            raise WireError("no such fragment in the session", field="fragment", value=fid)
        head = SB.check_head(meta, sparse=True, bulk_dtype=self.bulk_dtype)
        vd = meta.get("version_digest")
        if vd is None:
            return False   # the seal comes last: read once it is there
        held = self.mirror.get(fid, (-1, None))[0]
        if head.version <= held or (fid, head.version, vd) in self.refused:
            return False
        self.seals.setdefault(fid, {})[head.version] = (int(meta["chunks"]), vd)
        return True

    def next_update(self, fid: int, held: int) -> tuple[int, int, str] | None:
        """(version, chunks, version digest) of the update to apply on top of `held` (the version the reader
        holds), or None: no sealed update of held+1 announced, or the mirror is not at `held`."""
        seals = self.seals.get(fid, {})
        for v in [v for v in seals if v <= held]:
            del seals[v]
        m = self.mirror.get(fid)
        if m is None or m[0] != held or held + 1 not in seals:
            return None
        chunks, vd = seals[held + 1]
        if SB.decide(held, SB.UpdateHead(held + 1, held)) != "apply":
            return None
        return held + 1, chunks, vd

    def subjects(self, fid: int, version: int, chunks: int) -> list[str]:
        slot = SB.slot(version, self.outer.full_every)
        return [SB.update_subject(self.run, fid, slot, i) for i in range(chunks)]

    def assemble(self, fid: int, version: int, vdigest: str, msgs: list) -> bytes | None:
        """The update message from its fetched chunk messages (None where a subject holds no message or
        another version: the seal goes out last, so the update was overwritten by a newer one in its slot,
        or purged). WireError naming the field for a chunk that does not check."""
        parts, spans = [], None
        for i, m in enumerate(msgs):
            if m is None:
                return None
            meta = read_chunk(BcastChunk, m.headers, self.run).to_wire()
            head = SB.check_head(meta, sparse=True, bulk_dtype=self.bulk_dtype)
            if head is None:
                raise WireError("an update subject holds a full-cut chunk", field="encoding", value=None)
            if head.version != version:
                return None
            if meta["fragment"] != fid or meta["chunk"] != i or meta["chunks"] != len(msgs):
                raise WireError("update chunk header does not match its subject", field="chunk", value=meta["chunk"])
            if spans is None:
                spans = byte_plan(meta["total"], self.chunk_bytes)
            check_chunk(spans, meta, m.data)
            if i == len(msgs) - 1 and meta.get("version_digest") != vdigest:
                raise WireError("the seal's version digest is not the one announced", field="version_digest",
                                value=meta.get("version_digest"))
            parts.append(bytes(m.data))
        return b"".join(parts)

    def apply(self, fid: int, version: int, vdigest: str, message: bytes) -> torch.Tensor:
        """The new version (flat f32) from the mirror and the message, checked against the seal; the mirror
        then holds it: the update is applied in place (`apply_update_`, no copy of the fragment), and the
        tensor returned is the mirror's, to be copied before the next update. DecodeError / DigestMismatch
        (WireErrors naming the field) leave the mirror as it was, bit for bit."""
        base, new = self.mirror[fid]
        if base != version - 1:
            raise WireError(f"the island holds version {base}", field="base_version", value=version - 1)
        SB.apply_update_(new, message, self.frags[fid], self.outer.spec, vdigest)
        self.mirror[fid] = (version, new)
        self.counters["applied"] += 1
        return new

    def read(self, fid: int, held: int, fetch) -> tuple[int, str, torch.Tensor, int] | None:
        """The next version on top of `held` from its update, if one can be applied now: (version, version
        digest, flat f32 params, bytes fetched). `fetch(subjects)` is the shell's direct get (its errors pass
        through). A refused update raises its WireError once and is not read again (the island then reads a
        full cut)."""
        nxt = self.next_update(fid, held)
        if nxt is None:
            return None
        version, chunks, vd = nxt
        msgs = fetch(self.subjects(fid, version, chunks))
        try:
            message = self.assemble(fid, version, vd, msgs)
            if message is None:   # its seal was there, so the update is gone (a newer one took the slot): a full cut
                self.seals.get(fid, {}).pop(version, None)
                self.counters["gone"] += 1
                return None
            new = self.apply(fid, version, vd, message)
            self.counters["bytes"] += len(message)
            return version, vd, new, len(message)
        except WireError:
            self.refuse(fid, version, vd)
            raise

    def refuse(self, fid: int, version: int, vdigest: str) -> None:
        self.refused.add((fid, version, vdigest))
        self.seals.get(fid, {}).pop(version, None)
        self.counters["refused"] += 1

    # ---- full cuts read off BCAST keep the mirror ----------------------------------------------------

    def capture(self, fid: int, span: ChunkSpan, data, completed: int | None = None) -> None:
        """A full-cut chunk passed the reader (f32 bytes): copied into the fragment's scratch at its place.
        `completed`: the version it completed (every chunk passed in order, its digest matched): the scratch
        holds exactly its bytes and becomes the mirror."""
        buf = self._scratch.get(fid)
        if buf is None:
            buf = self._scratch[fid] = torch.empty(int(self.frags[fid]["numel"]), dtype=torch.float32)
        buf[span.elem_offset: span.elem_offset + span.elem_count] = torch.frombuffer(
            bytearray(data), dtype=torch.float32)
        if completed is not None:
            self._captured(fid, completed)

    def _captured(self, fid: int, version: int) -> None:
        old = self.mirror.get(fid)
        self.mirror[fid] = (version, self._scratch.pop(fid))
        if old is not None:
            self._scratch[fid] = old[1]   # reused by the next reading


__all__ = ["UpdateReader"]
