"""Broadcasts before the durable commit (`yeto syncer --broadcast cut-through`, the default, and
`with-commit`), against a real nats-server and the real syncer process, with scripted islands and an
independent reference of the outer step.

(a) Order, in the server's own timestamps: a new version's chunk 0 is in BCAST before the state KV
`commit` record of that version, and its seal (the last chunk, the only one with the version digest)
after it; with cut-through chunk 0 even precedes the end of the merge loop, with with-commit it follows
it. With `--broadcast after-commit` chunk 0 comes after the commit record: the checks tell the three
apart.
(b) A syncer killed with SIGKILL in the middle of a cut-through broadcast (some chunks of version v in
BCAST, no seal) and restarted with `--resume` sends version v again with identical bytes: the chunks
seen before the kill equal the ones after it, the commit record's digest on the tape is the sha256 of
the BCAST bytes, the values equal the reference, and no (fragment, version, chunk) is ever seen with two
chunk digests. While the syncer is down, the island's own reader (learner.cut_reader.CutReader) finds
no complete version in that BCAST: an island never installs a partial version. The run then finishes
(final cut equal to the reference, exit 0), and both processes' recorded inputs replay identical.
(c) The same kill, then the round's pushes deleted from PUSH before the restart: the redo fails (an
`error` record names the missing PUSH message), the committed v - 1 goes out again over the partial
chunks, the round restarts with a new attempt, and version v is committed from the new pushes (equal to
a reference that never saw the lost ones); an island's reader never completes v from the partial bytes.
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import re

import orjson
import pytest
import torch

from yeto.learner.cut_reader import CutReader
from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan, digest
from yeto.schemas.dtypes import pack, unpack
from yeto.schemas.errors import WireError
from yeto.services.syncer.checkpoint import CheckpointDir
from tests.e2e_procs import wait_until
from tests.broadcast_support import RUN_ARGS, TOKENS, bcast_state, watched_run
from tests.scripted import finish_on_reference, push_round, replay_segments, tape, wait_status, wait_tape

pytestmark = pytest.mark.timeout(120)

async def _commit_times(js, run: str) -> list[tuple[float, dict]]:
    """Every `commit` record of the state KV still in its stream, with the server's timestamp."""
    bucket = S.kv_bucket(run, "state")
    out = []
    sub = await js.subscribe(f"$KV.{bucket}.commit", stream=f"KV_{bucket}", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except asyncio.TimeoutError:
                return out
            out.append((msg.metadata.timestamp.timestamp(), orjson.loads(msg.data)))
    finally:
        await sub.unsubscribe()


async def _play(isls, ref, gen, t: int) -> None:
    await push_round(isls, ref, gen, t, TOKENS)


@pytest.mark.parametrize("mode", ["with-commit", "cut-through", "after-commit"])
async def test_chunks_go_out_before_the_commit_record_and_the_seal_after_it(nats_url, run_id, tmp_path, mode):
    async with watched_run(nats_url, run_id, tmp_path / "ckpt", *RUN_ARGS, "--total-steps", "4", "--broadcast", mode,
                           seed=3) as (syncer, isls, ref, gen, log):
        a = isls[0]
        for t in (1, 2, 3, 4):
            await _play(isls, ref, gen, t)
            fid, v = (t - 1) % 2, (t + 1) // 2
            torch.testing.assert_close(await a.wait_version(fid, v), ref.value(fid), rtol=1e-6, atol=1e-6)
        # the log's last messages (its ordered consumer lags on a loaded host: wait for what is asserted on)
        want = ((1, 1), (0, 2), (1, 2))
        async def seen_all():
            return all(k in log.first and k in log.sealed for k in want)
        await wait_until(seen_all, 20, "the log to see every version")
        commits = await _commit_times(a.js, run_id)
        for fid, v in want:
            t_commit = min(ts for ts, rec in commits if rec["versions"].get(str(fid), -1) >= v)
            t_first, t_seal = log.first[(fid, v)], log.sealed[(fid, v)]
            assert t_seal > t_commit, (fid, v, "sealed before the commit record")
            if mode == "after-commit":
                assert t_first > t_commit, (fid, v, "chunk 0 was sent before the commit record")
            else:
                assert t_first < t_commit, (fid, v, "chunk 0 was not sent before the commit record")
            # cut-through sends chunks while the merge loop runs; with-commit only after it. The syncer's own
            # count, not this process's receipt time against the loop's end: on a loaded host chunk 0 of a
            # small fragment reached this subscriber a few ms after the loop had ended.
            merge = next(m for m in await tape(a.js, run_id, "merge") if (m["fragment"], m["version"]) == (fid, v))
            in_loop = merge["detail"].get("chunks_in_loop", 0)
            assert (in_loop > 0) == (mode == "cut-through"), (fid, v, merge["detail"])
            if mode == "cut-through":   # every chunk but the seal
                assert in_loop == len(chunk_plan(a.frag(fid)["numel"], "f32", 1024)) - 1, (fid, v, merge["detail"])
        merges = await tape(a.js, run_id, "merge")
        n = {fid: len(chunk_plan(a.frag(fid)["numel"], "f32", 1024)) for fid in (0, 1)}
        for m in merges:
            d = m["detail"]
            assert d["broadcast_mode"] == mode
            assert d["early_chunks"] == (n[m["fragment"]] - 1 if mode != "after-commit" else 0), d
        assert log.two_digests() == []


@pytest.mark.timeout(240)
async def test_sigkill_mid_cut_through_broadcast_then_resume_reissues_identical_bytes(nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    async with watched_run(nats_url, run_id, ckpt, *RUN_ARGS, "--total-steps", "10", "--broadcast", "cut-through",
                           seed=8) as (syncer, isls, ref, gen, log):
        a = isls[0]
        js = a.js
        for t in (1, 2):
            await _play(isls, ref, gen, t)
            torch.testing.assert_close(await a.wait_version((t - 1) % 2, 1), ref.value((t - 1) % 2), rtol=1e-6, atol=1e-6)

        # ---- a round of fragment 1 (about 258 chunks): SIGKILL once a few of its chunks are in BCAST. A
        # kill that comes after the seal (the broadcast was quicker) just tries again two rounds later.
        fid = 1
        killed_at = None
        for t in (4, 6, 8):
            v = t // 2
            await _play(isls, ref, gen, t - 1)
            torch.testing.assert_close(await a.wait_version(0, v), ref.value(0), rtol=1e-6, atol=1e-6)
            if await log.kill_mid_broadcast(syncer, fid, v, lambda t=t: _play(isls, ref, gen, t)):
                killed_at = (t, v)
                break
            torch.testing.assert_close(await a.wait_version(fid, v), ref.value(fid), rtol=1e-6, atol=1e-6)
        assert killed_at is not None, "the broadcast was never caught in the middle in three rounds"
        t, v = killed_at

        # ---- the syncer is down mid-broadcast: early chunks of v in BCAST, no seal, v not committed
        state = await bcast_state(js, run_id, a.session, fid)
        versions = [meta["version"] for meta, _, _ in state]
        assert versions[0] == v and versions[-1] == v - 1, versions
        assert not any("version_digest" in meta for meta, _, _ in state[:-1])
        early = {meta["chunk"]: digest(data) for meta, data, _ in state if meta["version"] == v}
        assert len(early) >= 3
        ck = CheckpointDir(ckpt)
        held = ck.read_state()
        assert held.versions[fid] == v - 1
        assert ck.read_intent(fid)["merge"]["version"] == v
        # The island's reader over what BCAST holds, chunk by chunk as the island's shell reads (up to the
        # first verdict other than "accept"): the chunks of v are staged, the version does not complete.
        reader = CutReader(a.session)
        reader.hold(fid, v - 1, held.version_digests[fid])   # the island holds v - 1
        verdicts = []
        for meta, data, seq in state:
            verdicts.append(reader.take(fid, meta["chunk"], meta, data, seq))
            if verdicts[-1] != "accept":
                break
        assert verdicts == ["accept"] * len(early) + ["wait"], verdicts
        assert reader.held[fid] == (v - 1, held.version_digests[fid]) and reader.reading(fid)[:2] == (v, len(early))

        # ---- restart: version v again from the same pushes, the same bytes
        syncer.start("--resume")
        merge = await wait_tape(js, run_id, lambda r: r["step"] == t and r["fragment"] == fid, kind="merge",
                                timeout=60)
        assert merge["detail"].get("redone") is True and merge["version"] == v, merge
        commit = await wait_tape(js, run_id, lambda r: r["step"] == t and r["fragment"] == fid, kind="commit")
        after = await bcast_state(js, run_id, a.session, fid)
        assert [meta["version"] for meta, _, _ in after] == [v] * len(after)
        assert {c: digest(data) for c, data in ((meta["chunk"], data) for meta, data, _ in after) if c in early} == early
        whole = hashlib.sha256(b"".join(data for _, data, _ in after)).hexdigest()
        assert commit["detail"]["version_digest"] == whole == after[-1][0]["version_digest"]
        vals = unpack(b"".join(data for _, data, _ in after), "f32", a.frag(fid)["numel"])
        torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
        assert "merging it again from the same pushes" in syncer.output()

        # ---- the run goes on and finishes on the reference
        for t2 in range(t + 1, 11):
            await _play(isls, ref, gen, t2)
            f2 = (t2 - 1) % 2
            torch.testing.assert_close(await a.wait_version(f2, (t2 + 1) // 2), ref.value(f2), rtol=1e-6, atol=1e-6)
        await finish_on_reference(isls, syncer, ref, 10)
        await asyncio.sleep(0.3)
        assert log.two_digests() == [], "a chunk of one version number was sent with two different byte strings"
        segs = replay_segments(nats_url, run_id)
        assert len(segs) == 2 and all(line.endswith(" identical") for line in segs), segs


@pytest.mark.timeout(180)
async def test_sigkill_mid_broadcast_then_pushes_purged_the_redo_fails_and_the_round_restarts(nats_url, run_id, tmp_path):
    """The redo-failure path of (b): the syncer is killed in the middle of version v's cut-through
    broadcast, then the round's pushes are deleted from PUSH (an operator purge, or max_age passing while
    it is down), then it is restarted with `--resume`. The intent's merge cannot be done again: an
    `error` record says so on the tape, the partial version is never sealed (the committed v - 1 goes out
    again over its chunks, with new Nats-Msg-Ids), the round restarts with a new attempt, and version v
    is committed from the new pushes, equal to a reference that never saw the lost ones. The syncer
    lives on and finishes the run."""
    ckpt = tmp_path / "ckpt"
    total = 4
    async with watched_run(nats_url, run_id, ckpt, *RUN_ARGS, "--total-steps", str(total), "--broadcast", "cut-through",
                           seed=11) as (syncer, isls, ref, gen, log):
        a = isls[0]
        js = a.js
        await _play(isls, ref, gen, 1)
        torch.testing.assert_close(await a.wait_version(0, 1), ref.value(0), rtol=1e-6, atol=1e-6)

        # ---- fragment 1's rounds (about 258 chunks): SIGKILL once a few chunks of the round's version
        # are in BCAST; a broadcast quicker than the kill just tries again two rounds later (the last
        # round will do: the restarted round is then the last one).
        fid = 1
        killed_at = before = None
        for t in (2, 4):
            v = t // 2
            if t > 2:
                await _play(isls, ref, gen, t - 1)
                torch.testing.assert_close(await a.wait_version(0, v), ref.value(0), rtol=1e-6, atol=1e-6)
            before = copy.deepcopy(ref)   # the reference before round t: its pushes may be lost
            if await log.kill_mid_broadcast(syncer, fid, v, lambda t=t: _play(isls, ref, gen, t)):
                killed_at = (t, v)
                break
            torch.testing.assert_close(await a.wait_version(fid, v), ref.value(fid), rtol=1e-6, atol=1e-6)
        assert killed_at is not None, "the broadcast was never caught in the middle in two rounds"
        t, v = killed_at

        # ---- down mid-broadcast: early chunks of v in BCAST, no seal; an island's reader stages them
        state = await bcast_state(js, run_id, a.session, fid)
        versions = [meta["version"] for meta, _, _ in state]
        assert versions[0] == v and versions[-1] == v - 1, versions
        early = {meta["chunk"]: digest(data) for meta, data, _ in state if meta["version"] == v}
        assert len(early) >= 3
        ck = CheckpointDir(ckpt)
        held = ck.read_state()
        assert held.versions[fid] == v - 1
        intent = ck.read_intent(fid)
        assert intent["merge"]["version"] == v and intent["merge"]["step"] == t
        attempt1 = intent["merge"]["attempt"]
        readers = [CutReader(a.session), CutReader(a.session)]
        for reader in readers:
            reader.hold(fid, v - 1, held.version_digests[fid])
            verdicts = [reader.take(fid, meta["chunk"], meta, data, seq) for meta, data, seq in state[:len(early)]]
            assert verdicts == ["accept"] * len(early) and reader.reading(fid)[:2] == (v, len(early))

        # ---- the round's pushes leave PUSH while the syncer is down (the intent names their sequences)
        seqs = sorted({seq for tr in intent["tries"] for seq in tr["seqs"].values()})
        assert len(seqs) == 2 * len(chunk_plan(a.frag(fid)["numel"], "f32", 1024)), len(seqs)
        for seq in seqs:
            await js.delete_msg(S.stream(run_id, "PUSH"), seq)

        # ---- restart: the redo fails, is taped, and the committed v - 1 goes out again over the partial v
        syncer.start("--resume")
        err = await wait_tape(js, run_id, lambda r: r.get("fragment") == fid and "not redone" in r.get("reason", ""),
                              kind="error", timeout=30)
        assert err["step"] == t and f"interrupted merge of version {v} not redone" in err["reason"], err
        # the message named is one of the deleted pushes' chunk 0 (the members' reads run concurrently)
        gone = re.search(r"MergeError\('PUSH message (\d+) is gone from the stream", err["reason"])
        assert gone and int(gone[1]) in {tr["seqs"]["0"] for tr in intent["tries"]}, err
        assert ck.read_intent(fid) is None and ck.read_state().versions[fid] == v - 1
        await wait_status(js, run_id, lambda st: st["counters"].get("merge_redo_failed") == 1
                          and not st["counters"].get("merge_redone"))
        for _ in range(100):
            resent = await bcast_state(js, run_id, a.session, fid)
            if all(meta["version"] == v - 1 for meta, _, _ in resent):
                break
            await asyncio.sleep(0.05)
        assert [meta["version"] for meta, _, _ in resent] == [v - 1] * len(resent)
        assert resent[-1][0]["version_digest"] == held.version_digests[fid]

        # ---- the round restarts (a new attempt); the pushes merged now are the only ones in version v
        ref = before
        deltas = []
        for isl in isls:
            pull = await isl.expect_pull(t, timeout=30)
            assert pull["attempt"] > attempt1 and pull["base_version"] == v - 1, pull
            deltas.append(torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1)
            await isl.push(pull, deltas[-1], c_tokens=TOKENS[isl.island])
        ref.round(fid, deltas, [TOKENS[isl.island] for isl in isls])
        commit = await wait_tape(js, run_id, lambda r: r["step"] == t and r["fragment"] == fid, kind="commit",
                                 timeout=30)
        merge = await wait_tape(js, run_id, lambda r: r["step"] == t and r["fragment"] == fid, kind="merge")
        assert merge["version"] == v and merge["attempt"] > attempt1 and not merge["detail"].get("redone"), merge
        # the committed version v (its checkpoint files) is the reference's, and its digest the commit's
        params, _ = ck.load_fragment(fid, v, a.frag(fid)["numel"])
        torch.testing.assert_close(params, ref.value(fid), rtol=1e-6, atol=1e-6)
        assert commit["detail"]["version_digest"] == hashlib.sha256(pack(params, "f32").numpy().tobytes()).hexdigest()
        after = await bcast_state(js, run_id, a.session, fid)
        # (the restarted round's chunks of version v carry new Nats-Msg-Ids: under the killed syncer's
        # `bcast.F.v.C` JetStream would drop them as duplicates and BCAST would keep v - 1 there)
        assert [meta["version"] for meta, _, _ in after] == [v] * len(after)
        whole = hashlib.sha256(b"".join(data for _, data, _ in after)).hexdigest()
        assert commit["detail"]["version_digest"] == whole == after[-1][0]["version_digest"]
        torch.testing.assert_close(unpack(b"".join(data for _, data, _ in after), "f32", a.frag(fid)["numel"]),
                                   ref.value(fid), rtol=1e-6, atol=1e-6)
        # version v's first chunks now hold other bytes than the killed syncer's
        assert all(digest(after[c][1]) != d for c, d in early.items())

        # ---- no island installs the partial bytes. An island that saw the notice of the re-sent chunk 0
        # drops its staging and reads v afresh; one that missed every notice and reads on from where it
        # stopped hashes old and new chunks together, and the seal refuses that mix.
        r_notice, r_blind = readers
        assert r_notice.chunk_changed(fid, 0, v - 1, resent[0][0]["digest"]) is True
        verdicts = [r_notice.take(fid, meta["chunk"], meta, data, seq) for meta, data, seq in after]
        assert verdicts == ["accept"] * (len(after) - 1) + ["complete"]
        assert r_notice.held[fid] == (v, whole)
        with pytest.raises(WireError):
            for meta, data, seq in after[len(early):]:
                assert r_blind.take(fid, meta["chunk"], meta, data, seq) == "accept"
        assert r_blind.held[fid] == (v - 1, held.version_digests[fid])
        # only the early chunks of v were ever seen with two byte strings (the seal: one digest)
        assert {k[2] for k, _ in log.two_digests() if k[:2] == (fid, v)} == set(early), log.two_digests()
        assert all(k[:2] == (fid, v) for k, _ in log.two_digests()), log.two_digests()

        # ---- the syncer lives on and the run finishes on the reference
        assert syncer.proc.poll() is None
        for t2 in range(t + 1, total + 1):
            await _play(isls, ref, gen, t2)
            f2 = (t2 - 1) % 2
            torch.testing.assert_close(await a.wait_version(f2, (t2 + 1) // 2), ref.value(f2), rtol=1e-6, atol=1e-6)
        await finish_on_reference(isls, syncer, ref, total)
        out = syncer.output()
        assert f"fragment {fid} version {v} cannot be merged again" in out
        segs = replay_segments(nats_url, run_id)
        assert len(segs) == 2 and all(line.endswith(" identical") for line in segs), segs
