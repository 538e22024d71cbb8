"""Fuzzing the chunk framing (schemas/chunks.py) with hypothesis.

A chunk's header reaches `check_chunk` with any field changed to any value (other numbers, types,
bools, None) and its payload truncated, extended or flipped. Whatever arrives, `check_chunk` either
returns the chunk's span — only for the original header and bytes — or raises a WireError naming one
of the framing fields, never anything else; and any payload either decodes to its values or is
refused as a WireError.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from yeto.schemas.chunks import check_chunk, chunk_header, chunk_plan
from yeto.schemas.dtypes import pack
from yeto.schemas.errors import WireError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
FIELDS = ("chunk", "chunks", "offset", "nbytes", "total", "digest")
ODD = st.one_of(st.integers(-5, 1 << 40), st.booleans(), st.none(), st.floats(allow_nan=True),
                st.text(max_size=20), st.lists(st.integers(), max_size=3))


@FUZZ
@given(n=st.integers(1, 3000), dtype=st.sampled_from(("f32", "bf16", "q4")), cb=st.integers(132, 2048),
       data=st.data())
def test_a_chunk_passes_only_with_its_own_header_and_bytes(n, dtype, cb, data):
    spans = chunk_plan(n, dtype, cb)
    values = torch.randn(n)
    k = data.draw(st.integers(0, len(spans) - 1))
    s = spans[k]
    payload = pack(values[s.elem_offset:s.elem_offset + s.elem_count], dtype).numpy().tobytes()
    meta = chunk_header(spans, k, payload)
    assert check_chunk(spans, meta, payload) == s
    bad_meta = dict(meta)
    for field in data.draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        bad_meta[field] = data.draw(ODD)
    bad = payload
    op = data.draw(st.sampled_from(("same", "trunc", "extend", "flip")))
    if op == "trunc":
        bad = payload[:data.draw(st.integers(0, len(payload) - 1))]
    elif op == "extend":
        bad = payload + data.draw(st.binary(min_size=1, max_size=8))
    elif op == "flip":
        i = data.draw(st.integers(0, len(payload) - 1))
        bad = payload[:i] + bytes([payload[i] ^ 1]) + payload[i + 1:]
    same_meta = all(bad_meta[f] == meta[f] and type(bad_meta[f]) is type(meta[f]) for f in FIELDS)
    try:
        got = check_chunk(spans, bad_meta, bad)
    except WireError as exc:
        assert exc.field in FIELDS
        assert not (same_meta and bad == payload)
        return
    if same_meta and bad == payload:
        assert got == s
        return
    # A header changed into another chunk's own header (its index and offset, these bytes' size and
    # digest: equal-sized chunks) is that chunk's: only the bytes and the header together can say.
    own = chunk_header(spans, got.index, bad)
    assert all(bad_meta[f] == own[f] and type(bad_meta[f]) is type(own[f]) for f in FIELDS), (bad_meta, own)
    assert got != s and bad == payload


@FUZZ
@given(st.binary(max_size=600), st.sampled_from(("f32", "bf16", "q4")), st.integers(-3, 300))
def test_unpacking_any_payload_returns_the_values_or_raises_a_wire_error(buf, dtype, numel):
    """A chunk payload that passed its digest still decodes only if its size fits: anything else is refused as
    bad input (WireError naming the field), never a numpy/torch error."""
    from yeto.schemas.dtypes import packed_nbytes, unpack
    from yeto.schemas.errors import WireError

    try:
        out = unpack(buf, dtype, numel)
    except WireError:
        return
    assert numel >= 0 and len(buf) == packed_nbytes(dtype, numel) and out.numel() == numel
