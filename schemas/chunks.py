"""Chunk framing: cutting a fragment's packed bytes into chunks and reassembling them (DESIGN §3).

Pure logic, no I/O: the NATS shells publish `Chunk.header()` as the message header and `Chunk.payload`
as the message body, and feed what they receive to an `Assembler`.

Framing rule (both sides rely on it): a fragment of `total` bytes (total >= 1; zero-length fragments
are refused, the layout never produces one) cut with chunk size `cb` has `ceil(total / cb)` chunks,
chunk i covering bytes [i*cb, min((i+1)*cb, total)). Use `effective_chunk_bytes(..., align=...)` with
the wire dtype's unit (`dtypes.wire_align`) so every chunk decodes on its own.

Digests: a chunk digest is xxh3_64 (hex, 16 chars) of the chunk's payload bytes as sent — fast enough
to hash at memory speed; a version digest is sha256 over the whole fragment's bytes in layout order,
streamed with `VersionDigest`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch
import xxhash

from .dtypes import as_bytes_view
from .errors import ChunkError, WireError

# NATS counts headers toward max_payload but nats-py checks only the payload (NATS-NOTES trap 1):
# a chunk header (Nats-Msg-Id + compact JSON metadata with two digests) is well under 1 KiB; 4 KiB
# leaves room for tracing or auth headers added later.
HEADER_HEADROOM = 4096


# ---- errors ---------------------------------------------------------------------------------------

class ChunkOverlap(ChunkError):
    """A chunk's byte range overlaps a chunk already received under another index."""

    code = "chunk_overlap"


class ChunkOverflow(ChunkError):
    """A chunk reaches past `total`, is empty, or its payload length differs from its `nbytes`."""

    code = "chunk_overflow"


class TotalChanged(ChunkError):
    """A chunk's `total` or `chunks` differs from the assembly's (fixed by the first chunk or the caller)."""

    code = "total_changed"


class ChunkMissing(ChunkError):
    """The assembly was finished while chunks were missing; `value` lists the missing indexes."""

    code = "chunk_missing"


class ChunkDuplicate(ChunkError):
    """The same chunk index arrived twice; the second copy was dropped without touching state.

    `identical` says whether it repeated the first copy's offset, size and digest (a harmless resend).
    """

    code = "chunk_duplicate"

    def __init__(self, message: str, *, identical: bool, **kw: Any):
        self.identical = identical
        super().__init__(message, **kw)


class DigestMismatch(ChunkError):
    """A chunk's payload, or a whole version/push, does not hash to the digest it came with."""

    code = "digest_mismatch"


class ChunkIndexOutOfRange(ChunkError):
    """A chunk index outside [0, chunks)."""

    code = "chunk_index"


class ChunkMisplaced(ChunkError):
    """A chunk's offset or size does not follow the framing rule (chunk i at i*chunk_bytes)."""

    code = "chunk_misplaced"


class ChunkMetaInvalid(ChunkError):
    """A chunk header field is missing or of the wrong type."""

    code = "chunk_meta"


# ---- digests --------------------------------------------------------------------------------------

def digest(buf: Any) -> str:
    """xxh3_64 of the payload bytes, 16 lowercase hex characters."""
    return xxhash.xxh3_64_hexdigest(as_bytes_view(buf))


class VersionDigest:
    """Streaming sha256 over a fragment's bytes in layout order: `.update(buf)` per piece, `.hexdigest()`."""

    __slots__ = ("_h", "nbytes")

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.nbytes = 0

    def update(self, buf: Any) -> "VersionDigest":
        mv = as_bytes_view(buf)
        self._h.update(mv)
        self.nbytes += len(mv)
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def verify(self, expected: str, *, field: str = "version_digest") -> None:
        check_digest(expected, self.hexdigest(), field=field)


def version_digest_new() -> VersionDigest:
    return VersionDigest()


def version_digest(buf: Any) -> str:
    """sha256 hex of one in-memory buffer."""
    return VersionDigest().update(buf).hexdigest()


def check_digest(expected: Any, actual: str, *, field: str) -> None:
    """Raise DigestMismatch naming `field` unless `expected == actual`."""
    if expected != actual:
        raise DigestMismatch(f"digest does not match the bytes (computed {actual})", field=field, value=expected)


# ---- chunk size -----------------------------------------------------------------------------------

def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WireError("must be a positive integer", field=field, value=value)
    return value


def max_chunk_bytes(server_max_payload: int, headroom: int = HEADER_HEADROOM) -> int:
    """Largest chunk payload a server announcing `server_max_payload` accepts with our headers."""
    mp = _positive_int(server_max_payload, "max_payload")
    if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0:
        raise WireError("must be a non-negative integer", field="headroom", value=headroom)
    bound = mp - headroom
    if bound < 1:
        raise WireError(f"server max_payload leaves no room for a payload after {headroom} bytes of headers",
                        field="max_payload", value=mp)
    return bound


def effective_chunk_bytes(configured: int, server_max_payload: int, *, align: int = 1,
                          headroom: int = HEADER_HEADROOM) -> int:
    """The chunk size to cut with: min(configured, server bound), rounded down to a multiple of `align`.

    Pass `align = dtypes.wire_align(dtype)[1]` so chunks hold whole values (whole q4 blocks).
    Raises WireError naming `chunk_bytes` when the configured size is not a positive integer or is
    smaller than one unit, and naming `max_payload` when the server's limit cannot fit one unit.
    """
    cfg = _positive_int(configured, "chunk_bytes")
    al = _positive_int(align, "align")
    bound = max_chunk_bytes(server_max_payload, headroom)
    if cfg < al:
        raise WireError(f"must hold at least one {al}-byte unit", field="chunk_bytes", value=cfg)
    if bound < al:
        raise WireError(f"server limit minus {headroom} bytes of headers cannot hold one {al}-byte unit",
                        field="max_payload", value=server_max_payload)
    return (min(cfg, bound) // al) * al


# ---- planning -------------------------------------------------------------------------------------

def chunk_count(total: int, chunk_bytes: int) -> int:
    t = _positive_int(total, "total")
    cb = _positive_int(chunk_bytes, "chunk_bytes")
    return -(-t // cb)


def plan_chunks(total: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """[(index, offset, nbytes)] tiling [0, total); every chunk is `chunk_bytes` long except a short last."""
    n = chunk_count(total, chunk_bytes)
    return [(i, i * chunk_bytes, min(chunk_bytes, total - i * chunk_bytes)) for i in range(n)]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk as it goes on the wire. `payload` is a byte memoryview (possibly a slice of the
    caller's buffer: see Chunker); `header()` gives the framing fields under their wire names."""

    index: int
    chunks: int
    offset: int
    nbytes: int
    total: int
    digest: str
    payload: memoryview

    def header(self) -> dict:
        return {"chunk": self.index, "chunks": self.chunks, "offset": self.offset, "nbytes": self.nbytes,
                "total": self.total, "digest": self.digest}


class Chunker:
    """Cut a stream of byte pieces (packed tensors, delivered lazily) into chunks as they fill.

    `total` (the fragment's packed size, known from the session layout) is declared up front so
    every chunk can carry `chunks`; the pieces must add up to exactly `total` bytes (WireError naming
    `total` otherwise: at `feed` for too many bytes, at `close` for too few).

    Memory: at most one chunk of copied bytes. A chunk that lies inside one piece is yielded as a
    zero-copy memoryview slice of that piece, so the caller must not modify a piece until the chunks
    cut from it have been sent; only a chunk straddling pieces is copied into a fresh bytearray.
    """

    def __init__(self, total: int, chunk_bytes: int):
        self.chunks = chunk_count(total, chunk_bytes)
        self.total = total
        self.chunk_bytes = chunk_bytes
        self.received = 0  # bytes fed so far
        self._next = 0  # index of the chunk being filled
        self._buf: bytearray | None = None  # partial chunk straddling pieces
        self._fill = 0
        self._busy = False

    def _size(self, index: int) -> int:
        return min(self.chunk_bytes, self.total - index * self.chunk_bytes)

    def _emit(self, payload: memoryview) -> Chunk:
        i = self._next
        self._next += 1
        return Chunk(i, self.chunks, i * self.chunk_bytes, len(payload), self.total, digest(payload), payload)

    def feed(self, piece: Any) -> Iterator[Chunk]:
        """Take the next piece; returns an iterator of the chunks it completes. Exhaust the iterator
        before the next `feed` or `close` (a piece abandoned half-cut is refused loudly)."""
        if self._busy:
            raise RuntimeError("Chunker.feed: the previous piece's chunks were not all consumed")
        mv = as_bytes_view(piece)
        if self.received + len(mv) > self.total:
            raise WireError(f"pieces deliver more than the declared total ({self.received} + {len(mv)} bytes)",
                            field="total", value=self.total)
        self.received += len(mv)
        self._busy = True
        return self._cut(mv)

    def _cut(self, mv: memoryview) -> Iterator[Chunk]:
        pos, n = 0, len(mv)
        if self._buf is not None:
            take = min(len(self._buf) - self._fill, n)
            self._buf[self._fill : self._fill + take] = mv[:take]
            self._fill += take
            pos = take
            if self._fill == len(self._buf):
                full, self._buf, self._fill = self._buf, None, 0
                yield self._emit(memoryview(full))
        while self._next < self.chunks and n - pos >= self._size(self._next):
            size = self._size(self._next)
            yield self._emit(mv[pos : pos + size])
            pos += size
        if pos < n:
            self._buf = bytearray(self._size(self._next))
            self._buf[: n - pos] = mv[pos:]
            self._fill = n - pos
        self._busy = False

    def stream(self, pieces: Iterable[Any]) -> Iterator[Chunk]:
        """Feed every piece and close: yields each chunk as soon as it is full."""
        for piece in pieces:
            yield from self.feed(piece)
        self.close()

    def close(self) -> None:
        """Check that exactly `total` bytes were fed (every chunk has then been yielded)."""
        if self._busy:
            raise RuntimeError("Chunker.close: the last piece's chunks were not all consumed")
        if self.received != self.total:
            raise WireError(f"pieces delivered {self.received} bytes, fewer than the declared total",
                            field="total", value=self.total)


def iter_chunks(buf: Any, chunk_bytes: int) -> Iterator[Chunk]:
    """Chunks of an in-memory buffer, each payload a zero-copy memoryview slice of it."""
    mv = as_bytes_view(buf)
    n = chunk_count(len(mv), chunk_bytes)
    for i, off, size in plan_chunks(len(mv), chunk_bytes):
        part = mv[off : off + size]
        yield Chunk(i, n, off, size, len(mv), digest(part), part)


# ---- reassembly -----------------------------------------------------------------------------------

def _meta_int(meta: Mapping, key: str) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ChunkMetaInvalid("chunk header field must be a non-negative integer", field=key, value=value)
    return value


class Assembler:
    """Reassemble one fragment (one version, one push try) from chunks arriving in any order.

    `total` / `chunks` fix the expected size; pass None to take them from the first chunk. Pass
    `chunk_bytes` when known (the session's effective chunk size): otherwise it is inferred from the
    first chunk, which then has to be trusted for placement.

    Without `sink`, payloads are copied into a preallocated uint8 tensor returned by `finish()`.
    With `sink(offset, payload)`, each chunk is forwarded once it has passed every check (so the
    caller can apply chunk by chunk); the Assembler then keeps only a bitmap. If the sink raises,
    the chunk is not counted as received and may be added again.

    Every rejection raises a ChunkError subclass and leaves the state as it was.
    """

    def __init__(self, total: int | None = None, chunks: int | None = None, *, chunk_bytes: int | None = None,
                 sink: Callable[[int, memoryview], Any] | None = None, verify_digest: bool = True):
        if (total is None) != (chunks is None):
            raise WireError("give both total and chunks, or neither", field="chunks", value=(total, chunks))
        if chunk_bytes is not None:
            _positive_int(chunk_bytes, "chunk_bytes")
        self.total: int | None = None
        self.chunks: int | None = None
        self.chunk_bytes = chunk_bytes
        self.sink = sink
        self.verify_digest = verify_digest
        self.buffer: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._have = bytearray()
        self._digests: dict[int, tuple[int, int, str]] = {}
        self.bytes_received = 0
        if total is not None:
            self._fix(_positive_int(total, "total"), _positive_int(chunks, "chunks"))

    def _fix(self, total: int, chunks: int) -> None:
        if chunks > total:
            raise WireError("more chunks than bytes", field="chunks", value=chunks)
        if self.chunk_bytes is not None and chunk_count(total, self.chunk_bytes) != chunks:
            implied = chunk_count(total, self.chunk_bytes)
            raise WireError(f"{total} bytes in chunks of {self.chunk_bytes} make {implied} chunks",
                            field="chunks", value=chunks)
        self.total, self.chunks = total, chunks
        self._have = bytearray(chunks)
        if self.sink is None:
            self.buffer = torch.empty(total, dtype=torch.uint8)  # no zero fill: every byte gets written
            self._view = memoryview(self.buffer.numpy())

    @property
    def received(self) -> int:
        return len(self._digests)

    @property
    def complete(self) -> bool:
        return self.chunks is not None and self.received == self.chunks

    def missing(self) -> list[int]:
        if self.chunks is None:
            return []
        return [i for i, have in enumerate(self._have) if not have]

    def _placement(self, index: int, offset: int, nbytes: int, total: int, chunks: int) -> int:
        """The chunk size the framing rule implies; raise ChunkMisplaced if this chunk breaks it."""
        cb = self.chunk_bytes
        if cb is None:  # first accepted chunk: infer
            if index < chunks - 1:
                cb = nbytes
            elif chunks == 1:
                cb = total
            elif offset % index == 0:
                cb = offset // index
            else:
                raise ChunkMisplaced("last chunk's offset is not a multiple of its index", field="offset", value=offset)
        if cb < 1 or chunk_count(total, cb) != chunks:
            raise ChunkMisplaced(f"a chunk size of {cb} cannot cut {total} bytes into {chunks} chunks",
                                 field="chunks", value=chunks)
        want_off, want_n = index * cb, min(cb, total - index * cb)
        if offset != want_off:
            raise ChunkMisplaced(f"chunk {index} must start at byte {want_off}", field="offset", value=offset)
        if nbytes != want_n:
            raise ChunkMisplaced(f"chunk {index} must hold {want_n} bytes", field="nbytes", value=nbytes)
        return cb

    def add(self, meta: Mapping | Chunk, payload: Any = None) -> None:
        """Check and take one chunk. `meta` is the header dict (chunk, chunks, offset, nbytes, total,
        digest; `payload` may be in it) or a Chunk."""
        if isinstance(meta, Chunk):
            payload = meta.payload if payload is None else payload
            meta = meta.header()
        if payload is None:
            payload = meta.get("payload")
        if payload is None:
            raise ChunkMetaInvalid("chunk has no payload", field="payload", value=None)
        index = _meta_int(meta, "chunk")
        chunks = _meta_int(meta, "chunks")
        offset = _meta_int(meta, "offset")
        nbytes = _meta_int(meta, "nbytes")
        total = _meta_int(meta, "total")
        dig = meta.get("digest")
        if self.verify_digest and not isinstance(dig, str):
            raise ChunkMetaInvalid("chunk digest must be a string", field="digest", value=dig)
        mv = as_bytes_view(payload)

        if self.total is not None and total != self.total:
            raise TotalChanged(f"assembly expects {self.total} bytes", field="total", value=total)
        if self.chunks is not None and chunks != self.chunks:
            raise TotalChanged(f"assembly expects {self.chunks} chunks", field="chunks", value=chunks)
        if total < 1 or chunks < 1 or chunks > total:
            raise ChunkMetaInvalid("need 1 <= chunks <= total", field="chunks", value=(chunks, total))
        if index >= chunks:
            raise ChunkIndexOutOfRange(f"chunk index must be below chunks = {chunks}", field="chunk", value=index)
        if len(mv) != nbytes:
            raise ChunkOverflow(f"payload holds {len(mv)} bytes", field="nbytes", value=nbytes)
        if nbytes == 0:
            raise ChunkOverflow("chunk must carry at least one byte", field="nbytes", value=nbytes)
        if offset + nbytes > total:
            raise ChunkOverflow(f"chunk reaches byte {offset + nbytes} of {total}", field="offset", value=offset)
        if self.chunks is not None and self._have[index]:
            first = self._digests[index]
            raise ChunkDuplicate("chunk index already received", field="chunk", value=index,
                                 identical=first == (offset, nbytes, dig))
        if self.received:
            # Every accepted chunk sits where the framing rule puts it, so the chunks this byte range
            # touches are lo..hi; a received one among them (other than `index`) is an overlap.
            cb = self.chunk_bytes
            lo, hi = offset // cb, min((offset + nbytes - 1) // cb, chunks - 1)
            j = self._have.find(1, lo, min(index, hi + 1)) if lo < index else -1
            if j < 0:
                j = self._have.find(1, max(lo, index + 1), hi + 1)
            if j >= 0:
                raise ChunkOverlap(f"bytes [{offset}, {offset + nbytes}) overlap chunk {j}", field="offset",
                                   value=offset)
        cb = self._placement(index, offset, nbytes, total, chunks)
        if self.verify_digest:
            check_digest(dig, digest(mv), field="digest")

        if self.chunks is None:
            self._fix(total, chunks)
        if self.sink is not None:
            self.sink(offset, mv)
        else:
            self._view[offset : offset + nbytes] = mv
        self.chunk_bytes = cb
        self._have[index] = 1
        self._digests[index] = (offset, nbytes, dig)
        self.bytes_received += nbytes

    def finish(self) -> torch.Tensor | None:
        """The assembled bytes (a uint8 tensor of `total` bytes; None with a sink) once complete.

        Raises ChunkMissing naming the missing indexes otherwise."""
        if not self.complete:
            missing = self.missing()
            shown = missing[:32]
            more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
            raise ChunkMissing(f"{len(missing) if self.chunks else 'all'} chunks missing: {shown}{more}",
                               field="chunk", value=missing if self.chunks else "all")
        return self.buffer

    def result(self) -> torch.Tensor:
        """Like finish(), for an Assembler that keeps the bytes (no sink)."""
        if self.sink is not None:
            raise RuntimeError("Assembler.result: chunks went to the sink; call finish()")
        return self.finish()


# ---- tensor layout --------------------------------------------------------------------------------

class TensorSlot(NamedTuple):
    """Where one tensor lives in a fragment's flat value sequence (offsets in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


def flatten_layout(tensors: Iterable[tuple[str, Any]]) -> tuple[list[TensorSlot], int]:
    """Slots for (name, tensor-or-shape) pairs concatenated in the given order, and the total element count."""
    slots: list[TensorSlot] = []
    offset = 0
    seen: set[str] = set()
    for name, t in tensors:
        if name in seen:
            raise WireError("duplicate tensor name", field="name", value=name)
        seen.add(name)
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(int(s) for s in t)
        n = math.prod(shape)
        slots.append(TensorSlot(name, shape, offset, n))
        offset += n
    return slots, offset


def _slot(entry: Any, i: int) -> TensorSlot:
    if isinstance(entry, Mapping):
        try:
            entry = (entry["name"], entry["shape"], entry["offset"], entry["numel"])
        except KeyError as exc:
            raise WireError("layout entry lacks a key", field=f"layout.{i}", value=str(exc)) from None
    name, shape, offset, numel = entry
    shape = tuple(shape)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
        raise WireError("shape must be non-negative integers", field=f"layout.{i}.shape", value=shape)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise WireError("offset must be a non-negative integer", field=f"layout.{i}.offset", value=offset)
    if math.prod(shape) != numel:
        raise WireError(f"numel must equal the product of the shape {shape}", field=f"layout.{i}.numel", value=numel)
    return TensorSlot(name, shape, offset, numel)


def split_into_tensors(flat: torch.Tensor, layout: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Views into a reassembled, decoded fragment: name -> flat[offset : offset + numel].view(shape).

    `layout` entries are TensorSlots, (name, shape, offset, numel) tuples or the session record's
    dicts. No copy: the views share `flat`'s memory.
    """
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise WireError("expected a 1-D tensor", field="flat", value=getattr(flat, "shape", type(flat).__name__))
    out: dict[str, torch.Tensor] = {}
    for i, entry in enumerate(layout):
        slot = _slot(entry, i)
        if slot.offset + slot.numel > flat.numel():
            raise WireError(f"tensor ends past the {flat.numel()} values of the fragment",
                            field=f"layout.{i}.offset", value=slot.offset)
        out[slot.name] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return out


def push_digest(chunk_digests: Iterable[str]) -> str:
    """sha256 over a push's chunk digests (16-hex xxh3 strings) in chunk order.

    It binds the set and the order of a push's chunks to one try without re-reading their payloads,
    which stay in JetStream until the merge (each payload is covered by its own chunk digest).
    """
    h = hashlib.sha256()
    for d in chunk_digests:
        h.update(d.encode("ascii"))
    return h.hexdigest()
