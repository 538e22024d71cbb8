"""Wire dtype packing: f32/bf16 bitwise round trips, q4 against a slow exact reference, error feedback."""
from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto.schemas.dtypes import (
    Q4_BLOCK,
    Q4_BLOCK_BYTES,
    as_bytes_view,
    element_range,
    pack,
    pack_stream,
    packed_nbytes,
    q4_with_feedback,
    unpack,
    wire_align,
)
from yeto.schemas.errors import DecodeError, WireError

FAST = settings(max_examples=60, deadline=None)


# ---- independent reference for q4: per element, exact rational arithmetic ------------------------

def ref_q4_pack(values: list[float]) -> bytes:
    """Obviously-correct q4: per block s = max|x|; each value takes the level (0, s/64, ..., s/2, s)
    closest to |x| in exact arithmetic, the smaller level on a tie; sign bit only for a nonzero level."""
    out = bytearray()
    for start in range(0, len(values), Q4_BLOCK):
        block = list(values[start : start + Q4_BLOCK])
        block += [0.0] * (Q4_BLOCK - len(block))
        s = max(abs(v) for v in block)
        levels = [Fraction(0)] + [Fraction(s) / 2 ** (7 - lv) for lv in range(1, 8)]
        codes = []
        for v in block:
            a = Fraction(abs(v))
            lv = min(range(8), key=lambda k: (abs(a - levels[k]), k))
            codes.append((8 if v < 0 and lv > 0 else 0) | lv)
        out += struct.pack("<f", s)
        out += bytes(codes[i] | (codes[i + 1] << 4) for i in range(0, Q4_BLOCK, 2))
    return bytes(out)


def ref_q4_unpack(buf: bytes, n: int) -> list[float]:
    vals: list[float] = []
    for start in range(0, len(buf), Q4_BLOCK_BYTES):
        (s,) = struct.unpack("<f", buf[start : start + 4])
        for byte in buf[start + 4 : start + Q4_BLOCK_BYTES]:
            for code in (byte & 15, byte >> 4):
                lv = code & 7
                mag = 0.0 if lv == 0 else s * 2.0 ** -(7 - lv)
                vals.append(-mag if code & 8 else mag)
    return vals[:n]


def f32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.float32))


# Values built as scale * (a fraction chosen to hit levels, midpoints and their neighbours).
_FRACTIONS = [0.0, 1.0, 0.5, 0.75, 2.0**-6, 2.0**-7, 3 * 2.0**-7, 3 * 2.0**-3, 0.3, 1e-3, 0.99, 0.51]


@st.composite
def q4_inputs(draw, max_len: int = 700):
    n = draw(st.integers(0, max_len))
    mode = draw(st.sampled_from(["random", "structured"]))
    if mode == "random":
        vals = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=n, max_size=n))
        if draw(st.booleans()):  # whole blocks in the subnormal range too
            vals = [v * 1e-44 for v in vals]
    else:
        scale = draw(st.sampled_from([1.0, 3.0, 1e-20, 7.5e20, 0.1, 3e-38, 1e-42]))
        picks = draw(st.lists(st.sampled_from(_FRACTIONS), min_size=n, max_size=n))
        signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
        vals = [float(np.float32(scale * f * sg)) for f, sg in zip(picks, signs)]
    return np.asarray(vals, dtype=np.float32)


def block_scales(x: np.ndarray) -> np.ndarray:
    """Per-element absmax of its block (float64)."""
    n = x.size
    pad = np.zeros(-(-n // Q4_BLOCK) * Q4_BLOCK, dtype=np.float64)
    pad[:n] = np.abs(x.astype(np.float64))
    s = pad.reshape(-1, Q4_BLOCK).max(axis=1)
    return np.repeat(s, Q4_BLOCK)[:n]


# ---- sizes ---------------------------------------------------------------------------------------

def test_packed_nbytes_table():
    assert packed_nbytes("f32", 10) == 40
    assert packed_nbytes("bf16", 10) == 20
    assert packed_nbytes("q4", 0) == 0
    assert packed_nbytes("q4", 1) == 132
    assert packed_nbytes("q4", 256) == 132
    assert packed_nbytes("q4", 257) == 264
    assert wire_align("q4") == (256, 132) and wire_align("f32") == (1, 4) and wire_align("bf16") == (1, 2)


@pytest.mark.parametrize("bad", ["f16", "F32", None, 4])
def test_unknown_dtype_refused_naming_field(bad):
    with pytest.raises(WireError) as ei:
        packed_nbytes(bad, 3)
    assert ei.value.field == "dtype" and ei.value.value == bad


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_numel_refused(bad):
    with pytest.raises(WireError) as ei:
        packed_nbytes("f32", bad)
    assert ei.value.field == "numel"


def test_pack_refuses_non_float32():
    with pytest.raises(WireError) as ei:
        pack(torch.zeros(3, dtype=torch.float64), "f32")
    assert ei.value.field == "x.dtype"


def test_element_range_maps_aligned_byte_ranges():
    # 600 q4 values: blocks of 256, 256, 88 -> 396 bytes.
    assert element_range("q4", 0, 132, 600) == (0, 256)
    assert element_range("q4", 132, 264, 600) == (256, 344)
    assert element_range("q4", 264, 132, 600) == (512, 88)
    assert element_range("f32", 8, 8, 5) == (2, 2)
    assert element_range("bf16", 0, 10, 5) == (0, 5)
    with pytest.raises(WireError) as ei:
        element_range("q4", 100, 132, 600)
    assert ei.value.field == "offset"
    with pytest.raises(WireError):
        element_range("f32", 0, 6, 5)  # ends inside value 1
    with pytest.raises(WireError) as ei:
        element_range("f32", 16, 8, 5)  # past the end
    assert ei.value.field == "nbytes"


# ---- f32 / bf16 ----------------------------------------------------------------------------------

@FAST
@given(bits=st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_f32_round_trip_is_bitwise_for_every_bit_pattern(bits):
    x = torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())
    packed = pack(x, "f32")
    assert packed.dtype == torch.uint8 and packed.numel() == 4 * len(bits)
    # Little-endian bytes of each value, as a struct-level check independent of torch.
    assert bytes(as_bytes_view(packed)) == b"".join(struct.pack("<I", b) for b in bits)
    back = unpack(bytes(packed.numpy()), "f32", len(bits))
    assert back.numpy().view(np.uint32).tolist() == bits


def test_f32_pack_is_zero_copy_and_unpack_does_not_alias():
    x = torch.arange(6, dtype=torch.float32)
    packed = pack(x, "f32")
    assert packed.data_ptr() == x.data_ptr()
    back = unpack(packed, "f32", 6)
    back[0] = 42.0
    assert x[0] == 0.0


def rne_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Reference f32 -> bf16 round-to-nearest-even on the bit pattern (finite and inf inputs)."""
    b = x.view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


@FAST
@given(vals=st.lists(st.floats(width=32, allow_nan=False), max_size=300))
def test_bf16_pack_rounds_to_nearest_even(vals):
    x = np.asarray(vals, dtype=np.float32)
    packed = pack(torch.from_numpy(x.copy()), "bf16")
    assert packed.numel() == 2 * len(vals)
    got = np.frombuffer(bytes(packed.numpy()), dtype="<u2")
    assert got.tolist() == rne_bf16_bits(x).tolist()
    back = unpack(bytes(packed.numpy()), "bf16", len(vals))
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16).to(torch.float32)
    assert torch.equal(back.view(torch.int32), ref.view(torch.int32))


@FAST
@given(bits16=st.lists(st.integers(0, 2**16 - 1), max_size=200))
def test_bf16_representable_values_are_exact(bits16):
    x = torch.from_numpy((np.asarray(bits16, dtype=np.uint32) << 16).view(np.float32).copy())
    finite = torch.isfinite(x)  # NaN payloads may be quieted; every other bf16 value must survive
    back = unpack(pack(x, "bf16"), "bf16", x.numel())
    assert torch.equal(back[finite].view(torch.int32), x[finite].view(torch.int32))
    assert torch.isnan(back[~finite]).eq(torch.isnan(x[~finite])).all()


def test_unpack_wrong_length_is_decode_error():
    with pytest.raises(DecodeError) as ei:
        unpack(b"\x00" * 7, "f32", 2)
    assert ei.value.field == "nbytes" and ei.value.value == 7


# ---- q4 ------------------------------------------------------------------------------------------

@FAST
@given(x=q4_inputs())
def test_q4_matches_reference_bytes_and_values(x):
    packed = pack(torch.from_numpy(x.copy()), "q4")
    assert packed.numel() == packed_nbytes("q4", x.size)
    ref = ref_q4_pack(x.tolist())
    assert bytes(packed.numpy()) == ref
    back = unpack(ref, "q4", x.size)
    # float32 multiplication is correctly rounded, so decoding equals the exact level rounded once
    assert back.tolist() == np.asarray(ref_q4_unpack(ref, x.size), dtype=np.float32).tolist()


@FAST
@given(x=q4_inputs(max_len=1200))
def test_q4_error_bounds(x):
    q = unpack(pack(torch.from_numpy(x.copy()), "q4"), "q4", x.size).numpy().astype(np.float64)
    xd = x.astype(np.float64)
    a, s = np.abs(xd), block_scales(x)
    err = np.abs(xd - q)
    slack = 2.0**-149  # decoding rounds only when a level is subnormal (see module docstring)
    big = a >= s / 64
    assert np.all(err[big] <= a[big] / 3 * (1 + 1e-12) + slack)  # a/3 itself rounds in float64
    assert np.all(err[~big] <= s[~big] / 128 + slack)
    assert np.all(err <= s / 4 + slack)
    assert np.all((q == 0) | (np.sign(q) == np.sign(xd)))  # sign kept or flushed to zero
    assert np.all(np.abs(q) <= s)
    # each block's absmax element decodes exactly
    assert np.all(q[a == s] == xd[a == s])


def test_q4_relative_bound_is_attained_at_a_midpoint():
    # 1.5 * s/4 lies halfway between s/4 and s/2: the tie goes down, error exactly a/3.
    x = f32([1.0, 0.375, -0.375])
    q = unpack(pack(x, "q4"), "q4", 3)
    assert q.tolist() == [1.0, 0.25, -0.25]
    assert abs(0.375 - 0.25) == pytest.approx(0.375 / 3)


def test_q4_zero_block_is_all_zero_bytes():
    packed = pack(torch.zeros(300), "q4")
    assert packed.numel() == 264 and not packed.any()
    assert torch.equal(unpack(packed, "q4", 300), torch.zeros(300))


def test_q4_all_equal_block_is_exact():
    x = torch.full((256,), -2.5)
    assert torch.equal(unpack(pack(x, "q4"), "q4", 256), x)


def test_q4_one_huge_value_flushes_small_ones():
    x = torch.full((256,), 1e-3)
    x[17] = 1e4
    q = unpack(pack(x, "q4"), "q4", 256)
    assert q[17] == 1e4
    assert torch.count_nonzero(q) == 1  # 1e-3 < 1e4/128: nearest level is 0


def test_q4_partial_last_block_pads_with_zero_nibbles():
    x = torch.linspace(-1, 1, 300)
    packed = pack(x, "q4")
    tail = packed[Q4_BLOCK_BYTES + 4 + 22 :]  # values 300.. of block 1 are padding
    assert packed.numel() == 2 * Q4_BLOCK_BYTES and not tail.any()
    assert bytes(packed.numpy()) == ref_q4_pack(x.tolist())


def test_q4_negative_zero_and_tiny_negatives_encode_as_zero():
    x = f32([-0.0, -1e-9, 1.0])
    packed = pack(x, "q4")
    assert packed[4] == 0  # values 0 and 1 share byte 4: both nibble 0 (no "negative zero")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_q4_refuses_non_finite(bad):
    x = torch.ones(600)
    x[300] = bad
    with pytest.raises(WireError) as ei:
        pack(x, "q4")
    assert ei.value.field == "x" and "block 1" in str(ei.value)


def test_q4_tiny_scale_stays_within_bounds():
    x = torch.tensor([1e-45, 3e-45, -7e-45, 2e-40], dtype=torch.float32)
    q = unpack(pack(x, "q4"), "q4", 4).double()
    s = float(x.abs().max())
    assert float((q - x.double()).abs().max()) <= s / 4 + 2.0**-147


def test_q4_unpack_rejects_corrupt_blocks():
    packed = bytearray(pack(torch.linspace(-1, 1, 300), "q4").numpy().tobytes())
    bad_scale = bytearray(packed)
    bad_scale[Q4_BLOCK_BYTES : Q4_BLOCK_BYTES + 4] = struct.pack("<f", -1.0)
    with pytest.raises(DecodeError) as ei:
        unpack(bytes(bad_scale), "q4", 300)
    assert ei.value.field == "block.1.scale"
    bad_pad = bytearray(packed)
    bad_pad[-1] = 0x10
    with pytest.raises(DecodeError) as ei:
        unpack(bytes(bad_pad), "q4", 300)
    assert ei.value.field == "padding"


# ---- error feedback ------------------------------------------------------------------------------

def test_q4_with_feedback_identity():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(700, generator=g)
    r = torch.randn(700, generator=g) * 0.01
    packed, new_r = q4_with_feedback(x, r)
    y = x + r
    assert torch.equal(packed, pack(y, "q4"))
    assert torch.equal(new_r, y - unpack(packed, "q4", 700))
    packed0, r0 = q4_with_feedback(x, None)
    assert torch.equal(packed0, pack(x, "q4")) and torch.equal(r0, x - unpack(packed0, "q4", 700))
    with pytest.raises(WireError) as ei:
        q4_with_feedback(x, torch.zeros(5))
    assert ei.value.field == "residual"


def test_error_feedback_keeps_accumulated_error_within_one_quantum():
    g = torch.Generator().manual_seed(7)
    x = torch.rand(512, generator=g) * 0.9 + 0.05  # values between levels: every push is biased alike
    pushes = 50
    total_in = x.double() * pushes
    with_fb = torch.zeros(512, dtype=torch.float64)
    without = torch.zeros(512, dtype=torch.float64)
    residual = None
    for _ in range(pushes):
        packed, residual = q4_with_feedback(x, residual)
        with_fb += unpack(packed, "q4", 512).double()
        without += unpack(pack(x, "q4"), "q4", 512).double()
    err_fb = float((with_fb - total_in).abs().max())
    err_plain = float((without - total_in).abs().max())
    # Sum of dequantized pushes = sum of inputs - final residual; the residual is one quantization
    # error of the last push, at most s/4 of that push's input y = x + r, and
    # max|y| <= max|x| + max|y|/4 gives s <= 4/3 max|x|.
    s_last = float(x.abs().max()) * 4 / 3
    assert err_fb <= s_last / 4 * (1 + 1e-4)
    assert err_plain > 10 * err_fb


# ---- streaming packer ----------------------------------------------------------------------------

@FAST
@given(
    sizes=st.lists(st.integers(0, 600), min_size=0, max_size=6),
    wd=st.sampled_from(["f32", "bf16", "q4"]),
    seed=st.integers(0, 2**16),
)
def test_pack_stream_equals_pack_of_concatenation(sizes, wd, seed):
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(n, generator=g) for n in sizes]
    whole = torch.cat(pieces) if pieces else torch.zeros(0)
    out = list(pack_stream(iter(pieces), wd))
    assert all(p.dtype == torch.uint8 for p in out)
    got = torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8)
    assert torch.equal(got, pack(whole, wd))


@FAST
@given(sizes=st.lists(st.integers(0, 600), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_pack_stream_with_residual_equals_q4_with_feedback(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(n, generator=g) for n in sizes]
    whole = torch.cat(pieces)
    r0 = torch.randn(whole.numel(), generator=g) * 0.05
    residual = r0.clone()
    got = list(pack_stream(pieces, "q4", residual=residual))
    packed, new_r = q4_with_feedback(whole, r0)
    assert torch.equal(torch.cat(got) if got else torch.zeros(0, dtype=torch.uint8), packed)
    assert torch.equal(residual, new_r)


def test_pack_stream_residual_size_must_match():
    with pytest.raises(WireError) as ei:
        list(pack_stream([torch.ones(10)], "q4", residual=torch.zeros(9)))
    assert ei.value.field == "residual"
    with pytest.raises(WireError):
        list(pack_stream([torch.ones(10)], "q4", residual=torch.zeros(11)))
    with pytest.raises(WireError) as ei:
        list(pack_stream([torch.ones(10)], "f32", residual=torch.zeros(10)))
    assert ei.value.field == "dtype"


@pytest.mark.cuda
@pytest.mark.parametrize("wd", ["f32", "bf16", "q4"])
def test_device_pack_matches_cpu(wd):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pack(x.cuda(), wd), pack(x, wd))


def test_q4_decision_is_exact_where_the_midpoint_is_not_a_float():
    # s = float32(7.5e20) has a full mantissa, so 0.75 * s is not representable in float32; a value
    # just above the true midpoint must still round up to s (found by hypothesis).
    x = np.asarray([-7.5e20, -5.625e20], dtype=np.float32)
    assert float(x[1]) < -0.75 * float(np.abs(x).max())  # really past the midpoint
    packed = pack(torch.from_numpy(x.copy()), "q4")
    assert bytes(packed.numpy()) == ref_q4_pack(x.tolist())
    assert unpack(packed, "q4", 2)[1] == float(x[0])


def test_dtype_names_are_defined_once_and_the_json_schemas_agree():
    """yeto.schemas.dtypes holds the one list of dtype names; every enum in the JSON schemas says the same."""
    from yeto.schemas import codec
    from yeto.schemas.dtypes import AUTO_DTYPE, BULK_DTYPES, PUSH_DTYPES, WIRE_DTYPES

    assert set(BULK_DTYPES) < set(PUSH_DTYPES) == set(WIRE_DTYPES)
    hello, session = codec.load_schema("hello"), codec.load_schema("session")
    assert hello["properties"]["push_dtype"]["enum"] == [AUTO_DTYPE, *PUSH_DTYPES]
    assert hello["properties"]["bulk_dtype"]["enum"] == [AUTO_DTYPE, *BULK_DTYPES]
    assert session["properties"]["push_dtype"]["enum"] == list(PUSH_DTYPES)
    assert codec.load_schema("push_chunk")["properties"]["dtype"]["enum"] == list(PUSH_DTYPES)
    for kind in ("session", "init_chunk", "bcast_chunk"):
        assert codec.load_schema(kind)["$defs"]["bulk_wire_dtype"]["enum"] == list(BULK_DTYPES), kind


@pytest.mark.e2e
def test_importing_the_dtype_names_does_not_import_torch():
    """The CLI, the step-log consumers and bench/wire.py read the names and the chunk plan; torch costs them seconds."""
    import subprocess
    import sys

    code = ("import sys, yeto.schemas.dtypes, yeto.schemas.chunks, yeto.schemas.layout, yeto.schemas.publish, "
            "yeto.learner.config; "
            "yeto.schemas.chunks.digest(b'x'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
