"""A version of the sparse outer mode as a sparse step from the one before (docs/design.md §4.10): the bytes a
broadcast will carry and the one function that applies them. Pure, no I/O; both sides import it.

Invariant: `apply_step_` is the single definition of applying an update (θ[i] ← θ[i] − s[i] with
s = f32(α)·aggregate, in f32), used by the syncer on its params and by every island on its anchor: the same
subtraction on the same bits, so an island that applied every update since a full cut holds the syncer's
params bit for bit.

Message (little-endian; exact size `update_nbytes`): a header `"YSPU" | format u8 = 1 | reserved u8 = 0 |
tile u16 | chunk_1d u16 | tensors u32`, then per tensor, in the fragment's order, `numel u64 | n u32 |
count u16 per chunk (chunk order) | 12-bit local indices | values f32 × n`. Entries are in chunk order,
increasing local index within a chunk (schemas/sparse_chunks.py); the counts sum to n and none exceeds its
chunk's size.
"""
from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np
import torch

from .errors import DecodeError, WireError
from .sparse import SparseTensor, ByteReader, check_chunk_order, index_nbytes
from .sparse_chunks import grid_of, pack12, unpack12
from .sparse_spec import SparseSpec

MAGIC = b"YSPU"
FORMAT = 1
_HEADER = struct.Struct("<4sBBHHI")
_TENSOR = struct.Struct("<QI")


def update_nbytes(shapes: Sequence, counts: Sequence[int], spec: SparseSpec) -> int:
    """The exact size of an update with counts[t] entries in tensor t."""
    return _HEADER.size + sum(_TENSOR.size + 2 * grid_of(s, spec).n_chunks + index_nbytes(n) + 4 * n
                              for s, n in zip(shapes, counts))


def apply_step_(param: torch.Tensor, step: SparseTensor) -> torch.Tensor:
    """θ[i] ← θ[i] − s[i] in f32, in place (`param` f32 and contiguous; indices unique). Returns the
    θ[i] it read (the values before, in the step's order): what puts `param` back, at no second gather."""
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"apply_step_ needs a contiguous float32 tensor, got {param.dtype}")
    flat = param.view(-1)
    idx = step.indices.to(flat.device)
    old = flat[idx]
    flat[idx] = old - step.values.to(flat.device)
    return old


def encode_update(steps: Sequence[SparseTensor], shapes: Sequence, spec: SparseSpec) -> bytes:
    """The update message of `steps` (unique flat indices, any order; f32 values) for tensors of `shapes`."""
    parts = [_HEADER.pack(MAGIC, FORMAT, 0, spec.tile, spec.chunk_1d, len(steps))]
    for i, (step, shape) in enumerate(zip(steps, shapes, strict=True)):
        grid = grid_of(shape, spec)
        if not bool(torch.isfinite(step.values).all()):
            raise WireError("an update carries finite values only", field=f"tensors.{i}.values", value="non-finite")
        chunk, local = grid.to_chunk(step.indices.cpu())
        key = chunk * 4096 + local   # unique (indices are): any sort gives the one order
        order = torch.argsort(key.to(torch.int32) if grid.n_chunks < 2 ** 19 else key)
        counts = torch.bincount(chunk, minlength=grid.n_chunks)
        parts.append(_TENSOR.pack(math.prod(shape), step.indices.numel()))
        parts.append(counts.numpy().astype("<u2").tobytes())
        parts.append(pack12(local[order]).numpy().tobytes())
        parts.append(step.values.cpu()[order].numpy().astype("<f4").tobytes())
    return b"".join(parts)


def decode_update(buf, shapes: Sequence, spec: SparseSpec) -> list[SparseTensor]:
    """The steps of an update message for tensors of `shapes`; refuses malformed input naming the field."""
    r = ByteReader(buf)
    got = _HEADER.unpack(r.take(_HEADER.size, "header"))
    want = (MAGIC, FORMAT, 0, spec.tile, spec.chunk_1d, len(shapes))
    for name, g, w in zip(("magic", "format", "reserved", "tile", "chunk_1d", "tensors"), got, want):
        if g != w:
            raise DecodeError(f"expected {w!r}", field=f"header.{name}", value=g)
    out = []
    for i, shape in enumerate(shapes):
        grid = grid_of(shape, spec)
        numel, n = _TENSOR.unpack(r.take(_TENSOR.size, f"tensors.{i}"))
        if numel != math.prod(shape):
            raise DecodeError(f"expected {math.prod(shape)} values", field=f"tensors.{i}.numel", value=numel)
        counts = torch.from_numpy(np.frombuffer(r.take(2 * grid.n_chunks, f"tensors.{i}.counts"), dtype="<u2")
                                  .astype(np.int64))
        h, w = grid.chunk_shapes()
        over = counts > h * w
        if bool(over.any()):
            at = int(over.nonzero()[0, 0])
            raise DecodeError(f"more entries than the chunk's {int(h[at] * w[at])} values",
                              field=f"tensors.{i}.counts.{at}", value=int(counts[at]))
        if int(counts.sum()) != n:
            raise DecodeError(f"chunk counts sum to {int(counts.sum())}", field=f"tensors.{i}.n", value=n)
        local = unpack12(r.u8(index_nbytes(n), f"tensors.{i}.indices"), n, f"tensors.{i}.indices")
        values = torch.from_numpy(np.frombuffer(r.take(4 * n, f"tensors.{i}.values"), dtype="<f4").copy())
        if not bool(torch.isfinite(values).all()):
            at = int((~torch.isfinite(values)).nonzero()[0, 0])
            raise DecodeError("values must be finite", field=f"tensors.{i}.values.{at}", value=float(values[at]))
        chunk = grid.chunk_of_entries(counts)
        check_chunk_order(grid, chunk, local, f"tensors.{i}.indices")
        out.append(SparseTensor(grid.to_global(chunk, local), values))
    r.done()
    return out
