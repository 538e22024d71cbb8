"""docs/design.md §4.10, sparse broadcasts on the island (learner/update_reader.py through learner/island_wire.py)
against a real nats-server, the syncer's side played by hand (tests/island_support.py): an island at v−1 takes
v from its update message (bit for bit the syncer's params); an update that does not check (wrong seal, bytes
that do not decode) is refused naming the field, counted, and the island reads the full cut instead; a dense
run refuses update chunks.
"""
from __future__ import annotations

import pytest
import torch

from tests.island_support import anchor_flat, boundary, net, publish_v, started, until
from yeto.schemas import codec
from yeto.schemas import outer_mode as OM
from yeto.schemas import sparse_bcast as SB
from yeto.schemas import subjects as S
from yeto.schemas.chunks import version_digest
from yeto.schemas.dtypes import pack
from yeto.schemas.sparse import SparseTensor
from yeto.schemas.sparse_update import encode_update
from yeto.services.syncer import sparse_merge as SM

pytestmark = pytest.mark.e2e
OUTER = OM.check_outer("sparseloco", tile=8, k=4, chunk_1d=16, k_1d=8, full_every=4)


def step_of(frag: dict, seed: int) -> list[SparseTensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in frag["tensors"]:
        n = int(t["numel"])
        idx = torch.randperm(n, generator=g)[: max(1, n // 8)].sort().values
        out.append(SparseTensor(idx, torch.randn(idx.numel(), generator=g) * 1e-2))
    return out


def stepped(frag: dict, base: torch.Tensor, steps: list[SparseTensor]) -> torch.Tensor:
    """The syncer's params after the step (its merge's `FragmentStep.apply`, i.e. `apply_step_`)."""
    out = base.clone()
    SM.FragmentStep(torch.cat([s.indices + int(t["offset"]) for s, t in zip(steps, frag["tensors"])]),
                    torch.cat([s.values for s in steps])).apply(out, 0)
    return out


async def publish_update(js, run: str, session: dict, fid: int, version: int, message: bytes, vdigest: str) -> int:
    outer = OM.from_session(session)
    chunks = SB.update_chunks(message, run=run, fragment=fid, version=version, version_digest=vdigest,
                              chunk_bytes=session["chunk_bytes"], full_every=outer.full_every)
    for subject, msg_id, payload, meta in chunks:
        await js.publish(subject, bytes(payload), headers={S.MSG_ID: msg_id, codec.CHUNK_HEADER: meta.header()})
    return len(chunks)


async def test_an_island_at_v_minus_1_applies_updates_and_falls_back_to_full_cuts(island_env):
    island, session, syncer = island_env(net())
    session = OM.pin(session, OUTER)
    syncer.session = session
    await started(island_env, island, session)
    assert island.wire.updates is not None
    fid, frag = 1, session["fragments"][1]
    v0 = syncer.values(fid, 2)
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), fid: v0})
    assert await boundary(island) and island.state.version(fid) == 0

    # v1 from its update: the island's anchor is the syncer's params, bit for bit
    steps = step_of(frag, 3)
    v1 = stepped(frag, v0, steps)
    msg = encode_update(steps, SM.shapes(frag), OM.parse_pin(OUTER).spec)
    n = await publish_update(syncer.js, syncer.run, session, fid, 1, msg, version_digest(pack(v1, "f32")))
    await until(lambda: len(island.client.bcast) >= n, what="update notices")
    assert await boundary(island)
    assert island.state.version(fid) == 1 and torch.equal(anchor_flat(island, fid), v1)
    assert island.counters["bcast.update.applied"] == 1 and island.counters["bcast.update.bytes"] == len(msg)

    # v2's update sealed with another digest (not what applying it gives): refused, counted, not installed
    steps2 = step_of(frag, 4)
    v2 = stepped(frag, v1, steps2)
    msg2 = encode_update(steps2, SM.shapes(frag), OM.parse_pin(OUTER).spec)
    n = await publish_update(syncer.js, syncer.run, session, fid, 2, msg2, version_digest(pack(v1 + 1, "f32")))
    await until(lambda: len(island.client.bcast) >= n, what="v2 update notices")
    assert await boundary(island)
    assert island.state.version(fid) == 1
    assert island.counters["rejected.digest_mismatch"] == 1 and island.counters["bcast.update.refused"] == 1
    # ... so the island reads v2's full cut (the syncer's re-broadcast, or its next full cut)
    await publish_v(syncer, island, 2, {fid: v2})
    assert await boundary(island)
    assert island.state.version(fid) == 2 and torch.equal(anchor_flat(island, fid), v2)

    # v3's update truncated (framing and chunk digests valid, the message not): refused naming the field
    steps3 = step_of(frag, 5)
    v3 = stepped(frag, v2, steps3)
    msg3 = encode_update(steps3, SM.shapes(frag), OM.parse_pin(OUTER).spec)
    n = await publish_update(syncer.js, syncer.run, session, fid, 3, msg3[:-8], version_digest(pack(v3, "f32")))
    await until(lambda: len(island.client.bcast) >= n, what="v3 update notices")
    assert await boundary(island)
    assert island.state.version(fid) == 2 and island.counters["rejected.malformed"] == 1, island.counters
    assert island.counters["bcast.update.refused"] == 2
    # the island trains on; v4 (a full cut as every 4th) brings it back, and v5's update applies on it
    v4 = syncer.values(fid, 9)
    await publish_v(syncer, island, 4, {fid: v4})
    assert await boundary(island) and island.state.version(fid) == 4
    steps5 = step_of(frag, 6)
    v5 = stepped(frag, v4, steps5)
    msg5 = encode_update(steps5, SM.shapes(frag), OM.parse_pin(OUTER).spec)
    n = await publish_update(syncer.js, syncer.run, session, fid, 5, msg5, version_digest(pack(v5, "f32")))
    await until(lambda: len(island.client.bcast) >= n, what="v5 update notices")
    assert await boundary(island)
    assert island.state.version(fid) == 5 and torch.equal(anchor_flat(island, fid), v5)
    assert island.counters["bcast.update.applied"] == 2


async def test_a_dense_run_refuses_update_chunks_naming_encoding(island_env):
    island, session, syncer = island_env(net())
    await started(island_env, island, session)
    v0 = syncer.values(1, 2)
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: v0})
    assert await boundary(island) and island.wire.updates is None
    frag = session["fragments"][1]
    steps = step_of(frag, 3)
    msg = encode_update(steps, SM.shapes(frag), OM.parse_pin(OUTER).spec)
    pinned = OM.pin(session, OUTER)   # only to cut the chunks: the run itself stays dense
    n = await publish_update(syncer.js, syncer.run, pinned, 1, 1, msg, version_digest(pack(stepped(frag, v0, steps), "f32")))
    await until(lambda: len(island.client.bcast) >= n, what="update notices")
    assert await boundary(island)
    assert island.state.version(1) == 0 and island.counters["rejected.invalid"] == n, island.counters


async def test_a_joiner_reads_the_full_cut_then_the_updates_kept_after_it(island_env):
    """The island starts after version 0's full cut and the updates of versions 1 and 2 are on BCAST (the
    watcher announces the newest message of every subject): it installs the full cut, then each update in
    turn at the next boundaries, without a new notice, ending on the syncer's v2 bit for bit."""
    island, session, syncer = island_env(net())
    session = OM.pin(session, OUTER)
    syncer.session = session
    fid, frag = 1, session["fragments"][1]
    spec = OM.parse_pin(OUTER).spec
    v = [syncer.values(fid, 2)]
    await syncer.bcast(0, 0, syncer.values(0, 1))
    await syncer.bcast(fid, 0, v[0])
    n = 1 + syncer.bcast_chunks(fid)
    for version in (1, 2):
        steps = step_of(frag, 10 + version)
        v.append(stepped(frag, v[-1], steps))
        n += await publish_update(syncer.js, syncer.run, session, fid, version, encode_update(steps, SM.shapes(frag), spec),
                             version_digest(pack(v[-1], "f32")))
    await started(island_env, island, session)
    await until(lambda: len(island.client.bcast) >= n, what="notices")
    for _ in range(4):
        assert await boundary(island)
    assert island.state.version(fid) == 2 and torch.equal(anchor_flat(island, fid), v[2])
    assert island.counters["bcast.update.applied"] == 2
