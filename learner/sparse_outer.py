"""The island's side of the sparse outer mode (docs/design.md §4.10): the error-feedback accumulator and
the push it compresses. Pure tensor code, no I/O; the wire format is schemas/sparse.py.

SparseLoCo replaces the outer Nesterov momentum with an accumulator e per tensor, in f32, that never
leaves the island. At a push of a fragment, with Δ = anchor − local the fragment's pseudo-gradient:

    e ← β·e + Δ
    m  = Q(TopK(e))            the push message (per-chunk top-k, b-bit values)
    e ← e − decode(m)          subtract exactly what was sent, as the syncer will read it

The island decodes its own message with the syncer's decoder (`decode_push`), so what it subtracts is
bit for bit what the syncer adds; what TopK left out and the quantization error stay in e for the next
round. The new version comes back as a sparse step applied with `schemas.sparse_update.apply_step_`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from yeto.schemas.errors import ConfigError
from yeto.schemas.sparse import decode_push, encode_push
from yeto.schemas.sparse_spec import SparseSpec

FOLD_BLOCK = 1 << 16   # values folded at a time (256 KiB of f32): the block, its e and β·e stay in L2 for the three ops


def pseudo_gradient(anchor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Δ = anchor − local in f32: the direction the outer step θ ← θ − α·aggregate descends."""
    return anchor.float() - local.float()


class ErrorFeedback:
    """One fragment's accumulators (one f32 tensor per tensor of the fragment, on `device`)."""

    def __init__(self, shapes: Sequence, spec: SparseSpec, beta: float, *, device=None):
        if not (isinstance(beta, (int, float)) and 0.0 <= float(beta) <= 1.0):
            raise ConfigError("error-feedback decay must be in [0, 1]", field="sparse.beta", value=beta)
        self.spec, self.beta = spec, float(beta)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.acc = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.shapes]

    def push(self, deltas: Sequence[torch.Tensor]) -> bytes:
        """Fold this round's pseudo-gradients into the accumulators and return the push message;
        the accumulators keep what the message does not carry."""
        if len(deltas) != len(self.acc):
            raise ValueError(f"expected {len(self.acc)} pseudo-gradients, got {len(deltas)}")
        for e, d in zip(self.acc, deltas):
            if tuple(d.shape) != tuple(e.shape):
                raise ValueError(f"pseudo-gradient shape {tuple(d.shape)} != accumulator shape {tuple(e.shape)}")
            # two roundings (β·e, then + Δ), no fused multiply-add: the reference computes the same bits
            e.mul_(self.beta).add_(d.to(e.device, torch.float32))
        return self.compress()

    @classmethod
    def folded(cls, prev: "ErrorFeedback | None", spec: SparseSpec, beta: float, d: Sequence[torch.Tensor]
               ) -> "ErrorFeedback":
        """New accumulators β·e + Δ from `prev`'s (None: zeros; `prev` untouched) and d = local − anchor
        (f32, Δ = −d + 0.0), written over `d` itself (consumed: its tensors become the accumulators), block
        by block so each block is read once from memory. (β·e − d) + 0.0 is β·e + (−d + 0.0) bit for bit:
        x − d is x + (−d) in IEEE arithmetic, and the + 0.0 turns the one zero that differs (−0 − +0 = −0)
        into +0, as the reference's fold gives."""
        out = cls([x.shape for x in d], spec, beta, device="meta")
        out.acc = list(d)
        tmp = torch.empty(FOLD_BLOCK, dtype=torch.float32)
        for i, x in enumerate(out.acc):
            if x.dtype != torch.float32 or not x.is_contiguous():
                raise ValueError(f"pseudo-gradient {i} must be contiguous f32, got {x.dtype}")
            flat = x.view(-1)
            e = None if prev is None else prev.acc[i].reshape(-1)
            for o in range(0, flat.numel(), FOLD_BLOCK):
                xs = flat[o: o + FOLD_BLOCK]
                if e is None:
                    xs.neg_()
                else:   # two roundings as `push`'s mul_ then add_: β·e, then − d
                    torch.sub(torch.mul(e[o: o + FOLD_BLOCK], out.beta, out=tmp[: xs.numel()]), xs, out=xs)
                xs.add_(0.0)
        return out

    def compress(self) -> bytes:
        """The push message of the accumulators as they are; what it carries is subtracted from them."""
        msg = encode_push(self.acc, self.spec)
        for e, sent in zip(self.acc, decode_push(msg, self.shapes, self.spec)):
            flat = e.view(-1)
            # e + (−v) is e − v bit for bit (IEEE defines the one as the other); the indices are unique, and
            # one index_add_ pass costs a third of a gather and a scatter
            flat.index_add_(0, sent.indices.to(flat.device), sent.values.to(flat.device).neg())
        return msg

    def state_dict(self) -> dict:
        return {"beta": self.beta, "acc": [e.detach().cpu().clone() for e in self.acc]}

    def load_state_dict(self, state: dict) -> None:
        acc = state["acc"]
        if [tuple(a.shape) for a in acc] != self.shapes:
            raise ValueError("saved accumulators do not match this fragment's shapes")
        for e, a in zip(self.acc, acc):
            e.copy_(a)
