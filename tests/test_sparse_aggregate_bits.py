"""docs/design.md §4.10: the syncer's per-coordinate mean (services/syncer/sparse_outer.coordinate_means, one
stable sort and a gather per member) is bit for bit `scatter_reduce_(mean, include_self=False)` over
`unique(return_inverse)`, the definition it replaced: signed zeros, one to five members, duplicates only
across members (a push's indices are unique), indices beyond int32, and no index at all."""
from __future__ import annotations

import pytest
import torch

from yeto.services.syncer.sparse_outer import coordinate_means


def by_scatter(idx: torch.Tensor, vals: torch.Tensor):
    uniq, inv = torch.unique(idx, sorted=True, return_inverse=True)
    mean = torch.zeros(uniq.numel(), dtype=torch.float32)
    mean.scatter_reduce_(0, inv, vals, reduce="mean", include_self=False)
    return uniq, mean


def members(n: int, numel: int, kept: int, seed: int, base: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx, vals = [], []
    for _ in range(n):
        idx.append(torch.randperm(numel, generator=g)[:kept] + base)
        v = torch.randn(kept, generator=g) * torch.tensor([1e-3, 1.0, 1e30])[torch.randint(0, 3, (kept,), generator=g)]
        v[torch.rand(kept, generator=g) < 0.2] = -0.0
        v[torch.rand(kept, generator=g) < 0.1] = 0.0
        vals.append(v)
    return torch.cat(idx), torch.cat(vals)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("base", [0, 2 ** 33])
def test_the_means_are_the_scatter_means_bit_for_bit(n, base):
    idx, vals = members(n, 3000, 1200, seed=n, base=base)
    u, m = coordinate_means(idx, vals)
    wu, wm = by_scatter(idx, vals)
    assert u.dtype == torch.int64 and torch.equal(u, wu)
    assert torch.equal(m.view(torch.int32), wm.view(torch.int32))


def test_no_index_gives_nothing():
    u, m = coordinate_means(torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    assert u.numel() == 0 and m.numel() == 0 and u.dtype == torch.int64 and m.dtype == torch.float32
