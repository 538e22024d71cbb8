"""A reference of the sparse outer mode (SparseLoCo) written from its equations and from the wire format's
description in docs/design.md §4.10, with plain Python and numpy: no yeto import, no torch. Chunks are
walked one at a time, top-k is a sort (magnitude down, local index up), sums are Python loops in island
order. Slow on purpose; the tests run it on small tensors.

Per island and round, with Δ = anchor − local and f32 arithmetic (one rounding per operation):

    e ← f32(β)·e + Δ;  m = Q(TopK(e));  e ← e − m

and per tensor at the syncer: each island's m clipped to the lower median of the norms (float64 norms,
factor min(1, median / (norm + 1e-8)) rounded to f32), per-coordinate mean over the islands that sent the
coordinate (f32 sum in island order, divided by the count), θ ← θ − f32(α)·mean.
"""
from __future__ import annotations

import math

import numpy as np


def ref_chunks(shape, spec):
    """[(flat indices of the chunk, row-major in the chunk), k)] in chunk order."""
    if len(shape) <= 1:
        rows, cols, th, tw, kf = 1, (shape[0] if shape else 1), 1, spec.chunk_1d, spec.k_1d
    else:
        rows, cols, th, tw, kf = shape[0], math.prod(shape[1:]), spec.tile, spec.tile, spec.k
    out = []
    for r0 in range(0, rows, th):
        for c0 in range(0, cols, tw):
            h, w = min(th, rows - r0), min(tw, cols - c0)
            flat = [(r0 + i) * cols + c0 + j for i in range(h) for j in range(w)]
            out.append((flat, min(h * w, math.ceil(kf * h * w / (th * tw)))))
    return out


def ref_select(x, spec):
    """(local indices, flat indices, values) in chunk order, by index within a chunk."""
    v = np.asarray(x, dtype=np.float32).reshape(-1)
    local, flat_all = [], []
    for flat, k in ref_chunks(np.shape(x), spec):
        order = sorted(range(len(flat)), key=lambda i: (-abs(float(v[flat[i]])), i))[:k]
        for i in sorted(order):
            local.append(i)
            flat_all.append(flat[i])
    return local, flat_all, v[flat_all]


def ref_quantize(vals, bits):
    """(codes, f32 table): 2**bits equal bins over mean ± 3σ (float64 statistics), bin means."""
    nb = 1 << bits
    v = np.asarray(vals, dtype=np.float64)
    if v.size == 0:
        return [], np.zeros(nb, np.float32)
    c = v - v.mean()
    sigma = math.sqrt(float((c * c).sum()) / (v.size - 1)) if v.size > 1 else 0.0
    width = 6 * sigma / nb
    if width > 0:
        codes = [min(max(math.floor(ci / width), -(nb // 2)), nb // 2 - 1) + nb // 2 for ci in c]
    else:
        codes = [nb // 2] * v.size
    table = np.zeros(nb, np.float32)
    for b in range(nb):
        members = [v[i] for i in range(v.size) if codes[i] == b]
        if members:
            table[b] = np.float32(sum(members) / len(members))
    return codes, table


def ref_compress(x, spec):
    """What an island sends of x: (flat indices, decoded f32 values)."""
    _, flat, vals = ref_select(x, spec)
    codes, table = ref_quantize(vals, spec.value_bits)
    return flat, (table[codes] if codes else np.zeros(0, np.float32))


class RefIsland:
    def __init__(self, shapes, spec, beta):
        self.spec, self.beta = spec, np.float32(beta)
        self.acc = [np.zeros(s, np.float32) for s in shapes]

    def push(self, deltas):
        sent = []
        for e, d in zip(self.acc, deltas):
            e[...] = self.beta * e + np.asarray(d, np.float32)
            flat, vals = ref_compress(e, self.spec)
            ef = e.reshape(-1)
            ef[flat] = ef[flat] - vals
            sent.append((flat, vals))
        return sent


def ref_aggregate(pushes):
    """Per tensor {flat index: f32 mean}; pushes[i][t] = (flat indices, values) of island i."""
    out = []
    for t in range(len(pushes[0])):
        msgs = [p[t] for p in pushes]
        norms = [math.sqrt(sum(float(x) ** 2 for x in vals)) for _, vals in msgs]
        median = sorted(norms)[(len(norms) - 1) // 2]
        sums, counts = {}, {}
        for (flat, vals), n in zip(msgs, norms):
            f = min(1.0, median / (n + 1e-8))
            scaled = vals if f == 1.0 else vals * np.float32(f)
            for i, v in zip(flat, scaled):
                sums[i] = np.float32(sums.get(i, np.float32(0)) + v)
                counts[i] = counts.get(i, 0) + 1
        out.append({i: np.float32(sums[i] / np.float32(counts[i])) for i in sums})
    return out


def ref_outer_step(params, agg, lr):
    for p, a in zip(params, agg):
        pf = p.reshape(-1)
        for i, m in a.items():
            pf[i] = np.float32(pf[i] - np.float32(np.float32(lr) * m))
