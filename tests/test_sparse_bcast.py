"""docs/design.md §4.10, sparse broadcasts (schemas/sparse_bcast.py): which versions go out as update messages,
the decision rules an island follows (apply the update vs read a full cut), the update chunks' headers on the
wire, applying an update to an anchor against the seal, `--sparse-full-every`, and BCAST bytes per round."""
from __future__ import annotations

import orjson
import pytest
import torch

from yeto.schemas import codec
from yeto.schemas import outer_mode as OM
from yeto.schemas import sparse_bcast as SB
from yeto.schemas.chunks import DigestMismatch, VersionDigest, byte_plan, check_chunk, chunk_plan, plan_nbytes
from yeto.schemas.errors import ConfigError, DecodeError, SchemaError, WireError
from yeto.schemas.layout import build_session
from yeto.schemas.messages import BcastChunk, cut_chunk
from yeto.schemas.sparse import SparseTensor
from yeto.schemas.sparse_update import encode_update, update_nbytes
from yeto.services.syncer import sparse_merge as SM

LAYOUT = [{"name": "a.w", "shape": [70, 40], "dtype": "float32"}, {"name": "a.b", "shape": [70], "dtype": "float32"},
          {"name": "c.w", "shape": [33, 9], "dtype": "float32"}]
OUTER = OM.parse_pin(OM.check_outer("sparseloco", tile=8, k=4, chunk_1d=16, k_1d=8, full_every=4))


def session(chunk_bytes: int = 256) -> dict:
    s = build_session(LAYOUT, 1, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=chunk_bytes,
                      init_island="a", sync_every=2, created=1.0)
    return OM.pin(s, OUTER.to_pin())


def random_steps(frag, per_chunk: int, seed: int = 0) -> list[SparseTensor]:
    """An update with up to `per_chunk` entries in every chunk of every tensor (islands × k at most)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in frag["tensors"]:
        n = int(t["numel"])
        idx = torch.randperm(n, generator=g)[: max(1, min(n, per_chunk * max(1, n // 64)))].sort().values
        out.append(SparseTensor(idx, torch.randn(idx.numel(), generator=g) * 1e-2))
    return out


# ---- which versions go out how ----------------------------------------------------------------------

def test_full_cuts_at_version_0_and_every_full_every_updates_for_every_later_f32_version():
    assert [v for v in range(10) if SB.sends_full(v, 4)] == [0, 4, 8]
    assert [v for v in range(10) if SB.sends_update(v, "f32")] == list(range(1, 10))
    assert not any(SB.sends_update(v, "bf16") for v in range(10))   # bf16 anchors hold rounded bytes
    assert [SB.slot(v, 4) for v in range(1, 9)] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert SB.update_subject("r", 2, 3, 0) == "yeto.r.bcast.2.u3-0"
    with pytest.raises(WireError, match="slot"):
        SB.update_subject("r", 2, -1, 0)


# ---- decision rules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("held,version,verdict", [
    (4, 5, "apply"),     # at v-1: apply, check the digest
    (5, 5, "old"), (7, 5, "old"),
    (None, 5, "full"),   # a joiner (nothing held yet)
    (3, 5, "full"),      # missed version 4 (or a resumed island behind)
])
def test_decide(held, version, verdict):
    assert SB.decide(held, SB.UpdateHead(version, version - 1)) == verdict


def test_plan_updates_when_the_chain_is_kept_else_the_full_cut_then_its_chain():
    N = 4   # the updates of the last 4 versions are kept (slots), one full cut on the chunk subjects
    assert SB.plan(9, 9, 8, N) == []
    assert SB.plan(8, 9, 8, N) == [("update", 9)]
    assert SB.plan(6, 9, 8, N) == [("update", 7), ("update", 8), ("update", 9)]
    # behind the kept chain (held 5 < 9-4+1-1): the full cut, then the updates after it
    assert SB.plan(4, 9, 8, N) == [("full", 8), ("update", 9)]
    assert SB.plan(None, 9, 8, N) == [("full", 8), ("update", 9)]   # a joiner
    assert SB.plan(None, 8, 8, N) == [("full", 8)]
    assert SB.plan(None, 0, 0, N) == [("full", 0)]
    # a re-broadcast put version 7 on the chunk subjects: full 7 then 8, 9
    assert SB.plan(None, 9, 7, N) == [("full", 7), ("update", 8), ("update", 9)]
    # a full cut older than the kept chain is read alone; the next full cut catches up
    assert SB.plan(None, 12, 7, N) == [("full", 7)]
    assert SB.plan(None, 9, None, N) == []            # no full cut yet
    assert SB.plan(2, 9, 1, N) == []                  # the full cut is behind what is held: wait
    for held in (None, *range(0, 20)):              # never more than N-1 updates after a full cut
        for newest in range(0, 20):
            p = SB.plan(held, newest, newest - newest % N, N)
            ups = [v for k, v in p if k == "update"]
            assert len(ups) <= N - 1 or p[0][0] == "update"
            if p and p[0][0] == "full":
                assert ups == list(range(p[0][1] + 1, newest + 1))


# ---- headers on the wire ----------------------------------------------------------------------------

def header(**over) -> dict:
    spans = chunk_plan(100, "f32", 1024)
    meta = cut_chunk(spans, 0, b"\0" * 400, run="r", fragment=0, version=5, dtype="f32", version_digest="a" * 64,
                     base_version=4).to_wire()
    meta.update(over)
    return {k: v for k, v in meta.items() if v is not None}


def test_update_chunk_headers_round_trip_and_the_codec_checks_the_base():
    meta = header()
    assert meta["encoding"] == "sparse-update" and meta["base_version"] == 4
    back = BcastChunk.from_header(codec.encode_header("bcast_chunk", meta))
    assert (back.encoding, back.base_version) == ("sparse-update", 4)
    # a full cut's header has neither field (dense and sparse runs' full cuts unchanged on the wire)
    full = cut_chunk(chunk_plan(100, "f32", 1024), 0, b"\0" * 400, run="r", fragment=0, version=5, dtype="f32",
                     version_digest="a" * 64).to_wire()
    assert "encoding" not in {k for k, v in full.items() if v is not None}
    for bad, field in ((dict(base_version=3), "base_version"), (dict(base_version=None), "base_version"),
                       (dict(encoding=None), "base_version"), (dict(encoding="sparseloco"), "encoding")):
        with pytest.raises(SchemaError) as ei:
            codec.decode_header("bcast_chunk", _raw(header(**bad)))
        assert ei.value.field == field


def _raw(meta: dict) -> bytes:
    return orjson.dumps({"v": 1, **meta})


def test_check_head_names_the_field():
    assert SB.check_head(header(), sparse=True, bulk_dtype="f32") == SB.UpdateHead(5, 4)
    assert SB.check_head({"version": 5}, sparse=True, bulk_dtype="f32") is None
    for meta, kw, field in ((header(), dict(sparse=False, bulk_dtype="f32"), "encoding"),
                            (header(), dict(sparse=True, bulk_dtype="bf16"), "encoding"),
                            (header(encoding="gzip"), dict(sparse=True, bulk_dtype="f32"), "encoding"),
                            (header(base_version=2), dict(sparse=True, bulk_dtype="f32"), "base_version"),
                            (header(version=0, base_version=-1), dict(sparse=True, bulk_dtype="f32"), "version"),
                            ({"version": 5, "base_version": 4}, dict(sparse=True, bulk_dtype="f32"), "base_version")):
        with pytest.raises(WireError) as ei:
            SB.check_head(meta, **kw)
        assert ei.value.field == field


def test_update_chunks_are_byte_chunks_on_the_slot_subjects_sealed_with_the_full_digest():
    s = session(chunk_bytes=256)
    frag = s["fragments"][0]
    msg = encode_update(random_steps(frag, 8), SM.shapes(frag), OUTER.spec)
    out = SB.update_chunks(msg, run="r", fragment=0, version=6, version_digest="b" * 64, chunk_bytes=256,
                           full_every=OUTER.full_every)
    assert len(out) > 1 and b"".join(bytes(p) for _, _, p, _ in out) == msg
    for i, (subject, msg_id, payload, meta) in enumerate(out):
        assert subject == f"yeto.r.bcast.0.u2-{i}" and msg_id == f"bcast.0.6.u{i}"
        wire = codec.decode_header("bcast_chunk", meta.header())
        assert (wire["encoding"], wire["base_version"], wire["version"]) == ("sparse-update", 5, 6)
        assert ("version_digest" in wire) == (i == len(out) - 1)
        check_chunk(byte_plan(len(msg), 256), wire, payload)


# ---- applying an update to an anchor ----------------------------------------------------------------

def test_apply_update_gives_the_syncers_bytes_and_refuses_a_wrong_anchor_or_bad_bytes():
    s = session()
    frag = s["fragments"][0]
    g = torch.Generator().manual_seed(1)
    anchor = torch.randn(frag["numel"], generator=g)
    steps = random_steps(frag, 8, seed=2)
    # the syncer's side: its merge step (sparse_merge.FragmentStep.apply, apply_step_) on its params
    params = anchor.clone()
    fs = SM.FragmentStep(torch.cat([t.indices + int(f["offset"]) for t, f in zip(steps, frag["tensors"])]),
                         torch.cat([t.values for t in steps]))
    fs.apply(params, 0)
    vdigest = VersionDigest().update(params).hexdigest()
    msg = encode_update(steps, SM.shapes(frag), OUTER.spec)
    got = SB.apply_update(anchor, msg, frag, OUTER.spec, vdigest)
    assert torch.equal(got, params) and not torch.equal(anchor, params)   # bit for bit; the anchor untouched
    with pytest.raises(DigestMismatch) as ei:   # an anchor that is not the base version
        SB.apply_update(anchor + 1e-3, msg, frag, OUTER.spec, vdigest)
    assert ei.value.field == "version_digest"
    with pytest.raises(DecodeError) as ei:
        SB.apply_update(anchor, msg[:-3], frag, OUTER.spec, vdigest)
    assert ei.value.field.startswith("tensors.")
    with pytest.raises(DecodeError) as ei:
        SB.apply_update(anchor, b"XXXX" + msg[4:], frag, OUTER.spec, vdigest)
    assert ei.value.field == "header.magic"
    # in place (the island's mirror): the same bits, and a refused update leaves the params as they were
    mirror = anchor.clone()
    SB.apply_update_(mirror, msg, frag, OUTER.spec, vdigest)
    assert torch.equal(mirror.view(torch.int32), params.view(torch.int32))
    wrong = anchor + 1e-3
    before = wrong.clone()
    with pytest.raises(DigestMismatch):
        SB.apply_update_(wrong, msg, frag, OUTER.spec, vdigest)
    assert torch.equal(wrong.view(torch.int32), before.view(torch.int32))
    with pytest.raises(DecodeError):
        SB.apply_update_(wrong, msg[:-3], frag, OUTER.spec, vdigest)
    assert torch.equal(wrong.view(torch.int32), before.view(torch.int32))


# ---- the flag ---------------------------------------------------------------------------------------

def test_sparse_full_every_is_pinned_and_checked():
    assert "full_every" not in OM.check_outer("sparseloco")            # the default: pins as before
    assert OM.parse_pin(OM.check_outer("sparseloco")).full_every == OM.DEFAULT_FULL_EVERY == 16
    assert OM.check_outer("sparseloco", full_every=4)["full_every"] == 4
    codec.validate("session", session(chunk_bytes=1024))   # the pinned object passes the session schema
    for bad in (0, 4097, 2.5, True):
        with pytest.raises(ConfigError) as ei:
            OM.check_outer("sparseloco", full_every=bad)
        assert ei.value.field == "--sparse-full-every"
    with pytest.raises(WireError) as ei:
        OM.parse_pin({**OM.check_outer("sparseloco"), "full_every": 0})
    assert ei.value.field == "outer.full_every"


def test_cli_flag():
    from yeto.services.cli import build_parser
    args = build_parser().parse_args(["syncer", "--run", "r", "--outer", "sparseloco", "--sparse-full-every", "8"])
    assert args.sparse_full_every == 8
    assert build_parser().parse_args(["syncer", "--run", "r"]).sparse_full_every == 16


# ---- bytes per round --------------------------------------------------------------------------------

def test_bcast_bytes_per_round_dense_vs_sparse(capsys):
    """A 4096 × 1024 f32 weight at the defaults (tile 64, k 64) with two islands: a full cut is 16 MiB; an
    update carries at most islands × k entries per tile at 5.5 bytes each."""
    spec = OM.parse_pin(OM.check_outer("sparseloco")).spec
    shape, islands = (4096, 1024), 2
    dense = plan_nbytes(chunk_plan(shape[0] * shape[1], "f32", 1 << 20))
    entries = islands * spec.k * (shape[0] // 64) * (shape[1] // 64)
    sparse = update_nbytes([shape], [entries], spec)
    assert sparse == 14 + 12 + 2 * 1024 + entries * 3 // 2 + 4 * entries
    with capsys.disabled():
        print(f"\nBCAST bytes per round, one 4096x1024 f32 fragment, 2 islands, k=64/4096: dense {dense:,}, "
              f"sparse update {sparse:,} ({100 * sparse / dense:.2f} %); with a full cut every 16 versions "
              f"{dense / 16 + sparse:,.0f} a round on average")
    assert sparse < dense / 20


def test_the_cut_watcher_takes_update_chunks_on_their_slot_subjects_only():
    """learner/cut_notices.py: an update chunk's notice is taken on bcast.F.u<slot>-<chunk> (any slot: the
    reader fetches the slot it computes), refused on a full cut's subject or another chunk's."""
    import asyncio
    from types import SimpleNamespace

    from yeto.learner.cut_notices import notice_callback
    from yeto.learner.inbox import CutInbox

    s = session(chunk_bytes=256)
    frag = s["fragments"][0]
    msg = encode_update(random_steps(frag, 8), SM.shapes(frag), OUTER.spec)
    chunks = SB.update_chunks(msg, run="r", fragment=0, version=6, version_digest="b" * 64, chunk_bytes=256,
                              full_every=OUTER.full_every)
    inbox, rejected = CutInbox(), []
    cb = notice_callback("bcast_chunk", "r", inbox, lambda what, exc: rejected.append(exc.field))
    _, _, payload, meta = chunks[1]
    for subject in ("yeto.r.bcast.0.u2-1", "yeto.r.bcast.0.1", "yeto.r.bcast.0.u2-0", "yeto.r.bcast.1.u2-1",
                    "yeto.r.bcast.0.u2x1"):
        asyncio.run(cb(SimpleNamespace(subject=subject, headers={codec.CHUNK_HEADER: meta.header()}, data=payload)))
    got = inbox.drain()
    assert [n.subject for n in got] == ["yeto.r.bcast.0.u2-1"] and got[0].meta["encoding"] == "sparse-update"
    assert rejected == ["subject"] * 4
    assert SB.parse_update_token("u2-1") == (2, 1) and SB.parse_update_token("3") is None
    assert SB.parse_update_token("u-1") is None and SB.parse_update_token("u1-2-3") is None


def test_the_update_reader_applies_only_on_its_mirror_of_the_base_and_reads_a_refused_update_never_again():
    """learner/update_reader.py without a broker: the decision rules as the island applies them."""
    from types import SimpleNamespace

    from yeto.learner.update_reader import UpdateReader

    s = session(chunk_bytes=256)
    frag = s["fragments"][0]
    ur = UpdateReader.of(s, "r")
    assert ur is not None and UpdateReader.of({**s, "bulk_dtype": "bf16"}, "r") is None
    assert UpdateReader.of({k: v for k, v in s.items() if k != "outer"}, "r") is None
    base = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(7))
    steps = random_steps(frag, 8)
    new = base.clone()
    SM.FragmentStep(torch.cat([t.indices + int(f["offset"]) for t, f in zip(steps, frag["tensors"])]),
                    torch.cat([t.values for t in steps])).apply(new, 0)
    vd = VersionDigest().update(new).hexdigest()
    msg = encode_update(steps, SM.shapes(frag), OUTER.spec)
    chunks = SB.update_chunks(msg, run="r", fragment=0, version=4, version_digest=vd, chunk_bytes=256,
                              full_every=OUTER.full_every)
    store = {subj: SimpleNamespace(headers={codec.CHUNK_HEADER: meta.header()}, data=bytes(p))
             for subj, _, p, meta in chunks}
    seal = codec.decode_header("bcast_chunk", chunks[-1][3].header())
    assert not ur.note(0, codec.decode_header("bcast_chunk", chunks[0][3].header()))   # not the seal
    assert ur.note(0, seal)
    fetch = lambda subjects: [store.get(x) for x in subjects]   # noqa: E731
    assert ur.read(0, 3, fetch) is None               # a joiner: no mirror (it reads a full cut)
    for sp in chunk_plan(frag["numel"], "f32", 256):  # a full cut of version 2 read: the mirror is at 2
        ur.capture(0, sp, base[sp.elem_offset: sp.elem_offset + sp.elem_count].numpy().tobytes(),
                   2 if sp.index == len(chunk_plan(frag["numel"], "f32", 256)) - 1 else None)
    assert ur.mirror[0][0] == 2 and ur.read(0, 2, fetch) is None   # held 2: v4's update is not the next one
    ur.mirror[0] = (3, base.clone())                  # held 3 (as if v3 were applied on this mirror)
    got = ur.read(0, 3, fetch)
    assert got[0] == 4 and got[1] == vd and torch.equal(got[2], new) and ur.mirror[0][0] == 4
    # a chunk overwritten by a newer version in the slot: v4's update is gone, the island reads a full cut
    ur.mirror[0] = (3, base.clone())
    assert ur.note(0, seal)
    newer = SB.update_chunks(msg, run="r", fragment=0, version=8, version_digest=vd, chunk_bytes=256,
                             full_every=OUTER.full_every)
    store2 = dict(store)
    store2[chunks[0][0]] = SimpleNamespace(headers={codec.CHUNK_HEADER: newer[0][3].header()}, data=bytes(newer[0][2]))
    assert ur.read(0, 3, lambda subjects: [store2.get(x) for x in subjects]) is None
    assert ur.next_update(0, 3) is None and ur.counters["gone"] == 1
    assert ur.note(0, seal)   # announced again (a re-send): read again
    # a refused update (an anchor that is not the base: the seal does not match) is never read again
    ur.mirror[0] = (3, base + 1)
    with pytest.raises(DigestMismatch):
        ur.read(0, 3, fetch)
    assert ur.mirror[0][0] == 3 and ur.counters["refused"] == 1
    assert not ur.note(0, seal) and ur.read(0, 3, fetch) is None


def test_the_syncer_sends_the_merge_step_as_its_update_and_a_full_cut_only_where_needed():
    """services/syncer: the merge's step as an update message (`FragmentStep.update_message`) applied to the
    base gives the merge's params bit for bit; `CutPublisher.needs_full` (version 0, every `full_every`-th,
    any version not sent as an update, any dense run)."""
    from collections import Counter

    from yeto.services.syncer.cut import CutPublisher
    from yeto.services.syncer.model_store import ModelStore

    s = session(chunk_bytes=1024)
    frag = s["fragments"][0]
    steps = random_steps(frag, 8, seed=5)
    fs = SM.FragmentStep(torch.cat([t.indices + int(f["offset"]) for t, f in zip(steps, frag["tensors"])]),
                         torch.cat([t.values for t in steps]))
    base = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(6))
    params = base.clone()
    for sp in chunk_plan(frag["numel"], "f32", 1024):   # span by span, as the merge loop steps
        fs.apply(params[sp.elem_offset: sp.elem_offset + sp.elem_count], sp.elem_offset)
    msg = fs.update_message(frag, OUTER)
    assert msg == encode_update(steps, SM.shapes(frag), OUTER.spec)
    assert torch.equal(SB.apply_update(base, msg, frag, OUTER.spec, VersionDigest().update(params).hexdigest()), params)

    model = ModelStore(None, "r", Counter(), None)
    model.set_session(s)
    pub = CutPublisher(None, "r", Counter(), model, None)
    assert [v for v in range(1, 10) if pub.needs_full(v, True)] == [4, 8]
    assert all(pub.needs_full(v, False) for v in range(10))
    model.set_session({k: v for k, v in s.items() if k != "outer"})
    assert all(pub.needs_full(v, True) for v in range(10))
    assert SB.update_msg_id(1, 4, 2) == "bcast.1.4.u2" and SB.update_msg_id(1, 4, 2, 77) == "bcast.1.4.u2.r77"


def test_a_failure_midway_through_an_update_leaves_the_mirror_bit_for_bit(monkeypatch):
    """apply_update_ keeps the values each tensor's step read (apply_step_ returns them) and puts them
    back on a digest mismatch or on any failure after the first tensor moved."""
    from yeto.schemas import sparse_update as SU

    s = session()
    frag = s["fragments"][0]
    base = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(5))
    steps = random_steps(frag, 8, seed=6)
    msg = encode_update(steps, SM.shapes(frag), OUTER.spec)
    t = base[:100].clone()
    old = SU.apply_step_(t, SparseTensor(torch.tensor([3, 7]), torch.tensor([1.0, -2.0])))
    assert old.tolist() == base[[3, 7]].tolist() and t[3] == base[3] - 1.0 and t[7] == base[7] + 2.0
    calls = []
    real = SB.apply_step_

    def fail_second(param, step):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("midway")
        return real(param, step)

    monkeypatch.setattr(SB, "apply_step_", fail_second)
    mirror = base.clone()
    with pytest.raises(RuntimeError):
        SB.apply_update_(mirror, msg, frag, OUTER.spec, "0" * 64)
    assert len(calls) == 2 and torch.equal(mirror.view(torch.int32), base.view(torch.int32))


def test_an_update_is_staged_from_the_mirror_without_a_copy_and_a_deferred_staging_keeps_its_own():
    from yeto.learner.island_modes import StageDeferred
    from yeto.learner.island_ranks import payload_tensor
    from yeto.learner.rank_ops import StageOp
    from yeto.learner.update_reader import UpdateReader

    frag = session()["fragments"][0]
    spans = chunk_plan(frag["numel"], "f32", 256)
    mirror = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(8))
    chunks = UpdateReader.chunks(mirror, spans)
    assert sorted(chunks) == [s.index for s in spans]
    for s in spans:   # views of the mirror, the bytes a full cut of it carries
        c = payload_tensor(chunks[s.index], "f32")
        assert c.data_ptr() == mirror[s.elem_offset:].data_ptr() and c.numel() == s.elem_count
        assert bytes(c.numpy().tobytes()) == mirror.numpy().tobytes()[s.byte_offset: s.byte_offset + s.nbytes]
    with pytest.raises(ValueError):
        payload_tensor(chunks[0], "bf16")
    led = []
    deferred = StageDeferred(lambda op, payloads=None: led.append((op, payloads)))
    deferred.stage(StageOp(0, 5, "f32", tuple(chunks), True), chunks)
    want = mirror.clone()
    mirror.add_(1.0)   # the mirror takes the next update in place before the boundary installs
    deferred.install(0)
    (op, kept), = led
    assert torch.equal(torch.cat([kept[i] for i in sorted(kept)]), want)
