"""SyncState (versions, counters, readiness), the blend, the per-rank AnchorStore (staging, anchors,
q4 residual working copies; in memory and in files) and CutReader (in-order reading of versions).

Broadcast chunks are built here from first principles (raw little-endian bytes, xxh3 and sha256
straight from xxhash/hashlib) rather than with the project's own chunker, so the reader is checked
against an independent producer.
"""
from __future__ import annotations

import hashlib
import os

import pytest
import torch
import xxhash

from yeto.learner.anchors import AnchorStore
from yeto.learner.blend import blend
from yeto.learner.cut_reader import CutReader, VersionConflict
from yeto.learner.sync_state import ProtocolError, SyncState
from yeto.schemas.chunks import DigestMismatch
from yeto.schemas.errors import ConfigError, WireError
from yeto.schemas.layout import build_session

LAYOUT = [
    {"name": "embed.weight", "shape": [6, 5], "dtype": "float32"},
    {"name": "layers.0.w", "shape": [4, 6], "dtype": "float32"},
    {"name": "layers.1.w", "shape": [4, 6], "dtype": "float32"},
    {"name": "layers.1.b", "shape": [6], "dtype": "float32"},
]
CB = 24  # session chunk bytes: 6 f32 or 12 bf16 values per chunk


def session(bulk="f32"):
    return build_session(LAYOUT, 2, run="r", push_dtype="f32", bulk_dtype=bulk, chunk_bytes=CB,
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


def bcast_chunks(fid, version, values, dtype="f32", chunk_bytes=CB, vdigest=None, every=False):
    """BCAST chunks: the version digest seals the version on the last chunk only; `every`: on every
    chunk (FINAL's headers)."""
    raw = raw_bytes(values, dtype)
    vd = vdigest or hashlib.sha256(raw).hexdigest()
    n = -(-len(raw) // chunk_bytes)
    out = []
    for i in range(n):
        payload = raw[i * chunk_bytes: (i + 1) * chunk_bytes]
        meta = {"v": 1, "run": "r", "fragment": fid, "version": version, "dtype": dtype, "chunk": i, "chunks": n,
                "offset": i * chunk_bytes, "nbytes": len(payload), "total": len(raw),
                "digest": xxhash.xxh3_64_hexdigest(payload)}
        if every or i == n - 1:
            meta["version_digest"] = vd
        out.append((meta, payload))
    return out


def digest_of(values, dtype="f32"):
    return hashlib.sha256(raw_bytes(values, dtype)).hexdigest()


# ---- versions and counters ------------------------------------------------------------------------

def test_versions_are_monotonic_and_a_digest_conflict_is_fatal():
    st = state()
    assert st.accept_version(0, 3, "d3") == "new"
    assert st.installed(0, 3, "d3") == "first"
    assert st.accept_version(0, 3, "d3") == "same"
    assert st.accept_version(0, 2, "whatever") == "old"
    assert st.accept_version(0, 4, "d4") == "new"
    with pytest.raises(ProtocolError) as e:
        st.accept_version(0, 3, "other")
    assert e.value.field == "version_digest" and e.value.value == "other" and e.value.code == "protocol"
    with pytest.raises(ProtocolError):  # not new: the island's own bookkeeping is wrong
        st.installed(0, 2, "d2")
    assert st.installed(0, 4, "d4") == "blend"
    assert st.states[0].version == 4 and st.versions() == {"0": 4}
    with pytest.raises(ProtocolError) as e:
        st.installed(7, 0, "d0")
    assert e.value.field == "fragment" and not isinstance(e.value, WireError)


def test_alpha_out_of_range_is_refused():
    with pytest.raises(ConfigError) as e:
        SyncState(S, "isl-a", "00000000000000a1", 1.5)
    assert e.value.field == "alpha"


def test_counters_readiness_and_reset():
    st = state()
    assert not st.ready(0) and not st.ready(1)
    st.note_step(10)  # before any version: counted, but no anchor so not ready
    assert not st.ready(0) and not st.needs_local(0)
    st.installed(0, 0, "d0")
    assert not st.ready(0) and st.needs_local(0)  # a version but no step since it was installed
    st.note_step(32)
    st.note_step(16)
    assert st.ready(0) and not st.ready(1)
    s0 = st.states[0]
    assert (s0.c_steps, s0.c_tokens, s0.steps_since_reset) == (2, 48, 2)
    assert (st.states[1].c_steps, st.states[1].c_tokens) == (3, 58)
    st.installed(0, 1, "d1")
    assert (s0.c_steps, s0.c_tokens) == (0, 0) and not st.ready(0)
    assert not st.ready(99)  # unknown fragment: never ready
    with pytest.raises(ValueError, match="tokens must be a non-negative integer"):
        st.note_step(-1)


# ---- the blend ------------------------------------------------------------------------------------

def test_blend_against_a_hand_computation_leaves_its_inputs_alone():
    local = torch.tensor([1.0, 2.0, 3.0, -4.0])
    glob = torch.tensor([5.0, 6.0, 7.0, 8.0])
    out = blend(local, glob, 0.75)
    # 0.75*1 + 0.25*5 = 2, 0.75*2 + 0.25*6 = 3, 0.75*3 + 0.25*7 = 4, 0.75*(-4) + 0.25*8 = -1
    assert out.tolist() == [2.0, 3.0, 4.0, -1.0]
    assert local.tolist() == [1.0, 2.0, 3.0, -4.0] and glob.tolist() == [5.0, 6.0, 7.0, 8.0]


def test_blend_matches_a_float64_reference_on_random_values():
    alpha = 0.3
    local, glob = vec(N1, 1), vec(N1, 2)
    ref = alpha * local.double() + (1 - alpha) * glob.double()
    out = blend(local, glob, alpha)
    assert torch.allclose(out.double(), ref, rtol=0, atol=4e-7 * ref.abs().max().item())
    assert torch.equal(blend(local, glob, 0.0), glob) and torch.equal(blend(local, glob, 1.0), local)


# ---- per-rank values ------------------------------------------------------------------------------

@pytest.fixture(params=["memory", "files"])
def store(request, tmp_path):
    s = AnchorStore(None if request.param == "memory" else tmp_path / "anchors")
    yield s
    s.close()


def test_staging_becomes_the_anchor_of_owner_pieces_only_on_commit(store):
    numels = {"w": 6, "b": 3}
    store.begin(0, 5, numels)
    assert store.staging(0) == 5 and not store.has_anchor(0)
    store.stage(0, "w", 3, torch.tensor([4.0, 5.0, 6.0]))  # any order of runs
    store.stage(0, "w", 0, torch.tensor([1.0, 2.0, 3.0]))
    store.stage(0, "b", 0, torch.tensor([7.0, 8.0, 9.0]))
    assert store.staged(0, "w").tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    store.commit(0, owned=["w"])
    assert store.staging(0) is None and store.has_anchor(0)
    assert store.anchor(0, "w", 1, 4).tolist() == [2.0, 3.0, 4.0]
    # a newer version staged meanwhile does not touch the anchor until it commits; abort drops it
    store.begin(0, 6, numels)
    store.stage(0, "w", 0, torch.zeros(6))
    assert store.anchor(0, "w", 0, 6).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    store.abort(0)
    assert store.staging(0) is None and store.anchor(0, "w", 0, 2).tolist() == [1.0, 2.0]
    with pytest.raises(RuntimeError):
        store.anchor(1, "w", 0, 1)


def test_begin_replaces_another_version_being_staged(store):
    store.begin(1, 1, {"w": 2})
    store.stage(1, "w", 0, torch.tensor([1.0, 1.0]))
    store.begin(1, 2, {"w": 2})
    assert store.staging(1) == 2
    store.stage(1, "w", 0, torch.tensor([2.0, 3.0]))
    store.commit(1, owned=["w"])
    assert store.anchor(1, "w", 0, 2).tolist() == [2.0, 3.0]


def test_q4_residual_is_a_working_copy_kept_only_on_ack(store):
    numels = {"w": 4}
    store.begin_residual(0, numels)
    assert store.residual(0, "w", 0, 4).tolist() == [0.0] * 4  # zeros before the first q4 push
    store.stage_residual(0, "w", 0, torch.ones(4))
    store.abort_residual(0)  # the push failed: nothing kept
    assert store.committed_residual(0, "w", 0, 4) is None
    store.begin_residual(0, numels)
    store.stage_residual(0, "w", 1, torch.tensor([2.0, 3.0]))
    store.keep_residual(0)
    assert store.committed_residual(0, "w", 0, 4).tolist() == [0.0, 2.0, 3.0, 0.0]
    store.begin_residual(0, numels)  # the next push starts from the kept residual, on a copy
    assert store.residual(0, "w", 0, 4).tolist() == [0.0, 2.0, 3.0, 0.0]
    store.stage_residual(0, "w", 0, torch.full((4,), 9.0))
    assert store.committed_residual(0, "w", 0, 4).tolist() == [0.0, 2.0, 3.0, 0.0]
    # a new anchor keeps the residual (error not yet delivered)
    store.begin(0, 0, numels)
    store.commit(0, owned=["w"])
    assert store.committed_residual(0, "w", 0, 4).tolist() == [0.0, 2.0, 3.0, 0.0]


def test_file_store_holds_no_process_memory_and_cleans_up(tmp_path):
    d = tmp_path / "anchors"
    mem, files = AnchorStore(), AnchorStore(d)
    for s in (mem, files):
        s.begin(0, 0, {"w": 1000})
        s.stage(0, "w", 0, torch.arange(1000, dtype=torch.float32))
        s.commit(0, owned=["w"])
    assert mem.nbytes() == 4000 and files.nbytes() == 0
    assert torch.equal(mem.anchor(0, "w", 0, 1000), files.anchor(0, "w", 0, 1000))
    assert os.listdir(d)
    files.close()
    mem.close()
    assert os.listdir(d) == []


# ---- reading a cut --------------------------------------------------------------------------------

def read(reader, fid, chunks):
    """Feed chunks by index as a shell would fetch them; returns the verdicts."""
    return [reader.take(fid, m["chunk"], m, p) for m, p in chunks]


def test_reads_in_order_streams_the_digest_and_holds_the_version():
    r = CutReader(S)
    g = vec(N0, 5)
    chunks = bcast_chunks(0, 0, g)
    assert len(chunks) > 3 and r.announce(0, 0, digest_of(g)) and r.pending() == [0]
    assert [s.index for s in r.next_chunks(0)] == list(range(len(chunks)))
    assert read(r, 0, chunks[:2]) == ["accept", "accept"]
    assert r.reading(0) == (0, 2, len(chunks)) and [s.index for s in r.next_chunks(0)][0] == 2
    assert read(r, 0, chunks[2:]) == ["accept"] * (len(chunks) - 3) + ["complete"]
    assert r.held[0] == (0, digest_of(g)) and r.reading(0) is None and r.pending() == []
    # the held version and older ones are not read again
    assert not r.announce(0, 0, digest_of(g))
    assert read(r, 0, chunks[:1]) == ["wait"]


def test_bf16_chunks_follow_the_bf16_plan():
    s = session(bulk="bf16")
    r = CutReader(s)
    g = vec(s["fragments"][1]["numel"], 6)
    chunks = bcast_chunks(1, 2, g, dtype="bf16")
    assert read(r, 1, chunks)[-1] == "complete" and r.held[1] == (2, digest_of(g, "bf16"))


def test_a_version_overwritten_mid_read_is_dropped_and_the_newer_one_read_from_chunk_0():
    # Chunks 0..k-1 were read at v4; chunk k is already v5: the reading restarts at chunk 0 with v5.
    r = CutReader(S)
    v4, v5 = vec(N0, 4), vec(N0, 5)
    c4, c5 = bcast_chunks(0, 4, v4), bcast_chunks(0, 5, v5)
    k = len(c4) // 2
    assert read(r, 0, c4[:k]) == ["accept"] * k
    assert r.take(0, k, *c5[k]) == "restart"
    assert r.reading(0) is None and r.counters["dropped_partial"] == 1
    assert r.next_chunks(0)[0].index == 0
    assert read(r, 0, c5)[-1] == "complete" and r.held[0][0] == 5


def test_a_newer_version_not_yet_published_at_a_chunk_means_wait():
    # v5 is announced (its chunk 0 landed) but chunk 1 still holds v4: wait there, keep the reading.
    r = CutReader(S)
    v4, v5 = vec(N0, 4), vec(N0, 5)
    c4, c5 = bcast_chunks(0, 4, v4), bcast_chunks(0, 5, v5)
    r.announce(0, 5, digest_of(v5))
    assert r.take(0, 0, *c5[0]) == "accept"
    assert r.take(0, 1, *c4[1]) == "wait"
    assert r.reading(0) == (5, 1, len(c5)) and r.next_chunks(0)[0].index == 1
    assert read(r, 0, c5[1:])[-1] == "complete"


def test_fragments_read_independently_and_consecutive_versions_each_complete():
    r = CutReader(S)
    a, b = bcast_chunks(0, 1, vec(N0, 1)), bcast_chunks(1, 1, vec(N1, 2))
    for x, y in zip(a, b):
        r.take(0, x[0]["chunk"], *x)
        r.take(1, y[0]["chunk"], *y)
    read(r, 0, a[len(b):])
    read(r, 1, b[len(a):])
    assert r.held[0][0] == 1 and r.held[1][0] == 1
    assert read(r, 0, bcast_chunks(0, 2, vec(N0, 2)))[-1] == "complete" and r.held[0][0] == 2


def test_one_version_with_two_digests_is_refused_not_fatal_and_the_real_one_still_completes():
    # Regression: a chunk claiming the version held (or being read) with another version_digest used
    # to raise ProtocolError and kill the island. It is garbage someone published: refused, counted.
    r = CutReader(S)
    real3 = vec(N0, 1)
    read(r, 0, bcast_chunks(0, 3, real3))
    with pytest.raises(VersionConflict) as e:
        r.announce(0, 3, digest_of(vec(N0, 2)))
    assert e.value.field == "version_digest" and not isinstance(e.value, ProtocolError)
    forged3 = bcast_chunks(0, 3, vec(N0, 2))
    assert r.take(0, 0, *forged3[0], seq=9) == "wait"  # no digest to compare: just the held version
    last = len(forged3) - 1
    with pytest.raises(VersionConflict):  # the seal carries one: compared with the held version's
        r.take(0, last, *forged3[last], seq=10)
    assert r.held[0] == (3, digest_of(real3)) and r.counters["refused"] == 1
    assert r.take(0, last, *forged3[last], seq=10) == "wait"  # that message: not again
    assert r.counters["refused"] == 1 and r.counters["refused_again"] == 1
    # ... and while the version is still being read: a forged chunk 1 (valid chunk digest, no version
    # digest to compare on BCAST) is hashed in, and the seal refuses the mix; nothing is held
    real4 = vec(N0, 3)
    c4 = bcast_chunks(0, 4, real4)
    assert r.take(0, 0, *c4[0], seq=20) == "accept"
    assert r.take(0, 1, *bcast_chunks(0, 4, vec(N0, 4))[1], seq=21) == "accept"
    with pytest.raises(DigestMismatch):
        [r.take(0, m["chunk"], m, p, seq=22 + i) for i, (m, p) in enumerate(c4[2:])]
    assert r.reading(0) is None and r.held[0][0] == 3
    # the real chunk 1 overwrites the forged one (a new message): v4 is read again, whole
    assert [r.take(0, m["chunk"], m, p, seq=30 + i) for i, (m, p) in enumerate(c4)][-1] == "complete"
    assert r.held[0] == (4, digest_of(real4))


def test_version_digest_mismatch_refuses_that_reading_only_and_the_version_is_read_again():
    r = CutReader(S)
    real = vec(N0, 1)
    bad = bcast_chunks(0, 1, real, vdigest="0" * 64)
    with pytest.raises(DigestMismatch) as e:
        read(r, 0, bad)
    assert e.value.field == "version_digest"
    assert r.reading(0) is None and 0 not in r.held
    # a new notice of version 1 (the syncer's re-broadcast) is read, and completes
    assert r.announce(0, 1, digest_of(real)) and r.pending() == [0]
    assert read(r, 0, bcast_chunks(0, 1, real))[-1] == "complete" and r.held[0] == (1, digest_of(real))


def test_a_forged_chunk_with_a_predicted_version_number_does_not_make_the_real_version_refused():
    # Regression: a bad-digest chunk claiming v2 (the next version, easy to predict) used to put
    # (fragment, 2) in a `failed` set for good: the real v2 was never installed, pushes went stale.
    r = CutReader(S)
    read(r, 0, bcast_chunks(0, 1, vec(N0, 1)))
    real2 = bcast_chunks(0, 2, vec(N0, 2))
    forged_meta, payload = real2[0]
    with pytest.raises(DigestMismatch):
        r.take(0, 0, dict(forged_meta, digest="0" * 16), payload, seq=5)
    assert r.announce(0, 2, forged_meta.get("version_digest"))
    assert [r.take(0, m["chunk"], m, p, seq=6 + i) for i, (m, p) in enumerate(real2)][-1] == "complete"
    assert r.held[0][0] == 2
    # a self-consistent forged chunk (valid chunk digest) mixed into v3 is never installed as v3
    real3 = bcast_chunks(0, 3, vec(N0, 3))
    garbage = bcast_chunks(0, 3, vec(N0, 9), vdigest=real3[-1][0]["version_digest"])
    mixed = real3[:2] + garbage[2:3] + real3[3:]
    with pytest.raises(DigestMismatch):
        read(r, 0, mixed)
    assert r.held[0][0] == 2 and r.reading(0) is None
    assert read(r, 0, real3)[-1] == "complete" and r.held[0][0] == 3


@pytest.mark.parametrize("field,value", [("dtype", "bf16"), ("total", 12), ("chunks", 99), ("offset", 4),
                                         ("fragment", 1), ("chunk", 3), ("version", -1)])
def test_chunks_that_do_not_fit_the_session_are_refused(field, value):
    r = CutReader(S)
    meta, payload = bcast_chunks(0, 1, vec(N0, 1))[0]
    meta[field] = value
    with pytest.raises(WireError) as e:
        r.take(0, 0, meta, payload)
    assert e.value.field == {"fragment": "subject", "chunk": "subject"}.get(field, field)
    with pytest.raises(WireError) as e:
        CutReader(S).announce(9, 0, "d")
    assert e.value.field == "fragment"


def test_hold_seeds_a_version_and_a_missing_message_means_wait():
    r = CutReader(S)
    g = vec(N0, 1)
    r.hold(0, 2, digest_of(g))
    assert read(r, 0, bcast_chunks(0, 2, g)[:1] + bcast_chunks(0, 1, vec(N0, 0))[:1]) == ["wait", "wait"]
    assert r.take(0, 0, None, None) == "wait" and r.counters["missing"] == 1
    assert read(r, 0, bcast_chunks(0, 3, vec(N0, 3)))[-1] == "complete"


def test_a_forged_chunk_from_the_future_is_refused_and_holds_nothing_back():
    # A chunk claiming version 10**6 (bytes not matching its digest) replaced chunk 2 on the stream.
    r = CutReader(S)
    v1, v2 = vec(N0, 1), vec(N0, 2)
    c1, c2 = bcast_chunks(0, 1, v1), bcast_chunks(0, 2, v2)
    forged_meta, payload = bcast_chunks(0, 10**6, vec(N0, 9))[2]
    forged_meta = dict(forged_meta, digest="0" * 16)
    assert r.announce(0, 10**6, forged_meta.get("version_digest"))  # a notice only says "look"
    assert read(r, 0, c1[:2]) == ["accept", "accept"]
    with pytest.raises(DigestMismatch):
        r.take(0, 2, forged_meta, payload, seq=77)
    assert r.reading(0) is None and r.refused == {(0, 2): 77}
    assert r.take(0, 2, forged_meta, payload, seq=77) == "wait"  # the same garbage is not refused twice
    # the next real version overwrites the subject and is read whole
    assert read(r, 0, c2)[-1] == "complete" and r.held[0][0] == 2
    # check() refuses a chunk on its own, out of order (what a shell does with a suspicious notice)
    with pytest.raises(WireError) as e:
        r.check(0, 3, dict(c2[3][0], nbytes=4), c2[3][1])
    assert e.value.field == "nbytes"



def test_a_bad_chunk_checked_ahead_of_the_reading_is_refused_and_the_reading_goes_on():
    # The shell checks a chunk a notice pointed at, ahead of where the reading waits (its chunk 2 still
    # holds the older version). Refused and remembered; the reading of v1 is kept: it meets that message
    # later as "wait" (not refused twice), then the real seal that overwrote it, and completes.
    r = CutReader(S)
    v1 = vec(N0, 1)
    c1 = bcast_chunks(0, 1, v1)
    n = len(c1)
    forged_meta, payload = bcast_chunks(0, 10**6, vec(N0, 9))[n - 1]
    forged_meta = dict(forged_meta, digest="0" * 16)
    assert read(r, 0, c1[:2]) == ["accept", "accept"]
    with pytest.raises(DigestMismatch):
        r.check(0, n - 1, forged_meta, payload, seq=41)
    assert r.reading(0) == (1, 2, n) and r.refused == {(0, n - 1): 41}
    assert read(r, 0, c1[2:n - 1]) == ["accept"] * (n - 3)
    assert r.take(0, n - 1, forged_meta, payload, seq=41) == "wait" and r.reading(0) == (1, n - 1, n)
    assert r.take(0, n - 1, *c1[-1], seq=42) == "complete" and r.held[0] == (1, digest_of(v1))
    assert r.counters["refused"] == 1 and r.counters["refused_again"] == 1
    # the chunk the reading needs next, refused: that reading cannot go on and is dropped
    assert read(r, 0, bcast_chunks(0, 2, vec(N0, 2))[:1]) == ["accept"]
    with pytest.raises(WireError):
        r.check(0, 1, dict(bcast_chunks(0, 2, vec(N0, 2))[1][0], digest="0" * 16), bcast_chunks(0, 2, vec(N0, 2))[1][1])
    assert r.reading(0) is None

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_self_consistent_version_with_nan_or_inf_is_never_installed(dtype, bad):
    # Regression: chunks whose digests all match but whose values are NaN/Inf were installed.
    s = session(bulk=dtype)
    r = CutReader(s)
    g = vec(s["fragments"][0]["numel"], 3)
    g[len(g) // 2] = bad
    chunks = bcast_chunks(0, 1, g, dtype=dtype)
    with pytest.raises(WireError) as e:
        read(r, 0, chunks)
    assert e.value.code == "non_finite" and e.value.field == "payload"
    assert 0 not in r.held and r.reading(0) is None and r.counters["refused"] == 1
    g[len(g) // 2] = 1.0
    assert read(r, 0, bcast_chunks(0, 2, g, dtype=dtype))[-1] == "complete"


@pytest.mark.parametrize("cut", ["truncated", "oversize", "overlapping"])
def test_truncated_oversize_and_overlapping_chunks_are_refused_and_nothing_is_held(cut):
    r = CutReader(S)
    chunks = bcast_chunks(0, 1, vec(N0, 1))
    meta, payload = chunks[1]
    if cut == "truncated":
        bad = (dict(meta, nbytes=len(payload) - 4, digest=xxhash.xxh3_64_hexdigest(payload[:-4])), payload[:-4])
    elif cut == "oversize":
        big = payload + b"\0" * (1 << 20)
        bad = (dict(meta, nbytes=len(big), digest=xxhash.xxh3_64_hexdigest(big)), big)
    else:  # claims to start inside chunk 0's bytes
        bad = (dict(meta, offset=meta["offset"] - 4), payload)
    assert r.take(0, 0, *chunks[0]) == "accept"
    with pytest.raises(WireError):
        r.take(0, 1, *bad)
    assert r.reading(0) is None and 0 not in r.held


def test_a_chunk_index_beyond_the_plan_is_refused_not_an_index_error():
    # A chunk on subject bcast.0.999 claiming the plan's chunk count reached spans[999]: an IndexError,
    # which the shell does not catch. The codec's header rule (chunk < chunks) keeps it off the wire
    # today; the reader does not rely on that.
    r = CutReader(S)
    meta, payload = bcast_chunks(0, 1, vec(N0, 1))[0]
    forged = dict(meta, chunk=999, offset=999 * CB)
    with pytest.raises(WireError) as e:
        r.check(0, 999, forged, payload, seq=3)
    assert e.value.field == "chunk"
    with pytest.raises(WireError):
        r.take(0, 999, forged, payload)


def test_a_forged_chunk_0_from_far_ahead_does_not_hold_the_real_version_once_overwritten():
    # Regression (soak/hostile.py, seed 6): a well-framed chunk 0 claiming v7955 started a reading that
    # waited for its chunk 1 for ever ("not_yet"); the real v1 that overwrote chunk 0 was never read.
    r = CutReader(S)
    forged = bcast_chunks(0, 7955, vec(N0, 9), vdigest="7" * 64)
    real = bcast_chunks(0, 1, vec(N0, 1))
    assert r.take(0, 0, *forged[0], seq=1) == "accept"
    assert r.take(0, 1, *bcast_chunks(0, 0, vec(N0, 0))[1], seq=2) == "wait"  # not_yet
    # the real v1 lands: its chunk 0's notice drops the forged reading
    assert r.chunk_changed(0, 0, 1, real[0][0]["digest"]) is True
    assert r.reading(0) is None and r.next_chunks(0)[0].index == 0
    assert [r.take(0, m["chunk"], m, p, seq=10 + i) for i, (m, p) in enumerate(real)][-1] == "complete"
    # notices of the version being read, or of other chunks, change nothing
    real2 = bcast_chunks(0, 2, vec(N0, 2))
    assert r.take(0, 0, *real2[0], seq=20) == "accept"
    assert not r.chunk_changed(0, 0, 2, real2[0][0]["digest"]) and not r.chunk_changed(0, 1, 3, "x")
    assert r.reading(0) == (2, 1, len(real2))


def test_fixed_reader_reads_only_the_wanted_versions():
    r = CutReader(S, dtype="f32", fixed=True)
    want = vec(N0, 7)
    r.want(0, 4, digest_of(want))
    assert not r.announce(0, 5, digest_of(vec(N0, 8)))  # notices change nothing
    assert r.take(0, 0, *bcast_chunks(0, 5, vec(N0, 8), every=True)[0]) == "wait" and r.counters["ignored"] == 1
    with pytest.raises(VersionConflict):  # the wanted version with another digest than the manifest's
        r.take(0, 0, *bcast_chunks(0, 4, vec(N0, 9), every=True)[0])
    # FINAL: every chunk carries the version digest (a BCAST-style chunk 0 without one is refused)
    with pytest.raises(WireError) as e:
        r.take(0, 0, *bcast_chunks(0, 4, want)[0])
    assert e.value.field == "version_digest" and e.value.value is None
    assert read(r, 0, bcast_chunks(0, 4, want, every=True))[-1] == "complete" and r.held[0][0] == 4


# ---- the seal: cut-through broadcasts ---------------------------------------------------------------

def test_cut_through_chunks_land_one_by_one_and_only_the_seal_completes_the_version():
    # The syncer publishes chunks 0..n-2 of v2 while it still merges, the seal (last chunk, with the
    # version digest) once v2 is durable. Until then the last subject holds v1's seal.
    r = CutReader(S)
    c1, v2 = bcast_chunks(0, 1, vec(N0, 1)), vec(N0, 2)
    c2 = bcast_chunks(0, 2, v2)
    n = len(c2)
    assert n > 3 and read(r, 0, c1)[-1] == "complete"
    assert "version_digest" not in c2[0][0] and c2[-1][0]["version_digest"] == digest_of(v2)
    for k in range(n - 1):  # chunk k of v2 lands; the next subject still holds v1: read on, then wait
        assert r.announce(0, 2, c2[k][0].get("version_digest")) and r.pending() == [0]
        assert r.take(0, k, *c2[k]) == "accept"
        nxt = c1[k + 1]
        assert r.take(0, k + 1, *nxt) == "wait" and r.reading(0) == (2, k + 1, n)
    for _ in range(3):  # boundaries pass: the reading waits at the seal, nothing completes
        assert r.take(0, n - 1, *c1[-1]) == "wait"
    assert r.held[0] == (1, digest_of(vec(N0, 1))) and r.reading(0) == (2, n - 1, n)
    assert r.announce(0, 2, digest_of(v2))  # the seal's notice
    assert r.take(0, n - 1, *c2[-1]) == "complete" and r.held[0] == (2, digest_of(v2)) and r.reading(0) is None


def test_chunk_0_republished_with_the_same_bytes_keeps_the_reading():
    # A restarted syncer re-issues a version as it was (same bytes): chunk 0's notice keeps the reading.
    r = CutReader(S)
    v3 = vec(N0, 3)
    c3 = bcast_chunks(0, 3, v3)
    assert read(r, 0, c3[:2]) == ["accept", "accept"]
    assert r.chunk_changed(0, 0, 3, c3[0][0]["digest"]) is False
    assert r.reading(0) == (3, 2, len(c3)) and r.counters["chunk0_changed"] == 0
    assert read(r, 0, c3[2:])[-1] == "complete" and r.held[0] == (3, digest_of(v3))


def test_chunk_0_republished_with_other_bytes_under_the_same_version_restarts_the_reading():
    # A syncer restarted before v3 was durable merges it again with other bytes and re-publishes v3
    # from chunk 0: the old reading is dropped, v3 completes only from the new bytes.
    r = CutReader(S)
    old, new = vec(N0, 3), vec(N0, 4)
    a, b = bcast_chunks(0, 3, old), bcast_chunks(0, 3, new)
    assert a[0][0]["digest"] != b[0][0]["digest"]
    assert read(r, 0, a[:3]) == ["accept"] * 3
    assert r.chunk_changed(0, 0, 3, b[0][0]["digest"]) is True
    assert r.reading(0) is None and r.next_chunks(0)[0].index == 0 and r.counters["chunk0_changed"] == 1
    assert read(r, 0, b)[-1] == "complete" and r.held[0] == (3, digest_of(new))
    # ... and old chunks hashed with a new seal (the notice came too late) are refused by the seal
    r2 = CutReader(S)
    with pytest.raises(DigestMismatch):
        read(r2, 0, a[:3] + b[3:])
    assert 0 not in r2.held and r2.reading(0) is None


def test_a_chunk_already_read_republished_with_other_bytes_drops_the_reading():
    # A forged chunk 1 of the version being read (valid chunk digest: all BCAST can check before the
    # seal) is read; the real chunk 1 then overwrites it. Its notice drops the reading, and the
    # version is read again whole from the real bytes (the seal alone would refuse the mix, and
    # then nothing new would land to read it again).
    r = CutReader(S)
    real, forged = bcast_chunks(0, 4, vec(N0, 4)), bcast_chunks(0, 4, vec(N0, 5))
    assert read(r, 0, real[:1] + forged[1:3]) == ["accept"] * 3
    assert not r.chunk_changed(0, 2, 4, forged[2][0]["digest"])  # the bytes read there: keep
    assert not r.chunk_changed(0, 1, 3, real[1][0]["digest"])  # an older version there: not this reading's
    assert not r.chunk_changed(0, 3, 4, real[3][0]["digest"])  # not read yet: read when the reading gets there
    assert r.reading(0) == (4, 3, len(real))
    assert r.chunk_changed(0, 1, 4, real[1][0]["digest"]) is True
    assert r.reading(0) is None and r.counters["chunk_changed"] == 1 and r.next_chunks(0)[0].index == 0
    assert read(r, 0, real)[-1] == "complete" and r.held[0] == (4, digest_of(vec(N0, 4)))


def test_a_seal_whose_digest_does_not_match_installs_nothing():
    r = CutReader(S)
    v5 = vec(N0, 5)
    c5 = bcast_chunks(0, 5, v5)
    assert read(r, 0, c5[:-1]) == ["accept"] * (len(c5) - 1)
    bad_seal = (dict(c5[-1][0], version_digest=digest_of(vec(N0, 6))), c5[-1][1])
    with pytest.raises(DigestMismatch) as e:
        r.take(0, len(c5) - 1, *bad_seal, seq=40)
    assert e.value.field == "version_digest"
    assert 0 not in r.held and r.reading(0) is None and r.counters["completed"] == 0


@pytest.mark.parametrize("where", ["missing on the seal", "on chunk 0"])
def test_a_bcast_chunk_breaking_the_seal_rule_is_refused(where):
    r = CutReader(S)
    c = bcast_chunks(0, 1, vec(N0, 1))
    if where == "missing on the seal":
        idx, meta = len(c) - 1, {k: v for k, v in c[-1][0].items() if k != "version_digest"}
    else:
        idx, meta = 0, dict(c[0][0], version_digest=c[-1][0]["version_digest"])
    if idx:
        assert read(r, 0, c[:-1]) == ["accept"] * (len(c) - 1)
    with pytest.raises(WireError) as e:
        r.take(0, idx, meta, c[idx][1], seq=5)
    assert e.value.field == "version_digest" and r.refused == {(0, idx): 5}
    assert 0 not in r.held and r.reading(0) is None


def test_a_staging_in_memory_reuses_the_arrays_of_the_anchor_the_last_commit_replaced():
    store = AnchorStore()
    numels = {"w": 1000, "b": 10}
    anchors = []
    for v in range(3):
        store.begin(0, v, numels)
        if v == 2:   # version 1's commit replaced version 0's anchor: its arrays take this staging
            assert store.staged(0, "w").data_ptr() == anchors[0]
        for n, k in numels.items():
            store.stage(0, n, 0, torch.full((k,), float(v)))
        store.commit(0, owned=list(numels))
        anchors.append(store.anchor(0, "w", 0, 1000).data_ptr())
        assert store.anchor(0, "w", 0, 1000).tolist() == [float(v)] * 1000
        assert store.anchor(0, "b", 0, 10).tolist() == [float(v)] * 10
    assert store.nbytes() == 2 * 4 * 1010   # the anchor and one spare, never more
    store.begin(1, 0, {"x": 7})            # other sizes: new arrays, the spare let go
    assert store.nbytes() == 4 * 1010 + 4 * 7
    store.close()
    assert store.nbytes() == 0
