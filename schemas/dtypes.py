"""Wire dtypes: packing flat float32 tensors into bytes and back (docs/design.md §3.6, §5.4). Pure, no I/O.

`f32` (the float32 bits: a bitwise round trip), `bf16` (torch's round-to-nearest-even: the round trip is
`x.to(bfloat16).to(float32)` bitwise) and `q4` (4-bit blocks of `Q4_BLOCK` values with an f32 scale; the
format is docs/design.md §3.6, the rounding and its error bound `_q4_encode_blocks`).
Invariants: every wire format is little-endian, and the packers reinterpret torch memory directly, so the
module refuses to import on a big-endian host; every encoding is canonical (q4: zero is nibble 0); packed
buffers are contiguous 1-D `torch.uint8` CPU tensors (`as_bytes_view` gives a memoryview without a copy).
torch is imported by the functions that need it, not by this module: the dtype names and the byte
arithmetic serve processes that never touch a tensor (the CLI, step-log consumers, bench/wire.py).
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from .errors import DecodeError, WireError

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # pragma: no cover - no big-endian host in the fleet
    raise ImportError("yeto.schemas.dtypes assumes a little-endian host: wire bytes are raw little-endian memory")

# The one definition of the dtype names (the JSON schemas' enums say the same; tests/test_dtypes.py checks).
WIRE_DTYPES = ("f32", "bf16", "q4")
PUSH_DTYPES = WIRE_DTYPES           # a push may be 4-bit: d = local - anchor tolerates the error (with feedback)
BULK_DTYPES = ("f32", "bf16")       # whole-fragment bytes (INIT, broadcast) are never 4-bit
AUTO_DTYPE = "auto"                 # an island's setting: take the session's dtype
Q4_BLOCK = 256
Q4_BLOCK_BYTES = 4 + Q4_BLOCK // 2  # f32 scale + one nibble per value

_Q4_TINY = 2.0**-100  # below this block scale, levels are chosen on the block scaled by _Q4_UPSCALE
_Q4_UPSCALE = 2.0**100
_Q4_SLAB_CPU = 256  # blocks per slab on CPU (64 Ki values: temporaries stay in cache)
_Q4_SLAB_DEVICE = 1 << 16  # blocks per slab on an accelerator (16 Mi values per launch group)


def _check_dtype(wire_dtype: Any) -> str:
    if wire_dtype not in WIRE_DTYPES:
        raise WireError(f"must be one of {WIRE_DTYPES}", field="dtype", value=wire_dtype)
    return wire_dtype


def _check_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError("must be a non-negative integer", field=field, value=value)
    return value


def wire_align(wire_dtype: str) -> tuple[int, int]:
    """(elements, bytes) of the smallest independently decodable unit: (1, 4), (1, 2) or (256, 132).

    Chunks cut at multiples of the byte count decode on their own (see `element_range`).
    """
    wd = _check_dtype(wire_dtype)
    if wd == "f32":
        return 1, 4
    if wd == "bf16":
        return 1, 2
    return Q4_BLOCK, Q4_BLOCK_BYTES


def packed_nbytes(wire_dtype: str, numel: int) -> int:
    """Bytes that `numel` float32 values take on the wire in `wire_dtype` (q4: whole padded blocks)."""
    elems, nbytes = wire_align(wire_dtype)
    n = _check_count(numel, "numel")
    return -(-n // elems) * nbytes


def element_range(wire_dtype: str, byte_offset: int, nbytes: int, numel: int) -> tuple[int, int]:
    """(element offset, element count) covered by bytes [byte_offset, byte_offset + nbytes) of a
    packed buffer holding `numel` values. The range must start on a unit boundary and end on one (or
    at the end of the buffer), so that slice can be unpacked alone with `unpack(payload, dtype, count)`.
    """
    elems, ubytes = wire_align(wire_dtype)
    _check_count(byte_offset, "offset")
    _check_count(nbytes, "nbytes")
    total = packed_nbytes(wire_dtype, numel)
    end = byte_offset + nbytes
    if end > total:
        raise WireError(f"byte range ends past the packed size {total}", field="nbytes", value=(byte_offset, nbytes))
    if byte_offset % ubytes or (end % ubytes and end != total):
        raise WireError(
            f"byte range is not aligned to {ubytes}-byte units of {wire_dtype}",
            field="offset",
            value=(byte_offset, nbytes),
        )
    first = (byte_offset // ubytes) * elems
    last = min(-(-end // ubytes) * elems, numel)
    return first, max(0, last - first)


def as_bytes_view(buf: Any) -> memoryview:
    """A flat byte (format 'B') memoryview over `buf` without copying.

    Accepts bytes, bytearray, memoryview, NumPy arrays and contiguous CPU torch tensors of any dtype
    (their raw little-endian bytes). Refuses non-contiguous or device memory, which would need a copy.
    """
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise WireError("tensor must be in CPU memory to be viewed as bytes", field="device", value=str(buf.device))
        if not buf.is_contiguous():
            raise WireError("tensor must be contiguous to be viewed as bytes", field="stride",
                            value=tuple(buf.stride()))
        return memoryview(_uint8_view(buf.detach()).numpy())
    try:
        mv = memoryview(buf)
    except TypeError:
        raise WireError("expected a bytes-like object or tensor", field="payload", value=type(buf).__name__) from None
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise WireError("buffer must be C-contiguous", field="payload", value=type(buf).__name__)
    return mv.cast("B")


@functools.cache
def _q4_lut():
    """Nibble -> signed level as a fraction of s. Nibble 8 ("negative zero") is never produced; it decodes to -0.0."""
    import torch

    return torch.tensor(
        [0.0] + [2.0 ** -(7 - lv) for lv in range(1, 8)] + [-0.0] + [-(2.0 ** -(7 - lv)) for lv in range(1, 8)],
        dtype=torch.float32,
    )


def _uint8_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (empty tensors may carry odd strides)."""
    import torch

    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    t = t.reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _flat_f32(x: Any) -> torch.Tensor:
    import torch

    if not isinstance(x, torch.Tensor):
        raise WireError("expected a torch.Tensor", field="x", value=type(x).__name__)
    if x.dtype != torch.float32:
        raise WireError("pack takes float32 values", field="x.dtype", value=str(x.dtype))
    # A contiguous tensor flattens to a view; anything else is copied once here.
    return x.detach().reshape(-1)


def _q4_encode_blocks(blocks: torch.Tensor, out: torch.Tensor, first_block: int) -> None:
    """Encode an (nb, 256) float32 slab into the (nb, 132) uint8 rows `out`.

    Each value takes the level minimizing |x − q| (nearest in the linear sense); a value exactly halfway
    between two levels takes the smaller one. The choice is made with exact operations on the float bit
    patterns, for every finite block, subnormals included. Decoding multiplies s by a power of two, exact
    unless the level falls below the normal range (s < 2**-120), where it is correctly rounded (at most
    2**-150 off). Error bound (a = |x|): a ≥ s/64: |x − q| ≤ a/3 (worst case exactly at a midpoint
    1.5·s·2**-k: error 0.5·s·2**-k); a < s/64: |x − q| ≤ s/128 (nearest of 0 and s/64); always
    |x − q| ≤ s/4 (half the widest gap, between s/2 and s), and the block's absmax value is encoded exactly
    (L = 7, q = s), so an all-equal block round-trips exactly."""
    import torch

    nb = blocks.shape[0]
    mag = blocks.abs()
    scale = mag.amax(dim=1)  # NaN propagates, so one finiteness check covers NaN and inf
    if not bool(torch.isfinite(scale).all()):
        bad = int((~torch.isfinite(scale)).nonzero()[0, 0])
        raise WireError("q4 cannot encode non-finite values", field="x",
                        value=f"block {first_block + bad} has absmax {float(scale[bad])}")
    # The nearest level is found exactly, on the float bit patterns (no rounding can flip a choice):
    # for normal floats, s * 2^-k has the bits of s minus k << 23, and bit patterns of non-negative
    # floats order like the floats. So k* = ceil((bits(s) - bits(|x|)) / 2^23) is the smallest k with
    # |x| >= s * 2^-k, and low = s * 2^-k* is the largest level at or below |x| (k* <= 6), or, for
    # k* = 7, the midpoint s/128 between the levels 0 and s/64. Then round up to the next level iff
    # |x| - low > 2 * low - |x| (ties stay down): with low <= |x| < 2 * low both differences are exact
    # (Sterbenz). Comparing |x| with the midpoints 3 * s * 2^-k directly would not do: 3s needs 26 bits.
    # Blocks with 0 < s < 2^-100 are scaled up by 2^100 first (exact, and the choice of level is
    # scale-free), so every product above is a normal float.
    tiny = (scale > 0) & (scale < _Q4_TINY)
    if bool(tiny.any()):
        factor = torch.where(tiny, _Q4_UPSCALE, 1.0).unsqueeze(1)
        mag = mag * factor
        s_bits = (scale.unsqueeze(1) * factor).view(torch.int32)
    else:
        s_bits = scale.unsqueeze(1).view(torch.int32)
    k = (s_bits - mag.view(torch.int32)).add_(0x7FFFFF).bitwise_right_shift_(23).clamp_(max=7)
    low = (s_bits - k.bitwise_left_shift(23)).view(torch.float32)
    up = torch.where(k == 7, mag > low, (mag - low) > (low + low - mag))
    level = (7 - k).add_(up).to(torch.uint8)
    # A zero block (s = 0) lands on level 7 above; give it the canonical all-zero nibbles.
    level.masked_fill_((scale == 0).unsqueeze(1), 0)
    code = level.bitwise_or_(((blocks < 0) & (level > 0)).to(torch.uint8).bitwise_left_shift_(3))
    out[:, :4] = scale.view(torch.uint8).view(nb, 4)
    torch.bitwise_or(code[:, 0::2], code[:, 1::2].bitwise_left_shift(4), out=out[:, 4:])


def _pack_q4(x: torch.Tensor) -> torch.Tensor:
    import torch

    n = x.numel()
    nb = -(-n // Q4_BLOCK)
    out = torch.empty((nb, Q4_BLOCK_BYTES), dtype=torch.uint8, device=x.device)
    full = n // Q4_BLOCK
    # Work through slabs of blocks so the dozen temporaries stay cache-sized on CPU (allocating
    # them at full size costs more in page faults than the arithmetic); devices take big slabs.
    slab = _Q4_SLAB_CPU if x.device.type == "cpu" else _Q4_SLAB_DEVICE
    blocks = x[: full * Q4_BLOCK].view(full, Q4_BLOCK)
    for b in range(0, full, slab):
        _q4_encode_blocks(blocks[b : b + slab], out[b : min(b + slab, full)], b)
    if full < nb:  # partial last block, padded with zeros
        tail = torch.zeros((1, Q4_BLOCK), dtype=torch.float32, device=x.device)
        tail[0, : n - full * Q4_BLOCK] = x[full * Q4_BLOCK :]
        _q4_encode_blocks(tail, out[full:], full)
    return out.view(-1)


def pack(x: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """Pack float32 values (any shape, flattened in memory order) into the wire format.

    Returns a contiguous 1-D torch.uint8 tensor in CPU memory, `packed_nbytes(wire_dtype, x.numel())`
    long. For f32 on a contiguous CPU input it is a view of `x` itself (zero copy): do not modify `x`
    until the bytes are sent. A device tensor is packed on its device and the result copied to CPU.
    q4 refuses non-finite values (WireError); f32 and bf16 carry them as they are (bf16: values past
    the bf16 range round to inf, as torch rounds).
    """
    import torch

    wd = _check_dtype(wire_dtype)
    flat = _flat_f32(x)
    if wd == "f32":
        out = _uint8_view(flat)
    elif wd == "bf16":
        out = _uint8_view(flat.to(torch.bfloat16))
    else:
        out = _pack_q4(flat)
    return out.cpu()


def _owned_bytes(buf: Any, expected: int, wire_dtype: str, numel: int) -> torch.Tensor:
    import torch

    mv = as_bytes_view(buf)
    if len(mv) != expected:
        raise DecodeError(
            f"{wire_dtype} buffer of {numel} values must be {expected} bytes", field="nbytes", value=len(mv)
        )
    # One copy into fresh (aligned, writable, unaliased) memory; the float32 result lives there for f32.
    return torch.from_numpy(np.frombuffer(mv, dtype=np.uint8).copy())


def unpack(buf: Any, wire_dtype: str, numel: int) -> torch.Tensor:
    """Decode `numel` values from a packed buffer into a new float32 CPU tensor (1-D).

    `buf` is anything `as_bytes_view` accepts (bytes, memoryview, NumPy arrays, a CPU uint8 tensor).
    The result never aliases `buf`. A buffer of the wrong length, or a q4 block with a negative or
    non-finite scale or non-zero padding, raises DecodeError.
    """
    import torch

    wd = _check_dtype(wire_dtype)
    n = _check_count(numel, "numel")
    raw = _owned_bytes(buf, packed_nbytes(wd, n), wd, n)
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    if wd == "f32":
        return raw.view(torch.float32)
    if wd == "bf16":
        return raw.view(torch.bfloat16).to(torch.float32)
    nb = raw.numel() // Q4_BLOCK_BYTES
    rows = raw.view(nb, Q4_BLOCK_BYTES)
    scale = rows[:, :4].contiguous().view(torch.float32).view(nb)
    ok = torch.isfinite(scale) & (scale >= 0)
    if not bool(ok.all()):
        bad = int((~ok).nonzero()[0, 0])
        raise DecodeError("q4 block scale must be finite and non-negative", field=f"block.{bad}.scale",
                          value=float(scale[bad]))
    tail = n - (nb - 1) * Q4_BLOCK  # values in the last block
    if tail < Q4_BLOCK:
        last = rows[-1, 4 + tail // 2 :].clone()
        if tail % 2:
            last[0] &= 0xF0  # its low nibble is the last real value
        if bool(last.any()):
            raise DecodeError("q4 padding nibbles must be zero", field="padding", value=int(last.count_nonzero()))
    out = torch.empty((nb, Q4_BLOCK), dtype=torch.float32)
    for b in range(0, nb, _Q4_SLAB_CPU):  # slabs keep the index temporaries cache-sized
        nib = rows[b : b + _Q4_SLAB_CPU, 4:]
        codes = torch.stack((nib & 0x0F, nib >> 4), dim=2).view(-1, Q4_BLOCK)
        # Multiplying by a signed power of two is exact (for normal results): decoding adds no error.
        torch.mul(_q4_lut()[codes.long()], scale[b : b + _Q4_SLAB_CPU].unsqueeze(1), out=out[b : b + _Q4_SLAB_CPU])
    return out.view(-1)[:n]


def q4_with_feedback(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-feedback q4: pack y = x + residual and return (packed, y - unpack(packed)).

    Carrying the new residual into the next push makes the sum of the dequantized pushes track the
    sum of the inputs: after T pushes the difference is residual_0 - residual_T, one quantization
    error, instead of T of them. `residual=None` starts from zero. Neither input is modified.
    """
    flat = _flat_f32(x)
    if residual is None:
        y = flat.clone()
    else:
        r = _flat_f32(residual)
        if r.numel() != flat.numel():
            raise WireError(f"residual must have {flat.numel()} values like x", field="residual", value=r.numel())
        y = flat + r.to(flat.device)
    packed = pack(y, "q4")
    return packed, y - unpack(packed, "q4", y.numel()).to(y.device)


def pack_stream(
    pieces: Iterable[torch.Tensor], wire_dtype: str, *, residual: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """Pack float32 tensors that arrive one by one (e.g. gathered shard by shard) as one flat stream.

    The concatenation of the yielded uint8 tensors equals `pack(torch.cat(pieces), wire_dtype)`, but
    only one piece (plus, for q4, fewer than 256 carried-over values) is in memory at a time: q4
    blocks run across piece boundaries, so a partial block waits for the next piece.

    `residual` (q4 only): a 1-D float32 tensor with one value per element of the whole stream. Each
    piece is packed with error feedback (`x + residual`) and the residual is overwritten in place with
    the new one, exactly as `q4_with_feedback` on the concatenation would produce.
    """
    import torch

    wd = _check_dtype(wire_dtype)
    if residual is not None:
        if wd != "q4":
            raise WireError("error feedback applies to q4 only", field="dtype", value=wd)
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or residual.dim() != 1:
            raise WireError("residual must be a 1-D float32 tensor", field="residual",
                            value=getattr(residual, "shape", residual))
    if wd != "q4":
        for piece in pieces:
            yield pack(piece, wd)
        return
    carry = torch.empty(0, dtype=torch.float32)
    pos = 0  # elements of the stream consumed so far (the residual index of the next value)

    def encode(y: torch.Tensor, start: int) -> torch.Tensor:
        if residual is not None:
            r = residual[start : start + y.numel()]
            y = y + r.to(y.device)
            packed = pack(y, "q4")
            r.copy_(y.cpu() - unpack(packed, "q4", y.numel()))
            return packed
        return pack(y, "q4")

    for piece in pieces:
        flat = _flat_f32(piece)
        if residual is not None and pos + carry.numel() + flat.numel() > residual.numel():
            raise WireError("stream holds more values than the residual", field="residual", value=residual.numel())
        carry_start = pos
        if carry.numel():
            need = Q4_BLOCK - carry.numel()
            carry = torch.cat((carry.to(flat.device), flat[:need]))
            flat = flat[need:]
            if carry.numel() < Q4_BLOCK:
                continue
            yield encode(carry, carry_start)
            pos += Q4_BLOCK
            carry = torch.empty(0, dtype=torch.float32)
        whole = (flat.numel() // Q4_BLOCK) * Q4_BLOCK
        if whole:
            yield encode(flat[:whole], pos)
            pos += whole
        carry = flat[whole:].clone()  # clone: do not pin the caller's whole piece for a short tail
    if carry.numel():
        yield encode(carry, pos)
        pos += carry.numel()
    if residual is not None and pos != residual.numel():
        raise WireError(f"stream held {pos} values but the residual has {residual.numel()}", field="residual",
                        value=pos)
