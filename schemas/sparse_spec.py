"""The compression spec the sparse outer mode pins (docs/design.md §4.10): tile, k, 1-D chunk, k_1d and value bits,
checked on construction. Plain data, no torch: `yeto replay` and the syncer's configuration read it without one.
The chunk grid and packing that use it: schemas/sparse_chunks.py."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

MAX_CHUNK = 4096  # a local index must fit 12 bits
VALUE_BITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class SparseSpec:
    """The compression a run pins: every island and the syncer must use the same one (the message header
    names it, and a decoder refuses a message of another spec)."""

    tile: int = 64        # side of a 2-D tile: tile*tile <= 4096
    k: int = 64           # values kept per full 2-D tile (64 of 4096: 1.56 %)
    chunk_1d: int = 64    # values per chunk of a 1-D tensor
    k_1d: int = 64        # values kept per full 1-D chunk (SparseLoCo keeps all of a 1-D chunk)
    value_bits: int = 2   # bits per kept value: 2**bits bins over mean +- 3 sigma

    def __post_init__(self):
        for name in ("tile", "k", "chunk_1d", "k_1d", "value_bits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError("must be a positive integer", field=f"sparse.{name}", value=value)
        if self.tile * self.tile > MAX_CHUNK:
            raise ConfigError(f"a tile of tile*tile values must fit 12-bit indices (<= {MAX_CHUNK})",
                              field="sparse.tile", value=self.tile)
        if self.k > self.tile * self.tile:
            raise ConfigError(f"cannot keep more than a tile's {self.tile * self.tile} values", field="sparse.k",
                              value=self.k)
        if self.chunk_1d > MAX_CHUNK:
            raise ConfigError(f"a 1-D chunk must fit 12-bit indices (<= {MAX_CHUNK})", field="sparse.chunk_1d",
                              value=self.chunk_1d)
        if self.k_1d > self.chunk_1d:
            raise ConfigError(f"cannot keep more than a chunk's {self.chunk_1d} values", field="sparse.k_1d",
                              value=self.k_1d)
        if self.value_bits not in VALUE_BITS:
            raise ConfigError(f"must be one of {VALUE_BITS}", field="sparse.value_bits", value=self.value_bits)
