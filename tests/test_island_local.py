"""The island against a real nats-server, with the syncer side played by hand (schemas + nats-py,
tests/island_support.py).

Each test provisions its own run, writes a session record, publishes broadcasts / pulls / final
cut / manifest itself, and reads what the island publishes (pushes, INIT chunks, acks, step log)
from the streams.
"""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import torch

from yeto.learner.adapters import TorchModuleAdapter, gather_fragment
from yeto.learner.config import IslandConfig
from yeto.learner.island import ACK_RESEND_S, Island
from yeto.schemas import codec
from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan, digest, version_digest
from yeto.schemas.conn import ConnectOptions
from yeto.schemas.dtypes import pack, q4_with_feedback, unpack
from yeto.schemas.layout import build_session
from yeto.schemas.provision import RunLimits, kv, provision_run, remove_run
from tests.island_support import (CHUNK_BYTES, ISLAND, Syncer, anchor_flat, assemble, assemble_push, bits, boundary,
                                  dp_finish, dp_hello, dp_island, dp_join, frag_values, net, own_broker, publish_v,
                                  residual_flat, started, steplog_lines, until)

pytestmark = pytest.mark.e2e

# ---- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("anchors", ["memory", "files"])
async def test_v0_overwrites_then_a_later_version_blends_with_alpha(island_env, anchors, tmp_path):
    alpha = 0.25
    # files: through the config (YETO_ANCHOR_DIR); a file left by a SIGKILLed predecessor is removed
    rank_dir = tmp_path / "anchors" / f"{ISLAND}-rank0"
    if anchors == "files":
        rank_dir.mkdir(parents=True)
        (rank_dir / "deadbeef-anchor-f0-123456.f32").write_bytes(b"\0" * 64)
    island, session, syncer = island_env(net(), alpha=alpha, **({"anchor_dir": str(tmp_path / "anchors")} if anchors == "files" else {}))
    await started(island_env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    for fid in (0, 1):  # first version: overwrite, bit for bit, no blend
        assert torch.equal(bits(frag_values(island, fid)), bits(v0[fid]))
    assert island.state.versions() == {"0": 0, "1": 0}

    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.add_(0.5)
    local = {fid: frag_values(island, fid) for fid in (0, 1)}
    v1 = syncer.values(1, 3)
    await publish_v(syncer, island, 1, {1: v1})
    assert await boundary(island)
    # θ = α·θ_local + (1−α)·Θ, checked against a float64 reference
    want = alpha * local[1].double() + (1 - alpha) * v1.double()
    assert torch.allclose(frag_values(island, 1).double(), want, rtol=0, atol=1e-6)
    assert torch.equal(frag_values(island, 0), local[0])  # untouched fragment keeps its local values
    assert torch.equal(anchor_flat(island, 1), v1)  # the raw global value is the anchor
    held = 4 * sum(f["numel"] for f in session["fragments"])  # one f32 anchor per fragment
    spare = 4 * session["fragments"][1]["numel"]   # the anchor v1 replaced, kept for the next staging
    assert island.store.nbytes() == (0 if anchors == "files" else held + spare)
    if anchors == "files":
        files = sorted(p.name for p in rank_dir.iterdir())
        assert files and "deadbeef-anchor-f0-123456.f32" not in files
        assert sum(p.stat().st_size for p in rank_dir.iterdir()) >= held  # the anchors live in these files
    events = steplog_lines(island)
    assert [e["step"] for e in events] == [1, 2]
    assert [e["applies"] for e in events] == [2, 1] and events[-1]["versions"] == {"0": 0, "1": 1}
    assert events[0]["bytes_in"] == 4 * (session["fragments"][0]["numel"] + session["fragments"][1]["numel"])


async def test_pull_is_answered_with_local_minus_anchor_and_other_gen_is_ignored(island_env):
    island, session, syncer = island_env(net())
    await started(island_env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)  # v0 installed; counters reset
    # Round 2 targets fragment 1 and names us; round 1 (fragment 0) names another generation of "a".
    await syncer.pull(1, 2, 0, [(ISLAND, island.gen), ("b", "0123456789abcdef")])
    await syncer.pull(0, 1, 0, [(ISLAND, "fedcba9876543210")])
    await until(lambda: island.client.counters["pulls_received"] >= 2, what="pulls")
    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.mul_(1.5).add_(0.125)
    local1 = frag_values(island, 1)
    assert await boundary(island, tokens=7)

    chunks = await syncer.pushes(ISLAND, 1, syncer.bcast_chunks(1))
    last, payload = assemble_push(chunks, syncer.numel(1))
    assert {(m["step"], m["attempt"], m["try"], m["base_version"], m["c_steps"], m["c_tokens"], m["local_step"],
             m["gen"], m["dtype"]) for m, _ in chunks} == {(2, 1, 0, 0, 1, 7, 2, island.gen, "f32")}
    d = unpack(payload, "f32", syncer.numel(1))
    assert torch.equal(bits(d), bits(local1 - v0[1]))  # d = local − anchor, bit for bit
    assert await syncer.push_count(ISLAND, 0) == 0  # the other generation's pull is never answered
    assert island.counters["pull.not_member"] == 1 and island.counters["pushes"] == 1
    assert island.book.pending() == 0
    assert steplog_lines(island)[-1]["pushes"] == 1


async def test_bad_input_is_counted_as_rejected_and_training_goes_on(island_env):
    island, session, syncer = island_env(net())
    await started(island_env, island, session)
    js = island_env.js
    await js.publish(S.pull(syncer.run), b"{not json", headers={S.MSG_ID: "garbage-1"})
    bad_pull = codec.make("pull", run=syncer.run, fragment=0, step=1, attempt=1, seq=0, base_version=0,
                          members=[{"island": ISLAND, "gen": island.gen}])
    bad_pull["step"] = 0  # schema: step >= 1
    await js.publish(S.pull(syncer.run), orjson.dumps(bad_pull), headers={S.MSG_ID: "garbage-2"})
    v0 = syncer.values(0, 1)
    await syncer.bcast(0, 0, v0, corrupt=True)  # chunk digest does not match the bytes
    # A chunk of a fragment the session does not have (subject and header agree, so it gets noticed).
    meta = {"v": 1, "run": syncer.run, "fragment": 7, "version": 0, "dtype": "f32", "chunk": 0, "chunks": 1,
            "offset": 0, "nbytes": 4, "total": 4, "digest": "0" * 16, "version_digest": "0" * 64}
    await js.publish(S.bcast(syncer.run, 7, 0), b"\0\0\0\0",
                     headers={codec.CHUNK_HEADER: codec.encode_header("bcast_chunk", meta)})
    # A chunk of fragment 1 whose size is not the fragment's (8 bytes where f32 needs 3968).
    meta = dict(meta, fragment=1, nbytes=8, total=8, digest=digest(b"\1" * 8))
    await js.publish(S.bcast(syncer.run, 1, 0), b"\1" * 8,
                     headers={codec.CHUNK_HEADER: codec.encode_header("bcast_chunk", meta)})
    await until(lambda: island.client.rejected_total() >= 2 and len(island.client.bcast) >= 3, what="bad input")
    before = frag_values(island, 0)
    assert await boundary(island)
    assert steplog_lines(island)[-1]["rejected"] == 5
    assert island.state.version(1) is None
    assert torch.equal(frag_values(island, 0), before) and island.state.version(0) is None
    assert island.counters["rejected.digest_mismatch"] == 1
    # A good version still lands afterwards (v1: v0's Nats-Msg-Ids are taken by the corrupt copy).
    await publish_v(syncer, island, 1, {0: v0})
    assert await boundary(island)
    assert island.state.version(0) == 1 and torch.equal(frag_values(island, 0), v0)
    assert steplog_lines(island)[-1]["rejected"] == 0


async def test_a_version_overwritten_mid_read_is_never_half_applied(island_env):
    """Fragment 1 (4 chunks, fetched one per batch): v1's first two chunks land and are staged while
    chunk 2 still holds v0 (the island waits there); then v2 overwrites every chunk. The island
    drops v1's staging, reads v2 from chunk 0 and blends v2 only; v1 never touches the model."""
    alpha = 0.5
    island, session, syncer = island_env(net(), alpha=alpha, fetch_batch_bytes=CHUNK_BYTES)
    await started(island_env, island, session)
    assert syncer.bcast_chunks(1) == 4
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    with torch.no_grad():
        for p in island.adapter.module.parameters():
            p.add_(0.5)
    local = frag_values(island, 1)
    before = len(island.client.bcast)
    await syncer.bcast(1, 1, syncer.values(1, 3), only={0, 1})
    await until(lambda: len(island.client.bcast) >= before + 2, what="v1 notices")
    assert await boundary(island)
    assert island.reader.reading(1) == (1, 2, 4) and island.ops.store.staging(1) == 1  # staged, not applied
    assert island.state.version(1) == 0 and torch.equal(frag_values(island, 1), local)
    v2 = syncer.values(1, 4)
    await publish_v(syncer, island, 2, {1: v2})
    assert await boundary(island)
    assert island.state.version(1) == 2 and island.reader.reading(1) is None and island.store.staging(1) is None
    want = alpha * local.double() + (1 - alpha) * v2.double()
    assert torch.allclose(frag_values(island, 1).double(), want, rtol=0, atol=1e-6)
    assert torch.equal(anchor_flat(island, 1), v2)
    # chunk 2 still held v0 (the version installed: "old"), then v1's staging was dropped for v2 (at
    # v2's chunk 0 notice, or where a v2 chunk met the reading)
    assert island.counters["bcast.old"] >= 1
    assert island.counters["bcast.dropped_partial"] + island.counters["bcast.chunk0_changed"] == 1
    assert [e["applies"] for e in steplog_lines(island)] == [2, 0, 1]


async def test_a_cut_through_broadcast_is_read_as_it_lands_and_installed_only_at_its_seal(island_env):
    """Cut-through: the syncer publishes v1's chunks 0..2 of fragment 1 one by one while it merges
    (chunk 3, the seal, still holds v0's), the seal once v1 is durable. The island reads each chunk
    as it lands (staged, never applied) and installs v1 only when the seal's digest matches; chunk
    0 re-published with the same bytes keeps the reading. A seal that does not match installs
    nothing."""
    island, session, syncer = island_env(net(), fetch_batch_bytes=CHUNK_BYTES)
    await started(island_env, island, session)
    assert syncer.bcast_chunks(1) == 4
    await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: syncer.values(1, 2)})
    assert await boundary(island) and island.state.version(1) == 0
    v1 = syncer.values(1, 3)
    for k in range(3):
        await syncer.bcast(1, 1, v1, only={k})
        await until(lambda: len(island.client.bcast) >= 1, what=f"v1 chunk {k} notice")
        assert await boundary(island)
        assert island.reader.reading(1) == (1, k + 1, 4) and island.store.staging(1) == 1
        assert island.state.version(1) == 0
    assert await boundary(island) and island.state.version(1) == 0  # no seal, no news: nothing moves
    # a restarted syncer re-issues v1's chunk 0 with the same bytes (another Nats-Msg-Id): kept
    await syncer.bcast(1, 1, v1, only={0}, msg_id=lambda f, v, k: f"again.{f}.{v}.{k}")
    await until(lambda: len(island.client.bcast) >= 1, what="re-issued chunk 0 notice")
    assert await boundary(island) and island.reader.reading(1) == (1, 3, 4)
    await syncer.bcast(1, 1, v1, only={3})  # the seal
    await until(lambda: len(island.client.bcast) >= 1, what="v1 seal notice")
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), v1)
    assert island.reader.reading(1) is None and island.counters["bcast.chunk0_changed"] == 0
    # v2 whose seal's digest does not match its bytes: never installed
    v2 = syncer.values(1, 4)
    for k in range(3):
        await syncer.bcast(1, 2, v2, only={k})
    await syncer.bcast(1, 2, syncer.values(1, 5), only={3})  # the seal of other bytes (digest of those)
    await until(lambda: len(island.client.bcast) >= 4, what="v2 notices")
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), v1)
    assert island.counters["rejected.digest_mismatch"] == 1 and island.reader.reading(1) is None


async def test_versions_are_monotonic_and_a_version_with_another_digest_is_refused_not_fatal(island_env):
    """Regression: version 2 again with other bytes (held, or being read) used to raise ProtocolError
    and end the island. Anyone may publish on BCAST: a seal of the version held with another digest
    is refused and counted, a chunk being read with other bytes never reaches the model; the island
    keeps v2, trains on, and reads the next real version."""
    island, session, syncer = island_env(net(), fetch_batch_bytes=CHUNK_BYTES)
    await started(island_env, island, session)
    v2 = syncer.values(0, 2)
    await publish_v(syncer, island, 2, {0: v2})
    assert await boundary(island) and island.state.version(0) == 2
    await publish_v(syncer, island, 1, {0: syncer.values(0, 1)})  # older: ignored
    assert await boundary(island)
    assert island.state.version(0) == 2 and torch.equal(frag_values(island, 0), v2)
    # Version 2 again with other bytes (other msg ids so JetStream keeps it): refused, not fatal.
    await publish_v(syncer, island, 2, {0: syncer.values(0, 3)}, msg_id=lambda f, v, k: f"again.{f}.{v}.{k}")
    assert await boundary(island)
    assert torch.equal(frag_values(island, 0), v2) and island.state.version(0) == 2
    assert island.counters["rejected.version_conflict"] >= 1 and steplog_lines(island)[-1]["rejected"] >= 1
    # Fragment 1 (4 chunks): v5's chunks 0-1 are being read when a chunk 2 of v5 with other bytes
    # (valid chunk digest; only the seal, chunk 3, carries a version digest) lands: it is read, and
    # nothing of v5 is applied while the seal is missing; the real chunks 2-3 of v5 then land (new
    # messages): chunk 2's notice (other bytes than the ones read) drops the reading and v5 is read
    # again, whole, from the real bytes.
    v5 = syncer.values(1, 5)
    await syncer.bcast(1, 5, v5, only={0, 1})
    await until(lambda: len(island.client.bcast) >= 2, what="v5 notices")
    assert await boundary(island) and island.reader.reading(1) == (5, 2, 4)
    await syncer.bcast(1, 5, syncer.values(1, 6), only={2}, msg_id=lambda f, v, k: f"forged.{f}.{v}.{k}")
    await until(lambda: len(island.client.bcast) >= 1, what="forged notice")
    assert await boundary(island)
    assert island.state.version(1) is None and island.reader.reading(1) == (5, 3, 4)
    await syncer.bcast(1, 5, v5, only={2, 3}, msg_id=lambda f, v, k: f"real.{f}.{v}.{k}")
    await until(lambda: len(island.client.bcast) >= 2, what="real notices")
    assert await boundary(island)
    assert island.state.version(1) == 5 and torch.equal(frag_values(island, 1), v5)
    assert island.counters["bcast.chunk_changed"] == 1


async def test_a_forged_future_chunk_does_not_make_the_island_refuse_the_real_version(island_env):
    """Regression: a bad-digest chunk claiming the next version (easy to guess) put that version in a
    `failed` set for good. Here it lands first, then the real v1 overwrites it and is installed; a
    forged chunk that *replaces* a real one (one message per subject) holds v2 back only until the
    syncer re-broadcasts v2 (new messages, same version); the island never installs a mixed
    version and never the same version twice."""
    island, session, syncer = island_env(net())
    await started(island_env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    real1 = syncer.values(1, 3)
    await publish_v(syncer, island, 1, {1: syncer.values(1, 9)}, corrupt=True,
                    msg_id=lambda f, v, k: f"forged.{f}.{v}.{k}")
    assert await boundary(island)
    assert island.state.version(1) == 0 and island.counters["rejected.digest_mismatch"] >= 1
    await publish_v(syncer, island, 1, {1: real1})
    assert await boundary(island)
    assert island.state.version(1) == 1 and torch.equal(anchor_flat(island, 1), real1)
    # v2 published, then chunk 3 replaced by a forged one: v2 cannot complete (and is not applied)...
    real2 = syncer.values(1, 4)
    await syncer.bcast(1, 2, real2)
    await syncer.bcast(1, 2, syncer.values(1, 8), corrupt=True, only={3}, msg_id=lambda f, v, k: f"forged.{f}.{v}.{k}")
    await until(lambda: len(island.client.bcast) >= 4, what="v2 notices")
    applied_before = island.counters["applies"]
    for _ in range(3):
        assert await boundary(island)
    assert island.state.version(1) == 1 and island.counters["applies"] == applied_before
    # ... until the syncer re-broadcasts v2 (a resumed syncer does): installed once, exactly
    await publish_v(syncer, island, 2, {1: real2}, msg_id=lambda f, v, k: f"again.{f}.{v}.{k}")
    assert await boundary(island)
    assert island.state.version(1) == 2 and torch.equal(anchor_flat(island, 1), real2)
    await publish_v(syncer, island, 2, {1: real2}, msg_id=lambda f, v, k: f"third.{f}.{v}.{k}")
    assert await boundary(island)
    assert island.counters["applies"] == applied_before + 1  # never the same version twice
    assert [e["versions"].get("1") for e in steplog_lines(island)][-1] == 2


async def test_a_refused_push_is_recomputed_and_resent_with_the_next_try(nc, run_id, nats_url):
    """PUSH full (10077): the push retries with backoff until its timeout (in the background: the
    boundary does not wait for it), fails, the pull is pending again, and a later boundary sends the
    push again as try 1."""
    js = nc.jetstream()
    await provision_run(js, run_id, RunLimits.small(storage="memory", push_max_bytes=8192), log=lambda _: None)
    island = None
    try:
        adapter = TorchModuleAdapter(net())
        session = build_session(adapter.layout(), 2, run=run_id, push_dtype="f32", bulk_dtype="f32",
                                chunk_bytes=CHUNK_BYTES, init_island="syncer-side", sync_every=2, created=time.time())
        await (await kv(js, run_id, "state")).put("session", codec.encode("session", session))
        island = Island(adapter, IslandConfig(run=run_id, island=ISLAND, nats=ConnectOptions(url=nats_url),
                                              progress=False, push_timeout_s=1.5, heartbeat_s=0.5))
        await asyncio.to_thread(island.start)
        syncer = Syncer(js, run_id, session)
        await publish_v(syncer, island, 0, {0: syncer.values(0, 1), 1: syncer.values(1, 2)})
        assert await boundary(island)
        filler = S.push(run_id, "filler", 1)
        await js.publish(filler, b"x" * 7600)  # leaves no room for a 1 KiB chunk
        await syncer.pull(1, 2, 0, [(ISLAND, island.gen)])
        await until(lambda: island.client.counters["pulls_received"] >= 1, what="pull")
        t0 = time.monotonic()
        assert await boundary(island)
        assert time.monotonic() - t0 < 1.45  # the acks are awaited 1 s at most; the push goes on behind
        while island.counters["push_failed"] < 1:  # until its 1.5 s push timeout
            assert time.monotonic() - t0 < 10
            assert await boundary(island)
            await asyncio.sleep(0.05)
        # the boundary that learnt of the failure pushed again at once, as try 1
        rec = island.book.record(1, 2)
        assert rec.try_ == 1 and rec.state in ("inflight", "waiting") and island.book.pending() == 1
        assert island.counters["publish_retry.stream_full"] >= 1
        await js.purge_stream(S.stream(run_id, "PUSH"), subject=filler)  # the syncer made room
        while island.book.record(1, 2).state != "done":
            assert time.monotonic() - t0 < 20
            assert await boundary(island)
            await asyncio.sleep(0.05)
        # Chunks of a try that timed out may land late (re-sent behind it); the syncer takes the
        # first complete try. The one the book saw acked is complete and valid.
        stored = await syncer.pushes(ISLAND, 1, await syncer.push_count(ISLAND, 1))
        done = island.book.record(1, 2).try_
        assert done >= 1 and all(m["try"] <= done for m, _ in stored)
        assemble_push([(m, d) for m, d in stored if m["try"] == done], syncer.numel(1))
        assert len([m for m, _ in stored if m["try"] == done]) == syncer.bcast_chunks(1)
        assert island.book.pending() == 0 and island.counters["pushes"] == 1
    finally:
        if island is not None:
            await asyncio.to_thread(island.close)
        await remove_run(js, run_id)


@pytest.mark.parametrize("anchors", ["memory", "files"])
async def test_q4_pushes_carry_error_feedback(island_env, anchors, tmp_path):
    island, session, syncer = island_env(net(), push_dtype="q4", store_dir=tmp_path / "anchors" if anchors == "files" else None)
    await started(island_env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    g = torch.Generator().manual_seed(5)

    async def round_trip(step: int, base: int, anchor: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        await syncer.pull(1, step, base, [(ISLAND, island.gen)])
        await until(lambda: island.client.counters["pulls_received"] >= step // 2, what="pull")
        with torch.no_grad():
            for p in island.adapter.module.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        d = frag_values(island, 1) - anchor
        assert await boundary(island)
        chunks = [c for c in await syncer.pushes(ISLAND, 1, step // 2) if c[0]["step"] == step]
        return assemble_push(chunks, syncer.numel(1))[1], d

    sent1, d1 = await round_trip(2, 0, v0[1])
    want1, r1 = q4_with_feedback(d1, None)
    assert sent1 == bytes(want1.numpy())
    assert torch.equal(residual_flat(island, 1), r1)
    v1 = syncer.values(1, 3)
    await publish_v(syncer, island, 1, {1: v1})
    assert await boundary(island)  # v1 blends in; the residual survives the new anchor
    sent2, d2 = await round_trip(4, 1, v1)
    want2, r2 = q4_with_feedback(d2, r1)  # the second push carries the first one's quantization error
    assert sent2 == bytes(want2.numpy())
    assert sent2 != bytes(q4_with_feedback(d2, None)[0].numpy())
    assert torch.equal(residual_flat(island, 1), r2)


async def test_finalization_installs_the_exact_f32_cut_acks_and_stops(island_env):
    island, session, syncer = island_env(net(), bulk_dtype="bf16")
    await started(island_env, island, session)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    await publish_v(syncer, island, 0, v0)
    assert await boundary(island)
    assert torch.equal(frag_values(island, 1), v0[1].to(torch.bfloat16).float())  # bf16 bulk

    final = {0: syncer.values(0, 10), 1: syncer.values(1, 11)}
    await syncer.bcast(1, 3, final[1])  # a bf16 broadcast of the final version: must never count
    digest1 = await syncer.final(1, 3, final[1], final_step=6)  # fragment 1's final first: any order
    # final acks travel on HB (the newest per island), read by the syncer's heartbeat consumer
    ctl = await island_env.js.pull_subscribe_bind(durable=S.SYNCER_HB_CONSUMER, stream=S.stream(syncer.run, "HB"))
    await syncer.to_island("manifest", ISLAND, final_step=6, versions={"0": 2, "1": 3},
                           version_digests={"0": version_digest(pack(final[0], "f32")), "1": digest1},
                           gen=island.gen)
    await until(lambda: len(island.client.control) >= 1, what="manifest")
    # Fragment 0's final cut has not landed: the manifest is not backed by FINAL yet (the real syncer
    # publishes the cut first; without server permissions a manifest may be forged), so the island trains on.
    assert await boundary(island) is True
    assert island.machine.manifest is None and island.machine.offered is not None and not island.finalized
    await syncer.final(0, 2, final[0], final_step=6)
    task = asyncio.create_task(boundary(island))

    ack = None
    deadline = time.monotonic() + 15
    while ack is None and time.monotonic() < deadline:
        for m in await ctl.fetch(10, timeout=5):
            await m.ack()
            kind, msg = codec.decode_typed(m.data, ("hello", "heartbeat", "ack"))
            if kind == "ack":
                ack = (m.subject, msg)
    assert ack is not None and ack[0] == S.ack(syncer.run, ISLAND)
    assert ack[1]["final_step"] == 6 and ack[1]["gen"] == island.gen
    assert not task.done()  # acknowledged; now waiting for shutdown
    # No shutdown yet (a syncer killed before it recorded the ack would never send one): the ack comes
    # again, under its own Nats-Msg-Id so JetStream's duplicate window does not drop it.
    again = None
    deadline = time.monotonic() + ACK_RESEND_S + 10
    while again is None and time.monotonic() < deadline:
        for m in await ctl.fetch(10, timeout=5):
            await m.ack()
            kind, msg = codec.decode_typed(m.data, ("hello", "heartbeat", "ack"))
            if kind == "ack":
                again = (m.headers[S.MSG_ID], msg)
    assert again is not None and again[1] == ack[1]
    assert again[0] == S.ack_msg_id(ISLAND, island.gen, 6, 1) != S.ack_msg_id(ISLAND, island.gen, 6)
    await syncer.to_island("shutdown", ISLAND, reason="run complete", gen=island.gen)
    assert await asyncio.wait_for(task, 10) is False
    for fid in (0, 1):  # installed without blending, bit for bit, from the f32 final cut
        assert torch.equal(bits(frag_values(island, fid)), bits(final[fid]))
    assert island.should_stop and island.finalized and island.final_step == 6
    assert await boundary(island) is False
    assert steplog_lines(island)[-1]["versions"] == {"0": 2, "1": 3}


async def test_lockstep_blocks_until_the_pull_and_its_broadcast(island_env):
    alpha = 0.5
    island, session, syncer = island_env(net(), lockstep=True, alpha=alpha, sync_every=2)  # round t due at step t
    await island_env.write_session(session)
    start = asyncio.create_task(asyncio.to_thread(island.start))
    await asyncio.sleep(0.5)
    assert not start.done()  # lockstep waits for the whole cut before the first step
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    for fid, v in v0.items():
        await syncer.bcast(fid, 0, v)
    await asyncio.wait_for(start, 15)
    assert island.state.versions() == {"0": 0, "1": 0}

    with torch.no_grad():
        island.adapter.module.embed.weight.add_(1.0)
    local0 = frag_values(island, 0)
    step1 = asyncio.create_task(boundary(island))
    await asyncio.sleep(0.3)
    assert not step1.done()  # blocked: round 1's pull has not come
    await syncer.pull(0, 1, 0, [(ISLAND, island.gen)])
    chunks = await syncer.pushes(ISLAND, 0, 1)
    assert chunks[0][0]["step"] == 1
    await asyncio.sleep(0.2)
    assert not step1.done()  # answered, now blocked on the round's broadcast
    v1 = syncer.values(0, 3)
    await syncer.bcast(0, 1, v1)
    assert await asyncio.wait_for(step1, 10)
    want = alpha * local0.double() + (1 - alpha) * v1.double()
    assert torch.allclose(frag_values(island, 0).double(), want, rtol=0, atol=1e-6)
    assert island.state.version(0) == 1


async def test_init_island_streams_its_weights_then_takes_v0(island_env):
    model = net(3)
    island, session, syncer = island_env(model, init_island=ISLAND, bulk_dtype="bf16", init_v0_timeout_s=20)
    await island_env.write_session(session)
    expected = {fid: pack(gather_fragment(island.adapter, f), "bf16") for fid, f in
                enumerate(session["fragments"])}
    start = asyncio.create_task(asyncio.to_thread(island.start))
    sub = await island_env.js.pull_subscribe_bind(durable=S.SYNCER_INIT_CONSUMER, stream=S.stream(syncer.run, "INIT"))
    want = sum(len(chunk_plan(f["numel"], "bf16", CHUNK_BYTES)) for f in session["fragments"])
    got: dict[int, list] = {0: [], 1: []}
    while sum(map(len, got.values())) < want:
        for m in await sub.fetch(want, timeout=10):
            meta = codec.decode_header("init_chunk", m.headers[codec.CHUNK_HEADER])
            assert m.subject == S.init(syncer.run, meta["fragment"]) and meta["dtype"] == "bf16"
            assert m.headers[S.MSG_ID] == S.init_msg_id(meta["fragment"], meta["chunk"], island.client.gen)
            got[meta["fragment"]].append((meta, m.data))
            await m.ack()
    for fid, chunks in got.items():
        assert assemble(chunks, session["fragments"][fid]["numel"]) == expected[fid].numpy().tobytes()
    await asyncio.sleep(0.3)
    assert not start.done()  # the INIT island waits for v0 before its first step
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    for fid, v in v0.items():
        await syncer.bcast(fid, 0, v)
    await asyncio.wait_for(start, 15)
    for fid in (0, 1):  # v0 overwrites (bf16 bulk) before the first step
        assert torch.equal(frag_values(island, fid), v0[fid].to(torch.bfloat16).float())


async def test_initial_cut_is_installed_before_the_first_step(island_env):
    island, session, syncer = island_env(net(), initial_cut_timeout=10.0)
    v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
    for fid, v in v0.items():
        await syncer.bcast(fid, 0, v)
    await started(island_env, island, session)
    for fid in (0, 1):
        assert torch.equal(frag_values(island, fid), v0[fid])
    assert island.state.versions() == {"0": 0, "1": 0}
    assert island.counters["applies"] == 2


async def test_a_push_waits_while_disconnected_and_goes_out_after_the_reconnect(tmp_path):
    """The connection drops between the pull and its boundary: no push and no try is spent; after the
    reconnect (same generation) the next boundary sends it with try 0."""
    async with own_broker(tmp_path, "reconnect", RunLimits.small(), push_timeout_s=20,
                          background=False) as own:  # one boundary pushes and reaps (see the island_env fixture)
        island, syncer = own.island, own.syncer
        v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
        await publish_v(syncer, island, 0, v0)
        assert await boundary(island)
        gen = island.gen
        await syncer.pull(1, 2, 0, [(ISLAND, gen)])
        await until(lambda: island.client.counters["pulls_received"] >= 1, what="pull")

        own.stop()
        await until(lambda: not island.client.connected, what="disconnect")
        assert await boundary(island)  # training goes on
        rec = island.book.record(1, 2)
        assert rec.state == "waiting" and rec.try_ == 0 and island.counters["push_failed"] == 0
        assert island.book.pending() == 1

        await own.restart(timeout=20)
        assert await boundary(island)
        chunks = await syncer.pushes(ISLAND, 1, syncer.bcast_chunks(1))
        assert {(m["try"], m["gen"], m["local_step"]) for m, _ in chunks} == {(0, gen, 3)}
        assert island.gen == gen and island.book.pending() == 0
        assert island.counters["disconnects"] >= 1 and island.counters["reconnects"] >= 1


def _dp_island_worker(rank: int, world: int, init_file: str, url: str, run: str, out: str, device: str) -> None:
    import hashlib

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = net(0).to(device)  # `cuda`: both ranks' replicas on the one GPU, the island group on the host
        island = dp_island(model, url, run)
        island.start()
        states = []
        for _ in range(20000):  # >= 200 s at 10 ms a step (a step count: both ranks must stop together)
            with torch.no_grad():
                for p in model.parameters():  # the same update on every replica (DP after its all-reduce)
                    p.add_(0.001)
            if not island.boundary(tokens=4):
                break
            states.append(hashlib.sha256(b"".join(bits(p.detach()).numpy().tobytes()
                                                  for p in model.parameters())).hexdigest())
            time.sleep(0.01)
        torch.save({"states": states, "finalized": island.finalized, "gen": island.gen,
                    "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                    "devices": sorted({p.device.type for p in model.parameters()}),
                    "applies": island.counters["applies"]}, f"{out}/rank{rank}.pt")
        island.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
async def test_data_parallel_island_keeps_replicas_identical_through_v0_blend_and_final(island_env, tmp_path, device):
    """Also with both replicas' parameters on a GPU (`cuda`): staged and exchanged on the host, written and
    blended on the device, exported through the host staging."""
    import torch.multiprocessing as mp

    _, session, syncer = island_env(net())
    session = dict(session, init_island="syncer-side")
    await island_env.write_session(session)
    js, run = island_env.js, syncer.run
    ctx = mp.start_processes(_dp_island_worker, args=(2, str(tmp_path / "pg"), island_env.nats_url, run, str(tmp_path), device),
                             nprocs=2, join=False, start_method="spawn")
    try:
        hello = await dp_hello(js, run)
        gen = hello["gen"]
        assert hello["island"] == "dp" and hello["world"]["ranks"] == 2
        v0 = {0: syncer.values(0, 1), 1: syncer.values(1, 2)}
        for fid, v in v0.items():
            await syncer.bcast(fid, 0, v)
        await syncer.pull(1, 2, 0, [("dp", gen)])
        chunks = await syncer.pushes("dp", 1, syncer.bcast_chunks(1), timeout=30)
        assert {m["gen"] for m, _ in chunks} == {gen}
        await syncer.bcast(1, 1, syncer.values(1, 3))  # blended on rank 0, synced to rank 1
        await asyncio.sleep(0.5)
        final = {0: syncer.values(0, 10), 1: syncer.values(1, 11)}
        await dp_finish(js, syncer, gen, final, 4, {"0": 1, "1": 2})
        await dp_join(ctx)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["states"] == r1["states"] and len(r0["states"]) >= 3  # replicas equal after every boundary
    assert r0["finalized"] and r1["finalized"] and r0["gen"] == r1["gen"] == gen
    assert r0["applies"] == 5  # v0 of both fragments, v1 of fragment 1, the final cut of both
    assert r0["devices"] == r1["devices"] == [device]
    for fid, frag in enumerate(session["fragments"]):
        for r in (r0, r1):
            for t in frag["tensors"]:
                assert torch.equal(bits(r["params"][t["name"]].reshape(-1)),
                                   bits(final[fid][t["offset"]: t["offset"] + t["numel"]]))
