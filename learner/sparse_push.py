"""The sync rank's sparse pushes (docs/design.md §4.10): per fragment the error-feedback accumulators
(learner/sparse_outer.ErrorFeedback, f32 on the CPU) and the message a push sends.

Owns: the accumulators as of the last push that got through, and one candidate per fragment in flight.
May touch: nothing outside; the wire (learner/island_wire.py) hands it d = local − anchor of a whole
fragment (gathered in f32 chunk by chunk, rank 0) and sends the bytes it returns, chunked as opaque
bytes (`spans`, schemas/chunks.byte_plan).
Invariants: Δ = anchor − local is taken as −d + 0.0, the same bits as anchor − local (a zero is +0);
`encode` never changes the kept accumulators: it folds Δ into new ones written over d (`ErrorFeedback.folded`), and `settle(ok=True)` (every chunk
acknowledged) keeps that copy, a failed push drops it (the next try folds its own Δ into the old ones,
never Δ twice). Thread-safe: `encode` runs where the push is packed (the sync worker in the background
modes), `settle` at a boundary.
"""
from __future__ import annotations

import threading

import torch

from yeto.schemas.chunks import ChunkSpan, byte_plan
from yeto.schemas.outer_mode import SparseOuter
from yeto.schemas.sparse import push_nbytes

from .sparse_outer import ErrorFeedback


class SparsePushes:
    def __init__(self, session: dict, outer: SparseOuter):
        self.outer = outer
        self.chunk_bytes = session["chunk_bytes"]
        self.tensors = {f["id"]: [(t["offset"], t["numel"], tuple(t["shape"])) for t in f["tensors"]]
                        for f in session["fragments"]}
        self._kept: dict[int, ErrorFeedback] = {}
        self._pending: dict[int, ErrorFeedback] = {}
        self._lock = threading.Lock()

    def shapes(self, fid: int) -> list[tuple]:
        return [shape for _, _, shape in self.tensors[fid]]

    def spans(self, fid: int) -> list[ChunkSpan]:
        """The push's chunks: its message's exact size (a function of the shapes alone) cut as opaque bytes."""
        return byte_plan(push_nbytes(self.shapes(fid), self.outer.spec), self.chunk_bytes)

    def encode(self, fid: int, d: torch.Tensor) -> bytes:
        """d = local − anchor of fragment `fid` (f32, flat in layout order; consumed: its storage becomes
        the new accumulators) -> the push message; the accumulators after it wait for `settle`."""
        ds = [d[off: off + n].view(shape) for off, n, shape in self.tensors[fid]]
        with self._lock:
            kept = self._kept.get(fid)
        # β·e + Δ written over d (the kept accumulators stay as they are until `settle`)
        cand = ErrorFeedback.folded(kept, self.outer.spec, self.outer.beta, ds)
        msg = cand.compress()
        with self._lock:
            self._pending[fid] = cand
        return msg

    def settle(self, fid: int, ok: bool) -> None:
        """The push of `fid` got through (keep its accumulators) or failed (drop them)."""
        with self._lock:
            cand = self._pending.pop(fid, None)
            if ok and cand is not None:
                self._kept[fid] = cand

    def accumulators(self, fid: int) -> list[torch.Tensor] | None:
        """Copies of the kept accumulators of `fid` (None before its first push got through)."""
        with self._lock:
            kept = self._kept.get(fid)
        return None if kept is None else kept.state_dict()["acc"]


__all__ = ["SparsePushes"]
