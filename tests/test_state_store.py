"""docs/design.md §11: the committed state kept in the run's state KV (services/syncer/state_store.py), against a
real nats-server: saved versions restore bitwise into an empty directory on "another host", an older
version's chunks go once the manifest names the new one, the intent travels too, and a torn save (chunks
without their manifest) restores the previous version, complete."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from yeto.schemas.provision import RunLimits, kv as kv_handle, provision_run
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState
from yeto.services.syncer.state_store import StateStore
from tests.e2e_procs import kv_keys

SESSION = {"fragments": [{"id": 0, "numel": 1000}, {"id": 1, "numel": 37}], "session_fingerprint": "s" * 64,
           "layout_fingerprint": "l" * 64}


def _state(run, versions, step):
    return CheckpointState(run=run, session_fingerprint="s" * 64, layout_fingerprint="l" * 64, committed_step=step,
                           versions=dict(versions), version_digests={f: f"d{v}" for f, v in versions.items()})


def _frag(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


def _dies_after_chunks(n):
    """A lease guard that lets `n` chunk puts through and then raises, as a kill mid-save would stop it."""
    calls = 0

    async def guard():
        nonlocal calls
        calls += 1
        if calls > n:
            raise RuntimeError("killed")

    return guard


@pytest.fixture
async def store(nc, run_id):
    js = nc.jetstream(timeout=10)
    await provision_run(js, run_id, RunLimits.small())
    kv = await kv_handle(js, run_id, "ckpt")
    yield StateStore(js, run_id, kv, Counter(), shard=0, chunk_bytes=256), kv


async def test_saved_versions_restore_bitwise_into_an_empty_directory(store, run_id, tmp_path):
    st, kv = store
    v0 = {0: _frag(1, 1000), 1: _frag(2, 37)}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), v0, {})
    v1 = {0: _frag(3, 1000)}
    await st.save(_state(run_id, {0: 1, 1: 0}, 1), v1, {0: 0})
    await st.put_intent(1, {"merge": {"step": 2}, "seqs": [5, 6]})
    assert await st.has_state()
    other_host = CheckpointDir(tmp_path / "standby")
    state = await st.restore_into(other_host, SESSION, {0: 1000, 1: 37})
    assert state.versions == {0: 1, 1: 0} and state.committed_step == 1
    assert other_host.read_state().versions == {0: 1, 1: 0} and other_host.read_session() == SESSION
    for fid, v, (p, m) in ((0, 1, v1[0]), (1, 0, v0[1])):
        got_p, got_m = other_host.load_fragment(fid, v, p.numel())
        assert torch.equal(got_p, p) and torch.equal(got_m, m)
    assert other_host.read_intent(1)["seqs"] == [5, 6]
    # version 0 of fragment 0 is gone from the KV (purged once version 1's manifest landed)
    keys = await kv_keys(kv)
    assert not [k for k in keys if k.startswith("ckpt.0.f0.v0.")], sorted(keys)
    assert [k for k in keys if k.startswith("ckpt.0.f0.v1.p.")]


async def test_a_save_torn_before_its_manifest_restores_the_previous_version(store, run_id, tmp_path):
    st, kv = store
    v0 = {0: _frag(1, 1000), 1: _frag(2, 37)}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), v0, {})

    st.guard = _dies_after_chunks(5)
    with pytest.raises(RuntimeError, match="killed"):
        await st.save(_state(run_id, {0: 1, 1: 0}, 1), {0: _frag(9, 1000)}, {0: 0})
    st.guard = _none
    state = await st.restore_into(CheckpointDir(tmp_path / "standby"), SESSION, {0: 1000, 1: 37})
    assert state.versions == {0: 0, 1: 0}
    got_p, _ = CheckpointDir(tmp_path / "standby").load_fragment(0, 0, 1000)
    assert torch.equal(got_p, v0[0][0])
    # the torn version's chunks no manifest names: the next owner purges them when it starts
    keys = await kv_keys(kv)
    assert [k for k in keys if k.startswith("ckpt.0.f0.v1.")], sorted(keys)
    assert await st.purge_unnamed() == 1
    keys = await kv_keys(kv)
    assert not [k for k in keys if k.startswith("ckpt.0.f0.v1.")], sorted(keys)
    assert len([k for k in keys if k.startswith("ckpt.0.f0.v0.")]) == 2 * 16 and "ckpt.0.manifest" in keys
    assert await st.purge_unnamed() == 0


async def _none():
    return None


async def test_restore_names_what_is_missing(store, run_id, tmp_path):
    st, kv = store
    with pytest.raises(RuntimeError, match="no checkpoint manifest"):
        await st.restore_into(CheckpointDir(tmp_path / "a"), SESSION, {0: 1000, 1: 37})
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), {0: _frag(1, 1000), 1: _frag(2, 37)}, {})
    await kv.purge("ckpt.0.f1.v0.m.0")
    with pytest.raises(RuntimeError, match=r"ckpt\.0\.f1\.v0\.m\.0 is missing .* fragment 1 is incomplete"):
        await st.restore_into(CheckpointDir(tmp_path / "b"), SESSION, {0: 1000, 1: 37})


async def test_a_standby_keeps_the_cut_warm_and_a_takeover_fetches_only_what_is_newer(store, run_id, tmp_path):
    """state_store.py `warm`: a standby's passes fetch each committed version once; the takeover's restore
    moves the warm fragments into place and fetches only what was committed after the last pass."""
    from yeto.services.syncer.state_store import WARM_DIR

    st, _ = store
    numels = {0: 1000, 1: 37}
    chunks = {0: 1000 * 4 // 256 + 1, 1: 1}   # 256-byte chunks: 16, and one for the 37 elements
    ckpt = CheckpointDir(tmp_path / "standby")
    warm = CheckpointDir(ckpt.path / WARM_DIR)
    assert await st.warm(warm, numels) == 0   # nothing committed yet
    v0 = {0: _frag(1, 1000), 1: _frag(2, 37)}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), v0, {})
    assert await st.warm(warm, numels) == 2
    assert st.counters["state_store.warm_chunks"] == 2 * (chunks[0] + chunks[1])
    assert await st.warm(warm, numels) == 0   # a pass with nothing new fetches nothing
    assert st.counters["state_store.warm_chunks"] == 2 * (chunks[0] + chunks[1])
    v1 = {0: _frag(3, 1000)}
    await st.save(_state(run_id, {0: 1, 1: 0}, 1), v1, {0: 0})
    assert await st.warm(warm, numels) == 1
    assert sorted(p.name for p in warm.path.iterdir()) == ["frag-0-v1.momentum", "frag-0-v1.params",
                                                           "frag-1-v0.momentum", "frag-1-v0.params"]
    # committed after the last pass: fragment 1 version 1 is fetched at the takeover, fragment 0 moved
    v2 = {1: _frag(4, 37)}
    await st.save(_state(run_id, {0: 1, 1: 1}, 2), v2, {1: 0})
    state = await st.restore_into(ckpt, SESSION, numels, warm=warm)
    assert state.versions == {0: 1, 1: 1}
    assert st.counters["state_store.restored_warm"] == 1
    assert st.counters["state_store.restore_chunks"] == 2 * chunks[1]
    for fid, v, (p, m) in ((0, 1, v1[0]), (1, 1, v2[1])):
        got_p, got_m = ckpt.load_fragment(fid, v, p.numel())
        assert torch.equal(got_p, p) and torch.equal(got_m, m)
    assert not (warm.path / "frag-0-v1.params").exists()   # moved, not copied


async def test_a_torn_save_then_other_bytes_for_the_same_version_restores_the_second(store, run_id, tmp_path):
    """A save torn by a crash put some chunks of version 1; the version could not be redone, so its round ran
    again and gave version 1 other bytes. The second save puts the same keys: a restore must get its bytes
    (per-save Nats-Msg-Ids; with one id per key JetStream's duplicate window kept the first bytes)."""
    st, kv = store
    v0 = {0: _frag(1, 1000), 1: _frag(2, 37)}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), v0, {})
    torn = _frag(7, 1000)
    st.guard = _dies_after_chunks(5)
    with pytest.raises(RuntimeError, match="killed"):
        await st.save(_state(run_id, {0: 1, 1: 0}, 1), {0: torn}, {0: 0})
    st.guard = _none
    again = _frag(8, 1000)
    await st.save(_state(run_id, {0: 1, 1: 0}, 1), {0: again}, {0: 0})
    other_host = CheckpointDir(tmp_path / "standby")
    state = await st.restore_into(other_host, SESSION, {0: 1000, 1: 37})
    assert state.versions == {0: 1, 1: 0}
    got_p, got_m = other_host.load_fragment(0, 1, 1000)
    assert torch.equal(got_p, again[0]) and torch.equal(got_m, again[1])
    assert not torch.equal(got_p[:64], torn[0][:64])   # the torn save did reach the first chunks


async def test_a_version_streamed_while_the_merge_makes_it_restores_bitwise(store, run_id, tmp_path):
    """The merge puts each chunk of params and momentum once its outer step made it final (StateStream),
    in place on the fragment's tensors; the commit's save then only waits for the acks. A chunk not yet
    whole (the merge's spans need not match the store's chunks) is never put early."""
    st, kv = store
    v0 = {0: _frag(1, 1000), 1: _frag(2, 37)}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), v0, {})
    params, momentum = v0[0][0].clone(), v0[0][1].clone()   # the fragment's tensors, stepped in place
    new_p, new_m = _frag(3, 1000)
    stream = st.stream(0, 1, params, momentum)
    before = st.counters["state_store.chunks"]
    for off in range(0, 1000, 100):   # spans of 100 elements; the store's chunks hold 64
        params[off: off + 100], momentum[off: off + 100] = new_p[off: off + 100], new_m[off: off + 100]
        await stream.put_ready(off + 100)
        # chunks wholly within the first off + 100 elements; the last (960..999) once all are done
        assert stream.next == (16 if off + 100 == 1000 else (off + 100) // 64), (off, stream.next)
        if off == 0:
            assert st.counters["state_store.chunks"] - before == 2 * 1   # put before the merge ends
    assert st.counters["state_store.chunks"] - before == 2 * 16
    await st.save(_state(run_id, {0: 1, 1: 0}, 1), {0: (params, momentum)}, {0: 0}, streamed={0: stream})
    assert st.counters["state_store.chunks"] - before == 2 * 16   # flushed by the save, never put twice
    other_host = CheckpointDir(tmp_path / "standby")
    state = await st.restore_into(other_host, SESSION, {0: 1000, 1: 37})
    assert state.versions == {0: 1, 1: 0}
    got_p, got_m = other_host.load_fragment(0, 1, 1000)
    assert torch.equal(got_p, new_p) and torch.equal(got_m, new_m)
    keys = await kv_keys(kv)
    assert not [k for k in keys if k.startswith("ckpt.0.f0.v0.")], sorted(keys)


async def test_a_stream_torn_mid_merge_restores_the_previous_version_and_a_redo_wins(store, run_id, tmp_path):
    """A syncer killed mid-merge leaves some streamed chunks of the new version and no manifest naming them:
    a restore gets the previous version whole; the round run again streams the same version with other
    bytes, and a restore then gets those (the stream's own attempt id in every Nats-Msg-Id)."""
    st, kv = store
    v0 = {0: _frag(1, 1000), 1: _frag(2, 37)}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), v0, {})
    torn_p, torn_m = _frag(7, 1000)
    st.guard = _dies_after_chunks(5)
    stream = st.stream(0, 1, torn_p, torn_m)
    with pytest.raises(RuntimeError, match="killed"):
        await stream.put_ready(1000)
    st.guard = _none
    state = await st.restore_into(CheckpointDir(tmp_path / "a"), SESSION, {0: 1000, 1: 37})
    assert state.versions == {0: 0, 1: 0}
    assert torch.equal(CheckpointDir(tmp_path / "a").load_fragment(0, 0, 1000)[0], v0[0][0])
    again_p, again_m = _frag(8, 1000)
    stream = st.stream(0, 1, again_p, again_m)
    await stream.put_ready(1000)
    await st.save(_state(run_id, {0: 1, 1: 0}, 1), {0: (again_p, again_m)}, {0: 0}, streamed={0: stream})
    other_host = CheckpointDir(tmp_path / "b")
    state = await st.restore_into(other_host, SESSION, {0: 1000, 1: 37})
    got_p, got_m = other_host.load_fragment(0, 1, 1000)
    assert torch.equal(got_p, again_p) and torch.equal(got_m, again_m)
    assert not torch.equal(got_p[:64], torn_p[:64])


async def test_a_save_refuses_a_stream_of_another_version(store, run_id):
    st, _ = store
    p, m = _frag(1, 1000)
    stream = st.stream(0, 2, p, m)
    with pytest.raises(RuntimeError, match="version 2 was streamed, the commit names 1"):
        await st.save(_state(run_id, {0: 1}, 1), {0: (p, m)}, {}, streamed={0: stream})


async def test_a_sparse_run_stores_and_restores_params_alone(store, run_id, tmp_path):
    """docs/design.md §4.10: the sparse outer mode has no momentum: a save puts params chunks only (streamed
    or whole), a standby's warm pass and a takeover's restore fetch and write params only, bitwise."""
    from yeto.services.syncer.state_store import WARM_DIR

    st, kv = store
    session = {**SESSION, "outer": {"mode": "sparseloco", "tile": 64, "k": 64, "chunk_1d": 64, "k_1d": 64,
                                    "value_bits": 2, "beta": 0.95}}
    numels = {0: 1000, 1: 37}
    p0 = {0: _frag(1, 1000)[0], 1: _frag(2, 37)[0]}
    await st.save(_state(run_id, {0: 0, 1: 0}, 0), {f: (p, None) for f, p in p0.items()}, {})
    ckpt = CheckpointDir(tmp_path / "standby")
    warm = CheckpointDir(ckpt.path / WARM_DIR)
    assert await st.warm(warm, numels, momentum=False) == 2
    assert sorted(p.name for p in warm.path.iterdir()) == ["frag-0-v0.params", "frag-1-v0.params"]
    params = p0[0].clone()   # version 1 streamed while "the merge" steps it in place
    stream = st.stream(0, 1, params, None)
    new = _frag(3, 1000)[0]
    for off in range(0, 1000, 100):
        params[off: off + 100] = new[off: off + 100]
        await stream.put_ready(off + 100)
    await st.save(_state(run_id, {0: 1, 1: 0}, 1), {0: (params, None)}, {0: 0}, streamed={0: stream})
    keys = await kv_keys(kv)
    assert [k for k in keys if ".p." in k] and not [k for k in keys if ".m." in k], sorted(keys)
    state = await st.restore_into(ckpt, session, numels, warm=warm)
    assert state.versions == {0: 1, 1: 0} and st.counters["state_store.restored_warm"] == 1   # fragment 1 moved
    assert sorted(p.name for p in ckpt.path.glob("frag-*")) == ["frag-0-v1.params", "frag-1-v0.params"]
    for fid, v, want in ((0, 1, new), (1, 0, p0[1])):
        got, mom = ckpt.load_fragment(fid, v, want.numel(), momentum=False)
        assert mom is None and torch.equal(got, want)
