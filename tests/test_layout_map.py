"""yeto.learner.layout_map: per-rank boxes over a fragment's flat layout, against direct slicing of the
whole tensors (torch indexing is the independent reference), for boxes on any dimension, replicas,
ranks that hold nothing (PP), and the tiling checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yeto.learner.adapters.base import Piece
from yeto.learner.layout_map import IslandLayout, _merged, box_of, count_below, describe
from yeto.schemas.errors import ConfigError, WireError


def row(name, shape, box, owner=True, dtype="float32"):
    return {"name": name, "shape": list(shape), "dtype": dtype, "box": [list(b) for b in box], "owner": owner}


def frag_of(tensors):
    out, off = [], 0
    for name, shape in tensors:
        n = math.prod(shape)
        out.append({"name": name, "shape": list(shape), "offset": off, "numel": n})
        off += n
    return {"id": 0, "tensors": out, "numel": off}


@st.composite
def islands(draw):
    """A fragment of 1-4 tensors and a world of 4 ranks: each tensor cut into boxes along one or two
    dimensions, each box owned by one rank and replicated on 0-2 others; some ranks may hold nothing."""
    world = 4
    ntens = draw(st.integers(1, 4))
    tensors, rows = [], [[] for _ in range(world)]
    for t in range(ntens):
        nd = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd)))
        name = f"layers.{t}.w"
        tensors.append((name, shape))
        boxes = [tuple((0, s) for s in shape)]
        if nd:
            for d in draw(st.lists(st.integers(0, nd - 1), max_size=2, unique=True)):
                cuts = sorted(draw(st.sets(st.integers(1, shape[d] - 1), max_size=2))) if shape[d] > 1 else []
                edges = [0, *cuts, shape[d]]
                boxes = [b[:d] + ((e0, e1),) + b[d + 1:] for b in boxes for e0, e1 in zip(edges, edges[1:])]
        for b in boxes:
            holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3, unique=True))
            for i, r in enumerate(holders):
                if any(x["name"] == name for x in rows[r]):
                    continue  # a rank holds one box per tensor
                rows[r].append(row(name, shape, b, owner=i == 0))
        # every box must have landed somewhere as an owner; if its owner already held a box, re-home it
        owned = {tuple(map(tuple, x["box"])) for r in rows for x in r if x["name"] == name and x["owner"]}
        for b in boxes:
            if b not in owned:
                free = [r for r in range(world) if not any(x["name"] == name for x in rows[r])]
                if not free:
                    return None
                rows[free[0]].append(row(name, shape, b, owner=True))
    return tensors, rows


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(islands().filter(lambda x: x is not None), st.integers(1, 23), st.integers(0, 2**31 - 1))
def test_runs_and_positions_scatter_and_gather_like_direct_slicing(island, chunk, seed):
    tensors, rows = island
    lay = IslandLayout(rows)
    frag = frag_of(tensors)
    fm = lay.fragment(frag)
    flat = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(seed))
    full = {t["name"]: flat[t["offset"]: t["offset"] + t["numel"]].view(t["shape"]) for t in frag["tensors"]}
    got = {(r, p.name): torch.full((p.numel,), float("nan")) for r in range(4) for p in fm.pieces(r)}
    nxt = {k: 0 for k in got}
    gathered = torch.full_like(flat, float("nan"))
    writes = torch.zeros(frag["numel"], dtype=torch.int64)
    for off in range(0, frag["numel"], chunk):
        n = min(chunk, frag["numel"] - off)
        piece_of_chunk = flat[off: off + n]
        out = torch.full((n,), float("nan"))
        for r in range(4):
            for run in fm.runs(off, n, r):
                key = (r, run.piece.name)
                assert run.lo == nxt[key] and run.count > 0  # each piece is covered in order, no gaps
                nxt[key] = run.hi
                pos = fm.positions(run, off)
                got[key][run.lo: run.hi] = piece_of_chunk[pos]
            for run in fm.runs(off, n, r, owned=True):
                assert run.piece.owner
                pos = fm.positions(run, off)
                out[pos] = got[(r, run.piece.name)][run.lo: run.hi]
                idx = torch.arange(n)[pos] + off
                writes[idx] += 1
        gathered[off: off + n] = out
    for (r, name), vals in got.items():
        p = next(p for p in fm.pieces(r) if p.name == name)
        assert nxt[(r, name)] == p.numel
        assert torch.equal(vals, full[name][p.slices].reshape(-1)), (r, name, p.box)
    assert torch.equal(gathered, flat)
    assert bool((writes == 1).all())  # owners tile: every element gathered exactly once


def test_count_below_against_enumeration():
    shape, box = (3, 4, 5), ((1, 3), (0, 4), (2, 4))
    idx = torch.arange(60).view(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)
    for g in range(-1, 62):
        assert count_below(shape, box, g) == int((idx < g).sum()), g


def test_merged_dims_keep_the_elements_and_their_order():
    for shape, box, want in [((4, 6), ((0, 4), (2, 4)), 2), ((4, 6), ((1, 3), (0, 6)), 1),
                             ((2, 3, 4), ((1, 2), (0, 3), (0, 4)), 1), ((2, 3, 4), ((0, 2), (1, 2), (0, 4)), 2),
                             ((2, 3, 4), ((1, 2), (1, 2), (1, 3)), 1), ((5,), ((1, 4),), 1), ((), (), 0)]:
        ms, mb = _merged(shape, box)
        assert len(ms) == want, (shape, box, ms, mb)
        ref = torch.arange(math.prod(shape)).view(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)
        via = torch.arange(math.prod(ms)).view(ms)[tuple(slice(a, b) for a, b in mb)].reshape(-1)
        assert torch.equal(ref, via)


def test_a_pipeline_rank_with_no_piece_gets_no_runs():
    rows = [[row("embed.weight", (4, 2), ((0, 4), (0, 2)))],
            [row("layers.0.w", (3, 3), ((0, 3), (0, 3)))]]
    lay = IslandLayout(rows)
    fm = lay.fragment(frag_of([("embed.weight", (4, 2))]))
    assert fm.runs(0, 8, 1) == [] and fm.pieces(1) == []
    assert [r.count for r in fm.runs(0, 8, 0)] == [8]
    assert fm.positions(fm.runs(2, 5, 0)[0], 2) == slice(0, 5)
    assert [e["name"] for e in lay.layout()] == ["embed.weight", "layers.0.w"]


def test_describe_derives_partition_dim_and_offset_from_the_box():
    rows = describe([Piece("w", (8, 6), "bfloat16", (slice(None), slice(3, 6)), True),
                     Piece("b", (8,), "float32", None, False)])
    assert rows[0]["box"] == [[0, 8], [3, 6]] and rows[0]["partition_dim"] == 1 and rows[0]["offset"] == 3
    assert rows[0]["stride"] == 1 and rows[0]["dtype"] == "bfloat16" and rows[0]["owner"] is True
    assert rows[1]["box"] == [[0, 8]] and rows[1]["partition_dim"] is None and rows[1]["owner"] is False
    assert box_of((slice(2, 4),), (6, 5)) == ((2, 4), (0, 5))
    with pytest.raises(ConfigError) as e:  # the adapter's boxes: the model's configuration, not the wire
        box_of((slice(0, 6, 2),), (6,), "w")
    assert e.value.field == "w.local_slices"


@pytest.mark.parametrize("rows,words", [
    # two owners overlap on rows 2..3
    ([[row("w", (6, 2), ((0, 4), (0, 2)))], [row("w", (6, 2), ((2, 6), (0, 2)))]], ["'w'", "ranks 0 and 1", "overlap"]),
    # rows 4..5 have no owner (rank 1 is a replica)
    ([[row("w", (6, 2), ((0, 4), (0, 2)))], [row("w", (6, 2), ((4, 6), (0, 2)), owner=False)]],
     ["'w'", "cover 8 of 12", "holders: ranks [0, 1]"]),
    # one tensor, two shapes
    ([[row("w", (6, 2), ((0, 6), (0, 2)))], [row("w", (2, 6), ((0, 2), (0, 6)), owner=False)]],
     ["'w'", "rank 0 says shape [6, 2]", "rank 1 says [2, 6]"]),
    # a box past the tensor's end
    ([[row("w", (6, 2), ((0, 7), (0, 2)))]], ["'w'", "rank 0", "outside"]),
])
def test_bad_layouts_name_the_tensor_and_the_ranks(rows, words):
    with pytest.raises(ConfigError) as e:
        IslandLayout(rows)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_fragment_tensor_nobody_holds_or_of_another_shape_is_refused():
    lay = IslandLayout([[row("w", (2, 2), ((0, 2), (0, 2)))]])
    with pytest.raises(WireError) as e:
        lay.fragment(frag_of([("v", (3,))]))
    assert e.value.value == "v"
    with pytest.raises(WireError) as e:
        lay.fragment(frag_of([("w", (4,))]))
    assert e.value.field == "tensors.w.shape"
