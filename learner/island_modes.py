"""How the sync rank hands what it reads to the ranks, and how it sends a push: the island's modes, as objects.

Owns: the staging strategies and the push senders, and the one choice between them (`background_mode`).
May touch: the `lead` functions it is given (announce an operation to the ranks and run rank 0's part,
learner/island.py), a publish function and the sync worker's `submit`; never the wire's state.
Invariants: a `Mode` is chosen once, when the sync worker starts (from the world, the staging group and
the push dtype), and dropped when it stops; the wire reads and pushes through whichever it was given
(`IslandWire.use`) and never asks which one it is.

Staging: `StageDirect` leads each batch to the ranks as it passes; `StageOnGroup` leads it on the staging
group while the ranks train (learner/stager.py); `StageDeferred` keeps the batches for the installing
boundary to lead first (no staging group: one fragment at a time, or a whole model could wait in rank 0's
memory). Pushes: `SendAtBoundary` gathers, packs and publishes at the boundary; `SendSnapshot` gathers
there and leaves packing and publishing to the worker; `SendKept` has every rank keep its share at the
boundary and the worker gather the shares on the staging group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .rank_ops import AbortOp, ExportOp, KeepOp, ResidualOp, SnapshotOp, StageOp

Lead = Callable[..., object]   # (op, payloads=None) -> what rank 0's part returns
Publish = Callable[[Iterator], object]   # chunks to publish -> their PublishHandle
Items = Callable[[Iterator], Iterator]   # gathered (span, packed) -> what `Publish` takes


class StageDirect:
    """Every batch of a version is scattered to the ranks as it is read, on the island group."""

    def __init__(self, lead: Lead):
        self.lead = lead

    def stage(self, op: StageOp, chunks: dict[int, bytes]) -> None:
        self.lead(op, chunks)

    def abort(self, fid: int) -> None:
        """Drop a staging the ranks hold."""
        self.lead(AbortOp(fid))

    def drop(self, fid: int) -> bool:
        """Forget a staging kept back from the ranks; whether there was one."""
        return False

    def install(self, fid: int) -> None:
        """Before the ranks install the fragment's version: nothing is kept back here."""

    def holds_other(self, fid: int) -> bool:
        """Another fragment's staging is kept back (reading `fid` waits for it to be installed)."""
        return False

    def release(self) -> list[int]:
        """The fragments kept back, forgotten (the mode is being left)."""
        return []


class StageOnGroup(StageDirect):
    """Every batch is scattered as it is read, on the staging group, while the ranks train."""


class StageDeferred(StageDirect):
    """Rank 0 keeps a version's stage operations and chunks until the boundary that installs it leads them."""

    def __init__(self, lead: Lead):
        super().__init__(lead)
        self.kept: dict[int, list[tuple[StageOp, dict[int, bytes]]]] = {}

    def stage(self, op: StageOp, chunks: dict[int, bytes]) -> None:
        kept = self.kept[op.fid] = [] if op.begin else self.kept.get(op.fid, [])
        # chunks given as tensors are views of rank 0's mirror (learner/update_reader.py), which moves on
        kept.append((op, {i: c.clone() if isinstance(c, torch.Tensor) else c for i, c in chunks.items()}))

    def drop(self, fid: int) -> bool:
        return self.kept.pop(fid, None) is not None

    def install(self, fid: int) -> None:
        for op, chunks in self.kept.pop(fid, []):
            self.lead(op, chunks)

    def holds_other(self, fid: int) -> bool:
        return any(f != fid for f in self.kept)

    def release(self) -> list[int]:
        fids = list(self.kept)
        self.kept.clear()
        return fids


class SendAtBoundary:
    """Gather, pack and publish on the training thread (q4 in a group: its residual scatter is collective)."""

    def __init__(self, lead: Lead, publish: Publish):
        self.lead, self.publish = lead, publish

    def send(self, export: ExportOp, items: Items):
        chunks = self.lead(export)
        try:
            return self.publish(items(chunks))
        except BaseException:
            for _ in chunks:  # a failed push still completes the gather the other ranks are in
                pass
            if export.dtype == "q4":
                self.lead(ResidualOp(export.fid, False))
            raise


class SendSnapshot:
    """The boundary takes the values as of its step (a collective gather); the worker packs and publishes."""

    def __init__(self, lead: Lead, pack: Callable, publish: Publish, submit: Callable):
        self.lead, self.pack, self.publish, self.submit = lead, pack, publish, submit

    def send(self, export: ExportOp, items: Items):
        snap = self.lead(SnapshotOp(export.fid, export.dtype, export.purpose))
        return self.submit(lambda: self.publish(items(self.pack(export, snap))))


class SendKept:
    """Each rank keeps its own share at the boundary; the worker gathers them on the staging group and publishes."""

    def __init__(self, lead: Lead, stage_lead: Lead, publish: Publish, submit: Callable):
        self.lead, self.stage_lead, self.publish, self.submit = lead, stage_lead, publish, submit

    def send(self, export: ExportOp, items: Items):
        self.lead(KeepOp(export.fid, export.dtype, export.purpose))
        return self.submit(lambda: self._gather_and_publish(ExportOp(export.fid, export.dtype, export.purpose,
                                                                     kept=True), items))

    def _gather_and_publish(self, export: ExportOp, items: Items):
        chunks = self.stage_lead(export)
        try:
            return self.publish(items(chunks))
        except BaseException:
            for _ in chunks:  # the other ranks' Stagers are in this gather: complete it
                pass
            raise


@dataclass(frozen=True)
class Mode:
    """A staging strategy and a push sender; `background`: the sync worker reads (versions it read whole
    wait in the wire's `ready` for a boundary)."""

    staging: StageDirect
    sender: SendAtBoundary | SendSnapshot | SendKept
    background: bool = False


def foreground_mode(lead: Lead, publish: Publish) -> Mode:
    """The training thread reads and pushes (no worker, or once it stopped)."""
    return Mode(StageDirect(lead), SendAtBoundary(lead, publish))


def background_mode(*, lead: Lead, stage_lead: Lead | None, world: int, push_dtype: str, pack: Callable,
                    publish: Publish, submit: Callable) -> Mode:
    """The sync worker's mode: staging on the staging group when there is one, kept back for the
    boundary in a group without one, else direct (one rank); pushes gathered by the worker where the
    staging group allows, else snapshotted at the boundary, except q4 in a group (at the boundary)."""
    if stage_lead is not None:
        staging: StageDirect = StageOnGroup(stage_lead)
    elif world > 1:
        staging = StageDeferred(lead)
    else:
        staging = StageDirect(lead)
    sender: SendAtBoundary | SendSnapshot | SendKept
    if stage_lead is not None and push_dtype != "q4":
        sender = SendKept(lead, stage_lead, publish, submit)
    elif world == 1 or push_dtype != "q4":
        sender = SendSnapshot(lead, pack, publish, submit)
    else:
        sender = SendAtBoundary(lead, publish)
    return Mode(staging, sender, background=True)


__all__ = ["Mode", "SendAtBoundary", "SendKept", "SendSnapshot", "StageDeferred", "StageDirect", "StageOnGroup",
           "background_mode", "foreground_mode"]
