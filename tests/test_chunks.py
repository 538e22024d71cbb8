"""Chunk framing: sizes under the server limit, streaming Chunker, Assembler checks, digests, layouts."""
from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import orjson
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.chunks import (
    HEADER_HEADROOM,
    Assembler,
    Chunk,
    ChunkDuplicate,
    ChunkIndexOutOfRange,
    ChunkMetaInvalid,
    ChunkMisplaced,
    ChunkMissing,
    ChunkOverflow,
    ChunkOverlap,
    Chunker,
    DigestMismatch,
    TotalChanged,
    VersionDigest,
    check_digest,
    chunk_count,
    digest,
    effective_chunk_bytes,
    flatten_layout,
    iter_chunks,
    max_chunk_bytes,
    plan_chunks,
    push_digest,
    split_into_tensors,
    version_digest,
)
from schemas.dtypes import element_range, pack, pack_stream, packed_nbytes, unpack, wire_align
from schemas.errors import ChunkError, WireError

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


def test_effective_chunk_bytes():
    assert effective_chunk_bytes(8 * MiB, MiB) == MiB - HEADER_HEADROOM
    assert effective_chunk_bytes(64 * 1024, MiB) == 64 * 1024
    q4 = wire_align("q4")[1]
    got = effective_chunk_bytes(MiB, MiB, align=q4)
    assert got % q4 == 0 and MiB - HEADER_HEADROOM - q4 < got <= MiB - HEADER_HEADROOM


@pytest.mark.parametrize("configured", [0, -5, 1.5, True, None])
def test_effective_chunk_bytes_names_chunk_bytes(configured):
    with pytest.raises(WireError) as ei:
        effective_chunk_bytes(configured, MiB)
    assert ei.value.field == "chunk_bytes" and ei.value.value == configured


def test_effective_chunk_bytes_too_small_bounds():
    with pytest.raises(WireError) as ei:
        effective_chunk_bytes(100, MiB, align=132)
    assert ei.value.field == "chunk_bytes"
    with pytest.raises(WireError) as ei:
        effective_chunk_bytes(MiB, HEADER_HEADROOM + 100, align=132)
    assert ei.value.field == "max_payload"


def test_payload_near_the_server_limit_is_split():
    max_payload = MiB
    cb = effective_chunk_bytes(8 * MiB, max_payload, align=4)
    data = np.random.default_rng(0).integers(0, 256, size=3 * MiB + 12, dtype=np.uint8)
    chunks = list(iter_chunks(data, cb))
    assert len(chunks) == 4
    msg_id = "push.island-0.0123456789abcdef.3.1000.2.7." + str(len(chunks) - 1)
    for c in chunks:
        header = orjson.dumps({**c.header(), "fragment": 3, "dtype": "f32", "push_digest": "f" * 64})
        # what the server counts: payload + header block; must stay under max_payload
        assert c.nbytes + len(header) + len(msg_id) + 64 < max_payload
    assert b"".join(bytes(c.payload) for c in chunks) == data.tobytes()


# ---- plans ---------------------------------------------------------------------------------------

@FAST
@given(total=st.integers(1, 5000), cb=st.integers(1, 6000))
def test_plan_tiles_the_buffer(total, cb):
    plan = plan_chunks(total, cb)
    assert len(plan) == chunk_count(total, cb) == math.ceil(total / cb)
    pos = 0
    for i, (index, off, n) in enumerate(plan):
        assert index == i and off == pos and 1 <= n <= cb
        assert n == cb or i == len(plan) - 1
        pos += n
    assert pos == total


@pytest.mark.parametrize("total,cb,field", [(0, 4, "total"), (-1, 4, "total"), (10, 0, "chunk_bytes")])
def test_plan_refuses_empty_fragments_and_bad_sizes(total, cb, field):
    with pytest.raises(WireError) as ei:
        plan_chunks(total, cb)
    assert ei.value.field == field


# ---- round trip property -------------------------------------------------------------------------

@st.composite
def fragments(draw):
    shapes = draw(st.lists(st.lists(st.integers(0, 6), max_size=3), min_size=1, max_size=6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    tensors = [(f"layers.{i}.w", torch.randn(tuple(s), generator=g) * 10) for i, s in enumerate(shapes)]
    slots, numel = flatten_layout(tensors)
    if numel == 0:  # zero-length fragments are refused by design; make one tensor non-empty
        tensors.append(("extra", torch.randn(3, generator=g)))
        slots, numel = flatten_layout(tensors)
    return tensors, slots, numel


def expected_values(t: torch.Tensor, wd: str) -> torch.Tensor:
    return t if wd == "f32" else t.to(torch.bfloat16).to(torch.float32)


@FAST
@given(frag=fragments(), wd=st.sampled_from(["f32", "bf16"]), data=st.data())
def test_any_tensors_round_trip_through_chunker_and_shuffled_assembler(frag, wd, data):
    tensors, slots, numel = frag
    total = packed_nbytes(wd, numel)
    cb = data.draw(st.integers(1, total + 8), label="chunk_bytes")
    pieces = pack_stream((t.reshape(-1) for _, t in tensors), wd)
    chunks = list(Chunker(total, cb).stream(pieces))
    assert [c.index for c in chunks] == list(range(chunk_count(total, cb)))
    for c in chunks:
        assert c.nbytes == len(c.payload) <= cb and c.total == total and c.chunks == len(chunks)
        assert c.digest == xxhash.xxh3_64_hexdigest(bytes(c.payload))
    order = list(chunks)
    random.Random(data.draw(st.integers(0, 2**32), label="shuffle seed")).shuffle(order)
    asm = Assembler(total, len(chunks))
    for c in order:
        asm.add(c.header(), c.payload)
    flat = unpack(asm.result(), wd, numel)
    views = split_into_tensors(flat, slots)
    assert list(views) == [name for name, _ in tensors]
    for name, t in tensors:
        assert views[name].shape == t.shape
        assert torch.equal(views[name].view(torch.int32), expected_values(t, wd).view(torch.int32))


@FAST
@given(frag=fragments(), wd=st.sampled_from(["f32", "bf16", "q4"]), data=st.data())
def test_aligned_chunks_apply_one_by_one_through_a_sink(frag, wd, data):
    """With a unit-aligned chunk size every chunk decodes alone: the sink writes values, never a buffer."""
    tensors, slots, numel = frag
    total = packed_nbytes(wd, numel)
    unit = wire_align(wd)[1]
    cb = unit * data.draw(st.integers(1, max(1, total // unit) + 1), label="units")
    flat_in = torch.cat([t.reshape(-1) for _, t in tensors])
    chunks = list(Chunker(total, cb).stream(pack_stream((t.reshape(-1) for _, t in tensors), wd)))
    out = torch.full((numel,), float("nan"))

    def apply(offset, payload):
        first, count = element_range(wd, offset, len(payload), numel)
        out[first : first + count] = unpack(payload, wd, count)

    asm = Assembler(total, len(chunks), chunk_bytes=cb, sink=apply)
    random.Random(data.draw(st.integers(0, 2**32), label="shuffle seed")).shuffle(chunks)
    for c in chunks:
        asm.add(c)
    assert asm.complete and asm.buffer is None and asm.finish() is None
    assert torch.equal(out, unpack(pack(flat_in, wd), wd, numel))


def test_chunker_yields_each_chunk_as_soon_as_it_is_full():
    sizes = [5, 0, 3, 17, 1, 1, 9]
    total, cb = sum(sizes), 4
    data = bytes(range(total))
    ck = Chunker(total, cb)
    yielded, fed, pos = [], 0, 0
    for n in sizes:
        piece = data[pos : pos + n]
        pos += n
        fed += n
        yielded += list(ck.feed(piece))
        full = fed // cb if fed < total else chunk_count(total, cb)
        assert len(yielded) == full  # nothing held back once full, nothing emitted early
    ck.close()
    assert b"".join(bytes(c.payload) for c in yielded) == data
    # chunk 0 lies inside the first piece: a slice of it, not a copy; chunk 1 straddles pieces
    assert yielded[0].payload.obj is not None and bytes(yielded[0].payload.obj) == data[:5]


def test_chunker_checks_the_declared_total():
    ck = Chunker(10, 4)
    list(ck.feed(bytes(6)))
    with pytest.raises(WireError) as ei:
        ck.feed(bytes(5))
    assert ei.value.field == "total" and ei.value.value == 10
    list(ck.feed(bytes(3)))
    with pytest.raises(WireError) as ei:
        ck.close()
    assert ei.value.field == "total"


def test_chunker_refuses_a_piece_whose_chunks_were_not_consumed():
    ck = Chunker(10, 4)
    ck.feed(bytes(8))  # iterator dropped
    with pytest.raises(RuntimeError):
        ck.feed(bytes(2))


def test_iter_chunks_is_zero_copy():
    buf = bytearray(range(100))
    chunks = list(iter_chunks(buf, 30))
    assert [c.nbytes for c in chunks] == [30, 30, 30, 10]
    assert all(c.payload.obj is buf for c in chunks)
    buf[31] = 0  # slices see later writes: they share the caller's memory
    assert chunks[1].payload[1] == 0


# ---- assembler checks ----------------------------------------------------------------------------

DATA = bytes(range(10))  # total 10, chunk size 4 -> chunks [0,4) [4,8) [8,10)


def meta(index, offset=None, nbytes=None, payload=None, total=10, chunks=3, dig=None):
    offset = index * 4 if offset is None else offset
    payload = DATA[offset : offset + (nbytes if nbytes is not None else 4)] if payload is None else payload
    nbytes = len(payload) if nbytes is None else nbytes
    return {"chunk": index, "chunks": chunks, "offset": offset, "nbytes": nbytes, "total": total,
            "digest": digest(payload) if dig is None else dig, "payload": payload}


def good(index):
    return meta(index, nbytes=min(4, 10 - index * 4))


def complete_with(asm):
    for i in range(3):
        if i not in asm._digests:
            asm.add(good(i))
    return bytes(asm.result().numpy())


def test_error_codes_are_distinct_chunk_errors():
    classes = [ChunkOverlap, ChunkOverflow, TotalChanged, ChunkMissing, ChunkDuplicate, DigestMismatch,
               ChunkIndexOutOfRange, ChunkMisplaced, ChunkMetaInvalid]
    codes = [c.code for c in classes]
    assert len(set(codes)) == len(codes) and "chunk" not in codes
    assert all(issubclass(c, ChunkError) and issubclass(c, WireError) for c in classes)


@pytest.mark.parametrize("fixed", [True, False])
def test_total_changed(fixed):
    asm = Assembler(10, 3) if fixed else Assembler()
    asm.add(good(0))
    with pytest.raises(TotalChanged) as ei:
        asm.add(meta(1, total=11))
    assert ei.value.field == "total" and ei.value.value == 11 and ei.value.code == "total_changed"
    with pytest.raises(TotalChanged) as ei:
        asm.add(meta(1, chunks=4))
    assert ei.value.field == "chunks" and ei.value.value == 4
    assert complete_with(asm) == DATA


def test_index_out_of_range():
    asm = Assembler(10, 3)
    with pytest.raises(ChunkIndexOutOfRange) as ei:
        asm.add(meta(3, offset=8, nbytes=2))
    assert ei.value.field == "chunk" and ei.value.value == 3
    assert complete_with(asm) == DATA


def test_overflow_cases():
    asm = Assembler(10, 3)
    with pytest.raises(ChunkOverflow) as ei:
        asm.add({**good(1), "nbytes": 5})  # header says 5, payload holds 4
    assert ei.value.field == "nbytes" and ei.value.value == 5
    with pytest.raises(ChunkOverflow) as ei:
        asm.add(meta(2, offset=8, payload=b"\x08\x09\x0a\x0b"))  # reaches byte 12 of 10
    assert ei.value.field == "offset" and ei.value.value == 8
    with pytest.raises(ChunkOverflow):
        asm.add(meta(1, payload=b""))
    assert asm.received == 0 and complete_with(asm) == DATA


def test_duplicate_is_rejected_without_corrupting_state():
    asm = Assembler(10, 3)
    asm.add(good(1))
    with pytest.raises(ChunkDuplicate) as ei:
        asm.add(good(1))
    assert ei.value.identical and ei.value.value == 1 and ei.value.code == "chunk_duplicate"
    evil = meta(1, payload=b"XXXX")  # valid digest for different bytes
    with pytest.raises(ChunkDuplicate) as ei:
        asm.add(evil)
    assert not ei.value.identical
    assert asm.received == 1 and asm.bytes_received == 4
    assert complete_with(asm) == DATA


def test_overlap_with_a_received_chunk():
    asm = Assembler(10, 3)
    asm.add(good(0))
    with pytest.raises(ChunkOverlap) as ei:
        asm.add(meta(1, offset=2, payload=DATA[2:6]))
    assert ei.value.field == "offset" and ei.value.value == 2 and "chunk 0" in str(ei.value)
    asm.add(good(2))
    with pytest.raises(ChunkOverlap) as ei:
        asm.add(meta(1, offset=6, payload=DATA[6:10]))
    assert "chunk 2" in str(ei.value)
    assert complete_with(asm) == DATA


def test_misplaced_chunks():
    asm = Assembler(10, 3, chunk_bytes=4)
    with pytest.raises(ChunkMisplaced) as ei:
        asm.add(meta(1, offset=5, payload=DATA[5:9]))
    assert ei.value.field == "offset" and ei.value.value == 5
    with pytest.raises(ChunkMisplaced) as ei:
        asm.add(meta(2, offset=8, payload=DATA[8:9]))  # last chunk must hold 2 bytes
    assert ei.value.field == "nbytes"
    # inferred chunk size: a first chunk claiming 3 bytes cannot cut 10 bytes into 3 chunks
    with pytest.raises(ChunkMisplaced) as ei:
        Assembler(10, 3).add(meta(0, payload=DATA[:3]))
    assert ei.value.field == "chunks"
    # a first chunk that is the last one infers the size from its offset
    asm2 = Assembler()
    asm2.add(good(2))
    assert asm2.chunk_bytes == 4 and complete_with(asm2) == DATA
    assert complete_with(asm) == DATA


def test_digest_mismatch_leaves_state_untouched():
    asm = Assembler(10, 3)
    with pytest.raises(DigestMismatch) as ei:
        asm.add({**good(0), "payload": b"\x00\x01\x02\xff"})
    assert ei.value.field == "digest" and ei.value.value == digest(DATA[:4])
    assert asm.received == 0 and asm.missing() == [0, 1, 2]
    assert complete_with(asm) == DATA


def test_missing_names_the_indexes():
    asm = Assembler(10, 3)
    asm.add(good(1))
    assert not asm.complete and asm.missing() == [0, 2]
    with pytest.raises(ChunkMissing) as ei:
        asm.result()
    assert ei.value.value == [0, 2] and "[0, 2]" in str(ei.value) and ei.value.code == "chunk_missing"
    with pytest.raises(ChunkMissing):
        Assembler().finish()


@pytest.mark.parametrize(
    "patch,field",
    [({"chunk": None}, "chunk"), ({"offset": -1}, "offset"), ({"nbytes": True}, "nbytes"),
     ({"total": "10"}, "total"), ({"digest": 7}, "digest"), ({"payload": None}, "payload")],
)
def test_malformed_headers(patch, field):
    asm = Assembler(10, 3)
    with pytest.raises(ChunkMetaInvalid) as ei:
        asm.add({**good(0), **patch})
    assert ei.value.field == field
    assert complete_with(asm) == DATA


def test_sink_failure_does_not_mark_the_chunk():
    got = {}
    fail = [True]

    def sink(offset, payload):
        if fail[0]:
            fail[0] = False
            raise OSError("disk full")
        got[offset] = bytes(payload)

    asm = Assembler(10, 3, sink=sink)
    with pytest.raises(OSError):
        asm.add(good(0))
    assert asm.missing() == [0, 1, 2]
    for i in (2, 0, 1):
        asm.add(good(i))
    assert asm.finish() is None and b"".join(got[o] for o in sorted(got)) == DATA
    with pytest.raises(RuntimeError):
        asm.result()


def test_constructor_checks():
    with pytest.raises(WireError) as ei:
        Assembler(10, 4, chunk_bytes=4)
    assert ei.value.field == "chunks"
    with pytest.raises(WireError):
        Assembler(10, None)
    with pytest.raises(WireError) as ei:
        Assembler(0, 1)
    assert ei.value.field == "total"


def test_shuffled_chunks_of_a_large_buffer():
    rng = random.Random(5)
    data = np.random.default_rng(5).integers(0, 256, size=100_003, dtype=np.uint8)
    chunks = list(iter_chunks(data, 4096))
    rng.shuffle(chunks)
    asm = Assembler(chunk_bytes=4096)
    for c in chunks:
        asm.add(c)
    assert torch.equal(asm.result(), torch.from_numpy(data))


# ---- layouts -------------------------------------------------------------------------------------

def test_flatten_layout_and_split_views_share_memory():
    slots, numel = flatten_layout([("a", torch.zeros(2, 3)), ("b", (4,)), ("c", torch.zeros(0, 5)), ("d", ())])
    assert numel == 11
    assert [(s.name, s.shape, s.offset, s.numel) for s in slots] == [
        ("a", (2, 3), 0, 6), ("b", (4,), 6, 4), ("c", (0, 5), 10, 0), ("d", (), 10, 1)]
    flat = torch.arange(11, dtype=torch.float32)
    views = split_into_tensors(flat, slots)
    assert views["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and views["d"].item() == 10.0
    views["b"][0] = -1
    assert flat[6] == -1
    # the session record's dict entries work the same
    dict_views = split_into_tensors(flat, [{"name": "b", "shape": [4], "offset": 6, "numel": 4}])
    assert dict_views["b"].tolist() == [-1, 7, 8, 9]
    with pytest.raises(WireError) as ei:
        flatten_layout([("a", (1,)), ("a", (2,))])
    assert ei.value.field == "name"


@pytest.mark.parametrize(
    "entry,field",
    [(("x", (2, 2), 0, 5), "layout.0.numel"), (("x", (4,), 9, 4), "layout.0.offset"),
     (("x", (-1,), 0, -1), "layout.0.shape"), ({"name": "x", "shape": [1]}, "layout.0")],
)
def test_split_refuses_bad_layouts(entry, field):
    with pytest.raises(WireError) as ei:
        split_into_tensors(torch.zeros(10), [entry])
    assert ei.value.field == field


def test_chunk_header_uses_wire_names():
    c = next(iter_chunks(b"abcdef", 4))
    assert isinstance(c, Chunk)
    assert c.header() == {"chunk": 0, "chunks": 2, "offset": 0, "nbytes": 4, "total": 6, "digest": digest(b"abcd")}
