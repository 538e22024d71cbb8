"""docs/design.md §4.10, §8, §11: in the sparse mode with an f32 bulk the ckpt KV keeps a version as the update
message from the one before (services/syncer/state_store.py, state_chain.py), against a real nats-server: a
chain (a full version, then updates) restores and warms bitwise equal to params stepped with plain torch, a
full version frees the chain before it, and a missing or corrupt update, or bytes that do not hash to the
recorded digest, are refused naming the key; the checkpoint directory keeps the same chains as files."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from yeto.schemas import outer_mode as OM
from yeto.schemas.provision import RunLimits, kv as kv_handle, provision_run
from yeto.schemas.sparse import SparseTensor
from yeto.schemas.sparse_update import encode_update
from yeto.services.syncer.checkpoint import CheckpointDir, CheckpointState, sha256_of
from yeto.services.syncer.state_store import WARM_DIR, StateStore
from tests.e2e_procs import kv_keys

EVERY = 4
TENSORS = [{"shape": [64, 96], "offset": 0, "numel": 6144}, {"shape": [37], "offset": 6144, "numel": 37}]
N = 6181
SESSION = {"fragments": [{"id": 0, "numel": N, "tensors": TENSORS}], "outer": OM.check_outer("sparseloco",
           full_every=EVERY), "bulk_dtype": "f32", "session_fingerprint": "s" * 64, "layout_fingerprint": "l" * 64}
SPEC = OM.from_session(SESSION).spec


def _versions(top):
    """Params of versions 0..top and the update messages making 1..top: each step moves a few values, and
    the params are stepped with plain torch (θ[i] - s[i] in f32), not with yeto's apply_step_."""
    g = torch.Generator().manual_seed(5)
    params, msgs = [torch.randn(N, generator=g)], [None]
    for _ in range(top):
        steps, p = [], params[-1].clone()
        for t in TENSORS:
            idx = torch.randperm(t["numel"], generator=g)[:25].sort().values
            val = torch.randn(25, generator=g) * 1e-3
            steps.append(SparseTensor(idx, val))
            p[t["offset"] + idx] = p[t["offset"] + idx] - val
        params.append(p)
        msgs.append(encode_update(steps, [t["shape"] for t in TENSORS], SPEC))
    return params, msgs


def _state(run, v, digests):
    return CheckpointState(run=run, session_fingerprint="s" * 64, layout_fingerprint="l" * 64, committed_step=v,
                           versions={0: v}, version_digests={0: digests[v]})


@pytest.fixture
async def chain(nc, run_id):
    """A store that saved versions 0..3 of fragment 0 (0 full, 1..3 as updates), and what it saved."""
    js = nc.jetstream(timeout=10)
    await provision_run(js, run_id, RunLimits.small())
    kv = await kv_handle(js, run_id, "ckpt")
    st = StateStore(js, run_id, kv, Counter(), shard=0, chunk_bytes=256)
    params, msgs = _versions(5)
    digests = [sha256_of(p) for p in params]

    async def save(v, store=st):
        await store.save(_state(run_id, v, digests), {0: (params[v].clone(), None)}, {0: v - 1} if v else {},
                         updates={0: msgs[v]} if v else None, digests_before={0: digests[v - 1]} if v else None,
                         full_every=EVERY)

    for v in range(4):
        await save(v)
    return st, kv, params, msgs, save


def _kinds(keys, v):
    return sorted({k.split(".")[4] for k in keys if k.startswith(f"ckpt.0.f0.v{v}.")})


async def test_a_chain_restores_bitwise_and_a_full_version_frees_it(chain, tmp_path):
    st, kv, params, msgs, save = chain
    keys = await kv_keys(kv)
    assert [_kinds(keys, v) for v in range(4)] == [["p"], ["u"], ["u"], ["u"]], sorted(keys)
    assert st.counters["state_store.update_bytes"] == sum(len(m) for m in msgs[1:4])
    host = CheckpointDir(tmp_path / "a")
    state = await st.restore_into(host, SESSION, {0: N})
    assert state.versions == {0: 3} and st.counters["state_store.chain_reads"] == 1
    got, _ = host.load_fragment(0, 3, N, momentum=False)
    assert torch.equal(got.view(torch.int32), params[3].view(torch.int32))
    # version 4 is a full_every-th: written full, and the chain 0..3 is purged; 5 is an update on it
    await save(4)
    keys = await kv_keys(kv)
    assert [_kinds(keys, v) for v in range(5)] == [[], [], [], [], ["p"]], sorted(keys)
    await save(5)
    host = CheckpointDir(tmp_path / "b")
    await st.restore_into(host, SESSION, {0: N})
    got, _ = host.load_fragment(0, 5, N, momentum=False)
    assert torch.equal(got.view(torch.int32), params[5].view(torch.int32))


async def test_a_new_store_continues_the_chain_and_a_dense_save_has_no_chains(chain, nc, run_id, tmp_path):
    """A restarted owner's store reads the chain from the manifest (purge_unnamed at its claim) and keeps
    writing updates after it; a store knowing no chain for the version before writes it full."""
    st, kv, params, msgs, save = chain
    again = StateStore(st.js, run_id, kv, Counter(), shard=0, chunk_bytes=256)
    assert await again.purge_unnamed() == 0 and again.chains[0].versions == range(0, 4)
    assert again.plans_update(0, 4, EVERY) is False and again.plans_update(0, 3, 16) is False
    await save(4, again)    # full (a full_every-th)
    await save(5, again)
    assert _kinds(await kv_keys(kv), 5) == ["u"]
    raw = (await kv.get("ckpt.0.manifest")).value
    assert b'"chains":{"0":{"base":4' in raw


async def test_a_standby_warms_a_chain_fetching_only_the_updates(chain, run_id, tmp_path):
    st, kv, params, msgs, save = chain
    ckpt = CheckpointDir(tmp_path / "standby")
    warm = CheckpointDir(ckpt.path / WARM_DIR)
    assert await st.warm(warm, {0: N}, momentum=False, session=SESSION) == 1
    full_chunks = st.counters["state_store.warm_chunks"]
    assert full_chunks == (N * 4 + 255) // 256 + sum((len(m) + 255) // 256 for m in msgs[1:4])
    assert await st.warm(warm, {0: N}, momentum=False) == 0   # nothing new: no session needed
    await save(4)
    await save(5)
    # version 5 = full 4 + update 5: the warm copy holds 3, not in that chain, so 4 is fetched whole
    assert await st.warm(warm, {0: N}, momentum=False, session=SESSION) == 1
    # a sixth version as an update: only its update's chunks are fetched, applied to the warm copy of 5
    params.append(_apply(params[5], msgs[1]))
    d = [sha256_of(p) for p in params]
    await st.save(_state(run_id, 6, d), {0: (params[6].clone(), None)}, {0: 5}, updates={0: msgs[1]},
                  digests_before={0: d[5]}, full_every=EVERY)
    before = st.counters["state_store.warm_chunks"]
    assert await st.warm(warm, {0: N}, momentum=False, session=SESSION) == 1
    assert st.counters["state_store.warm_chunks"] - before == (len(msgs[1]) + 255) // 256
    state = await st.restore_into(ckpt, SESSION, {0: N}, warm=warm)
    assert state.versions == {0: 6} and st.counters["state_store.restored_warm"] == 1
    got, _ = ckpt.load_fragment(0, 6, N, momentum=False)
    assert torch.equal(got.view(torch.int32), params[6].view(torch.int32))


def _apply(p, msg):
    from yeto.schemas.sparse_update import decode_update
    out = p.clone()
    for t, s in zip(TENSORS, decode_update(msg, [t["shape"] for t in TENSORS], SPEC)):
        i = t["offset"] + s.indices
        out[i] = out[i] - s.values
    return out


async def test_a_missing_or_corrupt_update_or_base_is_refused_naming_the_key(chain, tmp_path):
    st, kv, params, msgs, save = chain
    last = (len(msgs[2]) - 1) // 256   # the chunk holding the message's last value
    good = (await kv.get(f"ckpt.0.f0.v2.u.{last}")).value
    flipped = bytearray(good)
    flipped[-1] ^= 0x80                # the last value's sign: decodes, hashes otherwise
    await kv.put(f"ckpt.0.f0.v2.u.{last}", bytes(flipped))
    with pytest.raises(RuntimeError, match=r"update ckpt\.0\.f0\.v2\.u\.\* is refused: .*version_digest"):
        await st.restore_into(CheckpointDir(tmp_path / "a"), SESSION, {0: N})
    await kv.put(f"ckpt.0.f0.v2.u.{last}", good)
    head = (await kv.get("ckpt.0.f0.v2.u.0")).value
    await kv.put("ckpt.0.f0.v2.u.0", b"\x00" * len(head))
    with pytest.raises(RuntimeError, match=r"update ckpt\.0\.f0\.v2\.u\.\* is refused: .*header\.magic"):
        await st.restore_into(CheckpointDir(tmp_path / "b"), SESSION, {0: N})
    await kv.put("ckpt.0.f0.v2.u.0", head)
    await kv.purge(f"ckpt.0.f0.v2.u.{last}")
    with pytest.raises(RuntimeError, match=rf"ckpt\.0\.f0\.v2\.u\.{last} is missing .* version 2 of fragment 0"):
        await st.restore_into(CheckpointDir(tmp_path / "c"), SESSION, {0: N})
    await kv.put(f"ckpt.0.f0.v2.u.{last}", good)
    base = bytearray((await kv.get("ckpt.0.f0.v0.p.3")).value)
    base[0] ^= 1
    await kv.put("ckpt.0.f0.v0.p.3", bytes(base))
    with pytest.raises(RuntimeError, match=r"ckpt\.0\.f0\.v0\.p\.\* hash to .* the manifest's chain recorded"):
        await st.restore_into(CheckpointDir(tmp_path / "d"), SESSION, {0: N})


async def test_the_checkpoint_directory_keeps_the_same_chains_and_loads_them_bitwise(tmp_path):
    """The directory's side (checkpoint.py, model_store.py): versions between full ones are
    `frag-F-vN.update` files named by checkpoint.json's `chains`, a resume loads them bitwise, a full
    version prunes the chain before it, and a corrupt or missing update file is refused naming it."""
    from yeto.services.syncer.checkpoint import CheckpointError
    from yeto.services.syncer.model_store import ModelStore

    params, msgs = _versions(5)
    digests = [sha256_of(p) for p in params]
    ckpt = CheckpointDir(tmp_path / "ckpt")
    ckpt.write_session(SESSION)
    model = ModelStore(None, "r", Counter(), ckpt)
    model.set_session(SESSION)

    async def commit(v):
        model.frags[0] = model.frags[0].__class__(N, params[v].clone(), None)
        updates = {0: msgs[v]} if v else None
        assert model.dir_plans_update(0, v) == (v not in (0, EVERY))
        state, _ = model.next_state({0: v}, {0: digests[v]}, step=v, attempts={}, records=[], updates=updates)
        await model.save_checkpoint(state, {0: v}, {}, updates)
        await model.prune(state, {0: v})
        return state

    for v in range(4):
        state = await commit(v)
    names = sorted(q.name for q in ckpt.path.glob("frag-*"))
    assert names == ["frag-0-v0.params", "frag-0-v1.update", "frag-0-v2.update", "frag-0-v3.update"], names
    assert ckpt.read_state().chains == state.chains and list(state.chains[0].versions) == [0, 1, 2, 3]
    again = ModelStore(None, "r", Counter(), ckpt)
    again.set_session(SESSION)
    again.load(ckpt.read_state().versions, ckpt.read_state().chains)
    assert torch.equal(again.frags[0].params.view(torch.int32), params[3].view(torch.int32))
    (ckpt.path / "frag-0-v2.update").write_bytes(b"\0" * 40)
    with pytest.raises(CheckpointError, match=r"frag-0-v2\.update is refused: .*header"):
        again.load(state.versions, state.chains)
    (ckpt.path / "frag-0-v2.update").unlink()
    with pytest.raises(CheckpointError, match=r"lacks frag-0-v2\.update"):
        again.load(state.versions, state.chains)
    (ckpt.path / "frag-0-v2.update").write_bytes(msgs[2])
    for v in (4, 5):
        state = await commit(v)
    names = sorted(q.name for q in ckpt.path.glob("frag-*"))
    assert names == ["frag-0-v4.params", "frag-0-v5.update"], names
    again.load(state.versions, state.chains)
    assert torch.equal(again.frags[0].params.view(torch.int32), params[5].view(torch.int32))
