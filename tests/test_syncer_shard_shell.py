"""Syncer shards end to end at the shell (docs/design.md §10): two `yeto syncer` processes of one run (P = 2,
`--shards 2`) and scripted islands, against a real nats-server.

- Each shard commits version 0 and the rounds of its own fragment only; the merged values equal an
  independent reference; each shard's checkpoint directory and state KV keys hold its own fragment
  only; the follower started after the session was pinned adopts it; the final cut of every fragment is
  in FINAL, the manifest covers both with their digests, and both processes exit 0.
- A fresh follower refuses to start when its shard already committed (state KV `commit.<K>`).
- A follower killed with SIGKILL is reported missing on the tape and in the coordinator's status
  record, resumes alone from its checkpoint (`--resume`), is reported back, and the run finishes.
"""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import torch

from yeto.schemas import subjects as S
from yeto.schemas.provision import RunLimits, kv_put, provision_run
from tests.scripted import Reference, SyncerProc, replay_segments, snapshot_dir, tape, wait_tape
from tests.shard_support import (RUN_ARGS, STEPS, ShardedRun, finish, play_round, state_value, wait_proc,
                                 wait_status_key)

pytestmark = pytest.mark.timeout(180)  # process starts take seconds each on a loaded machine


async def _kv(js, run: str, kind: str = "state") -> dict[str, object]:
    """Every key of the state (or ckpt) KV (listed from the bucket's stream: nats-py's kv.keys() can miss
    entries right after connecting)."""
    kv = await js.key_value(S.kv_bucket(run, kind))
    info = await js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
    out = {}
    for subject in sorted(info.state.subjects or {}):
        key = subject[len(kv._pre):]
        try:
            e = await kv.get(key)
        except Exception:   # deleted
            continue
        if e and e.value:
            # the committed state's chunks (state_store.py) are raw f32 bytes; every other value is JSON
            raw = key == "session" or (key.startswith("ckpt.") and key.split(".")[2].startswith("f"))
            out[key] = e.value if raw else orjson.loads(e.value)
    return out


async def test_two_shards_each_commit_their_own_fragment_and_finish_one_run(nats_url, run_id, tmp_path):
    run = ShardedRun(nats_url, run_id, tmp_path)
    try:
        init = await run.start()
        a = run.isls[0]
        js = a.js
        for fid in (0, 1):
            torch.testing.assert_close(await a.wait_version(fid, 0), init[fid])
        ref = Reference(init)
        gen = torch.Generator().manual_seed(3)
        # shard 1 follows the coordinator: its status record says so, and it holds fragment 1 only
        st1 = await state_value(js, run_id, "syncer.1")
        assert (st1["shard"], st1["shards"], st1["fragments"]) == (1, 2, [1]) and st1["rss_bytes"] > 0
        for t in range(1, STEPS + 1):
            await play_round(run, ref, t, gen)
        manifest = await finish(run)

        # the manifest covers both fragments, with the f32 final cut's digests as published in FINAL
        assert manifest["final_step"] == STEPS and manifest["versions"] == {"0": 2, "1": 2}
        for fid in (0, 1):
            v, vals, meta = await a.read_cut(fid, final=True)
            assert v == 2 and meta["version_digest"] == manifest["version_digests"][str(fid)]
            torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)

        # each shard's checkpoint holds its own fragment only
        for k in (0, 1):
            ck = orjson.loads((run.ckpt[k] / "checkpoint.json").read_bytes())
            assert ck["versions"] == {str(k): 2} and list(ck["version_digests"]) == [str(k)]
            assert ck["final"] is True
            frag_files = sorted(n for n in snapshot_dir(run.ckpt[k]) if n.startswith("frag-"))
            assert frag_files == [f"frag-{k}-v2.momentum", f"frag-{k}-v2.params"]
            assert orjson.loads((run.ckpt[k] / "session.json").read_bytes())["session_fingerprint"] == \
                a.session["session_fingerprint"]
        ck1 = orjson.loads((run.ckpt[1] / "checkpoint.json").read_bytes())
        assert ck1["final_record"] == {"shard_final": True, "final_step": STEPS, "versions": {"1": 2}}
        ck0 = orjson.loads((run.ckpt[0] / "checkpoint.json").read_bytes())
        assert ck0["final_record"]["finished"] and ck0["final_record"]["versions"] == {"0": 2, "1": 2}

        # state KV: per-shard keys only, each naming its own fragment; the run's final manifest
        kv = await _kv(js, run_id)
        assert not {"commit", "pulls", "syncer"} & set(kv), sorted(kv)
        # each shard keeps its own committed state for a standby (docs/design.md §11): its fragment at its version
        ckv = await _kv(js, run_id, "ckpt")   # a bucket of its own: only the syncer identity reads weights
        assert not [key for key in kv if key.startswith("ckpt.")], sorted(kv)
        for k in (0, 1):
            assert ckv[f"ckpt.{k}.manifest"]["state"]["versions"] == {str(k): 2}
            assert any(key.startswith(f"ckpt.{k}.f{k}.v2.p.") for key in ckv), sorted(ckv)
        assert not {"lease.0", "lease.1"} & set(kv)   # each shard's lease, released at its clean exit
        for k in (0, 1):
            assert kv[f"commit.{k}"]["versions"] == {str(k): 2}
            assert kv[f"final.{k}"] == {"shard": k, "final_step": STEPS, "versions": {str(k): 2},
                                        "version_digests": {str(k): manifest["version_digests"][str(k)]}}
            st = kv[f"syncer.{k}"]
            assert st["exited"] and st["phase"] == "done" and st["versions"] == {str(k): 2}
            assert st["committed_step"] == STEPS - 1 + k      # the highest own step: 3 (shard 0), 4 (shard 1)
        assert kv["syncer.0"]["shards_missing"] == []
        assert kv["final"]["version_digests"] == manifest["version_digests"]

        # only the coordinator consumes CTL; each shard has its own INIT/PUSH consumers
        names = {kind: sorted(c.name for c in await js.consumers_info(S.stream(run_id, kind)))
                 for kind in ("INIT", "PUSH")}
        assert names == {"INIT": ["syncer-init-s0", "syncer-init-s1"], "PUSH": ["syncer-push-s0", "syncer-push-s1"]}
        ctl = sorted(c.name for c in await js.consumers_info(S.stream(run_id, "CTL")))
        assert [n for n in ctl if n.startswith("syncer")] == [S.SYNCER_CTL_CONSUMER]

        # every commit on the tape was made by the shard that owns its fragment, once
        commits = [(r["fragment"], r["version"], r["detail"]["shard"]) for r in await tape(js, run_id, "commit")]
        assert sorted(commits) == sorted({(f, v, f) for f in (0, 1) for v in (0, 1, 2)})
        out1 = run.shards[1].output()
        assert "session adopted" in out1
        lines = [line for line in out1.splitlines() if " yeto.syncer " in line]
        assert lines and all("yeto.syncer [shard 1/2] " in line for line in lines), lines[:3]

        # --resume after the end: the follower re-writes its lost final.1 and exits 0; the coordinator
        # re-writes the run's lost `final` manifest, the other shard's digests read from final.1
        state = await js.key_value(S.kv_bucket(run_id, "state"))
        await state.delete("final.1")
        await state.delete("final")
        for k in (1, 0):
            run.shards[k].start("--resume")
            assert await wait_proc(run.shards[k], 60) == 0, run.shards[k].output()[-3000:]
        kv2 = await _kv(js, run_id)
        assert kv2["final.1"] == kv["final.1"] and kv2["final"]["version_digests"] == manifest["version_digests"]
    finally:
        await run.close()


async def test_a_fresh_follower_refuses_when_its_shard_already_committed(nats_url, run_id, tmp_path, nc):
    js = nc.jetstream()
    await provision_run(js, run_id, RunLimits.small(), push_headers_only=False, shard=1, shards=2, fragments=2,
                        log=lambda _: None)
    try:
        # a session in the state KV does not stop a fresh follower; its own shard's commit does
        await kv_put(js, run_id, "state", "commit.0", orjson.dumps({"committed_step": 3, "versions": {"0": 2}}))
        await kv_put(js, run_id, "state", "commit.1", orjson.dumps({"committed_step": 2, "versions": {"1": 1}}))
        follower = SyncerProc(nats_url, run_id, tmp_path / "s1", *RUN_ARGS, "--shard", "1").start()
        rc = await wait_proc(follower, 60)
        out = follower.output()
        assert rc == 2, out[-2000:]
        assert "shard 1/2 already committed" in out and "commit.1" in out and "--resume" in out
        assert not (tmp_path / "s1" / "checkpoint.json").exists()
        # shard 0 of another run layout: commit.0 alone does not stop shard 1 of a fresh run either way
        kv = await js.key_value(S.kv_bucket(run_id, "state"))
        await kv.delete("commit.1")
        follower2 = SyncerProc(nats_url, run_id, tmp_path / "s1b", *RUN_ARGS, "--shard", "1",
                               log=tmp_path / "f2.log").start()
        try:
            await asyncio.sleep(4)
            assert follower2.proc.poll() is None, follower2.output()[-2000:]   # waiting for a session
            st = await state_value(js, run_id, "syncer.1")
            assert st["phase"] == "pinning" and st["fragments"] == [1]
        finally:
            follower2.stop()
    finally:
        from yeto.schemas.provision import remove_run
        await remove_run(js, run_id)


async def test_a_killed_follower_is_reported_missing_resumes_alone_and_the_run_finishes(nats_url, run_id, tmp_path):
    run = ShardedRun(nats_url, run_id, tmp_path)
    try:
        init = await run.start(seed=1)
        a = run.isls[0]
        js = a.js
        ref = Reference(init)
        gen = torch.Generator().manual_seed(4)
        for t in (1, 2):
            await play_round(run, ref, t, gen)
        # shard 1's round 4 is in flight (strict: launched right after step 2 committed): kill it
        for isl in run.isls:
            await isl.expect_pull(4, attempt=1)
        ck_before = snapshot_dir(run.ckpt[1])
        run.shards[1].kill()
        # the coordinator keeps running its own rounds meanwhile
        await play_round(run, ref, 3, gen)
        rec = await wait_tape(js, run_id, lambda r: r["reason"].startswith("shard 1 missing"), timeout=40, kind="error")
        assert rec["detail"]["code"] == "shard_missing" and rec["detail"]["fragments"] == [1]
        await wait_status_key(js, run_id, "syncer.0", lambda st: st["shards_missing"] == [1])
        assert snapshot_dir(run.ckpt[1]) == ck_before
        run.shards[1].start("--resume")
        # the round in flight is launched again with a new attempt, from the checkpointed version
        await play_round(run, ref, 4, gen, attempt=2)
        await wait_tape(js, run_id, lambda r: r["reason"] == "shard 1 back", timeout=20, kind="error")
        manifest = await finish(run)
        assert manifest["versions"] == {"0": 2, "1": 2}
        for fid in (0, 1):
            _, vals, meta = await a.read_cut(fid, final=True)
            torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
        # no version committed twice (tape), none lost
        commits = sorted((r["fragment"], r["version"]) for r in await tape(js, run_id, "commit"))
        assert commits == sorted((f, v) for f in (0, 1) for v in (0, 1, 2))
        missing = [r for r in await tape(js, run_id, "error") if r["reason"].startswith("shard 1 missing")]
        assert len(missing) == 1
        # every shard process's recorded inputs (SessionSeen, MemberSeen, ShardFinal included) replay to
        # identical actions: shard 0, shard 1 fresh, shard 1 resumed
        segs = replay_segments(nats_url, run_id)
        assert len(segs) == 3 and all(line.endswith(" identical") for line in segs), segs
    finally:
        await run.close()


async def test_a_killed_coordinator_resumes_while_the_follower_keeps_committing(nats_url, run_id, tmp_path):
    run = ShardedRun(nats_url, run_id, tmp_path)
    try:
        init = await run.start(seed=2)
        a = run.isls[0]
        js = a.js
        ref = Reference(init)
        gen = torch.Generator().manual_seed(5)
        await play_round(run, ref, 1, gen)
        for isl in run.isls:                      # the coordinator's round 3 is in flight
            await isl.expect_pull(3, attempt=1)
        run.shards[0].kill()
        # the follower runs its rounds with the membership it last read
        await play_round(run, ref, 2, gen)
        await play_round(run, ref, 4, gen)
        # The status record is written every --status-every (0.5 s): the broadcast seen above may be newer.
        deadline = time.monotonic() + 20
        while (st1 := await state_value(js, run_id, "syncer.1"))["committed_step"] < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert st1["committed_step"] == 4 and st1["versions"] == {"1": 2}
        final1 = await state_value(js, run_id, "final.1")       # its final cut is out; it is done
        assert final1["versions"] == {"1": 2}
        assert await wait_proc(run.shards[1], 60) == 0
        run.shards[0].start("--resume")
        await play_round(run, ref, 3, gen, attempt=2)
        manifest = await finish(run)
        assert manifest["versions"] == {"0": 2, "1": 2}
        assert manifest["version_digests"]["1"] == final1["version_digests"]["1"]
        for fid in (0, 1):
            _, vals, meta = await a.read_cut(fid, final=True)
            assert meta["version_digest"] == manifest["version_digests"][str(fid)]
            torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
        commits = sorted((r["fragment"], r["version"]) for r in await tape(js, run_id, "commit"))
        assert commits == sorted((f, v) for f in (0, 1) for v in (0, 1, 2))
    finally:
        await run.close()
