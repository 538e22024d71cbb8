"""The sparse push message (schemas/sparse.py, schemas/sparse_chunks.py; docs/design.md §4.10) against a
reference written from the format's description with plain Python and numpy: chunks walked one by one,
top-k by sorting (magnitude down, local index up), the bytes parsed with struct and integer bit ops.
Property tests over shapes (1-D, 2-D with edge tiles, N-D, tiny, empty) and specs; ties; exact sizes;
every malformed message refused naming its field. Pure tier."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yeto.schemas import sparse
from yeto.schemas.errors import ConfigError, DecodeError, WireError
from yeto.schemas.sparse import decode_push, encode_push, push_nbytes
from yeto.schemas.sparse_spec import SparseSpec

from tests.sparse_reference import ref_chunks, ref_quantize, ref_select

DEFAULT = SparseSpec()


# ---------------------------------------------------------------- the reference

def parse(msg: bytes, n_tensors_hint=None):
    """The message read field by field with struct and Python integers (not the module's unpackers)."""
    magic, fmt, bits, tile, k, c1, k1, n = struct.unpack_from("<4sBBHHHHI", msg, 0)
    pos = 18
    tensors = []
    for _ in range(n):
        numel, kept = struct.unpack_from("<QI", msg, pos)
        pos += 12
        table = np.frombuffer(msg[pos:pos + 4 * (1 << bits)], dtype="<f4")
        pos += 4 * (1 << bits)
        nidx = 3 * (kept // 2) + 2 * (kept % 2)
        raw = msg[pos:pos + nidx]
        pos += nidx
        idx = []
        for p in range(kept // 2):
            v24 = int.from_bytes(raw[3 * p:3 * p + 3], "little")
            idx += [v24 & 0xFFF, v24 >> 12]
        if kept % 2:
            idx.append(int.from_bytes(raw[-2:], "little"))
        ncode = -(-kept * bits // 8)
        codes_int = int.from_bytes(msg[pos:pos + ncode], "little")
        pos += ncode
        codes = [(codes_int >> (bits * i)) & ((1 << bits) - 1) for i in range(kept)]
        tensors.append(dict(numel=numel, kept=kept, table=table, idx=idx, codes=codes))
    assert pos == len(msg)
    return dict(magic=magic, format=fmt, bits=bits, tile=tile, k=k, chunk_1d=c1, k_1d=k1), tensors


def check_against_reference(xs, spec):
    msg = encode_push(xs, spec)
    assert len(msg) == push_nbytes([x.shape for x in xs], spec)
    header, parsed = parse(msg)
    assert header == dict(magic=b"YSPK", format=1, bits=spec.value_bits, tile=spec.tile, k=spec.k,
                          chunk_1d=spec.chunk_1d, k_1d=spec.k_1d)
    decoded = decode_push(msg, [x.shape for x in xs], spec)
    for x, p, d in zip(xs, parsed, decoded):
        local, flat, vals = ref_select(x.numpy(), spec)
        codes, table = ref_quantize(vals, spec.value_bits)
        assert p["numel"] == x.numel() and p["kept"] == len(local)
        assert p["idx"] == local
        assert p["codes"] == codes
        np.testing.assert_allclose(p["table"], table, rtol=1e-6, atol=0)
        assert d.indices.tolist() == flat
        assert torch.equal(d.values, torch.from_numpy(p["table"][codes] if codes else np.zeros(0, np.float32)))
    return msg


# ---------------------------------------------------------------- properties

shapes = st.one_of(
    st.tuples(),
    st.tuples(st.integers(0, 300)),
    st.tuples(st.integers(1, 140), st.integers(1, 140)),
    st.tuples(st.integers(1, 9), st.integers(1, 7), st.integers(1, 5)),
)
specs = st.builds(
    lambda tile, kfrac, c1, k1frac, bits: SparseSpec(tile=tile, k=max(1, tile * tile * kfrac // 100), chunk_1d=c1,
                                                     k_1d=max(1, c1 * k1frac // 100), value_bits=bits),
    st.sampled_from([64, 16, 7, 1]), st.integers(1, 100), st.sampled_from([64, 10, 4096, 1]), st.integers(1, 100),
    st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(shapes, min_size=1, max_size=3), spec=specs, seed=st.integers(0, 2**31),
       ties=st.booleans())
def test_round_trip_matches_the_reference(shapes, spec, seed, ties):
    g = torch.Generator().manual_seed(seed)
    xs = []
    for s in shapes:
        x = torch.randn(s, generator=g)
        if ties:  # few distinct magnitudes, both signs: most chunks hold ties at their k-th value
            x = torch.randint(-3, 4, s, generator=g).float() * 0.5
        xs.append(x)
    check_against_reference(xs, spec)


def test_values_on_a_bin_edge_fall_in_the_reference_bin():
    """Few kept values of few distinct magnitudes put values exactly on a bin edge (c / width an integer):
    σ must be computed as the definition says, sqrt(Σc² / (n−1)), or they land one bin off (Hypothesis
    found shapes=[(226,)], k_1d=1 with ties: codes [2, 1, 1, 1] against the reference's [3, 1, 1, 1])."""
    for seed in range(60):
        x = torch.randint(-3, 4, (226,), generator=torch.Generator().manual_seed(seed)).float() * 0.5
        for c1 in (64, 10, 1):
            check_against_reference([x], SparseSpec(tile=64, k=64, chunk_1d=c1, k_1d=1, value_bits=2))


def test_edge_tiles_of_a_2d_weight_keep_the_same_density():
    # 130 x 70 in 64 x 64 tiles: 2 full, 2 right edge (64 x 6), 1 bottom (2 x 64), 1 corner (2 x 6)
    x = torch.randn(130, 70, generator=torch.Generator().manual_seed(1))
    msg = check_against_reference([x], DEFAULT)
    assert [k for _, k in ref_chunks((130, 70), DEFAULT)] == [64, 6, 64, 6, 2, 1]
    assert parse(msg)[1][0]["kept"] == 143


def test_one_d_tensors_default_to_dense_chunks_of_64_and_a_short_last_one():
    x = torch.randn(200, generator=torch.Generator().manual_seed(2))
    (d,) = decode_push(check_against_reference([x], DEFAULT), [x.shape], DEFAULT)
    assert d.indices.tolist() == list(range(200))  # k_1d = chunk_1d: every value, 2-bit


def test_ties_go_to_the_lower_index_whatever_the_input_order():
    spec = SparseSpec(tile=4, k=3)
    x = torch.ones(4, 4)
    (d,) = decode_push(encode_push([x], spec), [x.shape], spec)
    assert d.indices.tolist() == [0, 1, 2]
    x = torch.tensor([[1.0, -2.0, 2.0, 0.5], [-2.0, 0.0, 2.0, -1.0], [0.0] * 4, [0.0] * 4])
    (d,) = decode_push(encode_push([x], spec), [x.shape], spec)
    assert d.indices.tolist() == [1, 2, 4]  # magnitude 2 at local 1, 2, 4, 6: the first three
    # the same bytes however often, and a 0 and a -0 are one magnitude
    assert encode_push([x], spec) == encode_push([x.clone()], spec)
    y = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    (d,) = decode_push(encode_push([y], SparseSpec(chunk_1d=4, k_1d=2)), [y.shape], SparseSpec(chunk_1d=4, k_1d=2))
    assert d.indices.tolist() == [0, 1]


def test_tiles_with_and_without_ties_at_the_kth_value_side_by_side_match_the_reference():
    """select's two paths (docs/design.md §4.10): tiles whose (k+1)-th magnitude equals the k-th (a tie
    across the cut: resolved to the lower index) beside tiles without one, at the default 64 x 64 tiles,
    with edge tiles and a band split in the middle; the bytes are the reference's."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(200, 300, generator=g)
    x[:64, :64] = torch.randint(-3, 4, (64, 64), generator=g).float()   # few magnitudes: ties at the cut
    x[64:128, 128:192] = 0.5                                            # all equal: the first 64 kept
    x[130, 5] = x[130, 6] = -x[130, 7]                                  # a tie inside a random tile
    check_against_reference([x], DEFAULT)


@pytest.mark.parametrize("where", [(0, 0), (63, 63), (100, 200), (199, 299)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_anywhere_in_a_tile_is_refused(where, bad):
    x = torch.randn(200, 300, generator=torch.Generator().manual_seed(12))
    x[where] = bad
    with pytest.raises(WireError) as e:
        encode_push([x], DEFAULT, names=["w"])
    assert e.value.field == "tensors.w"


def test_constant_values_decode_exactly_and_values_keep_their_sign():
    x = torch.full((64, 64), 0.25)
    (d,) = decode_push(encode_push([x], DEFAULT), [x.shape], DEFAULT)
    assert torch.equal(d.values, torch.full((64,), 0.25))
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    (d,) = decode_push(encode_push([x], DEFAULT), [x.shape], DEFAULT)
    assert torch.equal(torch.sign(d.values), torch.sign(x.reshape(-1)[d.indices]))


def test_exact_sizes():
    # 4096 x 4096 at the defaults: 4096 tiles x 64 values; 12 + 16 bytes a tensor, 1.5 + 0.25 bytes a value
    n = 4096 * 64
    assert push_nbytes([(4096, 4096)], DEFAULT) == 18 + 12 + 16 + n * 3 // 2 + n // 4
    assert push_nbytes([(3,)], DEFAULT) == 18 + 12 + 16 + 5 + 1
    assert push_nbytes([(0,)], DEFAULT) == 18 + 12 + 16
    assert push_nbytes([(4096, 4096)], SparseSpec(value_bits=8)) == 18 + 12 + 4 * 256 + n * 3 // 2 + n


def test_bands_and_column_groups_change_no_byte(monkeypatch):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(300, 200, generator=g), torch.randn(5000, generator=g), torch.randn(3, 1000, generator=g)]
    whole = encode_push(xs, DEFAULT)
    for band in (1, 64 * 64, 3 * 64 * 64 + 5):
        monkeypatch.setattr(sparse, "BAND_NUMEL", band)
        assert encode_push(xs, DEFAULT) == whole


def test_other_float_dtypes_are_encoded_from_their_f32_values():
    x = torch.randn(70, 70, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert encode_push([x], DEFAULT) == encode_push([x.float()], DEFAULT)


# ---------------------------------------------------------------- refusals

SHAPES = [(130, 70), (7,)]


@pytest.fixture
def msg():
    g = torch.Generator().manual_seed(6)
    return encode_push([torch.randn(s, generator=g) for s in SHAPES], DEFAULT)


def _refused(buf, field_prefix, shapes=SHAPES, spec=DEFAULT):
    with pytest.raises(DecodeError) as e:
        decode_push(bytes(buf), shapes, spec)
    assert e.value.field.startswith(field_prefix), (e.value.field, str(e.value))
    assert "field" in str(e.value)
    return e.value


def test_every_truncation_is_refused(msg):
    for n in list(range(0, 40)) + list(range(40, len(msg), 7)) + [len(msg) - 1]:
        with pytest.raises(DecodeError):
            decode_push(msg[:n], SHAPES, DEFAULT)
    _refused(msg + b"\0", "length")


@pytest.mark.parametrize("offset,field,value", [
    (0, "header.magic", b"XSPK"), (4, "header.format", 2), (5, "header.value_bits", 4), (6, "header.tile", 32),
    (8, "header.k", 65), (10, "header.chunk_1d", 32), (12, "header.k_1d", 3), (14, "header.tensors", 3)])
def test_a_header_of_another_spec_is_refused(msg, offset, field, value):
    buf = bytearray(msg)
    if isinstance(value, bytes):
        buf[offset:offset + 4] = value
    else:
        width = {4: 1, 5: 1, 14: 4}.get(offset, 2)
        buf[offset:offset + width] = value.to_bytes(width, "little")
    err = _refused(buf, field)
    assert err.field == field and err.value == value


def test_wrong_counts_are_refused(msg):
    buf = bytearray(msg)
    buf[18:26] = (130 * 71).to_bytes(8, "little")
    assert _refused(buf, "tensors.0.numel").value == 130 * 71
    buf = bytearray(msg)
    buf[26:30] = (142).to_bytes(4, "little")
    assert _refused(buf, "tensors.0.kept").value == 142
    _refused(msg, "tensors.1", shapes=[(130, 70), (8,)])
    _refused(msg, "header.tensors", shapes=[(130, 70)])


def test_a_non_finite_table_entry_is_refused(msg):
    buf = bytearray(msg)
    buf[30 + 8:30 + 12] = struct.pack("<f", float("nan"))
    assert _refused(buf, "tensors.0.table.2").field == "tensors.0.table.2"


def _index_offset():
    return 18 + 12 + 16


def _set_index(buf, i, value):
    """Rewrite the i-th 12-bit index of the first tensor."""
    base = _index_offset() + 3 * (i // 2)
    v24 = int.from_bytes(buf[base:base + 3], "little")
    v24 = (v24 & ~0xFFF | value) if i % 2 == 0 else (v24 & 0xFFF | value << 12)
    buf[base:base + 3] = v24.to_bytes(3, "little")


def test_indices_out_of_their_chunk_or_out_of_order_are_refused(msg):
    buf = bytearray(msg)
    _set_index(buf, 0, 4095)  # first chunk is 64 x 64: 4095 is in range but breaks the order
    assert _refused(buf, "tensors.0.indices").field == "tensors.0.indices.1"
    buf = bytearray(msg)
    _set_index(buf, 64, 384)  # entry 64 opens the 64 x 6 right-edge tile: 384 values, local < 384
    err = _refused(buf, "tensors.0.indices.64")
    assert err.value == 384 and "384 values" in str(err)
    buf = bytearray(msg)
    parsed = parse(msg)[1][0]["idx"]
    _set_index(buf, 1, parsed[0])  # a repeat
    assert _refused(buf, "tensors.0.indices").field == "tensors.0.indices.1"


def test_set_padding_bits_are_refused():
    spec = SparseSpec(chunk_1d=4, k_1d=3)
    good = encode_push([torch.tensor([1.0, -2.0, 3.0, 0.0])], spec)
    # 3 indices: 3 + 2 bytes; the odd last one's top nibble must be zero
    buf = bytearray(good)
    buf[18 + 12 + 16 + 4] |= 0x10
    assert _refused(buf, "tensors.0.indices", shapes=[(4,)], spec=spec).field == "tensors.0.indices"
    buf = bytearray(good)
    buf[-1] |= 0xC0  # 3 codes of 2 bits use 6 of the last byte's bits
    assert _refused(buf, "tensors.0.codes", shapes=[(4,)], spec=spec).field == "tensors.0.codes"


def test_non_finite_values_are_refused_at_encode_naming_the_tensor(monkeypatch):
    with pytest.raises(WireError) as e:
        encode_push([torch.zeros(3), torch.tensor([1.0, float("inf")])], DEFAULT, names=["a", "b"])
    assert e.value.field == "tensors.b"
    monkeypatch.setattr(sparse, "BAND_NUMEL", 64 * 64)  # checked band by band: a NaN in the last band
    x = torch.zeros(200, 100)
    x[199, 99] = float("nan")
    with pytest.raises(WireError) as e:
        encode_push([x], DEFAULT)
    assert e.value.field == "tensors.0"


@pytest.mark.parametrize("kwargs,field", [
    (dict(tile=65), "sparse.tile"), (dict(tile=0), "sparse.tile"), (dict(k=4097), "sparse.k"),
    (dict(chunk_1d=4097), "sparse.chunk_1d"), (dict(k_1d=65), "sparse.k_1d"), (dict(value_bits=3), "sparse.value_bits"),
    (dict(k=True), "sparse.k")])
def test_bad_specs_are_refused_naming_the_setting(kwargs, field):
    with pytest.raises(ConfigError) as e:
        SparseSpec(**kwargs)
    assert e.value.field == field and e.value.value == next(iter(kwargs.values()))


# ---------------------------------------------------------------- the pre-filter against the encoder before it

def old_select(block, th, tw, k, field, scratch=None):
    """`sparse._select` as it was before the pre-filter (one topk of k + 1 per tile, the tie rule where
    the smallest of them is not unique), kept verbatim as the reference for the bytes."""
    b, g = block.shape[0] // th, block.shape[1] // tw
    n, rows = th * tw, b * g
    t4 = block.reshape(b, th, g, tw).permute(0, 2, 1, 3)
    a = torch.empty((b, g, th, tw), dtype=block.dtype)
    torch.abs(t4, out=a)
    a = a.view(rows, n)
    if k == n:
        if not bool(torch.isfinite(a.amax())):
            raise WireError("a sparse push carries finite values only", field=field, value="non-finite")
        local = torch.arange(n).expand(rows, n)
    else:
        top, idx = torch.topk(a, k + 1, dim=1, sorted=False)
        if not bool(torch.isfinite(top).all()):
            raise WireError("a sparse push carries finite values only", field=field, value="non-finite")
        low, at = top.min(dim=1, keepdim=True)
        idx.scatter_(1, at, n)
        local = idx.sort(dim=1).values[:, :k].contiguous()
        crowded = ((top == low).sum(dim=1) > 1).nonzero()[:, 0]
        if crowded.numel():
            local[crowded] = sparse._ties_to_lower(a[crowded], low[crowded], k)
    flat = block.reshape(-1)
    stride = block.shape[1]
    tile = torch.arange(rows).unsqueeze(1)
    ti = torch.div(tile, g, rounding_mode="floor")
    r = torch.div(local, tw, rounding_mode="floor")
    return local, flat[(ti * th + r) * stride + (tile - ti * g) * tw + (local - r * tw)]


def old_encode(xs, spec, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(sparse, "_select", old_select)
        return encode_push(xs, spec, **kw)


def _hard_cases(g):
    """Tensors that take every path of the pre-filter: random rows, ties at the k-th value, rows with
    more than n/8 candidates (zeros, constants), rows holding one huge value, edge tiles, bf16."""
    x = torch.randn(200, 300, generator=g)
    x[:64, :64] = torch.randint(-3, 4, (64, 64), generator=g).float()
    x[64:128, 128:192] = 0.5
    x[128:192, :64] = 0.0
    x[128:192, 64:128] = 0.0
    x[130, 70:75] = torch.tensor([1.0, -2.0, 2.0, 3.0, -3.0])
    x[0:64, 192:256] *= 1e-30
    x[70, 200] = 1e30
    x[100, 5] = x[100, 6] = -x[100, 7]
    return [x, torch.randn(4096, 4096 // 64, generator=g), torch.randn(5000, generator=g),
            torch.randint(-2, 3, (256, 128), generator=g).float() * 0.25, torch.zeros(64, 64),
            torch.randn(3, 70, 70, generator=g).to(torch.bfloat16)]


@pytest.mark.parametrize("spec", [DEFAULT, SparseSpec(tile=16, k=4), SparseSpec(tile=32, k=8),
                                  SparseSpec(tile=16, k=1), SparseSpec(tile=64, k=200, value_bits=4)])
def test_the_prefilter_gives_the_bytes_of_one_topk_a_tile(spec, monkeypatch):
    assert sparse._groups(spec.tile * spec.tile, spec.k)   # these specs take the pre-filter
    g = torch.Generator().manual_seed(21)
    xs = _hard_cases(g)
    assert encode_push(xs, spec) == old_encode(xs, spec, monkeypatch)
    for band in (64 * 64, 3 * 64 * 64 + 5):
        monkeypatch.setattr(sparse, "BAND_NUMEL", band)
        assert encode_push(xs, spec) == old_encode(xs, spec, monkeypatch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 150), cols=st.integers(1, 150), tile=st.sampled_from([8, 16, 32, 64]),
       kfrac=st.integers(1, 60), seed=st.integers(0, 2**31), levels=st.sampled_from([0, 2, 5, 50]))
def test_the_prefilter_matches_the_old_encoder_on_random_tensors(rows, cols, tile, kfrac, seed, levels):
    spec = SparseSpec(tile=tile, k=max(1, tile * tile * kfrac // 100))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if levels:   # few distinct magnitudes: ties at the cut and rows with many candidates
        x = torch.randint(-levels, levels + 1, (rows, cols), generator=g).float()
    with pytest.MonkeyPatch.context() as m:
        want = old_encode([x], spec, m)
    assert encode_push([x], spec) == want


@pytest.mark.parametrize("where", [(0, 0), (63, 63), (100, 200), (199, 299), (150, 70)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_prefilter_refuses_a_non_finite_value_as_the_old_encoder(where, bad, monkeypatch):
    x = torch.randn(200, 300, generator=torch.Generator().manual_seed(22))
    x[128:192, 64:128] = 0.0   # a tile decided on the whole row
    x[where] = bad
    for encode in (lambda: encode_push([x], DEFAULT, names=["w"]),
                   lambda: old_encode([x], DEFAULT, monkeypatch, names=["w"])):
        with pytest.raises(WireError) as e:
            encode()
        assert (e.value.field, e.value.value) == ("tensors.w", "non-finite")
