"""The chunk grid of the sparse outer mode and its bit packing (docs/design.md §4.10). Pure, no I/O.

Chunks, as SparseLoCo cuts them: a 2-D weight (an N-D one viewed as rows × the rest) into `tile` × `tile`
tiles from the top-left corner, smaller at the edges (no chunk spans two tile positions, nothing is
padded); a 1-D tensor or a scalar into runs of `chunk_1d` values. Chunks are numbered in row-major order
of the grid, a value by its row-major *local index* in its chunk (< 4096: 12 bits).
A chunk of n values keeps ceil(k_full · n / F) of them (F: a full chunk's size, k_full the spec's k or
k_1d), so density is the same everywhere and a message's size depends on the tensor's shape alone.
Packing: 12-bit indices two to three bytes, little-endian (`a | b << 12`), an odd last index in two bytes
(Templar's `pack_12bit_indices` order); b-bit codes 8/b to a byte, the first in the low bits.
Invariant: unused bits are zero (a decoder refuses anything else), so every message has one encoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import DecodeError
from .sparse_spec import SparseSpec


@dataclass(frozen=True)
class Grid:
    """One tensor's chunk grid: the tensor as a rows × cols matrix in tiles of th × tw (edge tiles smaller)."""

    rows: int
    cols: int
    th: int
    tw: int
    k_full: int

    @property
    def full_rows(self) -> int:
        return self.rows // self.th

    @property
    def full_cols(self) -> int:
        return self.cols // self.tw

    @property
    def edge_rows(self) -> int:
        return self.rows % self.th

    @property
    def edge_cols(self) -> int:
        return self.cols % self.tw

    @property
    def tile_rows(self) -> int:
        return self.full_rows + (self.edge_rows > 0)

    @property
    def tile_cols(self) -> int:
        return self.full_cols + (self.edge_cols > 0)

    @property
    def n_chunks(self) -> int:
        return self.tile_rows * self.tile_cols

    def keep(self, n: int) -> int:
        """Values kept in a chunk of n values."""
        return min(n, -(-self.k_full * n // (self.th * self.tw)))

    def n_kept(self) -> int:
        fr, fc, er, ec = self.full_rows, self.full_cols, self.edge_rows, self.edge_cols
        th, tw = self.th, self.tw
        return (fr * (fc * self.keep(th * tw) + self.keep(th * ec))
                + fc * self.keep(er * tw) + self.keep(er * ec))

    def chunk_shapes(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(height, width) of every chunk, in chunk order, as int64 tensors of n_chunks."""
        c = torch.arange(self.n_chunks, device=device)
        ti = torch.div(c, max(1, self.tile_cols), rounding_mode="floor")
        tj = c - ti * self.tile_cols
        h = torch.where(ti < self.full_rows, self.th, self.edge_rows)
        w = torch.where(tj < self.full_cols, self.tw, self.edge_cols)
        return h, w

    def chunk_keep(self, device=None) -> torch.Tensor:
        """Values kept per chunk (int64, chunk order): the push message's implied per-chunk counts."""
        h, w = self.chunk_shapes(device)
        n = h * w
        return torch.minimum(n, -torch.div(-self.k_full * n, self.th * self.tw, rounding_mode="floor"))

    def chunk_of_entries(self, counts: torch.Tensor) -> torch.Tensor:
        """The chunk of every entry of a stream with `counts[c]` entries in chunk c, in chunk order."""
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def _narrow(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`ts` as int32 when every flat index of the tensor fits (the same integers, divided about
        twice as fast as int64 on a CPU), else unchanged."""
        if self.rows * self.cols < 2 ** 31 and all(t.dtype == torch.int64 for t in ts):
            return tuple(t.to(torch.int32) for t in ts)
        return ts

    def to_global(self, chunk: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Flat (row-major) index in the tensor of `local` in `chunk` (int64 tensors of equal shape, and
        in range: decoders check them first)."""
        chunk, local = self._narrow(chunk, local)
        ti = torch.div(chunk, self.tile_cols, rounding_mode="floor")
        tj = chunk - ti * self.tile_cols
        w = torch.where(tj < self.full_cols, self.tw, self.edge_cols).to(local.dtype)
        lr = torch.div(local, w, rounding_mode="floor")
        return ((ti * self.th + lr) * self.cols + tj * self.tw + (local - lr * w)).to(torch.int64)

    def to_chunk(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk, local) of flat row-major indices (in range): the inverse of `to_global`."""
        (flat,) = self._narrow(flat)
        r = torch.div(flat, self.cols, rounding_mode="floor")
        c = flat - r * self.cols
        ti = torch.div(r, self.th, rounding_mode="floor")
        tj = torch.div(c, self.tw, rounding_mode="floor")
        w = torch.where(tj < self.full_cols, self.tw, self.edge_cols).to(flat.dtype)
        return ((ti * self.tile_cols + tj).to(torch.int64),
                ((r - ti * self.th) * w + (c - tj * self.tw)).to(torch.int64))


def grid_of(shape: tuple[int, ...] | torch.Size, spec: SparseSpec) -> Grid:
    """The chunk grid of a tensor of `shape` under `spec`."""
    shape = tuple(int(d) for d in shape)
    if len(shape) <= 1:
        return Grid(1, shape[0] if shape else 1, 1, spec.chunk_1d, spec.k_1d)
    return Grid(shape[0], math.prod(shape[1:]), spec.tile, spec.tile, spec.k)


def pack12(idx: torch.Tensor) -> torch.Tensor:
    """Indices < 4096 (int64, 1-D) as uint8: pairs in 3 bytes, an odd last one in 2."""
    n = idx.numel()
    pairs = n // 2
    a = idx[0:2 * pairs:2]
    b = idx[1:2 * pairs:2]
    out = torch.empty(3 * pairs + 2 * (n % 2), dtype=torch.uint8, device=idx.device)
    body = out[:3 * pairs].view(pairs, 3)
    body[:, 0] = a & 0xFF
    body[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    body[:, 2] = b >> 4
    if n % 2:
        out[-2] = idx[-1] & 0xFF
        out[-1] = idx[-1] >> 8
    return out


def unpack12(raw: torch.Tensor, n: int, field: str) -> torch.Tensor:
    """n indices from `raw` (uint8, exactly pack12's length); refuses set padding bits."""
    pairs = n // 2
    r = raw.to(torch.int64)
    out = torch.empty(n, dtype=torch.int64, device=raw.device)
    body = r[:3 * pairs].view(pairs, 3)
    out[0:2 * pairs:2] = body[:, 0] | ((body[:, 1] & 0xF) << 8)
    out[1:2 * pairs:2] = (body[:, 1] >> 4) | (body[:, 2] << 4)
    if n % 2:
        if int(r[-1]) > 0xF:
            raise DecodeError("padding bits of the odd last 12-bit index must be zero", field=field, value=int(r[-1]))
        out[-1] = r[-2] | (r[-1] << 8)
    return out


def packed_codes_nbytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """b-bit codes (uint8 values < 2**b, 1-D) packed 8/b to a byte, first code in the low bits."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(packed_codes_nbytes(n, bits) * per, dtype=torch.int32, device=codes.device)
    padded[:n] = codes
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (padded.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(raw: torch.Tensor, n: int, bits: int, field: str) -> torch.Tensor:
    """n codes (int64) from `raw`; refuses set bits past the last code."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int64, device=raw.device) * bits
    codes = ((raw.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if bool((codes[n:] != 0).any()):
        raise DecodeError("padding bits after the last value code must be zero", field=field,
                          value=int(raw[-1]))
    return codes[:n]
