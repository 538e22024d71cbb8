"""Staging a version on an island's ranks while they train (docs/design.md §5.5, §6).

Owns: the staging group (`open_staging`: a second gloo group of the same ranks, so staging need not wait
for every training thread to reach `boundary()`), the `Stager` thread that follows rank 0's worker on every
other rank (stage, abort, and gathering the shares of a push each rank kept at its boundary), and `Fence`.
Invariants: `Fence` keeps the island group's and the staging group's operations in the order rank 0
issued them where they touch the same fragment's staging or kept push (each is stamped with how many of
the other stream's rank 0 had issued before it): a commit never runs before its version's last chunk is
staged on that rank, the next version's staging never starts before the one before is installed, and a
push is gathered only after every rank kept it; a boundary that installs nothing never waits.
A group other than the whole world gets no staging group (torch would need every process of the world to
create it): its worker defers a version's staging to the installing boundary (`StageDeferred`,
learner/island_modes.py).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from typing import Callable

import torch.distributed as dist

from .errors import IslandUnhealthy
from .rank_ops import AbortOp, CommitOp, ExportOp, KeepOp, RankOp, StageOp, StopOp

log = logging.getLogger("yeto.island")

STREAMS = ("island", "staging")
STOP = StopOp()   # rank 0 to the Stagers: no more staging (the worker stopped)


def resource(op: RankOp) -> tuple | None:
    """What of a rank's an operation touches that the other stream's may too: a fragment's staging
    (stage, abort, commit) or its kept push (keep, and the export that gathers it); None for the rest
    (end, a push's snapshot, a q4 residual, ...), which never wait."""
    if isinstance(op, (StageOp, AbortOp, CommitOp)):
        return ("staging", op.fid)
    if isinstance(op, KeepOp) or (isinstance(op, ExportOp) and op.kept):
        return ("kept", op.fid)
    return None


class Fence:
    """Rank 0's issue order of two operation streams, kept on the other ranks where they touch the
    same thing (see the module doc and `resource`)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._issued: Counter = Counter()   # rank 0: (stream, resource) -> operations issued
        self._done: Counter = Counter()     # the other ranks: (stream, resource) -> operations run
        self._error: str | None = None

    @staticmethod
    def _other(stream: str) -> str:
        return STREAMS[1 - STREAMS.index(stream)]

    def stamp(self, stream: str, op: RankOp) -> RankOp:
        """Rank 0, as it issues `op` on `stream`."""
        res = resource(op)
        if res is None:
            return op
        with self._cv:
            self._issued[(stream, res)] += 1
            return dataclasses.replace(op, after=self._issued[(self._other(stream), res)])

    def wait(self, stream: str, op: RankOp) -> None:
        """Another rank, before running `op` received on `stream`."""
        res = resource(op)
        key, need = (self._other(stream), res), op.after
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or res is None or self._done[key] >= need)
            if self._error is not None:
                raise IslandUnhealthy(f"the {key[0]} operations of this rank failed: {self._error}")

    def finish(self, stream: str, op: RankOp) -> None:
        """Another rank ran `op`, received on `stream`."""
        res = resource(op)
        if res is None:
            return
        with self._cv:
            self._done[(stream, res)] += 1
            self._cv.notify_all()

    def fail(self, error: str) -> None:
        """Nothing more will finish (a Stager died): whoever waits raises."""
        with self._cv:
            self._error = error
            self._cv.notify_all()


def can_stage_apart(group) -> bool:
    """A staging group of the same ranks can be made for `group` (see the module doc)."""
    return group is not None and dist.get_world_size(group) == dist.get_world_size() > 1


def open_staging(comm) -> tuple["object", Fence]:
    """Every rank of the island, in the same order: the staging group's Comm, fenced with `comm`'s."""
    from .piece_io import Comm

    fence = Fence()
    staging = Comm(dist.new_group(ranks=comm.ranks, backend="gloo"), fence=fence, stream="staging")
    staging.bytes = comm.bytes   # one count per purpose, whichever group moved them (step-log counters)
    comm.fence_with(fence, "island")
    return staging, fence


class Stager:
    """The thread of a rank other than 0 that runs the staging group's operations as they come."""

    def __init__(self, comm, run: Callable[[RankOp], object], *, name: str):
        self.comm, self._run_op = comm, run
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                op = self.comm.share(None)
                if isinstance(op, StopOp):
                    self.comm.settle()
                    return
                out = self._run_op(op)
                if isinstance(op, ExportOp):   # a push's gather (RankOps.keep): every rank runs it to its end
                    for _ in out:
                        pass
                self.comm.settle()
        except BaseException as exc:   # noqa: BLE001 - the training thread raises it at its next operation
            log.error("island rank %d: staging thread: %r", self.comm.rank, exc)
            self.comm.fence.fail(repr(exc))

    def join(self, timeout: float) -> bool:
        """Whether the thread ended (rank 0 sent STOP) within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


__all__ = ["Fence", "STOP", "Stager", "can_stage_apart", "open_staging", "resource"]
