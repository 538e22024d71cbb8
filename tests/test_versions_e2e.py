"""The version rules against a real nats-server and `yeto syncer` (schemas/versions.py; the rules alone:
tests/test_versions.py):

- a refused mix: an island of the next protocol says hello to a running run; the syncer refuses it in one
  line naming both versions (its log, its tape, a fatal error to that island), counts it, and finishes the
  run with the other islands exactly (final cut equal to an independent reference);
- the island side of a refusal: the client stops on the syncer's fatal error, and on a session record of a
  protocol it does not speak, each time naming both versions;
- old state resumed: tests/fixtures/state-format-1/ (a checkpoint directory written by the code before
  versioned state, with the state KV's commit record of that moment) resumed by today's `yeto syncer
  --resume`, which migrates it, continues at step 4 from its exact bytes and finishes the run equal to a
  reference started from those bytes; its first commit writes format 2.
"""
from __future__ import annotations

import asyncio
import shutil

import nats
import orjson
import pytest
import torch

from yeto.schemas import codec, subjects as S, versions
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.provision import RunLimits, kv_put, provision_run, remove_run
from tests.scripted import (LR, MU, Reference, ScriptedIsland, SyncerProc, close_run, finish_on_reference, kv_json,
                            push_round, start_run, syncer_status, tape, tiny_layout, wait_provisioned, wait_status,
                            wait_tape)
from tests.test_versions import OLD

pytestmark = pytest.mark.timeout(90)

MINE = versions.software()
ARGS = ("--islands", "2", "--fragments", "2", "--sync-every", "2", "--total-steps", "4", "--strict",
        "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.3")


async def test_an_island_of_a_newer_protocol_is_refused_naming_both_and_the_run_goes_on(nats_url, run_id, tmp_path):
    syncer, isls, init = await start_run(nats_url, run_id, ["a", "b"], tmp_path / "ckpt", *ARGS,
                                         layout=tiny_layout(1, 8))
    a, b = isls
    c = ScriptedIsland(await nats.connect(nats_url), run_id, "c", tiny_layout(1, 8))
    try:
        # the session pinned states the syncer's release; the islands' hellos stated theirs, taped with their joins
        assert a.session["software"] == MINE and a.session["v"] == 1
        joins = await wait_tape(a.js, run_id, lambda r: r.get("island") == "b", kind="join")
        assert joins["detail"]["software"] == MINE
        ref = Reference(init)
        gen = torch.Generator().manual_seed(3)
        tokens = {"a": 200, "b": 100}
        fid = await push_round(isls, ref, gen, 1, tokens)
        torch.testing.assert_close(await a.wait_version(fid, 1), ref.value(fid), rtol=1e-6, atol=1e-6)

        # ---- island c of the next release: protocol 2, fields protocol 1 does not know
        await c.connect_consumer()
        hello = codec.make("hello", run=run_id, island="c", gen=c.gen, layout=c.layout,
                           layout_fingerprint=a.session["layout_fingerprint"], push_dtype="auto", bulk_dtype="auto",
                           world={"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1}, host="next")
        hello.update(v=2, software="yeto-nats 0.2.0", capabilities=["something-new"])
        await c.publish_raw(S.hello(run_id, "c"), orjson.dumps(hello), msg_id=S.hello_msg_id("c", c.gen))
        line = (f"hello: island speaks protocol 2 (yeto-nats 0.2.0), this syncer accepts 1..1 ({MINE}) "
                f"(field 'v', value 2)")
        # the island hears it: a fatal error to its generation, that one line, field v
        _, err = await c.expect(lambda k, m: k == "error", timeout=20)
        assert (err["code"], err["fatal"], err["field"], err["gen"], err["message"]) == \
            ("protocol_version", True, "v", c.gen, line)
        # the syncer counted it and taped it, and said it in one line of its log
        st = await wait_status(js := a.js, run_id, lambda s: s["counters"].get("rejected.protocol_version", 0) >= 1)
        assert st["counters"]["rejected.protocol_version"] == 1
        rec = await wait_tape(js, run_id, lambda r: r.get("detail", {}).get("code") == "protocol_version", kind="error")
        assert rec["island"] == "c" and rec["gen"] == c.gen and rec["detail"]["field"] == "v"
        assert rec["reason"] == f"hello on {S.hello(run_id, 'c')}: {line}"
        logged = [ln for ln in syncer.output().splitlines() if "rejected hello" in ln]
        assert len(logged) == 1 and logged[0].endswith(f"rejected hello on {S.hello(run_id, 'c')}: {line}"), logged
        # c is no member: nobody waits for it, no pull names it
        assert not [r for r in await tape(js, run_id, "join") if r.get("island") == "c"]

        # ---- the run goes on with a and b and finishes exactly
        for t in (2, 3, 4):
            fid = await push_round(isls, ref, gen, t, tokens)
            torch.testing.assert_close(await a.wait_version(fid, (t + 1) // 2), ref.value(fid), rtol=1e-6, atol=1e-6)
        # every round after the refusal asked a and b, never c
        merges = [r for r in await tape(js, run_id, "merge") if r["step"] >= 2]
        assert len(merges) == 3 and all(sorted(m["island"] for m in r["expected"]) == ["a", "b"] for r in merges)
        await finish_on_reference(isls, syncer, ref, 4)
    finally:
        await close_run(isls, syncer, run_id, extra_nc=[c.nc])


async def test_the_island_client_stops_on_a_protocol_refusal_and_on_a_session_it_does_not_speak(
        nc, run_id, nats_url):
    from yeto.learner.client import IslandClient
    from yeto.learner.config import IslandConfig
    from yeto.learner.errors import IslandUnhealthy, SyncerRefused
    from yeto.schemas.conn import ConnectOptions

    js = nc.jetstream()
    await provision_run(js, run_id, RunLimits.small(storage="memory"), log=lambda _: None)
    lay = tiny_layout(1, 8)
    hello = {"layout": lay, "layout_fingerprint": layout_fingerprint(lay), "push_dtype": "auto", "bulk_dtype": "auto", "host": "h", "software": MINE,
             "world": {"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1}}
    clients = []
    try:
        # a session record of protocol 2 (a syncer of the next release pinned it)
        c = IslandClient(IslandConfig(run=run_id, island="a", nats=ConnectOptions(url=nats_url), progress=False,
                                      heartbeat_s=0.2, session_timeout_s=10, connect_timeout_s=10))
        clients.append(c)
        await asyncio.to_thread(c.start)
        await asyncio.to_thread(c.provision, dict(hello))
        session = codec.examples("session")[0]
        session.update(v=2, run=run_id, software="yeto-nats 0.2.0")
        await kv_put(js, run_id, "state", "session", orjson.dumps(session))
        with pytest.raises(IslandUnhealthy) as ei:
            await asyncio.to_thread(c.wait_session)
        assert str(ei.value) == (f"island a: cannot join run {run_id}: session: syncer speaks protocol 2 "
                                 f"(yeto-nats 0.2.0), this island accepts 1..1 ({MINE}) (field 'v', value 2)")

        # the syncer's fatal refusal of this island's hello (as Receiver.refuse_protocol sends it)
        line = f"hello: island speaks protocol 1 ({MINE}), this syncer accepts 2..2 (yeto-nats 0.2.0)"
        err = codec.make("error", run=run_id, code="protocol_version", message=line, fatal=True, field="v", gen=c.gen)
        await js.publish(S.to_island(run_id, "a"), codec.encode("error", err), headers={S.MSG_ID: "pv-1"})
        for _ in range(200):
            if c.ctl.fatal is not None:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(SyncerRefused) as ei:
            c.check_health()
        assert str(ei.value) == f"syncer refused this island: protocol_version: {line} (field v)"
    finally:
        for c in clients:
            await asyncio.to_thread(c.close)
        await remove_run(js, run_id)


# ---- old state resumed --------------------------------------------------------------------------------------

OLD_RUN = "statev1"   # the fixture's run (its checkpoint names it; a resume refuses another)
OLD_ARGS = ("--islands", "2", "--fragments", "2", "--sync-every", "2", "--total-steps", "6", "--strict",
            "--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.3")


def _fixture_tensors(session: dict) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    state = orjson.loads((OLD / "checkpoint.json").read_bytes())
    params, momentum = {}, {}
    for f in session["fragments"]:
        v = state["versions"][str(f["id"])]
        params[f["id"]] = torch.frombuffer(bytearray((OLD / f"frag-{f['id']}-v{v}.params").read_bytes()), dtype=torch.float32)
        momentum[f["id"]] = torch.frombuffer(bytearray((OLD / f"frag-{f['id']}-v{v}.momentum").read_bytes()),
                                             dtype=torch.float32)
    return params, momentum


async def test_a_syncer_of_this_release_resumes_state_written_before_versioning_and_finishes_exactly(
        nats_url, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("checkpoint.json", "session.json", "intent-0.json", "intent-1.json", "frag-0-v2.params",
                 "frag-0-v2.momentum", "frag-1-v1.params", "frag-1-v1.momentum"):
        shutil.copy(OLD / name, ckpt / name)
    session = orjson.loads((OLD / "session.json").read_bytes())
    old_commit = (OLD / "kv-commit.json").read_bytes()
    members = orjson.loads((OLD / "kv-members.json").read_bytes())
    nc = await nats.connect(nats_url)
    js = nc.jetstream(timeout=20)
    await remove_run(js, OLD_RUN)   # a leftover of an interrupted earlier run of this test
    # The broker kept what the old syncer wrote there: the session, its commit record (no format field) and
    # the members; the islands kept running (same generations) while the syncer was replaced.
    await provision_run(js, OLD_RUN, RunLimits.small(), push_headers_only=False, fragments=2, log=lambda _: None)
    await kv_put(js, OLD_RUN, "state", "session", orjson.dumps(session))
    await kv_put(js, OLD_RUN, "state", "commit", orjson.dumps(orjson.loads(old_commit)))
    isls = []
    for name, rec in sorted(members.items()):
        await kv_put(js, OLD_RUN, "members", name, orjson.dumps(rec))
        isl = ScriptedIsland(await nats.connect(nats_url), OLD_RUN, name, tiny_layout(1, 8))
        isl.gen = rec["gen"]
        isls.append(isl)
        await isl.connect_consumer()
    syncer = SyncerProc(nats_url, OLD_RUN, ckpt, *OLD_ARGS).start("--resume")
    try:
        await wait_provisioned(js, OLD_RUN)
        start = await wait_tape(js, OLD_RUN, lambda r: r["detail"].get("batch") == 0, kind="input")
        assert start["detail"]["resumed_state"] == {"format": 1, "software": None, "migrated_from": 1}
        assert start["detail"]["state_format"] == 2 and start["detail"]["config"]["software"] == MINE
        assert "resuming state format 1" in syncer.wait_line("resuming state format 1", 20)
        # the commit record is now this release's, for the same step
        commit = await kv_json(js, OLD_RUN, "commit")
        assert commit["format"] == 2 and commit["software"] == MINE
        assert {k: commit[k] for k in ("committed_step", "versions", "version_digests")} == orjson.loads(old_commit)

        # the cut the islands read is the old syncer's bytes, exactly
        for isl in isls:
            await isl.wait_session()
        a = isls[0]
        params, momentum = _fixture_tensors(session)
        for fid, want in ((0, 2), (1, 1)):
            await a.wait_version(fid, want, 60)   # the resumed syncer republishes the cut: not at once when loaded
            v, vals, _ = await a.read_cut(fid)
            assert v == want and torch.equal(vals, params[fid])

        # rounds 4-6 on a reference that starts from the checkpoint's params and momentum buffers
        ref = Reference(params)
        for fid, p in ref.p.items():
            ref.opt[fid].state[p]["momentum_buffer"] = momentum[fid].clone()
        gen = torch.Generator().manual_seed(12)
        for t in (4, 5, 6):
            fid = await push_round(isls, ref, gen, t, {"a": 200, "b": 100})
            torch.testing.assert_close(await a.wait_version(fid, {4: 2, 5: 3, 6: 3}[t]), ref.value(fid),
                                       rtol=1e-6, atol=1e-6)
        # its first commit rewrote checkpoint.json in format 2
        doc = orjson.loads((ckpt / "checkpoint.json").read_bytes())
        assert doc["format"] == 2 and doc["software"] == MINE and doc["committed_step"] >= 4
        await finish_on_reference(isls, syncer, ref, 6)
        st = await syncer_status(js, OLD_RUN)
        assert st["committed_step"] == 6
    finally:
        await close_run(isls, syncer, OLD_RUN, extra_nc=[nc])
