"""Fuzzing the chunk framing (schemas/chunks.py) with hypothesis.

A fragment's chunks reach an `Assembler` in any order, duplicated, dropped, truncated, extended, with headers
whose offsets, sizes, totals, counts, indexes, digests and types are changed. Whatever arrives:
- `add` either takes the chunk or raises a `ChunkError` subclass (the codes the shells tape), never anything else;
- a refused chunk changes nothing (the good copy can still be added afterwards);
- an assembly that completes holds exactly the original bytes (no forged or misplaced byte gets in).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from schemas.chunks import (Assembler, ChunkDuplicate, ChunkError, ChunkOverlap, Chunker, ChunkMisplaced, DigestMismatch,
                            digest, iter_chunks)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
FIELDS = ("chunk", "chunks", "offset", "nbytes", "total", "digest")
OPS = ("trunc", "extend", "flip", "digest", "shift", "dup", "drop", "type", "none", "bool", "float", "neg", "huge")


def _isint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@st.composite
def deliveries(draw):
    """(original bytes, chunk size, [(header, payload, mutated?)] in arrival order)."""
    buf = draw(st.binary(min_size=1, max_size=257))
    cb = draw(st.integers(1, 48))
    msgs = [[c.header(), bytes(c.payload), False] for c in iter_chunks(buf, cb)]
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(msgs) - 1))
        op = draw(st.sampled_from(OPS))
        h, p, _ = msgs[i]
        h = dict(h)
        k = draw(st.integers(-5, 70))
        if op == "trunc" and len(p) > 0:
            p = p[: draw(st.integers(0, len(p) - 1))]
        elif op == "extend":
            p = p + bytes([k & 0xFF]) * draw(st.integers(1, 8))
        elif op == "flip":
            j = draw(st.integers(0, len(p) - 1)) if p else 0
            p = p[:j] + bytes([(p[j] ^ 0x5A) if p else 1]) + p[j + 1:]
        elif op == "digest":
            h["digest"] = digest(p + b"!")
        elif op == "shift":
            f = draw(st.sampled_from(FIELDS[:-1]))
            h[f] = (h[f] + k) if _isint(h[f]) else k
        elif op == "dup":
            msgs.append([dict(h), p, False])
            continue
        elif op == "drop":
            msgs.pop(i)
            if not msgs:
                msgs.append([h, p, False])
            continue
        elif op == "type":
            h[draw(st.sampled_from(FIELDS))] = draw(st.sampled_from(["7", [1], {"a": 1}, b"x"]))
        elif op == "none":
            h[draw(st.sampled_from(FIELDS))] = None
        elif op == "bool":
            h[draw(st.sampled_from(FIELDS[:-1]))] = True
        elif op == "float":
            f = draw(st.sampled_from(FIELDS[:-1]))
            h[f] = float(h[f]) if _isint(h[f]) else 0.5
        elif op == "neg":
            h[draw(st.sampled_from(FIELDS[:-1]))] = -1
        elif op == "huge":
            h[draw(st.sampled_from(FIELDS[:-1]))] = 2**62
        msgs[i] = [h, p, True]
    order = draw(st.permutations(range(len(msgs))))
    return buf, cb, [msgs[j] for j in order]


@FUZZ
@given(deliveries(), st.sampled_from(("known", "known_cb", "unknown")), st.booleans())
def test_any_delivery_raises_only_chunk_errors_and_completes_only_with_the_original_bytes(d, mode, use_sink):
    buf, cb, msgs = d
    n = -(-len(buf) // cb)
    sunk: dict[int, bytes] = {}

    def sink(offset, mv):
        assert offset not in sunk, "a sink must see each chunk once"
        sunk[offset] = bytes(mv)

    a = Assembler(len(buf) if mode != "unknown" else None, n if mode != "unknown" else None,
                  chunk_bytes=cb if mode == "known_cb" else None, sink=sink if use_sink else None)
    for h, p, _ in msgs:
        before = (a.received, a.bytes_received, a.missing(), dict(sunk))
        try:
            a.add(h, p)
        except ChunkError:
            assert (a.received, a.bytes_received, a.missing(), dict(sunk)) == before, "a refused chunk changed state"
    if a.complete:
        got = b"".join(sunk[o] for o in sorted(sunk)) if use_sink else bytes(a.finish().numpy())
        assert got == buf
    else:
        with pytest.raises(ChunkError):
            a.finish()


@FUZZ
@given(deliveries())
def test_good_chunks_complete_in_any_order_after_any_refused_garbage(d):
    """Garbage first (whatever the fuzzer made), then every genuine chunk: with the size known from the session
    the assembly always completes with the original bytes; duplicates are reported as identical resends."""
    buf, cb, msgs = d
    a = Assembler(len(buf), -(-len(buf) // cb), chunk_bytes=cb)
    for h, p, mutated in msgs:
        if mutated:
            try:
                a.add(h, p)
            except ChunkError:
                pass
    for c in iter_chunks(buf, cb):
        try:
            a.add(c.header(), bytes(c.payload))
        except ChunkDuplicate as exc:
            assert exc.identical  # only a genuine copy can have been taken before
    assert a.complete, (a.missing(), msgs)
    assert bytes(a.finish().numpy()) == buf


@FUZZ
@given(st.binary(min_size=1, max_size=300), st.integers(1, 40), st.data())
def test_chunker_cuts_any_split_of_the_pieces_into_the_same_chunks(buf, cb, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(buf)), max_size=6)))
    pieces = [buf[a:b] for a, b in zip([0, *cuts], [*cuts, len(buf)])]
    got = [(c.header(), bytes(c.payload)) for c in Chunker(len(buf), cb).stream(pieces)]
    want = [(c.header(), bytes(c.payload)) for c in iter_chunks(buf, cb)]
    assert got == want


@FUZZ
@given(st.binary(min_size=8, max_size=200), st.integers(2, 32), st.data())
def test_a_chunk_claiming_bytes_another_chunk_holds_is_refused(buf, cb, data):
    chunks = list(iter_chunks(buf, cb))
    if len(chunks) < 2:
        return
    i = data.draw(st.integers(0, len(chunks) - 1))
    a = Assembler(len(buf), len(chunks), chunk_bytes=cb)
    a.add(chunks[i])
    j = data.draw(st.sampled_from([k for k in range(len(chunks)) if k != i]))
    # chunk j's index, but an offset inside chunk i's range, its own digest: an overlap or a misplaced chunk
    off = chunks[i].offset + data.draw(st.integers(0, chunks[i].nbytes - 1))
    size = min(chunks[j].nbytes, len(buf) - off)
    payload = buf[off: off + size]
    h = dict(chunks[j].header(), offset=off, nbytes=size, digest=digest(payload))
    with pytest.raises((ChunkOverlap, ChunkMisplaced)):
        a.add(h, payload)
    assert a.received == 1


def test_a_sink_that_fails_leaves_the_chunk_to_be_added_again():
    buf = bytes(range(100))
    calls = []

    def sink(offset, mv):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError("disk full")

    a = Assembler(len(buf), 4, chunk_bytes=25, sink=sink)
    c0 = next(iter_chunks(buf, 25))
    with pytest.raises(OSError):
        a.add(c0)
    assert a.received == 0
    a.add(c0)
    assert a.received == 1 and calls == [0, 0]
    bad = dict(c0.header(), chunk=1, offset=25, digest=digest(b"?" * 25))
    with pytest.raises(DigestMismatch):
        a.add(bad, b"!" * 25)


@FUZZ
@given(st.binary(max_size=600), st.sampled_from(("f32", "bf16", "q4")), st.integers(-3, 300))
def test_unpacking_any_payload_returns_the_values_or_raises_a_wire_error(buf, dtype, numel):
    """A chunk payload that passed its digest still decodes only if its size fits: anything else is refused as
    bad input (WireError naming the field), never a numpy/torch error."""
    from schemas.dtypes import packed_nbytes, unpack
    from schemas.errors import WireError

    try:
        out = unpack(buf, dtype, numel)
    except WireError:
        return
    assert numel >= 0 and len(buf) == packed_nbytes(dtype, numel) and out.numel() == numel
