"""The syncer's side of the sparse outer mode (docs/design.md §4.10): aggregate the islands' sparse pushes
of a fragment and take the outer step. Pure tensor code, no I/O; the wire formats are schemas/sparse.py
(pushes in) and schemas/sparse_update.py (the step out).

Per tensor, as SparseLoCo's aggregation (Templar's `batch_decompress`):

1. each island's decoded values v_i are clipped to the median norm: with n_i = ‖v_i‖ (float64) and m the
   lower median of the n_i (torch.median's choice; of two islands the smaller norm),
   v_i ← v_i · f32(min(1, m / (n_i + 1e-8)));
2. per coordinate the mean over the islands that sent it (`scatter_reduce(mean)`, sums in member order);
   a coordinate no island sent does not move;
3. the outer step θ ← θ − s, s = f32(α)·mean, in f32 (`apply_step_`, the one definition the islands use).

Islands are weighted equally, as in SparseLoCo: the token weights of the dense merge do not apply.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from yeto.schemas.sparse import SparseTensor
from yeto.schemas.sparse_update import apply_step_

CLIP_EPS = 1e-8


def clip_factors(norms: Sequence[float]) -> list[float]:
    """Each message's factor to the lower median of the norms (1 for those at or under it)."""
    if not norms:
        return []
    median = sorted(norms)[(len(norms) - 1) // 2]
    return [min(1.0, median / (n + CLIP_EPS)) for n in norms]


def aggregate(pushes: Sequence[Sequence[SparseTensor]]) -> list[SparseTensor]:
    """The per-coordinate mean of the clipped pushes, per tensor: sorted unique indices and f32 means.
    `pushes[i][t]` is island i's tensor t, islands in member order."""
    if not pushes:
        raise ValueError("aggregate needs at least one push")
    n_tensors = len(pushes[0])
    if any(len(p) != n_tensors for p in pushes):
        raise ValueError("every push must carry the fragment's tensors")
    out = []
    for t in range(n_tensors):
        msgs = [p[t] for p in pushes]
        factors = clip_factors([math.sqrt(float(m.values.double().square().sum())) for m in msgs])
        idx = torch.cat([m.indices for m in msgs])
        vals = torch.cat([m.values if f == 1.0 else m.values * torch.tensor(f, dtype=torch.float32)
                          for m, f in zip(msgs, factors)])
        # the same sorted indices from int32 keys where they fit (a sort about twice as fast)
        narrow = idx.numel() > 0 and int(idx.max()) < 2 ** 31
        uniq, inv = torch.unique(idx.to(torch.int32) if narrow else idx, sorted=True, return_inverse=True)
        uniq = uniq.to(torch.int64)
        mean = torch.zeros(uniq.numel(), dtype=torch.float32)
        mean.scatter_reduce_(0, inv, vals, reduce="mean", include_self=False)
        out.append(SparseTensor(uniq, mean))
    return out


def step_amounts(agg: Sequence[SparseTensor], lr: float) -> list[SparseTensor]:
    """The steps s = f32(lr)·aggregate per tensor (what `outer_step_` subtracts and an update carries)."""
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"outer lr must be finite and >= 0, got {lr!r}")
    alpha = torch.tensor(lr, dtype=torch.float32)
    return [SparseTensor(a.indices, a.values * alpha) for a in agg]


def outer_step_(params: Sequence[torch.Tensor], agg: Sequence[SparseTensor], lr: float) -> list[SparseTensor]:
    """θ ← θ − f32(lr)·aggregate on the fragment's f32 params, in place; returns the steps applied (what
    the version's update carries)."""
    steps = step_amounts(agg, lr)
    for p, step in zip(params, steps, strict=True):
        apply_step_(p, step)
    return steps
