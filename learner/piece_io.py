"""Moving chunks between the sync rank and the ranks that hold the pieces (docs/design.md §6): the thin
torch.distributed shell around `layout_map`.

* `Comm`: the island group — `share` (rank 0's small plan to everyone), `all_gather` (objects),
  `exchange` (batched point-to-point isend/irecv); in a single process nothing travels.
* `scatter_chunk`: rank 0 holds one chunk of a fragment and sends each peer only its own runs of it, one
  message per peer (about DP copies of a fragment on the wire in all, never world copies); every rank
  hands its runs to a `sink` (staging). `gather_chunk`: the reverse for exports, from the owners.
* `PieceReads`: the adapter's `read` for one pass over a fragment, in fragment order; values on an
  accelerator reach the host through `learner/device.py`, so everything here works on host tensors.
Invariants: every rank calls these with the same arguments in the same order (rank 0 announces each step
with `Comm.share` first), so the messages between two ranks match in order; tensors travel as raw bytes
(bf16 needs nothing from the backend); the island group carries CPU tensors (gloo, or `learner.hybrid`).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .device import HostStaging
from .layout_map import FragmentMap, Run

Sink = Callable[[Run, torch.Tensor], None]
Source = Callable[[Run], torch.Tensor]


class Comm:
    """The island's process group as the sync core uses it (group None: a single process)."""

    def __init__(self, group: "dist.ProcessGroup | None" = None, *, fence=None, stream: str = "island"):
        self.group = group
        # With a staging group beside the island group (learner/stager.py): rank 0 stamps what it shares,
        # the others wait for the other group's operations it names, and `settle` once they ran it.
        self.fence, self.stream = fence, stream
        self._unsettled: dict | None = None
        if group is None:
            self.rank, self.world, self.ranks = 0, 1, [0]
        else:
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            self.ranks = [dist.get_global_rank(group, i) for i in range(self.world)]
        # Bytes rank 0 moved, by purpose ("scatter", "gather"), since start: the step log's counters.
        self.bytes: Counter[str] = Counter()

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def fence_with(self, fence, stream: str) -> None:
        """From now on order what this group shares against another group's (learner/stager.py's Fence)."""
        self.fence, self.stream = fence, stream

    def count_bytes(self, purpose: str, n: int) -> None:
        self.bytes[purpose] += n

    def share(self, obj=None):
        """Rank 0's object on every rank."""
        if self.world == 1:
            return obj
        if self.lead and self.fence is not None:
            obj = self.fence.stamp(self.stream, obj)
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        obj = box[0]
        if not self.lead and self.fence is not None:
            self.fence.wait(self.stream, obj)
            self._unsettled = obj
        return obj

    def settle(self) -> None:
        """Another rank ran the operation `share` gave it last (the fence counts it as done)."""
        if self._unsettled is not None:
            op, self._unsettled = self._unsettled, None
            self.fence.finish(self.stream, op)

    def all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def exchange(self, sends: Iterable[tuple[int, torch.Tensor]], recvs: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Point to point with group ranks: send each (peer, tensor), receive into each (peer, tensor);
        returns once all are done. Tensors must be contiguous CPU tensors."""
        ops = [dist.P2POp(dist.isend, _raw(t), self.ranks[p], self.group) for p, t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, _raw(t), self.ranks[p], self.group) for p, t in recvs if t.numel()]
        if not ops:
            return
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def scatter_chunk(comm: Comm, fm: FragmentMap, elem_offset: int, elem_count: int, values: torch.Tensor | None,
                  sink: Sink, *, dtype: torch.dtype = torch.float32, owned: bool = False,
                  purpose: str = "scatter") -> None:
    """Rank 0's `values` (1-D, `elem_count` values of the fragment from `elem_offset`, in `dtype`) to
    every rank's runs (only owner pieces with `owned`); each rank's `sink(run, float32 values)`."""
    if comm.lead:
        sends = []
        for r in range(comm.world):
            runs = fm.runs(elem_offset, elem_count, r, owned=owned)
            if not runs:
                continue
            parts = [values[fm.positions(run, elem_offset)] for run in runs]
            if r == 0:
                for run, part in zip(runs, parts):
                    sink(run, part.to(torch.float32))
            else:
                buf = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                sends.append((r, buf))
                comm.count_bytes(purpose, buf.numel() * buf.element_size())
        comm.exchange(sends, ())
        return
    runs = fm.runs(elem_offset, elem_count, comm.rank, owned=owned)
    if not runs:
        return
    buf = torch.empty(sum(r.count for r in runs), dtype=dtype)
    comm.exchange((), [(0, buf)])
    pos = 0
    for run in runs:
        sink(run, buf[pos: pos + run.count].to(torch.float32))
        pos += run.count


def gather_chunk(comm: Comm, fm: FragmentMap, elem_offset: int, elem_count: int, source: Source,
                 *, purpose: str = "gather") -> torch.Tensor | None:
    """The owners' values of the span, assembled on rank 0 (float32, `elem_count` values); None on
    the other ranks. `source(run)` gives this rank's float32 values of an owned run."""
    if comm.lead:
        out = torch.empty(elem_count, dtype=torch.float32)
        recvs = []
        for r in range(comm.world):
            runs = fm.runs(elem_offset, elem_count, r, owned=True)
            if not runs:
                continue
            if r == 0:
                for run in runs:
                    out[fm.positions(run, elem_offset)] = source(run)
            else:
                recvs.append((r, torch.empty(sum(x.count for x in runs), dtype=torch.float32), runs))
        comm.exchange((), [(r, buf) for r, buf, _ in recvs])
        for _, buf, runs in recvs:
            comm.count_bytes(purpose, buf.numel() * buf.element_size())
            pos = 0
            for run in runs:
                out[fm.positions(run, elem_offset)] = buf[pos: pos + run.count]
                pos += run.count
        return out
    runs = fm.runs(elem_offset, elem_count, comm.rank, owned=True)
    if runs:
        parts = [source(run).to(torch.float32) for run in runs]
        comm.exchange([(0, torch.cat(parts) if len(parts) > 1 else parts[0].contiguous())], ())
    return None


class PieceReads:
    """`adapter.read` for one pass over a fragment, chunk after chunk: `advance(span)` reads every
    tensor the span reaches for the first time that this rank holds (owner or replica, in fragment
    order, as the adapter contract asks) and keeps the owner pieces the span overlaps, flat. An owner
    piece on an accelerator is kept as its host copy: every copy of one `advance` is issued before the
    first is waited for (`HostStaging`), so they overlap one another and the reads' own kernels."""

    def __init__(self, adapter, fm: FragmentMap, rank: int):
        self.adapter, self.fm = adapter, fm
        self._mine = {}
        for i, t in enumerate(fm.tensors):
            ps = [p for p in fm.pieces(rank) if p.name == t["name"]]
            if ps:
                self._mine[i] = ps[0]
        self._next = 0
        self._cache: dict[int, torch.Tensor] = {}
        self.staging = HostStaging()

    def advance(self, elem_offset: int, elem_count: int) -> None:
        rng = self.fm.tensor_range(elem_offset, elem_count)
        for i in range(self._next, rng.stop):
            p = self._mine.get(i)
            if p is not None:
                v = self.adapter.read(p.name)
                if p.owner:
                    self._cache[i] = self.staging.host(v.detach().reshape(-1))
        self.staging.wait()
        self._next = max(self._next, rng.stop)
        for i in [i for i in self._cache if i < rng.start]:
            del self._cache[i]

    def flat(self, run: Run) -> torch.Tensor:
        return self._cache[run.tensor]

    def close(self) -> None:
        self._cache.clear()


__all__ = ["Comm", "PieceReads", "gather_chunk", "scatter_chunk"]
