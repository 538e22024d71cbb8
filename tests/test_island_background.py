"""The island's sync worker (learner/background.py) against a real nats-server, the
syncer side played by hand (tests/island_support.py): versions are read whole while the
loop trains and installed only at the next boundary, exactly as a boundary that read them itself
would; a push carries the values of the boundary that took its snapshot, whatever the parameters do
after it; q4 error feedback and the final cut work as before.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from yeto.learner.adapters import gather_fragment
from yeto.learner.island_modes import StageDeferred
from yeto.schemas.dtypes import q4_with_feedback, unpack
from tests.island_support import (ISLAND, anchor_flat, assemble_push, bits, boundary, dp_finish, dp_hello, dp_island,
                                  dp_join, frag_values, net, publish_v, residual_flat, started, steplog_lines, until)


async def test_versions_are_read_while_training_and_installed_at_the_next_boundary(island_env):
    alpha = 0.25
    island, session, syncer = island_env(net(), alpha=alpha, background=True)
    await started(island_env, island, session)
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


async def test_a_push_carries_the_values_of_the_boundary_that_took_its_snapshot(island_env):
    island, session, syncer = island_env(net(), background=True)
    await started(island_env, island, session)
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


async def test_q4_error_feedback_survives_the_worker(island_env, tmp_path):
    island, session, syncer = island_env(net(), push_dtype="q4", background=True)
    await started(island_env, island, session)
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


async def test_with_several_ranks_the_worker_keeps_the_staging_for_the_boundary(island_env):
    """An island of several ranks whose group is not the whole world has no staging group
    (learner/stager.py): staging is a collective of its group, which only the training thread may run,
    so its worker keeps a version's stage operations and chunks (StageDeferred, learner/island_modes.py) and the boundary that
    installs the version hands them to the ranks first. One process plays the group here (the lead's
    operations run on its own rank); islands of several gloo ranks over the whole world stage on a
    staging group instead (the test below, and tests/test_island_pieces.py against an independent
    reference)."""
    alpha = 0.25
    island, session, syncer = island_env(net(), alpha=alpha, background=True)
    await started(island_env, island, session)
    with island.worker.lock:   # the worker's mode, kept back as in a group without a staging group
        island.wire.use(dataclasses.replace(island.wire.mode, staging=StageDeferred(island.wire.mode.staging.lead)))
    kept = island.wire.mode.staging.kept
    store = island.ops.store
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    for fid, v in v0.items():
        await syncer.bcast(fid, 0, v)
    # fragment 0 read whole by the worker: parked, its staging kept back; fragment 1 waits, since rank 0
    # keeps one fragment's bytes at a time
    await until(lambda: 0 in island.wire.ready, what="fragment 0 read whole")
    await asyncio.sleep(0.5)
    assert list(kept) == [0] and list(island.wire.ready) == [0]
    assert store.staging(0) is None and store.staging(1) is None   # nothing handed to the ranks yet
    assert await boundary(island)   # installs fragment 0; the worker then reads fragment 1
    assert torch.equal(bits(frag_values(island, 0)), bits(v0[0]))   # first version: overwrite, bit for bit
    await until(lambda: 1 in island.wire.ready, what="fragment 1 read whole after fragment 0 was installed")
    assert list(kept) == [1] and store.staging(1) is None
    assert await boundary(island)
    assert torch.equal(bits(frag_values(island, 1)), bits(v0[1]))
    assert kept == {} and island.state.versions() == {"0": 0, "1": 0}

    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.add_(0.5)
    local = frag_values(island, 1)
    v1 = syncer.values(1, 3)
    await publish_v(syncer, island, 1, {1: v1})
    assert store.staging(1) is None and {op.version for op, _ in kept[1]} == {1}
    assert await boundary(island)
    want = alpha * local.double() + (1 - alpha) * v1.double()
    assert torch.allclose(frag_values(island, 1).double(), want, rtol=0, atol=1e-6)
    assert torch.equal(anchor_flat(island, 1), v1) and island.state.versions() == {"0": 0, "1": 1}


async def test_the_stopped_worker_gives_the_wire_back_the_training_threads_mode(island_env):
    """The worker owns the wire while it runs (learner/island_modes.py): stopped (as before the final
    cut), it hands back the training thread's mode, and what its mode kept back from the ranks goes with
    it; the boundary then reads on the training thread and stages on the ranks directly."""
    island, session, syncer = island_env(net(), background=True)
    await started(island_env, island, session)
    assert island.wire.mode.background and island.wire.mode is not island.wire.foreground
    with island.worker.lock:
        island.wire.use(dataclasses.replace(island.wire.mode, staging=StageDeferred(island.wire.mode.staging.lead)))
    kept = island.wire.mode.staging.kept
    await syncer.bcast(0, 0, syncer.values(0, 1))
    await until(lambda: 0 in island.wire.ready, what="fragment 0 read whole")
    assert list(kept) == [0]
    island._stop_worker()
    assert island.worker is None and island.wire.mode is island.wire.foreground
    assert kept == {} and island.wire.ready == {} and island.store.staging(0) is None
    v0 = syncer.values(1, 2)
    await publish_v(syncer, island, 0, {1: v0})   # the notices wait for the boundary: no worker drains them
    assert await boundary(island)   # read, staged and installed on the training thread
    assert torch.equal(bits(frag_values(island, 1)), bits(v0)) and island.state.version(1) == 0


def _staging_rank(rank: int, world: int, init_file: str, url: str, run: str, out: str) -> None:
    """One rank of a data-parallel island of two gloo ranks (see the test below)."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = net(0)
        island = dp_island(model, url, run, background=True).start()
        rec: dict = {"stager": island.stager is not None, "staging_group": island.staging is not None}
        for _ in range(3000):   # v0 of both fragments: the same on every rank after each boundary
            if island.state.versions() == {"0": 0, "1": 0}:
                break
            assert island.boundary(tokens=4)
            time.sleep(0.01)
        rec["v0"] = island.state.versions()
        with torch.no_grad():
            for p in model.parameters():   # a step of training, the same on both replicas
                p.add_(0.25)
        if rank == 0:
            open(f"{out}/phase1", "w").close()   # the test broadcasts v1 of fragment 1 now
        # No boundary now: the ranks "train" while the worker reads v1 and stages it on every rank.
        frag = island.frags[1]
        want = torch.randn(frag["numel"], generator=torch.Generator().manual_seed(3))   # the test's v1
        deadline, staged = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            if island.store.staging(1) == 1:
                staged = torch.cat([island.store.staged(1, t["name"]).clone() for t in frag["tensors"]])
                if torch.equal(bits(staged), bits(want)):
                    break
            time.sleep(0.02)
        rec["staged_while_training"] = staged is not None and torch.equal(bits(staged), bits(want))
        while rank == 0 and 1 not in island.wire.ready and time.monotonic() < deadline:
            time.sleep(0.02)   # staged is not yet parked: the seal's digest is checked after the last chunk
        rec["before"] = gather_fragment(island.adapter, frag).clone()
        assert island.boundary(tokens=4)   # installs v1: the commit alone
        rec["after"] = gather_fragment(island.adapter, frag).clone()
        rec["v1"] = island.state.versions()
        if rank == 0:
            open(f"{out}/phase2", "w").close()   # the test sends the final cut now
        while island.boundary(tokens=0):
            time.sleep(0.01)
        rec["finalized"] = island.finalized
        rec["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        island.close()
        rec["stager_ended"] = island.stager is None or island.stager.join(0.0)
        torch.save(rec, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


async def test_with_several_ranks_a_version_is_staged_on_every_rank_while_they_train(island_env, tmp_path):
    """An island of two gloo ranks (the whole world): the worker stages a version on every rank over a
    staging group of its own (learner/stager.py) while the ranks are between boundaries, so the boundary
    that installs it only commits. The install is still the blend, the same on both replicas, and the
    final cut is exact; both staging threads end with the run."""
    import os

    import torch.multiprocessing as mp

    alpha = 0.5   # IslandConfig's default
    _, session, syncer = island_env(net())
    session = dict(session, init_island="syncer-side")
    await island_env.write_session(session)
    ctx = mp.start_processes(_staging_rank, args=(2, str(tmp_path / "pg"), island_env.nats_url, syncer.run, str(tmp_path)),
                             nprocs=2, join=False, start_method="spawn")
    try:
        gen = (await dp_hello(island_env.js, syncer.run))["gen"]
        for fid, seed in ((0, 1), (1, 2)):
            await syncer.bcast(fid, 0, syncer.values(fid, seed))
        await until(lambda: os.path.exists(tmp_path / "phase1"), timeout=60, what="v0 installed on both ranks")
        v1 = syncer.values(1, 3)
        await syncer.bcast(1, 1, v1)
        await until(lambda: os.path.exists(tmp_path / "phase2"), timeout=60, what="v1 installed on both ranks")
        final = {0: syncer.values(0, 10), 1: syncer.values(1, 11)}
        await dp_finish(island_env.js, syncer, gen, final, 3, {"0": 1, "1": 2})
        await dp_join(ctx)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["staging_group"] and r1["staging_group"] and not r0["stager"] and r1["stager"]
    assert r0["v0"] == r1["v0"] == {"0": 0, "1": 0}
    # the point: rank 1 held the whole of v1 in its staging before its training thread reached a boundary
    assert r0["staged_while_training"] and r1["staged_while_training"]
    for r in (r0, r1):
        want = alpha * r["before"].double() + (1 - alpha) * v1.double()
        assert torch.allclose(r["after"].double(), want, rtol=0, atol=1e-6)
        assert r["v1"] == {"0": 0, "1": 1} and r["finalized"] and r["stager_ended"]
    assert torch.equal(bits(r0["after"]), bits(r1["after"]))
    for fid, frag in enumerate(session["fragments"]):
        for r in (r0, r1):
            for t in frag["tensors"]:
                assert torch.equal(bits(r["params"][t["name"]].reshape(-1)),
                                   bits(final[fid][t["offset"]: t["offset"] + t["numel"]]))
