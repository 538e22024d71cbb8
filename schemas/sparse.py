"""Sparse push messages of the sparse outer mode (docs/design.md §4.10, which has the message layout):
per-chunk top-k, b-bit values, 12-bit chunk-local indices, raw bytes. Pure, no I/O; both sides import it.

Selection: in every chunk (schemas/sparse_chunks.py) the values of largest magnitude are kept, the lower
local index winning among equal magnitudes (never torch.topk's order), listed by increasing local index.
Values: all kept values of one tensor share one table: with μ and σ their mean and sample standard
deviation, 2**b equal bins cover μ ± 3σ (values beyond fall in the outer bins), a code is its bin and the
table holds each bin's mean (0 when empty), rounded once to f32; statistics in float64, so no code hinges
on a summation order. (Templar rounds to bins centred at μ − 3σ … μ + 1.5σ; equal bins keep the sign of
every kept value when μ ≈ 0, which 4 bins need.) Exact size: `push_nbytes`.
Invariant: one encoding per message. A decoder refuses (DecodeError naming the field and the value)
another spec, tensor count or size, a count other than the shape implies (`Grid.n_kept`), a non-finite
table entry, an index outside its chunk or not increasing in it, set padding bits, short or trailing bytes.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .errors import DecodeError, WireError
from .sparse_chunks import Grid, grid_of, pack12, pack_codes, packed_codes_nbytes, unpack12, unpack_codes
from .sparse_spec import SparseSpec

MAGIC = b"YSPK"
FORMAT = 1
_HEADER = struct.Struct("<4sBBHHHHI")
_TENSOR = struct.Struct("<QI")
SIGMAS = 3.0  # bins cover mean +- 3 sigma
# Values selected at once: bounds the temporaries of a big tensor (|x|, masks, ranks) to a few of these.
BAND_NUMEL = 1 << 22


@dataclass(frozen=True)
class SparseTensor:
    """A decoded sparse tensor: flat (row-major) indices into the tensor, unique, and their f32 values."""

    indices: torch.Tensor  # int64
    values: torch.Tensor   # float32

    def dense(self, shape, device=None) -> torch.Tensor:
        out = torch.zeros(math.prod(shape), dtype=torch.float32, device=device)
        out[self.indices.to(out.device)] = self.values.to(out.device)
        return out.view(shape)


def index_nbytes(n: int) -> int:
    return 3 * (n // 2) + 2 * (n % 2)


def tensor_nbytes(shape, spec: SparseSpec) -> int:
    n = grid_of(shape, spec).n_kept()
    return _TENSOR.size + 4 * (1 << spec.value_bits) + index_nbytes(n) + packed_codes_nbytes(n, spec.value_bits)


def push_nbytes(shapes: Sequence, spec: SparseSpec) -> int:
    """The exact size of a push message for tensors of `shapes`."""
    return _HEADER.size + sum(tensor_nbytes(s, spec) for s in shapes)


# ---------------------------------------------------------------- selection

def _ties_to_lower(a: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of magnitudes `a` (R, n) whose k-th largest is `kth` (R, 1): the k local indices kept, in
    index order — everything above kth, and of the values equal to it the first ones that make up k."""
    above = a > kth
    need = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
    tied = a == kth
    take = above | (tied & (tied.cumsum(dim=1, dtype=torch.int32) <= need))
    return take.nonzero()[:, 1].view(a.shape[0], k)


class Scratch:
    """Buffers reused band after band (by name, grown when too small): a fresh tensor of a band's size
    costs its page faults again each time, as much as the pass that fills it."""

    def __init__(self):
        self.bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple, dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self.bufs[name] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


def _groups(n: int, k: int) -> int:
    """Groups per tile for `_prefiltered` (0: none, `_select` takes one topk per tile): a power of two
    ≥ 2k dividing n, with at least 8 values a group (fewer and the filter passes too many to save)."""
    g = 1 << (2 * k - 1).bit_length()
    return g if n % g == 0 and n // g >= 8 else 0


def _nonfinite(field: str) -> WireError:
    return WireError("a sparse push carries finite values only", field=field, value="non-finite")


def _prefiltered(a: torch.Tensor, k: int, g: int, field: str, scratch: Scratch) -> torch.Tensor:
    """`_select`'s kept local indices (R, k) of the rows of magnitudes `a` (R, n), through a pre-filter.
    A row cut into g strided groups (value i in group i mod g) has k groups holding a value ≥ L, the
    k-th largest group maximum, so L ≤ the row's k-th largest value V: every value ≥ V is among the
    candidates ≥ L (about 2 % of a random row), which are written in index order into a (R, width) buffer
    padded with −1 (below every magnitude); V is their k-th largest and `_ties_to_lower` keeps them as on
    the whole row. A row with more than n/8 candidates (ties, zeros) is decided on the whole row.
    Refuses a non-finite value (WireError naming `field`): amax propagates NaN, and inf is the maximum."""
    rows, n = a.shape
    gm = a.view(rows, n // g, g).amax(dim=1)
    if not bool(torch.isfinite(gm).all()):
        raise _nonfinite(field)
    low = torch.kthvalue(gm, g - k + 1, dim=1, keepdim=True).values
    mask = scratch.take("mask", (rows, n), torch.bool, a.device)
    flat = torch.ge(a, low, out=mask).view(-1).nonzero()[:, 0]
    row = torch.div(flat, n, rounding_mode="floor")
    counts = torch.bincount(row, minlength=rows)
    wide = (counts > n // 8).nonzero()[:, 0]
    if wide.numel():
        narrow = counts[row] <= n // 8
        flat, row = flat[narrow], row[narrow]
        counts[wide] = 0
    width = max(k, int(counts.max()))
    pos = torch.arange(flat.numel(), device=a.device) - (counts.cumsum(0) - counts)[row]
    vals = scratch.take("vals", (rows, width), a.dtype, a.device).fill_(-1.0)
    vals[row, pos] = a.view(-1)[flat]
    local = scratch.take("local", (rows, width), torch.int64, a.device).zero_()
    local[row, pos] = flat - row * n
    kth = torch.kthvalue(vals, width - k + 1, dim=1, keepdim=True).values
    out = local.gather(1, _ties_to_lower(vals, kth, k))
    if wide.numel():
        whole = a[wide]
        out[wide] = _ties_to_lower(whole, torch.kthvalue(whole, n - k + 1, dim=1, keepdim=True).values, k)
    return out


def _select(block: torch.Tensor, th: int, tw: int, k: int, field: str, scratch: Scratch
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by magnitude of every th × tw tile of `block` (b·th, g·tw), tiles in row-major order, ties to
    the lower local index, in index order: (local indices int64 (b·g, k), values (b·g, k)). The tiles'
    magnitudes are written once into a (b·g, th·tw) buffer (`scratch`). Where `_groups` allows it, a
    pre-filter (`_prefiltered`); else one topk of k + 1 per tile: where its smallest value is unique, the
    other k are exactly the kept set (sorted), else (a tie across the k-th value, rare with real data)
    `_ties_to_lower` decides. Refuses a non-finite value (WireError naming `field`): topk ranks NaN above
    every number, so a tile holding one has it (or an inf) among its k + 1."""
    b, g = block.shape[0] // th, block.shape[1] // tw
    n, rows = th * tw, b * g
    t4 = block.reshape(b, th, g, tw).permute(0, 2, 1, 3)   # a view: tile (i, j), row r, column c
    a = scratch.take("abs", (b, g, th, tw), block.dtype, block.device)
    torch.abs(t4, out=a)
    a = a.view(rows, n)
    if k == n:
        if not bool(torch.isfinite(a.amax())):   # amax propagates NaN
            raise _nonfinite(field)
        local = torch.arange(n, device=block.device).expand(rows, n)
    elif _groups(n, k):
        local = _prefiltered(a, k, _groups(n, k), field, scratch)
    else:
        top, idx = torch.topk(a, k + 1, dim=1, sorted=False)
        if not bool(torch.isfinite(top).all()):
            raise _nonfinite(field)
        low, at = top.min(dim=1, keepdim=True)
        idx.scatter_(1, at, n)   # the (k+1)-th largest sorts last and is cut off
        local = idx.sort(dim=1).values[:, :k].contiguous()
        crowded = ((top == low).sum(dim=1) > 1).nonzero()[:, 0]
        if crowded.numel():   # there the (k+1)-th largest equals the k-th
            local[crowded] = _ties_to_lower(a[crowded], low[crowded], k)
    # the values, read from `block` at each kept entry's flat offset (no copy of the tiles)
    flat = block.reshape(-1)   # a view unless the block is a group of columns of a wider band
    stride = block.shape[1]
    tile = torch.arange(rows, device=block.device).unsqueeze(1)
    ti = torch.div(tile, g, rounding_mode="floor")
    r = torch.div(local, tw, rounding_mode="floor")
    return local, flat[(ti * th + r) * stride + (tile - ti * g) * tw + (local - r * tw)]


def _band(band: torch.Tensor, grid: Grid, th: int, field: str, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection in one band of whole tile rows (b·th rows): entries in chunk order."""
    b = band.shape[0] // th
    fc, ec, tw = grid.full_cols, grid.edge_cols, grid.tw
    per_group = max(1, BAND_NUMEL // (th * tw)) if b == 1 else fc
    locs, vals = [], []
    for c0 in range(0, fc, max(per_group, 1)):
        g = min(per_group, fc - c0)
        loc, val = _select(band[:, c0 * tw:(c0 + g) * tw], th, tw, grid.keep(th * tw), field, scratch)
        locs.append(loc.reshape(b, -1))
        vals.append(val.reshape(b, -1))
    if ec:
        loc, val = _select(band[:, fc * tw:], th, ec, grid.keep(th * ec), field, scratch)
        locs.append(loc.reshape(b, -1))
        vals.append(val.reshape(b, -1))
    return torch.cat(locs, dim=1).reshape(-1), torch.cat(vals, dim=1).reshape(-1)


def select(x: torch.Tensor, spec: SparseSpec, field: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """The kept entries of `x` in chunk order: (local indices int64, f32 values), `Grid.n_kept` of each.
    A non-finite value is refused (WireError naming `field`). Works band by band (at most about
    BAND_NUMEL values at a time, converted to f32 and checked as it goes), so the temporaries stay a
    few bands whatever the tensor's size."""
    grid = grid_of(x.shape, spec)
    m = x.detach().reshape(grid.rows, grid.cols)
    th, fr = grid.th, grid.full_rows
    rows_per_band = max(1, BAND_NUMEL // max(1, th * grid.cols))
    bands = [(r0, min(rows_per_band, fr - r0), th) for r0 in range(0, fr, rows_per_band)]
    if grid.edge_rows:
        bands.append((fr, 1, grid.edge_rows))
    locs, vals = [], []
    scratch = Scratch()
    for t0, b, h in bands if grid.cols else ():
        loc, val = _band(m[t0 * th:t0 * th + b * h].to(torch.float32), grid, h, field, scratch)
        locs.append(loc)
        vals.append(val)
    if not locs:
        return torch.empty(0, dtype=torch.int64, device=x.device), torch.empty(0, device=x.device)
    return torch.cat(locs), torch.cat(vals)


# ---------------------------------------------------------------- values

def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64, table f32 of 2**bits) of one tensor's kept values; decoded = table[codes]."""
    nb = 1 << bits
    n = values.numel()
    table = torch.zeros(nb, dtype=torch.float64, device=values.device)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=values.device), table.float()
    v = values.double()
    centred = v - v.mean()
    # σ as sqrt(Σc² / (n−1)), in this order: values on a bin edge (ties are common in small chunks) must fall
    # in the same bin for any implementation of the format's definition (norm() rounds otherwise)
    sigma = math.sqrt(float((centred * centred).sum()) / (n - 1)) if n > 1 else 0.0
    width = 2 * SIGMAS * sigma / nb
    if width > 0 and math.isfinite(width):
        codes = torch.floor(centred / width).clamp_(-(nb // 2), nb // 2 - 1).to(torch.int64) + nb // 2
    else:  # all values equal (or one value): one bin holds them, its mean is exact
        codes = torch.full((n,), nb // 2, dtype=torch.int64, device=values.device)
    sums = table.index_add(0, codes, v)
    counts = torch.bincount(codes, minlength=nb).to(torch.float64)
    table = torch.where(counts > 0, sums / counts.clamp(min=1), table)
    return codes, table.float()


# ---------------------------------------------------------------- message

def encode_push(tensors: Sequence[torch.Tensor], spec: SparseSpec, *, names: Sequence[str] | None = None) -> bytes:
    """The push message of `tensors` (any float dtype, any device; f32 arithmetic): `push_nbytes` long.
    Non-finite values are refused (WireError naming the tensor)."""
    parts = [_HEADER.pack(MAGIC, FORMAT, spec.value_bits, spec.tile, spec.k, spec.chunk_1d, spec.k_1d, len(tensors))]
    for i, t in enumerate(tensors):
        local, vals = select(t, spec, f"tensors.{names[i] if names else i}")
        codes, table = quantize(vals, spec.value_bits)
        parts.append(_TENSOR.pack(t.numel(), local.numel()))
        parts.append(table.cpu().numpy().astype("<f4").tobytes())
        parts.append(pack12(local).cpu().numpy().tobytes())
        parts.append(pack_codes(codes, spec.value_bits).cpu().numpy().tobytes())
    return b"".join(parts)


class ByteReader:
    def __init__(self, buf):
        self.mv = memoryview(buf).cast("B")
        self.pos = 0

    def take(self, n: int, field: str) -> memoryview:
        if self.pos + n > len(self.mv):
            raise DecodeError(f"message ends {self.pos + n - len(self.mv)} bytes short", field=field,
                              value=len(self.mv))
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, n: int, field: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self.take(n, field), dtype=np.uint8).copy())

    def done(self) -> None:
        if self.pos != len(self.mv):
            raise DecodeError("trailing bytes after the last tensor", field="length", value=len(self.mv))


def _check_header(r: ByteReader, spec: SparseSpec, n_tensors: int, magic: bytes) -> None:
    got = _HEADER.unpack(r.take(_HEADER.size, "header"))
    want = (magic, FORMAT, spec.value_bits, spec.tile, spec.k, spec.chunk_1d, spec.k_1d, n_tensors)
    names = ("magic", "format", "value_bits", "tile", "k", "chunk_1d", "k_1d", "tensors")
    for name, g, w in zip(names, got, want):
        if g != w:
            raise DecodeError(f"expected {w!r}", field=f"header.{name}", value=g)


def check_chunk_order(grid: Grid, chunk: torch.Tensor, local: torch.Tensor, field: str) -> None:
    """Refuse a local index outside its chunk or not increasing within it (a repeat included)."""
    h, w = grid.chunk_shapes(local.device)
    size = (h * w)[chunk]
    bad = (local < 0) | (local >= size)
    if bool(bad.any()):
        at = int(bad.nonzero()[0, 0])
        raise DecodeError(f"index outside its chunk of {int(size[at])} values", field=f"{field}.{at}",
                          value=int(local[at]))
    if local.numel() > 1:
        order = (local[1:] > local[:-1]) | (chunk[1:] != chunk[:-1])
        if not bool(order.all()):
            at = int((~order).nonzero()[0, 0]) + 1
            raise DecodeError("indices must increase within a chunk", field=f"{field}.{at}", value=int(local[at]))


def decode_push(buf, shapes: Sequence, spec: SparseSpec) -> list[SparseTensor]:
    """The tensors of a push message, for tensors of `shapes` (the fragment's layout) under `spec`."""
    r = ByteReader(buf)
    _check_header(r, spec, len(shapes), MAGIC)
    nb = 1 << spec.value_bits
    out = []
    for i, shape in enumerate(shapes):
        grid = grid_of(shape, spec)
        numel, kept = _TENSOR.unpack(r.take(_TENSOR.size, f"tensors.{i}"))
        if numel != math.prod(shape):
            raise DecodeError(f"expected {math.prod(shape)} values", field=f"tensors.{i}.numel", value=numel)
        if kept != grid.n_kept():
            raise DecodeError(f"expected {grid.n_kept()} kept values", field=f"tensors.{i}.kept", value=kept)
        table = torch.from_numpy(np.frombuffer(r.take(4 * nb, f"tensors.{i}.table"), dtype="<f4").copy())
        if not bool(torch.isfinite(table).all()):
            bad = int((~torch.isfinite(table)).nonzero()[0, 0])
            raise DecodeError("table entries must be finite", field=f"tensors.{i}.table.{bad}",
                              value=float(table[bad]))
        local = unpack12(r.u8(index_nbytes(kept), f"tensors.{i}.indices"), kept, f"tensors.{i}.indices")
        codes = unpack_codes(r.u8(packed_codes_nbytes(kept, spec.value_bits), f"tensors.{i}.codes"), kept,
                             spec.value_bits, f"tensors.{i}.codes")
        chunk = grid.chunk_of_entries(grid.chunk_keep())
        check_chunk_order(grid, chunk, local, f"tensors.{i}.indices")
        out.append(SparseTensor(grid.to_global(chunk, local), table[codes]))
    r.done()
    return out
