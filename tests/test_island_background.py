"""The island's sync worker (learner/background.py) against a real nats-server, the
syncer side played by hand (tests/test_island_local.py's helpers): versions are read whole while the
loop trains and installed only at the next boundary, exactly as a boundary that read them itself
would; a push carries the values of the boundary that took its snapshot, whatever the parameters do
after it; q4 error feedback and the final cut work as before.
"""
from __future__ import annotations

import asyncio

import torch

from tests.test_island_local import (ISLAND, anchor_flat, assemble_push, bits, boundary, env, frag_values,  # noqa: F401 (env: fixture)
                                     net, publish_v, residual_flat, started, steplog_lines, until)
from yeto.schemas.dtypes import q4_with_feedback, unpack


async def test_versions_are_read_while_training_and_installed_at_the_next_boundary(env):  # noqa: F811 - the env fixture, imported
    alpha = 0.25
    island, session, syncer = env(net(), alpha=alpha, background=True)
    await started(env, island, session)
    assert island.worker is not None
    before = {fid: frag_values(island, fid) for fid in (0, 1)}
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)   # read whole by the worker, no boundary in between
    for fid in (0, 1):   # staged, not installed: the parameters are the loop's until a boundary
        assert torch.equal(frag_values(island, fid), before[fid])
    assert island.state.versions() == {}
    assert await boundary(island)
    for fid in (0, 1):   # first version: overwrite, bit for bit
        assert torch.equal(bits(frag_values(island, fid)), bits(v0[fid]))
    assert island.state.versions() == {"0": 0, "1": 0} and island.wire.ready == {}

    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.add_(0.5)
    local = frag_values(island, 1)
    v1, v2 = syncer.values(1, 3), syncer.values(1, 4)
    await publish_v(syncer, island, 1, {1: v1})
    # v2 lands while v1 waits for the boundary: v1's staging is kept, v2 is read after v1 is installed
    await syncer.bcast(1, 2, v2)
    await asyncio.sleep(0.3)
    assert island.wire.ready[1][0] == 1
    assert await boundary(island)
    want = alpha * local.double() + (1 - alpha) * v1.double()
    assert torch.allclose(frag_values(island, 1).double(), want, rtol=0, atol=1e-6)
    assert torch.equal(anchor_flat(island, 1), v1)
    await until(lambda: island.wire.ready.get(1, (None,))[0] == 2, what="v2 read whole after v1 was installed")
    after_v1 = frag_values(island, 1)
    assert await boundary(island)
    want = alpha * after_v1.double() + (1 - alpha) * v2.double()
    assert torch.allclose(frag_values(island, 1).double(), want, rtol=0, atol=1e-6)
    assert torch.equal(anchor_flat(island, 1), v2) and island.state.versions() == {"0": 0, "1": 2}
    events = steplog_lines(island)
    assert [e["applies"] for e in events] == [2, 1, 1]
    # the reading's time is the worker's, reported beside the boundary's own (which only installs)
    assert all(e["extra"]["background_s"] >= 0 for e in events) and sum(e["extra"]["background_s"] for e in events) > 0
    assert sum(e["bytes_in"] for e in events) >= 4 * (session["fragments"][0]["numel"] + 3 * session["fragments"][1]["numel"])


async def test_a_push_carries_the_values_of_the_boundary_that_took_its_snapshot(env):  # noqa: F811 - the env fixture, imported
    island, session, syncer = env(net(), background=True)
    await started(env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    await syncer.pull(1, 2, 0, [(ISLAND, island.gen)])
    await until(lambda: island.client.counters["pulls_received"] >= 1, what="pull")
    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.mul_(1.5).add_(0.125)
    local1 = frag_values(island, 1)
    assert await boundary(island, tokens=3)
    with torch.no_grad():   # the next steps move the parameters while the worker may still be sending
        for p in island.adapter.module.parameters():
            p.add_(100.0)
    chunks = await syncer.pushes(ISLAND, 1, syncer.bcast_chunks(1))
    last, payload = assemble_push(chunks, syncer.numel(1))
    assert (last["step"], last["base_version"], last["c_steps"], last["c_tokens"]) == (2, 0, 1, 3)
    assert torch.equal(bits(unpack(payload, "f32", syncer.numel(1))), bits(local1 - v0[1]))
    for _ in range(100):   # a boundary after the acks reaps them (under load they may take a few)
        assert await boundary(island)
        if island.book.pending() == 0:
            break
        await asyncio.sleep(0.1)
    assert island.book.pending() == 0
    assert island.counters["pushes"] == 1


async def test_q4_error_feedback_survives_the_worker(env, tmp_path):  # noqa: F811 - the env fixture, imported
    island, session, syncer = env(net(), push_dtype="q4", background=True)
    await started(env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    g = torch.Generator().manual_seed(5)
    residual = None
    for step in (2, 4):
        await syncer.pull(1, step, 0, [(ISLAND, island.gen)])
        await until(lambda: island.client.counters["pulls_received"] >= step // 2, what="pull")
        with torch.no_grad():
            for p in island.adapter.module.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        d = frag_values(island, 1) - v0[1]
        assert await boundary(island)
        chunks = [c for c in await syncer.pushes(ISLAND, 1, step // 2) if c[0]["step"] == step]  # one q4 chunk each
        sent = assemble_push(chunks, syncer.numel(1))[1]
        want, r = q4_with_feedback(d, residual)
        assert sent == bytes(want.numpy())
        # the residual is kept once the push's acks are reaped, at a later boundary
        for _ in range(50):
            assert await boundary(island)
            if island.residual(1) is not None and torch.equal(residual_flat(island, 1), r):
                break
            await asyncio.sleep(0.05)
        assert torch.equal(residual_flat(island, 1), r)
        residual = r


async def test_with_several_ranks_the_worker_keeps_the_staging_for_the_boundary(env):  # noqa: F811 - the env fixture, imported
    """An island of several ranks stages as a collective of its group, which only the training thread
    may run, so its worker keeps a version's stage operations and chunks (IslandWire.defer) and the
    boundary that installs the version hands them to the ranks first. One process plays the group here
    (the lead's operations run on its own rank); tests/test_island_pieces.py runs a TP=2 island of two
    gloo ranks through this path against an independent reference."""
    alpha = 0.25
    island, session, syncer = env(net(), alpha=alpha, background=True)
    await started(env, island, session)
    island.wire.defer = True
    store = island.ops.store
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    for fid, v in v0.items():
        await syncer.bcast(fid, 0, v)
    # fragment 0 read whole by the worker: parked, its staging kept back; fragment 1 waits, since rank 0
    # keeps one fragment's bytes at a time
    await until(lambda: 0 in island.wire.ready, what="fragment 0 read whole")
    await asyncio.sleep(0.5)
    assert list(island.wire._deferred) == [0] and list(island.wire.ready) == [0]
    assert store.staging(0) is None and store.staging(1) is None   # nothing handed to the ranks yet
    assert await boundary(island)   # installs fragment 0; the worker then reads fragment 1
    assert torch.equal(bits(frag_values(island, 0)), bits(v0[0]))   # first version: overwrite, bit for bit
    await until(lambda: 1 in island.wire.ready, what="fragment 1 read whole after fragment 0 was installed")
    assert list(island.wire._deferred) == [1] and store.staging(1) is None
    assert await boundary(island)
    assert torch.equal(bits(frag_values(island, 1)), bits(v0[1]))
    assert island.wire._deferred == {} and island.state.versions() == {"0": 0, "1": 0}

    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.add_(0.5)
    local = frag_values(island, 1)
    v1 = syncer.values(1, 3)
    await publish_v(syncer, island, 1, {1: v1})
    assert store.staging(1) is None and {op["version"] for op, _ in island.wire._deferred[1]} == {1}
    assert await boundary(island)
    want = alpha * local.double() + (1 - alpha) * v1.double()
    assert torch.allclose(frag_values(island, 1).double(), want, rtol=0, atol=1e-6)
    assert torch.equal(anchor_flat(island, 1), v1) and island.state.versions() == {"0": 0, "1": 1}
