"""What every rank of an island does for one step the sync rank announces (docs/design.md §5, §6).

Owns: `RankOps`, one announced operation's work on one rank — the same code on rank 0 (which also holds the
wire bytes) and on the others. May touch: this rank's adapter, anchors and the island group; never the
network. Invariants: every rank runs the same ops in the same order (the sync rank shares each with
`Comm.share` before running it, learner/rank_ops.py); rank 0 holds a fetched batch, never a fragment.

* `stage`: an incoming version's chunks (BCAST or FINAL), scattered to the ranks' staging chunk by chunk;
* `abort`: drop a staging (a newer version overwrote it mid-read, or it was bad);
* `commit`: the digest was verified: every rank writes its pieces through the adapter (overwrite for the
  first version or a final cut, the blend later) and keeps the staged Θ as its owner pieces' anchor;
* `export`: the fragment gathered to rank 0 chunk by chunk for a push (d = local − anchor on the owners;
  q4: with their residuals, each owner's new one sent back) or for INIT, packed chunk by chunk;
* `residual`: keep or drop the q4 residual of the push just made.
"""
from __future__ import annotations

import copy
from typing import Iterator, Mapping

import torch

from yeto.schemas.dtypes import pack, unpack
from yeto.schemas.chunks import ChunkSpan, chunk_plan

from .anchors import AnchorStore
from .rank_ops import AbortOp, CommitOp, ExportOp, KeepOp, RankOp, ResidualOp, SnapshotOp, StageOp, ValuesOp
from .layout_map import FragmentMap, IslandLayout
from .piece_io import Comm, PieceReads, gather_chunk, scatter_chunk

XFER = {"f32": torch.float32, "bf16": torch.bfloat16}


def payload_tensor(payload, dtype: str) -> torch.Tensor:
    """A fetched chunk's bytes as values of its wire dtype (one chunk-sized copy: NATS hands out
    read-only bytes); a chunk given as values already (a version made on rank 0 from an update,
    learner/update_reader.py) as they are."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != XFER[dtype]:
            raise ValueError(f"a {payload.dtype} chunk staged as {dtype}")
        return payload
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(XFER[dtype])


class RankOps:
    def __init__(self, adapter, comm: Comm, layout: IslandLayout, session: Mapping, store: AnchorStore, alpha: float):
        self.adapter, self.comm, self.store, self.alpha = adapter, comm, store, alpha
        self.rank = comm.rank
        self.chunk_bytes = session["chunk_bytes"]
        self.maps: dict[int, FragmentMap] = {f["id"]: layout.fragment(f) for f in session["fragments"]}
        self._spans: dict[tuple[int, str], list[ChunkSpan]] = {}
        # `keep`: a push's values as of its boundary, per fragment {(tensor, lo): this rank's owned run}
        self._kept: dict[int, dict[tuple[int, int], torch.Tensor]] = {}

    def over(self, comm: Comm) -> "RankOps":
        """The same rank's operations over another group of the same ranks (learner/stager.py), sharing
        the maps, the store and the kept snapshots."""
        twin = copy.copy(self)
        twin.comm = comm
        return twin

    def spans(self, fid: int, dtype: str) -> list[ChunkSpan]:
        key = (fid, dtype)
        s = self._spans.get(key)
        if s is None:
            s = self._spans[key] = chunk_plan(self.maps[fid].numel, dtype, self.chunk_bytes)
        return s

    def _numels(self, fid: int, owned: bool = False) -> dict[str, int]:
        return {p.name: p.numel for p in self.maps[fid].pieces(self.rank) if p.owner or not owned}

    # ---- incoming versions ----------------------------------------------------------------------

    def stage(self, op: StageOp, payloads: Mapping[int, object] | None = None) -> None:
        fid, dtype = op.fid, op.dtype
        fm, spans = self.maps[fid], self.spans(fid, dtype)
        if op.begin:
            self.store.begin(fid, op.version, self._numels(fid))

        def sink(run, values):
            self.store.stage(fid, run.piece.name, run.lo, values)

        for k in op.chunks:
            s = spans[k]
            vals = payload_tensor(payloads[k], dtype) if self.comm.lead else None
            scatter_chunk(self.comm, fm, s.elem_offset, s.elem_count, vals, sink, dtype=XFER[dtype])

    def abort(self, op: AbortOp) -> None:
        self.store.abort(op.fid)

    def commit(self, op: CommitOp) -> None:
        """Writes every piece this rank holds, in
        fragment order (the adapter contract), then keeps the staging as the anchor (not for a final
        cut: nothing is pushed after it)."""
        fid, mode = op.fid, op.mode
        pieces = self.maps[fid].pieces(self.rank)
        for p in pieces:
            staged = self.store.staged(fid, p.name)
            if mode == "blend":
                self.adapter.blend(p.name, staged, self.alpha, p.local_shape)
            else:
                self.adapter.write(p.name, staged.view(p.local_shape))
        if mode == "final":
            self.store.drop_staged(fid)
        else:
            self.store.commit(fid, [p.name for p in pieces if p.owner])

    # ---- exports --------------------------------------------------------------------------------

    def export(self, op: ExportOp) -> Iterator[tuple[ChunkSpan, torch.Tensor]]:
        """On rank 0 yields (span, packed bytes)
        per chunk in order; the others yield nothing. Every rank must exhaust it (rank 0 does so even
        when it stops publishing, so the others are never left waiting in a gather)."""
        return self.pack(op, self._values(op))

    def keep(self, op: KeepOp) -> None:
        """A push (dtype not q4). Every rank, at the push's boundary: its own
        owned runs of d = local − anchor as of now, copied and kept (reading the adapter may be a
        collective of the island group, hence here); an `ExportOp(kept=True)` gathers them to rank 0
        later, on the staging group. One per fragment: the next keep replaces one never exported."""
        fid = op.fid
        fm = self.maps[fid]
        reads = PieceReads(self.adapter, fm, self.rank)
        source = self._source(op, reads)
        kept = {}
        try:
            for s in self.spans(fid, op.dtype):
                reads.advance(s.elem_offset, s.elem_count)
                for run in fm.runs(s.elem_offset, s.elem_count, self.rank, owned=True):
                    kept[(run.tensor, run.lo)] = source(run).to(torch.float32)
        finally:
            reads.close()
        self._kept[fid] = kept

    def snapshot(self, op: SnapshotOp) -> list[tuple[ChunkSpan, torch.Tensor | None]]:
        """The export values as of now, gathered to rank 0 and unpacked (f32 per chunk: d = local −
        anchor, q4 plus the residual; None on the other ranks): what a push must take at its boundary.
        `pack` may run later on rank 0's worker thread while the parameters and anchors move on, except
        q4 in a group (its residual scatter is collective)."""
        return list(self._values(op))

    def _values(self, op: ValuesOp) -> Iterator[tuple[ChunkSpan, torch.Tensor | None]]:
        """(span, the owners' values gathered on rank 0, float32; None on the other ranks) per chunk;
        with `kept`, the values `keep` took (no adapter reads)."""
        fid, dtype = op.fid, op.dtype
        fm = self.maps[fid]
        if isinstance(op, ExportOp) and op.kept:
            kept = self._kept.pop(fid)
            for s in self.spans(fid, dtype):
                yield s, gather_chunk(self.comm, fm, s.elem_offset, s.elem_count, lambda run: kept[(run.tensor, run.lo)])
            return
        reads = PieceReads(self.adapter, fm, self.rank)
        if op.purpose == "push" and dtype == "q4":
            self.store.begin_residual(fid, self._numels(fid, owned=True))
        source = self._source(op, reads)
        try:
            for s in self.spans(fid, dtype):
                reads.advance(s.elem_offset, s.elem_count)
                yield s, gather_chunk(self.comm, fm, s.elem_offset, s.elem_count, source)
        finally:
            reads.close()

    def _source(self, op: ValuesOp, reads: PieceReads):
        """This rank's float32 values of an owned run for `op` (read through `reads`): the values for
        INIT, d = local − anchor for a push (q4: plus the residual)."""
        fid, purpose = op.fid, op.purpose
        q4 = purpose == "push" and op.dtype == "q4"

        def source(run):
            name = run.piece.name
            loc = reads.flat(run)[run.lo: run.hi]
            if purpose == "init":
                return loc
            d = loc - self.store.anchor(fid, name, run.lo, run.hi)
            if q4:
                d += self.store.residual(fid, name, run.lo, run.hi)
            return d

        return source

    def pack(self, op: ValuesOp, values) -> Iterator[tuple[ChunkSpan, torch.Tensor]]:
        """Each chunk of `values` packed in the wire dtype (rank 0); q4 also hands each owner its new
        residual r' = y − q4(y) (error feedback). Every rank exhausts it (the q4 scatter is collective)."""
        fid, dtype = op.fid, op.dtype
        fm = self.maps[fid]
        q4 = op.purpose == "push" and dtype == "q4"

        def keep_residual(run, values):
            self.store.stage_residual(fid, run.piece.name, run.lo, values)

        for s, y in values:
            packed = pack(y, dtype) if y is not None else None
            if q4:
                r = y - unpack(packed, "q4", s.elem_count) if y is not None else None
                scatter_chunk(self.comm, fm, s.elem_offset, s.elem_count, r, keep_residual, owned=True,
                              purpose="gather")
            if packed is not None:
                yield s, packed

    def residual(self, op: ResidualOp) -> None:
        if op.keep:
            self.store.keep_residual(op.fid)
        else:
            self.store.abort_residual(op.fid)

    def run(self, op: RankOp, payloads: Mapping[int, object] | None = None):
        """Run `op` on this rank: the handler its type names (`_RUN`)."""
        handler = _RUN.get(type(op))
        if handler is None:
            raise ValueError(f"unknown island op {op!r}")
        return handler(self, op, payloads) if type(op) is StageOp else handler(self, op)


_RUN = {StageOp: RankOps.stage, AbortOp: RankOps.abort, CommitOp: RankOps.commit, ExportOp: RankOps.export,
        SnapshotOp: RankOps.snapshot, KeepOp: RankOps.keep, ResidualOp: RankOps.residual}


__all__ = ["RankOps", "payload_tensor"]
