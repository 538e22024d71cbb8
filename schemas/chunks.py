"""Chunk framing, the one definition every side uses (docs/design.md §3.6): the chunk plan, the chunk header's
framing fields, the check of one received chunk, and the digests.

Pure logic, no I/O. A fragment of `numel` values in a wire dtype is cut by `chunk_plan` into chunks of
whole decodable units (a q4 block is never split), at most `chunk_bytes` bytes each; every member of
a session cuts the same fragment the same way, so chunk k of every push, broadcast, INIT and final
cut covers the same elements and the syncer merges chunk by chunk. A publisher puts
`chunk_header(...)` into the message's JSON header (with the message kind's own fields: run,
fragment, version, ...); a receiver passes the decoded header and the payload to `check_chunk`
against its own plan — it never trusts the sender's offsets.

Digests: a chunk digest is xxh3_64 (hex, 16 chars) of the chunk's payload bytes as sent — fast enough
to hash at memory speed; a version digest is sha256 over the whole fragment's bytes in chunk order,
streamed with `VersionDigest`; a push digest binds a push's chunk digests in order (`push_digest`).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import xxhash

from .dtypes import as_bytes_view, packed_nbytes, wire_align
from .errors import ChunkError, WireError

# NATS counts headers toward max_payload but nats-py checks only the payload (docs/design.md §15.1):
# a chunk header (Nats-Msg-Id + compact JSON metadata with two digests) is well under 1 KiB; 4 KiB
# leaves room for tracing or auth headers added later.
HEADER_HEADROOM = 4096


class DigestMismatch(ChunkError):
    """A chunk's payload, or a whole version/push, does not hash to the digest it came with."""

    code = "digest_mismatch"


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


# ---- the chunk plan -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Chunk `index` of a plan: elements [elem_offset, +elem_count) packed into bytes [byte_offset, +nbytes)."""

    index: int
    elem_offset: int
    elem_count: int
    byte_offset: int
    nbytes: int


def chunk_plan(n: int, wire_dtype: str, chunk_bytes: int) -> list[ChunkSpan]:
    """Cut a fragment of `n` elements into chunks of whole units of at most `chunk_bytes` bytes."""
    elems, ubytes = wire_align(wire_dtype)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < ubytes:
        raise WireError(f"must be at least {ubytes} bytes for {wire_dtype}", field="chunk_bytes", value=chunk_bytes)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise WireError("fragment must hold at least one element", field="numel", value=n)
    return list(_plan(n, wire_dtype, chunk_bytes))


@functools.lru_cache(maxsize=256)
def _plan(n: int, wire_dtype: str, chunk_bytes: int) -> tuple[ChunkSpan, ...]:
    # Built once per (size, dtype, chunk size): the syncer checks every push chunk against its plan,
    # and building a 256-chunk plan per chunk cost 0.65 ms, a third of a round's push intake on the
    # syncer's event loop (the spans are frozen; callers get their own list).
    elems, ubytes = wire_align(wire_dtype)
    per_chunk = (chunk_bytes // ubytes) * elems
    return tuple(ChunkSpan(i, off, min(per_chunk, n - off), (off // elems) * ubytes,
                           packed_nbytes(wire_dtype, min(per_chunk, n - off)))
                 for i, off in enumerate(range(0, n, per_chunk)))


def byte_plan(total: int, chunk_bytes: int) -> list[ChunkSpan]:
    """Cut `total` opaque bytes (a sparse push message) into chunks of at most `chunk_bytes`; a span's
    elements are its bytes (elem_offset == byte_offset), so the framing and checks above apply as they are."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise WireError("must be a positive integer", field="chunk_bytes", value=chunk_bytes)
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise WireError("a message must hold at least one byte", field="total", value=total)
    return [ChunkSpan(i, off, min(chunk_bytes, total - off), off, min(chunk_bytes, total - off))
            for i, off in enumerate(range(0, total, chunk_bytes))]


def plan_nbytes(spans: Sequence[ChunkSpan]) -> int:
    """The fragment's bytes on the wire (the header's `total`)."""
    return spans[-1].byte_offset + spans[-1].nbytes


# ---- one chunk on the wire ------------------------------------------------------------------------

def chunk_header(spans: Sequence[ChunkSpan], index: int, payload: Any) -> dict:
    """The framing fields of chunk `index`'s header (the message kind adds its own fields)."""
    s = spans[index]
    return {"chunk": s.index, "chunks": len(spans), "offset": s.byte_offset, "nbytes": s.nbytes,
            "total": plan_nbytes(spans), "digest": digest(payload)}


def _is(value: Any, want: int) -> bool:
    # A JSON 4.0 or true is not the integer 4 or 1: a header's framing fields are exact integers.
    return type(value) is int and value == want


def check_chunk(spans: Sequence[ChunkSpan], meta: Mapping, payload: Any) -> ChunkSpan:
    """Check one received chunk's framing against the receiver's own plan and its digest; returns its span.

    Raises WireError naming the first field that disagrees: `chunk` (index outside the plan), `chunks`,
    `total`, `offset` / `nbytes` (code wrong_size; `nbytes` also for a payload of another length), or
    DigestMismatch naming `digest`. The message kind's other fields (run, fragment, dtype, version) are
    the caller's to check.
    """
    n = len(spans)
    k = meta.get("chunk")
    if type(k) is not int or not 0 <= k < n:
        raise WireError(f"the fragment has chunks 0..{n - 1}", field="chunk", value=k)
    if not _is(meta.get("chunks"), n):
        raise WireError(f"the fragment has {n} chunks", field="chunks", value=meta.get("chunks"))
    total = plan_nbytes(spans)
    if not _is(meta.get("total"), total):
        raise WireError(f"the fragment is {total} bytes on the wire", field="total", value=meta.get("total"))
    s = spans[k]
    if not _is(meta.get("offset"), s.byte_offset):
        raise WireError(f"chunk {k} starts at byte {s.byte_offset}", field="offset", value=meta.get("offset"),
                        code="wrong_size")
    size = None if payload is None else len(as_bytes_view(payload))
    if not _is(meta.get("nbytes"), s.nbytes) or size != s.nbytes:
        raise WireError(f"chunk {k} is {s.nbytes} bytes", field="nbytes",
                        value={"nbytes": meta.get("nbytes"), "payload": size}, code="wrong_size")
    check_digest(meta.get("digest"), digest(payload), field="digest")
    return s


def push_digest(chunk_digests: Iterable[str]) -> str:
    """sha256 over a push's chunk digests (16-hex xxh3 strings) in chunk order.

    It binds the set and the order of a push's chunks to one try without re-reading their payloads,
    which stay in JetStream until the merge (each payload is covered by its own chunk digest).
    """
    h = hashlib.sha256()
    for d in chunk_digests:
        h.update(d.encode("ascii"))
    return h.hexdigest()
