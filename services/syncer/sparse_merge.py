"""The syncer shell's sparse pushes (docs/design.md §4.10): what intake checks of a sparse push chunk, the
decode of a whole push, and the step a merge applies to the fragment's f32 params span by span.

Owns no state beyond one merge's `FragmentStep`. Pure tensor code; the shell (receive.py, merge.py) reads
the bytes. A sparse run's push is one schemas/sparse.py message cut into opaque byte chunks
(schemas/chunks.byte_plan); its header says `encoding` sparseloco, and a dense run's never does.
Invariants: every accepted push was decoded once at intake (a DecodeError makes its try invalid); the
merge takes that decode (decoded_pushes.py) or decodes the same bytes again, aggregates the islands in
member order (services/syncer/sparse_outer: median-norm clip, per-coordinate mean, islands weighted
equally) and subtracts s = f32(lr)·mean from the params (the bits of `apply_step_`; a coordinate no island sent does not move). No momentum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from yeto.schemas import outer_mode as OM
from yeto.schemas.chunks import ChunkSpan, byte_plan
from yeto.schemas.errors import WireError
from yeto.schemas.sparse import SparseTensor, decode_push, push_nbytes
from yeto.schemas.sparse_update import apply_step_, encode_update
from yeto.services.syncer.sparse_outer import aggregate, step_amounts


def shapes(frag: Mapping) -> list[tuple]:
    return [tuple(t["shape"]) for t in frag["tensors"]]


def push_spans(frag: Mapping, outer: OM.SparseOuter, chunk_bytes: int) -> list[ChunkSpan]:
    """The chunks a sparse push of fragment `frag` (the session's record) must come in."""
    return byte_plan(push_nbytes(shapes(frag), outer.spec), chunk_bytes)


def check_encoding(meta: Mapping, outer: OM.SparseOuter | None) -> None:
    """A push chunk's `encoding` matches the run's outer mode; else WireError naming the field."""
    enc = meta.get("encoding")
    if outer is not None and enc != OM.SPARSE:
        raise WireError(f"this run's outer mode is {OM.SPARSE}: its pushes must say encoding {OM.SPARSE}",
                        field="encoding", value=enc, code="wrong_encoding")
    if outer is None and enc is not None:
        raise WireError(f"this run's outer mode is {OM.DENSE}: a push must carry dense values (no encoding)",
                        field="encoding", value=enc, code="wrong_encoding")


def decode(frag: Mapping, outer: OM.SparseOuter, data) -> list[SparseTensor]:
    """One whole push message of `frag` -> its tensors (DecodeError naming the field)."""
    return decode_push(data, shapes(frag), outer.spec)


def decode_norm(frag: Mapping, outer: OM.SparseOuter, data) -> tuple[list[SparseTensor], float]:
    """`decode` and the `norm` of its result, in one call (one thread hop at intake)."""
    push = decode(frag, outer, data)
    return push, norm(push)


def norm(push: Sequence[SparseTensor]) -> float:
    """The L2 norm of the decoded values (float64): the figure the quarantine rules judge."""
    return math.sqrt(sum(float(t.values.double().square().sum()) for t in push))


@dataclass
class FragmentStep:
    """One merge's step over the fragment's flat params: increasing fragment offsets and their f32 steps."""

    index: torch.Tensor   # int64
    step: torch.Tensor    # float32

    @classmethod
    def of(cls, frag: Mapping, pushes: Sequence[Sequence[SparseTensor]], lr: float) -> "FragmentStep":
        """Aggregate the pushes (member order) and take s = f32(lr)·mean per tensor (`step_amounts`, the
        same as `outer_step_`); tensors lie in the fragment in order, so the offsets stay increasing."""
        steps = step_amounts(aggregate(pushes), lr)
        return cls(torch.cat([t.indices + int(f["offset"]) for t, f in zip(steps, frag["tensors"], strict=True)]),
                   torch.cat([t.values for t in steps]))

    def update_message(self, frag: Mapping, outer: OM.SparseOuter) -> bytes:
        """This step as the update message BCAST carries (schemas/sparse_update.py): per tensor the entries
        that fall in it, as indices local to the tensor."""
        steps = []
        for t in frag["tensors"]:
            off, n = int(t["offset"]), int(t["numel"])
            lo, hi = torch.searchsorted(self.index, torch.tensor([off, off + n])).tolist()
            steps.append(SparseTensor(self.index[lo:hi] - off, self.step[lo:hi]))
        return encode_update(steps, shapes(frag), outer.spec)

    def apply(self, params: torch.Tensor, elem_offset: int) -> None:
        """θ ← θ − s (`apply_step_`) on the span of the fragment's params that starts at `elem_offset`."""
        lo, hi = torch.searchsorted(self.index, torch.tensor([elem_offset, elem_offset + params.numel()])).tolist()
        if hi > lo:
            apply_step_(params, SparseTensor(self.index[lo:hi] - elem_offset, self.step[lo:hi]))


__all__ = ["FragmentStep", "check_encoding", "decode", "decode_norm", "norm", "push_spans", "shapes"]
