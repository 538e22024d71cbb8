"""Where every rank's pieces sit in a fragment's flat layout (docs/design.md §6) — pure: no torch.distributed.

`describe` is one rank's list of pieces (canonical name, global shape, dtype, box, owner), gathered once at
start; `IslandLayout` checks the lists (one shape and dtype per name; boxes inside the tensor; the owners'
boxes tile every tensor exactly once, else a ConfigError naming the tensor and the ranks) and answers what
the per-rank scatter and gather ask:
* `FragmentMap.runs(elem_offset, elem_count, rank)`: for a chunk (a span of the fragment's flat layout, as
  `schemas.chunks.chunk_plan` cuts it), which elements of each of the rank's boxes it covers: always one
  contiguous range of the box's own row-major index (a box read in row-major order keeps the order of
  the global indices), so one `Run` per (rank, tensor), whatever dimension the box splits;
* `FragmentMap.positions(run)`: where those elements sit in the chunk: a slice when the box is a
  contiguous part of its tensor, else a chunk-sized index tensor.
Canonical names do not depend on the parallel layout, so islands with different TP/PP/EP layouts share one
session: only this map differs. A session fragment no rank holds is a WireError (it came from the syncer).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from yeto.schemas.errors import ConfigError, WireError
from yeto.schemas.layout import canonical_layout

Box = tuple[tuple[int, int], ...]


# ---- one rank's description -----------------------------------------------------------------------

def box_of(local_slices: Sequence[slice] | None, shape: Sequence[int], name: str = "") -> Box:
    """The [start, stop) ranges of a `Piece.local_slices` (None: the whole tensor). Slices may be
    fewer than the dimensions (the rest are whole); steps other than 1 are refused."""
    shape = tuple(int(s) for s in shape)
    if local_slices is None:
        return tuple((0, s) for s in shape)
    sl = tuple(local_slices)
    if len(sl) > len(shape):
        raise ConfigError(f"{len(sl)} slices for a {len(shape)}-dimensional tensor", field=f"{name}.local_slices",
                          value=sl)
    out = []
    for d, size in enumerate(shape):
        s = sl[d] if d < len(sl) else slice(None)
        if not isinstance(s, slice):
            raise ConfigError("local_slices must be slices", field=f"{name}.local_slices", value=sl)
        start, stop, step = s.indices(size)
        if step != 1:
            raise ConfigError("a box must have step 1 on every dimension (fused or strided layouts must be "
                              "presented as canonical tensors)", field=f"{name}.local_slices", value=sl)
        out.append((start, max(start, stop)))
    return tuple(out)


def describe(pieces: Iterable) -> list[dict]:
    """This rank's rows for the island-wide gather (plain data: all_gather_object pickles it).

    Each row: name, shape (global), dtype, box [[start, stop], ...], owner, and, derived from the box
    for logs and for adapters that speak Megatron's terms: partition_dim (the first dimension the box
    does not cover whole, or None), offset (the box's start on it), stride (always 1: boxes are
    contiguous ranges), expert (the piece's `expert` attribute when it has one)."""
    rows = []
    for s in pieces:
        shape = [int(x) for x in s.global_shape]
        box = box_of(s.local_slices, shape, s.name)
        part = next((d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d])), None)
        rows.append({"name": s.name, "shape": shape, "dtype": s.dtype, "box": [list(r) for r in box],
                     "owner": bool(s.owner), "partition_dim": part,
                     "offset": None if part is None else box[part][0], "stride": 1,
                     "expert": getattr(s, "expert", None)})
    return rows


# ---- pieces ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankPiece:
    """One rank's box of one tensor."""

    rank: int
    name: str
    shape: tuple[int, ...]  # the tensor's global shape
    box: Box
    owner: bool
    dtype: str = "float32"

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def whole(self) -> bool:
        return all((a, b) == (0, s) for (a, b), s in zip(self.box, self.shape))

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _overlap(x: Box, y: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(x, y))


def _merged(shape: tuple[int, ...], box: Box) -> tuple[tuple[int, ...], Box]:
    """The same elements in the same order described with as few dimensions as possible (usually 1
    or 2): a dimension the box covers whole folds into its outer neighbour, and an outer dimension of
    extent 1 folds into the next one's offset."""
    dims: list[list] = []
    for size, (a, b) in zip(shape, box):
        if dims and (a, b) == (0, size):
            top = dims[-1]
            top[0], top[1] = top[0] * size, (top[1][0] * size, top[1][1] * size)
        elif dims and dims[-1][1][1] - dims[-1][1][0] == 1:
            top = dims[-1]
            ta = top[1][0]
            top[0], top[1] = top[0] * size, (ta * size + a, ta * size + b)
        else:
            dims.append([size, (a, b)])
    return tuple(d[0] for d in dims), tuple(d[1] for d in dims)


def count_below(shape: Sequence[int], box: Box, g: int) -> int:
    """How many of the box's elements have a row-major index (in `shape`) below `g`."""
    n = math.prod(shape)
    if g <= 0:
        return 0
    if g >= n:
        return _volume(box)
    idx = []
    rem = g
    for size in reversed(shape):
        idx.append(rem % size)
        rem //= size
    idx.reverse()
    inner = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        inner[d] = inner[d + 1] * (box[d + 1][1] - box[d + 1][0])
    c = 0
    for d, (a, b) in enumerate(box):
        i = idx[d]
        c += (min(max(i, a), b) - a) * inner[d]
        if not a <= i < b:
            break
    return c


class IslandLayout:
    """Every rank's pieces, checked. `rows[r]` is rank r's `describe(...)` list."""

    def __init__(self, rows: Sequence[Sequence[Mapping]]):
        self.world = len(rows)
        self.by_rank: list[list[RankPiece]] = [[] for _ in rows]
        self.pieces: dict[str, list[RankPiece]] = {}
        first: dict[str, tuple[int, tuple[int, ...], str]] = {}
        for r, rank_rows in enumerate(rows):
            seen: set[str] = set()
            for row in rank_rows:
                name = row["name"]
                if name in seen:
                    raise ConfigError(f"rank {r} lists tensor {name!r} twice", field="layout.name", value=name)
                seen.add(name)
                shape = tuple(int(s) for s in row["shape"])
                dtype = row.get("dtype", "float32")
                if name in first and first[name][1:] != (shape, dtype):
                    r0, s0, d0 = first[name]
                    raise ConfigError(f"tensor {name!r}: rank {r0} says shape {list(s0)} {d0}, rank {r} says "
                                      f"{list(shape)} {dtype}", field=f"layout.{name}.shape", value=[r0, r])
                first.setdefault(name, (r, shape, dtype))
                box = tuple((int(a), int(b)) for a, b in row["box"])
                if len(box) != len(shape) or any(not 0 <= a < b <= s for (a, b), s in zip(box, shape)):
                    raise ConfigError(f"tensor {name!r}: rank {r}'s box {[list(x) for x in box]} is empty or outside "
                                      f"the shape {list(shape)}", field=f"layout.{name}.box", value=r)
                p = RankPiece(r, name, shape, box, bool(row["owner"]), dtype)
                self.by_rank[r].append(p)
                self.pieces.setdefault(name, []).append(p)
        for name, ps in self.pieces.items():
            self._check_tiling(name, ps)
        self._layout = canonical_layout({"name": n, "shape": list(ps[0].shape), "dtype": ps[0].dtype}
                                        for n, ps in self.pieces.items())

    @staticmethod
    def _check_tiling(name: str, pieces: list[RankPiece]) -> None:
        owners = [p for p in pieces if p.owner]
        numel = math.prod(pieces[0].shape)
        for i, p in enumerate(owners):
            for q in owners[i + 1:]:
                if _overlap(p.box, q.box):
                    raise ConfigError(f"tensor {name!r}: the owner boxes of ranks {p.rank} and {q.rank} overlap "
                                      f"({[list(x) for x in p.box]} and {[list(x) for x in q.box]})",
                                      field=f"layout.{name}.owner", value=[p.rank, q.rank])
        covered = sum(p.numel for p in owners)
        if covered != numel:  # disjoint boxes inside the tensor: equal volumes means an exact tiling
            raise ConfigError(f"tensor {name!r}: its owners (ranks {[p.rank for p in owners]}) cover {covered} of "
                              f"{numel} elements; every element needs exactly one owner (holders: ranks "
                              f"{[p.rank for p in pieces]})", field=f"layout.{name}.owner",
                              value=[p.rank for p in owners])

    def layout(self) -> list[dict]:
        """[{name, shape, dtype}] of every tensor any rank holds, canonical order (the hello's layout)."""
        return [dict(e) for e in self._layout]

    def fragment(self, frag: Mapping) -> "FragmentMap":
        return FragmentMap(self, frag)


# ---- fragments ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """The elements [lo, hi) (flat, row-major, in the box) of one rank's piece that one chunk covers."""

    piece: RankPiece
    tensor: int  # index of the tensor in the fragment
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


class FragmentMap:
    """One session fragment ({id, tensors [{name, shape, offset, numel}], numel}) over an island layout."""

    def __init__(self, layout: IslandLayout, frag: Mapping):
        self.fid = frag["id"]
        self.tensors = [dict(t) for t in frag["tensors"]]
        self.numel = frag.get("numel", max(t["offset"] + t["numel"] for t in self.tensors))
        self._starts = [t["offset"] for t in self.tensors]
        self._by_rank: list[list[list[RankPiece]]] = [[[] for _ in self.tensors] for _ in range(layout.world)]
        for i, t in enumerate(self.tensors):
            ps = layout.pieces.get(t["name"])
            if not ps:
                raise WireError(f"fragment {self.fid}: no rank of this island holds tensor {t['name']!r}",
                                field="tensors.name", value=t["name"])
            if list(ps[0].shape) != list(t["shape"]):
                raise WireError(f"fragment {self.fid}: the island holds {t['name']!r} with shape {list(ps[0].shape)}",
                                field=f"tensors.{t['name']}.shape", value=t["shape"])
            for p in ps:
                self._by_rank[p.rank][i].append(p)
        self._merged: dict[tuple[int, str], tuple[tuple[int, ...], Box]] = {}

    def pieces(self, rank: int) -> list[RankPiece]:
        """The rank's pieces of this fragment, in fragment (canonical) order."""
        return [p for ps in self._by_rank[rank] for p in ps]

    def held_numel(self, rank: int, *, owned: bool = False) -> int:
        return sum(p.numel for p in self.pieces(rank) if p.owner or not owned)

    def tensor_range(self, elem_offset: int, elem_count: int) -> range:
        """Indexes of the fragment tensors a span overlaps."""
        end = elem_offset + elem_count
        first = bisect.bisect_right(self._starts, elem_offset) - 1
        last = bisect.bisect_left(self._starts, end)
        return range(max(first, 0), last)

    def runs(self, elem_offset: int, elem_count: int, rank: int, *, owned: bool = False) -> list[Run]:
        """The rank's runs for the span [elem_offset, elem_offset + elem_count), fragment order; with
        `owned` only its owner pieces (what a gather reads)."""
        out = []
        end = elem_offset + elem_count
        for i in self.tensor_range(elem_offset, elem_count):
            t = self.tensors[i]
            a, b = max(elem_offset, t["offset"]) - t["offset"], min(end, t["offset"] + t["numel"]) - t["offset"]
            if a >= b:
                continue
            for p in self._by_rank[rank][i]:
                if owned and not p.owner:
                    continue
                lo, hi = count_below(p.shape, p.box, a), count_below(p.shape, p.box, b)
                if hi > lo:
                    out.append(Run(p, i, lo, hi))
        return out

    def positions(self, run: Run, elem_offset: int) -> slice | torch.Tensor:
        """Where the run's elements sit in the chunk that starts at `elem_offset`: a slice, or an int64
        index tensor of `run.count` chunk positions (increasing)."""
        p = run.piece
        key = (p.rank, p.name)
        m = self._merged.get(key)
        if m is None:
            m = self._merged[key] = _merged(p.shape, p.box)
        shape, box = m
        base = self.tensors[run.tensor]["offset"] - elem_offset
        if len(shape) <= 1:  # a contiguous range of the tensor
            start = base + (box[0][0] if box else 0) + run.lo
            return slice(start, start + run.count)
        local = torch.arange(run.lo, run.hi, dtype=torch.int64)
        g = torch.zeros_like(local)
        stride = 1
        gstrides = []
        for size in reversed(shape):
            gstrides.append(stride)
            stride *= size
        gstrides.reverse()
        rem = local
        for d in range(len(shape) - 1, -1, -1):
            a, b = box[d]
            ext = b - a
            if d:
                q, i = torch.div(rem, ext, rounding_mode="floor"), rem.remainder(ext)
            else:
                q, i = None, rem
            g += (i + a) * gstrides[d]
            rem = q
        return g + base


__all__ = ["Box", "FragmentMap", "IslandLayout", "RankPiece", "Run", "box_of", "count_below", "describe"]
