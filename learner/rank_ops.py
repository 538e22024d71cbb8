"""The operations the sync rank announces to the other ranks of its island (`Comm.share`), typed.

Owns: the shape of each operation. Rank 0 builds one, shares it and runs its own part; every other rank
runs the same operation in the same order (`RankOps.run` dispatches by type, learner/island_ranks.py).
`after` is the staging fence's stamp (learner/stager.py): how many of the other stream's operations on the
same thing rank 0 had issued before this one; 0 when unfenced. Frozen: an operation is shared by pickle
and must read the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankOp:
    after: int = field(default=0, kw_only=True)


@dataclass(frozen=True)
class StageOp(RankOp):
    """Chunks `chunks` of `version` (wire `dtype`) scattered to the ranks' staging; `begin`: chunk 0 is one."""

    fid: int
    version: int | None
    dtype: str
    chunks: tuple[int, ...]
    begin: bool


@dataclass(frozen=True)
class AbortOp(RankOp):
    """Drop the fragment's staging (a newer version overwrote it mid-read, or it was bad)."""

    fid: int


@dataclass(frozen=True)
class CommitOp(RankOp):
    """Install the staged version: `mode` "first" or "final" overwrites, "blend" blends."""

    fid: int
    version: int
    digest: str
    mode: str


@dataclass(frozen=True)
class ValuesOp(RankOp):
    """What a push or INIT reads of a fragment: `purpose` "push" (d = local − anchor) or "init" (the values)."""

    fid: int
    dtype: str
    purpose: str


@dataclass(frozen=True)
class ExportOp(ValuesOp):
    """Gather and pack to rank 0 chunk by chunk; `kept`: the shares `KeepOp` took, on the staging group."""

    kept: bool = False


@dataclass(frozen=True)
class SnapshotOp(ValuesOp):
    """Gather the values as of now, unpacked, for the worker to pack later."""


@dataclass(frozen=True)
class KeepOp(ValuesOp):
    """Every rank copies its own owned share as of now (gathered later by an `ExportOp(kept=True)`)."""


@dataclass(frozen=True)
class ResidualOp(RankOp):
    """Keep or drop the q4 residual of the push just made (`keep`: it got through)."""

    fid: int
    keep: bool


@dataclass(frozen=True)
class SessionOp(RankOp):
    """Every rank sets up the session's fragments; `stage_apart`: open a staging group."""

    session: dict
    gen: str
    alpha: float
    stage_apart: bool


@dataclass(frozen=True)
class EndOp(RankOp):
    """The sync rank's decision for this boundary: the other ranks stop following."""

    decision: dict[str, Any]


@dataclass(frozen=True)
class ErrorOp(RankOp):
    """The sync rank failed: the other ranks raise."""

    error: str


@dataclass(frozen=True)
class StopOp(RankOp):
    """To the Stagers: no more staging (the worker stopped)."""


__all__ = ["AbortOp", "CommitOp", "EndOp", "ErrorOp", "ExportOp", "KeepOp", "RankOp", "ResidualOp", "SessionOp",
           "SnapshotOp", "StageOp", "StopOp", "ValuesOp"]
