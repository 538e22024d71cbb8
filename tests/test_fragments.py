"""SyncState (versions, overwrite vs blend, anchors, counters, delta) and BcastAssembly.

Broadcast chunks are built here from first principles (raw little-endian bytes, xxh3 and sha256
straight from xxhash/hashlib) rather than with the project's own chunker, so the assembly is checked
against an independent producer.
"""
from __future__ import annotations

import hashlib

import pytest
import torch
import xxhash

from learner.fragments import BcastAssembly, Completed, ProtocolError, SyncState
from schemas.chunks import ChunkError, DigestMismatch
from schemas.errors import WireError
from schemas.layout import build_session

LAYOUT = [
    {"name": "embed.weight", "shape": [6, 5], "dtype": "float32"},
    {"name": "layers.0.w", "shape": [4, 6], "dtype": "float32"},
    {"name": "layers.1.w", "shape": [4, 6], "dtype": "float32"},
    {"name": "layers.1.b", "shape": [6], "dtype": "float32"},
]


def session(bulk="f32"):
    return build_session(LAYOUT, 2, run="r", push_dtype="f32", bulk_dtype=bulk, chunk_bytes=64,
                         init_island="a", sync_every=4)


S = session()
N0 = S["fragments"][0]["numel"]
N1 = S["fragments"][1]["numel"]


def state(alpha=0.75):
    return SyncState(S, "isl-a", "00000000000000a1", alpha)


def vec(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def raw_bytes(values: torch.Tensor, dtype: str) -> bytes:
    if dtype == "f32":
        return values.numpy().tobytes()
    return values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def bcast_chunks(fid, version, values, dtype="f32", chunk_bytes=24, vdigest=None):
    raw = raw_bytes(values, dtype)
    vd = vdigest or hashlib.sha256(raw).hexdigest()
    n = -(-len(raw) // chunk_bytes)
    out = []
    for i in range(n):
        payload = raw[i * chunk_bytes : (i + 1) * chunk_bytes]
        out.append(({"v": 1, "run": "r", "fragment": fid, "version": version, "dtype": dtype, "chunk": i, "chunks": n,
                     "offset": i * chunk_bytes, "nbytes": len(payload), "total": len(raw),
                     "digest": xxhash.xxh3_64_hexdigest(payload), "version_digest": vd}, payload))
    return out


def digest_of(values, dtype="f32"):
    return hashlib.sha256(raw_bytes(values, dtype)).hexdigest()


# ---- versions -------------------------------------------------------------------------------------

def test_versions_are_monotonic_and_a_digest_conflict_is_fatal():
    st = state()
    g = vec(N0, 1)
    assert st.accept_version(0, 3, "d3") == "new"
    st.apply(0, 3, "d3", g)
    assert st.accept_version(0, 3, "d3") == "same"
    assert st.accept_version(0, 2, "whatever") == "old"
    assert st.accept_version(0, 4, "d4") == "new"
    with pytest.raises(ProtocolError) as e:
        st.accept_version(0, 3, "other")
    assert e.value.field == "version_digest" and e.value.value == "other" and e.value.code == "protocol"
    with pytest.raises(ProtocolError):
        st.apply(0, 3, "other", vec(N0, 2), vec(N0, 3))
    # not new: nothing changes, nothing to write
    assert st.apply(0, 3, "d3", vec(N0, 2), vec(N0, 3)) is None
    assert st.apply(0, 1, "d1", vec(N0, 2), vec(N0, 3)) is None
    assert st.states[0].version == 3 and torch.equal(st.states[0].anchor, g)
    assert st.versions() == {"0": 3}


def test_first_version_overwrites_without_blending():
    st = state(alpha=0.5)
    g = vec(N0, 1)
    st.note_step(100)
    assert not st.needs_local(0)
    out = st.apply(0, 0, digest_of(g), g)  # no local values needed
    assert torch.equal(out, g)
    assert torch.equal(st.states[0].anchor, g)
    assert st.states[0].c_steps == 0 and st.states[0].c_tokens == 0
    assert st.needs_local(0)


def test_later_version_blends_against_a_hand_computation():
    st = state(alpha=0.75)
    st.apply(0, 0, "d0", torch.zeros(N0))
    local = torch.zeros(N0)
    glob = torch.zeros(N0)
    local[:4] = torch.tensor([1.0, 2.0, 3.0, -4.0])
    glob[:4] = torch.tensor([5.0, 6.0, 7.0, 8.0])
    out = st.apply(0, 1, "d1", glob.clone(), local)
    # 0.75*1 + 0.25*5 = 2, 0.75*2 + 0.25*6 = 3, 0.75*3 + 0.25*7 = 4, 0.75*(-4) + 0.25*8 = -1
    assert out[:4].tolist() == [2.0, 3.0, 4.0, -1.0]
    assert out is local  # blended in place: no second fragment-sized buffer
    # The anchor is the raw global value, not the blend.
    assert torch.equal(st.states[0].anchor, glob)
    assert not torch.equal(st.states[0].anchor, out)


def test_blend_matches_a_float64_reference_on_random_values():
    alpha = 0.3
    st = state(alpha=alpha)
    st.apply(1, 0, "d0", vec(N1, 0))
    local, glob = vec(N1, 1), vec(N1, 2)
    ref = alpha * local.double() + (1 - alpha) * glob.double()
    out = st.apply(1, 1, "d1", glob.clone(), local.clone())
    assert torch.allclose(out.double(), ref, rtol=0, atol=4e-7 * ref.abs().max().item())


def test_blend_needs_local_values_and_checks_sizes():
    st = state()
    st.apply(0, 0, "d0", vec(N0, 0))
    with pytest.raises(WireError) as e:
        st.apply(0, 1, "d1", vec(N0, 1))
    assert e.value.field == "local"
    with pytest.raises(WireError) as e:
        st.apply(0, 1, "d1", vec(N0 + 1, 1), vec(N0, 2))
    assert e.value.field == "global_values"
    with pytest.raises(WireError) as e:
        st.apply(7, 0, "d0", vec(N0, 1))
    assert e.value.field == "fragment"
    assert st.states[0].version == 0  # refused applies changed nothing


def test_alpha_out_of_range_is_refused():
    with pytest.raises(WireError) as e:
        SyncState(S, "isl-a", "00000000000000a1", 1.5)
    assert e.value.field == "alpha"


# ---- counters, readiness, delta -------------------------------------------------------------------

def test_counters_readiness_and_reset():
    st = state()
    assert not st.ready(0) and not st.ready(1)
    st.note_step(10)  # before any version: counted, but no anchor so not ready
    assert not st.ready(0)
    st.apply(0, 0, "d0", vec(N0, 0))
    assert not st.ready(0)  # anchor but no step since it was installed
    st.note_step(32)
    st.note_step(16)
    assert st.ready(0) and not st.ready(1)
    s0 = st.states[0]
    assert (s0.c_steps, s0.c_tokens, s0.steps_since_reset) == (2, 48, 2)
    assert (st.states[1].c_steps, st.states[1].c_tokens) == (3, 58)
    st.apply(0, 1, "d1", vec(N0, 1), vec(N0, 2))
    assert (s0.c_steps, s0.c_tokens) == (0, 0) and not st.ready(0)
    assert not st.ready(99)  # unknown fragment: never ready
    with pytest.raises(WireError):
        st.note_step(-1)


def test_delta_is_local_minus_anchor():
    st = state()
    g = vec(N0, 0)
    st.apply(0, 0, "d0", g)
    local = vec(N0, 1)
    d = st.delta(0, local)
    assert torch.equal(d, local - g)
    assert torch.equal(local, vec(N0, 1))  # untouched
    d2 = st.delta(0, local, inplace=True)
    assert d2 is local and torch.equal(local, d)
    with pytest.raises(RuntimeError):
        st.delta(1, vec(N1, 0))  # no anchor yet


def test_q4_residual_is_a_working_copy_kept_only_on_ack():
    st = state()
    r = st.push_residual(0)
    assert torch.equal(r, torch.zeros(N0))
    r += 1.0  # the packer updates its working copy; the push then fails: nothing kept
    assert torch.equal(st.push_residual(0), torch.zeros(N0))
    st.keep_residual(0, r)
    r2 = st.push_residual(0)
    assert torch.equal(r2, torch.ones(N0)) and r2 is not r
    st.apply(0, 0, "d0", vec(N0, 0))  # a new anchor keeps the residual (error not yet delivered)
    assert torch.equal(st.states[0].residual, torch.ones(N0))


# ---- broadcast assembly ---------------------------------------------------------------------------

def feed(asm, chunks):
    done = []
    for meta, payload in chunks:
        c = asm.add(meta, payload)
        if c is not None:
            done.append(c)
    return done


def test_assembles_out_of_order_and_decodes_f32_bitwise():
    asm = BcastAssembly(S)
    g = vec(N0, 5)
    chunks = bcast_chunks(0, 0, g)
    assert len(chunks) > 3
    done = feed(asm, list(reversed(chunks)))
    assert len(done) == 1
    c = done[0]
    assert isinstance(c, Completed) and (c.fragment, c.version) == (0, 0)
    assert c.version_digest == digest_of(g)
    assert torch.equal(c.values.view(torch.int32), g.view(torch.int32))
    assert asm.partial(0) is None and asm.completed(0) == 0 and asm.nbytes_held() == 0


def test_bf16_broadcast_decodes_to_the_rounded_values():
    s = session(bulk="bf16")
    asm = BcastAssembly(s)
    g = vec(s["fragments"][1]["numel"], 6)
    (c,) = feed(asm, bcast_chunks(1, 2, g, dtype="bf16", chunk_bytes=16))
    assert c.values.dtype == torch.float32
    assert torch.equal(c.values, g.to(torch.bfloat16).to(torch.float32))
    assert c.version_digest == digest_of(g, "bf16")


def test_interleaved_versions_complete_only_whole_versions_and_drop_the_older_partial():
    # A late reader of BCAST: chunks 0..2 of v4 were overwritten by v5, so it sees v4's tail, then
    # v5's head (the current messages), then v5's tail as the syncer publishes it.
    asm = BcastAssembly(S)
    v4, v5 = vec(N0, 4), vec(N0, 5)
    c4, c5 = bcast_chunks(0, 4, v4), bcast_chunks(0, 5, v5)
    k = len(c4) // 2
    assert feed(asm, c4[k:]) == []
    assert asm.partial(0) == (4, len(c4) - k, len(c4))
    assert feed(asm, c5[:k]) == []
    assert asm.partial(0) == (5, k, len(c5))  # v4's partial dropped
    assert asm.counts["dropped_partial"] == 1
    # A straggling v4 chunk (older than the partial) is ignored, not mixed into v5.
    assert feed(asm, c4[:1]) == []
    assert asm.partial(0) == (5, k, len(c5))
    (done,) = feed(asm, c5[k:])
    assert done.version == 5 and torch.equal(done.values, v5)
    # Chunks of v4 and v5 after v5 completed: older or same version, ignored.
    assert feed(asm, c4 + c5) == []
    assert asm.counts["old"] == len(c4) and asm.counts["same"] == len(c5)


def test_versions_of_different_fragments_assemble_independently():
    asm = BcastAssembly(S)
    a, b = bcast_chunks(0, 1, vec(N0, 1)), bcast_chunks(1, 1, vec(N1, 2))
    mixed = [x for pair in zip(a, b) for x in pair] + a[len(b):] + b[len(a):]
    done = feed(asm, mixed)
    assert sorted((c.fragment, c.version) for c in done) == [(0, 1), (1, 1)]


def test_consecutive_complete_versions_each_complete():
    asm = BcastAssembly(S)
    done = feed(asm, bcast_chunks(0, 1, vec(N0, 1)) + bcast_chunks(0, 2, vec(N0, 2)))
    assert [c.version for c in done] == [1, 2]


def test_identical_redelivered_chunk_is_ignored():
    asm = BcastAssembly(S)
    chunks = bcast_chunks(0, 0, vec(N0, 1))
    feed(asm, chunks[:2])
    assert asm.add(*chunks[1]) is None
    assert asm.counts["duplicate_chunk"] == 1
    assert len(feed(asm, chunks[2:])) == 1


def test_same_version_with_another_digest_is_fatal():
    asm = BcastAssembly(S)
    feed(asm, bcast_chunks(0, 3, vec(N0, 1)))
    other = bcast_chunks(0, 3, vec(N0, 2))
    with pytest.raises(ProtocolError):
        asm.add(*other[0])
    # ... and also while the version is still partial.
    feed(asm, bcast_chunks(0, 4, vec(N0, 3))[:1])
    with pytest.raises(ProtocolError):
        asm.add(*bcast_chunks(0, 4, vec(N0, 4))[1])


def test_version_digest_mismatch_drops_the_version():
    asm = BcastAssembly(S)
    g = vec(N0, 1)
    bad = bcast_chunks(0, 1, g, vdigest="0" * 64)
    with pytest.raises(DigestMismatch):
        feed(asm, bad)
    assert asm.partial(0) is None and asm.completed(0) is None


def test_corrupted_chunk_is_refused_and_the_version_still_completes():
    asm = BcastAssembly(S)
    chunks = bcast_chunks(0, 1, vec(N0, 1))
    meta, payload = chunks[1]
    corrupt = bytes([payload[0] ^ 1]) + payload[1:]
    with pytest.raises(ChunkError):
        asm.add(meta, corrupt)
    assert len(feed(asm, chunks)) == 1


@pytest.mark.parametrize("field,value", [("dtype", "bf16"), ("total", 12), ("fragment", 9), ("version", -1)])
def test_chunks_that_do_not_fit_the_session_are_refused(field, value):
    asm = BcastAssembly(S)
    meta, payload = bcast_chunks(0, 1, vec(N0, 1))[0]
    meta[field] = value
    with pytest.raises(WireError) as e:
        asm.add(meta, payload)
    assert e.value.field == field


def test_seed_ignores_versions_already_held():
    asm = BcastAssembly(S)
    g = vec(N0, 1)
    asm.seed(0, 2, digest_of(g))
    assert feed(asm, bcast_chunks(0, 2, g) + bcast_chunks(0, 1, vec(N0, 0))) == []
    assert asm.partial(0) is None and asm.completed(0) == 2
    with pytest.raises(ProtocolError):
        asm.add(*bcast_chunks(0, 2, vec(N0, 5))[0])
    assert [c.version for c in feed(asm, bcast_chunks(0, 3, vec(N0, 3)))] == [3]


# ---- the boundary, end to end ---------------------------------------------------------------------

def test_boundary_flow_overwrite_then_blend_from_broadcast_chunks():
    st, asm = state(alpha=0.5), BcastAssembly(S)
    v0, v1 = vec(N0, 10), vec(N0, 11)
    (c,) = feed(asm, bcast_chunks(0, 0, v0))
    model = st.apply(c.fragment, c.version, c.version_digest, c.values).clone()
    assert torch.equal(model, v0)
    model += 1.0  # local training
    st.note_step(8)
    d = st.delta(0, model)
    assert torch.allclose(d, torch.ones(N0))
    (c,) = feed(asm, bcast_chunks(0, 1, v1))
    out = st.apply(c.fragment, c.version, c.version_digest, c.values, model)
    assert torch.allclose(out, 0.5 * (v0 + 1.0) + 0.5 * v1)
    assert torch.equal(st.states[0].anchor, v1)
