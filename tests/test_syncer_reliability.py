"""Syncer failures found by chaos runs and review (docs/design.md §14), each against a real nats-server and a real
`yeto syncer` process killed with SIGKILL and resumed, driven by scripted islands.

- `--resume` of a finished run exits 0 at once (it used to finalize again, wait --final-timeout, exit 3);
- a syncer killed between a durable commit and its tape records: the resumed syncer tapes them, and
  every merge/commit record is on the tape exactly once across kills;
- a resumed syncer whose members record is empty asks each island that heartbeats to say hello again
  (it used to ignore them for ever: no round ever launched).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import orjson
import pytest
import torch

from yeto.schemas import codec, subjects as S
from yeto.schemas.chunks import digest as chunk_digest
from tests.scripted import (LR, MU, Heartbeater, Reference, SyncerProc, close_run, start_run, tape, tiny_layout,
                            wait_status, wait_tape)

pytestmark = pytest.mark.timeout(180)


def _ckpt_step(ckpt) -> int:
    try:
        return orjson.loads((ckpt / "checkpoint.json").read_bytes())["committed_step"]
    except (FileNotFoundError, ValueError):
        return -1


async def _play(isls, ref, t: int, gen: torch.Generator, *, attempt: int | None = None) -> None:
    fid = (t - 1) % len(isls[0].session["fragments"])
    deltas = []
    for isl in isls:
        pull = await isl.expect_pull(t, attempt=attempt, timeout=60)
        deltas.append(torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1)
        await isl.push(pull, deltas[-1], c_tokens=100)
    ref.round(fid, deltas, [100] * len(isls))


async def _finish(isls, syncer, final_step: int) -> None:
    for isl in isls:
        _, man = await isl.expect(lambda k, m: k == "manifest", timeout=60)
        assert man["final_step"] == final_step
    for isl in isls:
        await isl.ack(final_step)
    rc = await asyncio.to_thread(syncer.wait, 60)
    assert rc == 0, syncer.output()[-4000:]


async def test_resume_of_a_finished_run_exits_0_at_once(nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ("--islands", "1", "--fragments", "1", "--sync-every", "1", "--total-steps", "2", "--strict",
            "--chunk-bytes", "1024", "--final-timeout", "90")
    syncer, isls, init = await start_run(nats_url, run_id, ["a"], ckpt, *args)
    try:
        ref, gen = Reference(init), torch.Generator().manual_seed(3)
        for t in (1, 2):
            await _play(isls, ref, t, gen)
        await _finish(isls, syncer, 2)
        before = (ckpt / "checkpoint.json").read_bytes()
        # the exiting syncer left the final manifest (no gen) in the state KV for islands that come
        # later; one a syncer of a finished run did not leave is written by the resume
        kv = await isls[0].js.key_value(S.kv_bucket(run_id, "state"))
        record = codec.decode("manifest", (await kv.get("final")).value)
        assert record["final_step"] == 2 and record["versions"] == {"0": 2} and "gen" not in record
        await kv.delete("final")

        resumed = SyncerProc(nats_url, run_id, ckpt, *args, log=tmp_path / "resumed.log").start("--resume")
        t0 = time.monotonic()
        try:
            # the old syncer waited --final-timeout (90 s), then exit 3; a start alone took 34 s under load
            rc = await asyncio.to_thread(resumed.wait, 85)
        finally:
            resumed.stop()
        took = time.monotonic() - t0
        out = resumed.output()
        assert rc == 0, out[-3000:]
        print(f"resume of a finished run: exit {rc} after {took:.1f}s (--final-timeout 90)")
        assert took < 80, f"a finished run took {took:.1f}s to resume and exit"
        assert "already finished" in out
        state = orjson.loads(before)
        assert state["final"] and state["final_record"]["finished"] and state["final_record"]["acked"] == ["a"]
        # nothing was finalized again: no second manifest, the checkpoint is as it was
        assert (ckpt / "checkpoint.json").read_bytes() == before
        assert not [m for k, m in await isls[0].messages(timeout=1.0) if k == "manifest"]
        finals = await tape(isls[0].js, run_id, "final")
        assert any("already finished" in r.get("reason", "") for r in finals)
        assert codec.decode("manifest", (await kv.get("final")).value) == record
    finally:
        await close_run(isls, syncer, run_id)


async def test_tape_keeps_every_round_exactly_once_across_kills_after_the_commit(nats_url, run_id, tmp_path):
    # One big fragment in small chunks: its broadcast (between the durable commit and the tape write)
    # takes long enough to SIGKILL the syncer inside it. `after-commit` sends the whole version there;
    # the default (cut-through) sends all but the seal before the commit, leaving no such window.
    ckpt = tmp_path / "ckpt"
    layout = tiny_layout(4, 128)
    args = ("--islands", "2", "--fragments", "1", "--sync-every", "1", "--total-steps", "4", "--strict",
            "--broadcast", "after-commit",
            "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--final-timeout", "60",
            "--status-every", "0.3", "--member-timeout", "600")   # no heartbeats: under load 30 s passed at round 2
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *args, layout=layout)
    js = isls[0].js
    try:
        ref, gen = Reference(init), torch.Generator().manual_seed(4)
        await _play(isls, ref, 1, gen)
        await wait_tape(js, run_id, lambda r: r["step"] == 1, kind="merge", timeout=60)

        # ---- kill 1: right after round 2's durable commit, while its version is broadcast
        await _play(isls, ref, 2, gen)
        deadline = time.monotonic() + 60
        while _ckpt_step(ckpt) < 2:
            assert time.monotonic() < deadline, "round 2 never committed"
            await asyncio.sleep(0.002)
        syncer.kill()
        taped = {r["step"] for r in await tape(js, run_id, "merge")}
        assert 2 not in taped, "killed too late: round 2's merge record was already taped"
        syncer.start("--resume")
        await wait_tape(js, run_id, lambda r: r["step"] == 2, kind="merge", timeout=60)

        # ---- kill 2: after round 3 is committed and taped; the resumed syncer must not tape it again
        await _play(isls, ref, 3, gen)
        await wait_tape(js, run_id, lambda r: r["step"] == 3, kind="merge", timeout=60)
        syncer.kill()
        killed_at = time.time()
        syncer.start("--resume")
        # round 4 may or may not have been launched before the kill: play the resumed syncer's attempt
        st = await wait_status(js, run_id, lambda st: st["started_at"] > killed_at and
                               any(r["step"] == 4 for r in st["rounds_in_flight"]), timeout=60)
        await _play(isls, ref, 4, gen, attempt=next(r["attempt"] for r in st["rounds_in_flight"] if r["step"] == 4))
        await _finish(isls, syncer, 4)

        for fid in range(1):
            _, vals, _ = await isls[0].read_cut(fid, final=True)
            torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
        merges = Counter(r["step"] for r in await tape(js, run_id, "merge"))
        commits = Counter((r["fragment"], r["version"]) for r in await tape(js, run_id, "commit"))
        assert merges == {1: 1, 2: 1, 3: 1, 4: 1}, merges
        assert commits == {(0, v): 1 for v in range(5)}, commits
        rec2 = next(r for r in await tape(js, run_id, "merge") if r["step"] == 2)
        assert rec2["version"] == 2 and rec2["sync_s"] >= 0 and set(rec2["weights"]) == {"a", "b"}
    finally:
        await close_run(isls, syncer, run_id)


# Its waits add up to more than 180 s in the worst case (each is bounded on its own); it passed in 12 s
# alone but once ran past 180 s after other e2e tests in one session, cause not found.
@pytest.mark.timeout(420)
async def test_resumed_syncer_without_members_asks_islands_to_say_hello_again(nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ("--islands", "2", "--fragments", "1", "--sync-every", "1", "--total-steps", "2", "--strict",
            "--chunk-bytes", "1024", "--final-timeout", "60")
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *args)
    js = isls[0].js
    beats = []
    try:
        ref, gen = Reference(init), torch.Generator().manual_seed(5)
        await _play(isls, ref, 1, gen)
        await wait_tape(js, run_id, lambda r: r["step"] == 1, kind="merge", timeout=60)
        await isls[0].expect_pull(2, timeout=60)
        await isls[1].expect_pull(2, timeout=60)
        syncer.kill()
        # what a NoKeysError misread as "no members" left the resumed syncer with
        kv = await js.key_value(S.kv_bucket(run_id, "members"))
        for isl in isls:
            await kv.purge(isl.island)
        syncer.start("--resume")
        await wait_tape(js, run_id, lambda r: "resumed" in r.get("reason", ""), kind="restart", timeout=60)
        beats = [Heartbeater(isl, every_s=0.5).start() for isl in isls]
        for isl in isls:
            _, err = await isl.expect(lambda k, m: k == "error", timeout=30)
            assert err["code"] == "unknown_member" and err["fatal"] is False and err["gen"] == isl.gen
            assert "hello again" in err["message"]
            # hello again (a new Nats-Msg-Id: the first hello is inside JetStream's duplicate window)
            msg = codec.make("hello", run=run_id, island=isl.island, gen=isl.gen, layout=isl.layout,
                             layout_fingerprint=isl.session["layout_fingerprint"], push_dtype="auto", bulk_dtype="auto",
                             world={"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1}, host="test")
            await isl.publish_raw(S.hello(run_id, isl.island), codec.encode("hello", msg),
                                  msg_id=f"{S.hello_msg_id(isl.island, isl.gen)}.again")
        # the round in flight is relaunched (strict: with whoever is a member when it launches; N gates
        # only version 0), and the run ends
        pulls, deadline = {}, time.monotonic() + 60
        while not pulls:
            assert time.monotonic() < deadline, "no island got round 2's pull after saying hello again"
            for isl in isls:
                try:
                    pulls[isl.island] = await isl.expect_pull(2, timeout=0.3)
                except TimeoutError:
                    pass
        members = {m["island"] for m in next(iter(pulls.values()))["members"]}
        deltas = []
        for isl in isls:
            if isl.island in members:
                pull = pulls.get(isl.island) or await isl.expect_pull(2, timeout=30)
                assert pull["attempt"] >= 2   # never the pull id of the killed syncer's attempt
                deltas.append(torch.randn(isl.frag(0)["numel"], generator=gen) * 0.1)
                await isl.push(pull, deltas[-1], c_tokens=100)
        ref.round(0, deltas, [100] * len(deltas))
        await _finish(isls, syncer, 2)
        _, vals, _ = await isls[0].read_cut(0, final=True)
        torch.testing.assert_close(vals, ref.value(0), rtol=1e-6, atol=1e-6)
    finally:
        for b in beats:
            await b.stop()
        await close_run(isls, syncer, run_id)


async def test_init_chunks_that_overtake_their_hello_are_held_not_waited_for(nats_url, run_id, tmp_path):
    # regression: each INIT chunk of a generation the syncer had not seen blocked INIT intake for 10 s,
    # and a complete fragment's chunks of that generation were then refused (unknown_gen) for good
    from yeto.schemas.dtypes import pack, unpack
    from tests.scripted import ScriptedIsland, wait_provisioned
    import nats

    layout = tiny_layout(4, 32)
    args = ("--islands", "1", "--fragments", "2", "--sync-every", "2", "--total-steps", "1", "--strict",
            "--chunk-bytes", "1024", "--status-every", "0.3")
    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", *args).start()
    isl = ScriptedIsland(await nats.connect(nats_url), run_id, "a", layout)
    try:
        js = isl.js
        await wait_provisioned(js, run_id)
        await isl.connect_consumer()
        await isl.hello()
        session = await isl.wait_session()

        def values(seed):
            g = torch.Generator().manual_seed(seed)
            return {f["id"]: unpack(pack(torch.randn(f["numel"], generator=g), "f32"), "f32", f["numel"])
                    for f in session["fragments"]}

        x, y = values(1), values(2)
        # generation A: fragment 0 whole
        await isl.send_init({0: x[0]})
        await wait_status(js, run_id, lambda st: st["rounds"].get("init.fragment", 0) == 1)
        # generation B restarts; all its chunks arrive before its hello
        gen_a = isl.gen
        await isl.new_generation()
        t0 = time.monotonic()
        sent = await isl.send_init(y)
        st = await wait_status(js, run_id, lambda st: st["rounds"].get("init.held_chunk", 0) == sent, timeout=30)
        held_s = time.monotonic() - t0
        print(f"{sent} INIT chunks of an unseen generation held in {held_s:.2f}s")
        assert held_s < 8, f"holding {sent} chunks of an unseen generation took {held_s:.1f}s"
        assert st["phase"] == "init" and not st["versions"]      # A's complete fragment 0 is not replaced yet
        await isl.hello()                                        # B's hello: its held chunks make version 0
        for f in sorted(y):
            v0 = await isl.wait_version(f, 0, timeout=30)
            assert torch.equal(v0, y[f]), f"fragment {f}: version 0 is not generation B's bytes"
        st = await wait_status(js, run_id, lambda st: st["phase"] == "running")
        assert st["rounds"]["init.chunk_replayed"] == sent and st["rounds"].get("rejected.unknown_gen", 0) == 0
        assert gen_a in {r.get("gen") for r in await tape(js, run_id, "join")}
        assert (await js.stream_info(S.stream(run_id, "INIT"))).state.messages == 0
    finally:
        await close_run([isl], syncer, run_id)


async def test_syncer_killed_in_finalization_resumes_it_and_exits_0(nats_url, run_id, tmp_path):
    # keeps holding: killed after the final cut and one ack, the resumed syncer keeps that ack (the
    # checkpoint's finalization record), sends the manifest to the target that has not acked, no new
    # final cut, and exits 0 on the missing ack
    ckpt = tmp_path / "ckpt"
    args = ("--islands", "2", "--fragments", "1", "--sync-every", "1", "--total-steps", "1", "--strict",
            "--chunk-bytes", "1024", "--final-timeout", "60")
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *args)
    a, b = isls
    js = a.js
    try:
        ref, gen = Reference(init), torch.Generator().manual_seed(6)
        await _play(isls, ref, 1, gen)
        for isl in isls:
            _, man = await isl.expect(lambda k, m: k == "manifest", timeout=60)
        await a.ack(1)
        deadline = time.monotonic() + 30
        while "a" not in ((orjson.loads((ckpt / "checkpoint.json").read_bytes()).get("final_record") or {})
                          .get("acked") or []):
            assert time.monotonic() < deadline, "a's ack never reached the checkpoint"
            await asyncio.sleep(0.05)
        final_seq = (await js.stream_info(S.stream(run_id, "FINAL"))).state.last_seq
        syncer.kill()
        syncer.start("--resume")
        await wait_tape(js, run_id, lambda r: "finalization resumed" in r.get("reason", ""), kind="final", timeout=60)
        await b.ack(1)
        rc = await asyncio.to_thread(syncer.wait, 60)
        assert rc == 0, syncer.output()[-3000:]
        for isl in isls:   # both get their shutdown, a's from the resumed syncer
            await isl.expect(lambda k, m: k == "shutdown", timeout=30)
        assert (await js.stream_info(S.stream(run_id, "FINAL"))).state.last_seq == final_seq   # no second cut
        _, vals, _ = await a.read_cut(0, final=True)
        torch.testing.assert_close(vals, ref.value(0), rtol=1e-6, atol=1e-6)
        state = orjson.loads((ckpt / "checkpoint.json").read_bytes())
        assert state["final_record"]["finished"] and state["final_record"]["acked"] == ["a", "b"]
    finally:
        await close_run(isls, syncer, run_id)


async def test_forged_bcast_chunk_of_the_committed_version_is_broadcast_again(nats_url, run_id, tmp_path):
    # BCAST keeps one message per chunk subject: a forged seal (last chunk) claiming the committed version
    # (another version digest, garbage bytes with a matching chunk digest, as an attacker would send it)
    # replaces the real one, and islands never read that version. The stale-base push that follows must make
    # the syncer publish the committed bytes again (same version, same version digest, a new msg id).
    ckpt = tmp_path / "ckpt"
    args = ("--islands", "2", "--fragments", "1", "--sync-every", "1", "--total-steps", "2", "--strict",
            "--max-base-lag", "0", "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024",
            "--final-timeout", "90", "--status-every", "0.3", "--member-timeout", "600")
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], ckpt, *args, layout=tiny_layout(4, 128))
    a, b = isls
    js = a.js
    try:
        ref, gen = Reference(init), torch.Generator().manual_seed(5)
        await _play(isls, ref, 1, gen)
        real = await a.wait_version(0, 1, timeout=60)
        stream = S.stream(run_id, "BCAST")
        # the seal (the last chunk): the only BCAST chunk carrying the version digest
        m = await js.get_msg(stream, subject=S.bcast(run_id, 0, 0), direct=True)
        seal = codec.decode_header("bcast_chunk", m.headers[codec.CHUNK_HEADER])["chunks"] - 1
        assert seal > 0
        subj = S.bcast(run_id, 0, seal)
        m = await js.get_msg(stream, subject=subj, direct=True)
        meta = codec.decode_header("bcast_chunk", m.headers[codec.CHUNK_HEADER])
        assert meta["version"] == 1
        real_vdigest = meta["version_digest"]
        garbage = bytes(reversed(m.data))
        forged = {**meta, "digest": chunk_digest(garbage), "version_digest": "0" * 64}
        await a.publish_raw(subj, garbage, {codec.CHUNK_HEADER: codec.encode_header("bcast_chunk", forged)})
        m = await js.get_msg(stream, subject=subj, direct=True)
        assert codec.decode_header("bcast_chunk", m.headers[codec.CHUNK_HEADER])["version_digest"] == "0" * 64
        _, cut, _ = await a.read_cut(0)
        assert not torch.equal(cut, real), "the forgery did not replace the real chunk"

        # island a never got version 1: its push for round 2 says base 0 (stale with --max-base-lag 0)
        pa = await a.expect_pull(2, timeout=60)
        assert pa["base_version"] == 1
        await a.push(pa, torch.zeros(a.frag(0)["numel"]), base_version=0)
        rec = await wait_tape(js, run_id, lambda r: r["fragment"] == 0, kind="rebroadcast", timeout=60)
        assert rec["version"] == 1 and rec["detail"]["version_digest"] == real_vdigest
        assert "stale base_version 0" in rec["reason"]
        m = await js.get_msg(stream, subject=subj, direct=True)
        back = codec.decode_header("bcast_chunk", m.headers[codec.CHUNK_HEADER])
        assert back["version"] == 1 and back["version_digest"] == real_vdigest
        assert m.headers[S.MSG_ID] == S.bcast_msg_id(0, 1, seal, rec["detail"]["resend"]) != S.bcast_msg_id(0, 1, seal)
        v, cut, _ = await a.read_cut(0)
        assert v == 1 and torch.equal(cut, real)              # the scripted island reads the real version
        await wait_status(js, run_id, lambda st: st["counters"].get("rebroadcast") == 1, timeout=30)
        disp = await wait_tape(js, run_id, lambda r: r["island"] == "a" and r["step"] == 2, kind="disposition")
        assert disp["disposition"] == "stale_base"

        # with the real version back, the round commits and the run finishes
        deltas = []
        for isl, try_ in ((a, 1), (b, 0)):
            pull = pa if isl is a else await b.expect_pull(2, timeout=60)
            deltas.append(torch.randn(isl.frag(0)["numel"], generator=gen) * 0.1)
            await isl.push(pull, deltas[-1], c_tokens=100, try_=try_)
        ref.round(0, deltas, [100, 100])
        await _finish(isls, syncer, 2)
        _, vals, _ = await a.read_cut(0, final=True)
        torch.testing.assert_close(vals, ref.value(0), rtol=1e-6, atol=1e-6)
    finally:
        await close_run(isls, syncer, run_id)
