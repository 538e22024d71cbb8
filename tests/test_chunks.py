"""Chunk framing (schemas/chunks.py): digests, the chunk size under the server limit, the chunk plan,
the chunk header and `check_chunk` — the one framing syncer, learner and bench all use."""
from __future__ import annotations

import hashlib

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto.schemas.chunks import (
    HEADER_HEADROOM,
    DigestMismatch,
    VersionDigest,
    check_chunk,
    check_digest,
    chunk_header,
    chunk_plan,
    digest,
    max_chunk_bytes,
    plan_nbytes,
    push_digest,
    version_digest,
)
from yeto.schemas.dtypes import pack, packed_nbytes, unpack, wire_align
from yeto.schemas.errors import WireError

FAST = settings(max_examples=60, deadline=None)
MiB = 1 << 20


# ---- digests -------------------------------------------------------------------------------------

def test_digest_is_xxh3_64_hex_of_the_payload():
    assert digest(b"") == "2d06800538d394c2"  # published XXH3_64bits("") with seed 0
    data = bytes(range(256)) * 5
    assert digest(data) == xxhash.xxh3_64(data).hexdigest()
    assert len(digest(data)) == 16
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert digest(t) == digest(memoryview(data)[0:]) == digest(data)
    assert digest(t.view(torch.float32)) == digest(data)  # raw bytes of a float tensor
    assert digest(data[:-1] + b"\x00") != digest(data)


def test_version_digest_streams_sha256():
    parts = [b"abc", b"", bytes(1000), torch.arange(10, dtype=torch.float32)]
    vd = VersionDigest()
    for p in parts:
        vd.update(p)
    whole = b"abc" + bytes(1000) + torch.arange(10, dtype=torch.float32).numpy().tobytes()
    assert vd.hexdigest() == hashlib.sha256(whole).hexdigest() == version_digest(whole)
    assert vd.nbytes == len(whole)
    vd.verify(hashlib.sha256(whole).hexdigest())
    with pytest.raises(DigestMismatch) as ei:
        vd.verify("0" * 64, field="push_digest")
    assert ei.value.field == "push_digest" and ei.value.code == "digest_mismatch"
    with pytest.raises(DigestMismatch):
        check_digest("x", "y", field="version_digest")


def test_push_digest_binds_chunk_digests_in_order():
    ds = [digest(b"a"), digest(b"b"), digest(b"c")]
    assert push_digest(ds) == hashlib.sha256("".join(ds).encode()).hexdigest()
    assert push_digest(reversed(ds)) != push_digest(ds)
    assert push_digest(ds[:2]) != push_digest(ds)


# ---- chunk size under the server limit -----------------------------------------------------------

def test_max_chunk_bytes_leaves_header_headroom():
    assert HEADER_HEADROOM >= 1024
    assert max_chunk_bytes(MiB) == MiB - HEADER_HEADROOM
    assert max_chunk_bytes(8 * MiB, headroom=0) == 8 * MiB
    with pytest.raises(WireError) as ei:
        max_chunk_bytes(HEADER_HEADROOM)
    assert ei.value.field == "max_payload"


# ---- the chunk plan ------------------------------------------------------------------------------

@FAST
@given(n=st.integers(1, 5000), dtype=st.sampled_from(["f32", "bf16", "q4"]), chunk=st.integers(132, 4096))
def test_chunk_plan_covers_every_element_once_in_whole_units(n, dtype, chunk):
    spans = chunk_plan(n, dtype, chunk)
    elems, ubytes = wire_align(dtype)
    off = boff = 0
    for i, s in enumerate(spans):
        assert s.index == i and s.elem_offset == off and s.byte_offset == boff
        assert 0 < s.nbytes <= chunk and s.nbytes == packed_nbytes(dtype, s.elem_count)
        if i < len(spans) - 1:
            assert s.elem_count % elems == 0 and s.nbytes == (chunk // ubytes) * ubytes
        off += s.elem_count
        boff += s.nbytes
    assert off == n and boff == packed_nbytes(dtype, n) == plan_nbytes(spans)


@pytest.mark.parametrize("n,dtype,cb,field", [(0, "f32", 4096, "numel"), (-1, "f32", 4096, "numel"),
                                              (10, "f32", 3, "chunk_bytes"), (10, "q4", 131, "chunk_bytes"),
                                              (10, "f32", True, "chunk_bytes"), (1.5, "f32", 64, "numel")])
def test_chunk_plan_refuses_empty_fragments_and_bad_sizes(n, dtype, cb, field):
    with pytest.raises(WireError) as ei:
        chunk_plan(n, dtype, cb)
    assert ei.value.field == field


def test_chunks_decode_on_their_own_and_concatenate_to_the_fragment():
    values = torch.randn(1000)
    for dtype in ("f32", "bf16", "q4"):
        whole = pack(values, dtype).numpy().tobytes()
        spans = chunk_plan(values.numel(), dtype, 600)
        parts = [pack(values[s.elem_offset:s.elem_offset + s.elem_count], dtype).numpy().tobytes() for s in spans]
        assert b"".join(parts) == whole
        for s, p in zip(spans, parts):
            assert torch.equal(unpack(p, dtype, s.elem_count), unpack(whole, dtype, values.numel())[s.elem_offset:s.elem_offset + s.elem_count])


# ---- one chunk on the wire -----------------------------------------------------------------------

def _chunks(n=1000, dtype="f32", cb=1024):
    values = torch.arange(n, dtype=torch.float32)
    spans = chunk_plan(n, dtype, cb)
    payloads = [pack(values[s.elem_offset:s.elem_offset + s.elem_count], dtype).numpy().tobytes() for s in spans]
    return spans, payloads


def test_chunk_header_uses_wire_names_and_passes_check_chunk():
    spans, payloads = _chunks()
    assert len(spans) == 4
    h = chunk_header(spans, 3, payloads[3])
    assert h == {"chunk": 3, "chunks": 4, "offset": 3072, "nbytes": 928, "total": 4000, "digest": digest(payloads[3])}
    for k, p in enumerate(payloads):
        assert check_chunk(spans, chunk_header(spans, k, p), p) == spans[k]
    # bytes, memoryview and a uint8 tensor are the same payload
    assert check_chunk(spans, h, memoryview(payloads[3])) == spans[3]
    assert check_chunk(spans, h, torch.frombuffer(bytearray(payloads[3]), dtype=torch.uint8)) == spans[3]


@pytest.mark.parametrize("change,field,code", [
    ({"chunk": 4}, "chunk", "invalid"), ({"chunk": -1}, "chunk", "invalid"), ({"chunk": True}, "chunk", "invalid"),
    ({"chunk": "1"}, "chunk", "invalid"), ({"chunks": 5}, "chunks", "invalid"), ({"chunks": None}, "chunks", "invalid"),
    ({"total": 4004}, "total", "invalid"), ({"chunks": 4.0}, "chunks", "invalid"), ({"offset": 1024.0}, "offset", "wrong_size"), ({"offset": 1020}, "offset", "wrong_size"),
    ({"nbytes": 1020}, "nbytes", "wrong_size"), ({"digest": "0" * 16}, "digest", "digest_mismatch"),
])
def test_check_chunk_names_the_field_that_disagrees(change, field, code):
    spans, payloads = _chunks()
    meta = dict(chunk_header(spans, 1, payloads[1]), **change)
    with pytest.raises(WireError) as ei:
        check_chunk(spans, meta, payloads[1])
    assert (ei.value.field, ei.value.code) == (field, code)
    if field == "digest":
        assert isinstance(ei.value, DigestMismatch)


def test_check_chunk_refuses_a_payload_of_another_length_or_none():
    spans, payloads = _chunks()
    meta = chunk_header(spans, 1, payloads[1])
    for payload in (payloads[1][:-4], payloads[1] + b"\0\0\0\0", None, b""):
        with pytest.raises(WireError) as ei:
            check_chunk(spans, meta, payload)
        assert ei.value.field == "nbytes" and ei.value.code == "wrong_size"
    # another chunk's bytes under this header: same size, wrong digest
    with pytest.raises(DigestMismatch):
        check_chunk(spans, meta, payloads[2])
