"""The speculative merge (services/syncer/speculate.py) against a real nats-server and a real `yeto syncer`
process, killed with SIGKILL:

(a) while a round is being merged speculatively: one island's push is in, the other's half way, the
    syncer has summed chunks of the round's Δ; killed there and resumed, nothing of that round is
    anywhere (checkpoint files, commit record, BCAST unchanged, no intent of its version), the round is
    relaunched, and the run finishes on an independent reference with no version number lost or doubled.
(b) after the merge adopted the speculative sums, in the middle of its cut-through broadcast: the resumed
    syncer redoes the merge from the pushes in PUSH (no speculation), and every chunk the killed syncer
    sent from the adopted sums has the very bytes of the redo (a speculative merge and a merge of the
    pushes agree bit for bit), the version equal to the reference.
Every merge before the kills adopts its sums (the merge record's `speculated_chunks`), so the values the
reference checks all along came out of the speculative path.
"""
from __future__ import annotations

import asyncio
import hashlib
import signal

import orjson
import pytest
import torch

from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan, digest
from yeto.schemas.dtypes import unpack
from yeto.services.syncer.checkpoint import CheckpointDir
from tests.broadcast_support import RUN_ARGS as BROADCAST_RUN_ARGS, TOKENS, bcast_state, watched_run
from tests.scripted import (finish_on_reference, push_round, replay_segments, snapshot_dir, syncer_status, tape,
                            wait_status, wait_tape)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

RUN_ARGS = (*BROADCAST_RUN_ARGS, "--speculate", "on")


def _chunks(isl, fid: int) -> int:
    return len(chunk_plan(isl.frag(fid)["numel"], isl.session["push_dtype"], isl.session["chunk_bytes"]))


async def _play(isls, ref, gen, t: int, attempt: int | None = None) -> None:
    fid = await push_round(isls, ref, gen, t, TOKENS, attempt=attempt)
    torch.testing.assert_close(await isls[0].wait_version(fid, (t + 1) // 2), ref.value(fid), rtol=1e-6, atol=1e-6)


async def _merge_record(js, run_id: str, t: int) -> dict:
    return await wait_tape(js, run_id, lambda r: r["step"] == t, kind="merge", timeout=30)


async def test_sigkill_during_a_speculative_merge_then_resume(nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    async with watched_run(nats_url, run_id, ckpt, *RUN_ARGS, "--total-steps", "6",
                           seed=11) as (syncer, isls, ref, gen, log):
        a, b = isls
        js = a.js
        for t in (1, 2, 3):
            await _play(isls, ref, gen, t)
        # the rounds so far were merged from their speculative sums, every chunk of them
        for t in (1, 2, 3):
            rec = await _merge_record(js, run_id, t)
            assert rec["detail"]["speculated_chunks"] == _chunks(a, rec["fragment"]), rec["detail"]
        summed = (await syncer_status(js, run_id))["counters"].get("speculate.chunks", 0)

        # ---- round 4 (fragment 1): a's push whole, b's up to chunk 99 of ~258; the syncer sums chunks
        fid, n = 1, _chunks(a, 1)
        pa, pb = await a.expect_pull(4, attempt=1), await b.expect_pull(4, attempt=1)
        await a.push(pa, torch.randn(a.frag(fid)["numel"], generator=gen) * 0.1, c_tokens=TOKENS["a"])
        await b.push(pb, torch.randn(b.frag(fid)["numel"], generator=gen) * 0.1, c_tokens=TOKENS["b"], only=range(100))
        await wait_status(js, run_id, lambda st: st["counters"].get("speculate.chunks", 0) >= summed + 100, timeout=30)
        # intake acks each chunk once recorded: the syncer killed now leaves no push chunk waiting out the
        # PUSH consumer's ack wait (its in-flight round is relaunched anyway, below)
        for _ in range(100):
            pending = (await js.consumer_info(S.stream(run_id, "PUSH"), S.SYNCER_PUSH_CONSUMER)).num_ack_pending
            if pending == 0:
                break
            await asyncio.sleep(0.05)
        assert pending == 0
        files_before = snapshot_dir(ckpt)
        bcast_before = await bcast_state(js, run_id, a.session, fid)
        syncer.proc.send_signal(signal.SIGKILL)
        syncer.proc.wait()

        # ---- nothing of the speculation is anywhere: files, commit record, BCAST, no intent of version 2
        assert snapshot_dir(ckpt) == files_before
        held = CheckpointDir(ckpt).read_state()
        assert held.versions == {0: 2, 1: 1} and held.committed_step == 3
        intent = CheckpointDir(ckpt).read_intent(fid)
        assert intent is None or intent["merge"]["version"] != 2
        assert [(m, d) for m, d, _ in await bcast_state(js, run_id, a.session, fid)] == \
               [(m, d) for m, d, _ in bcast_before]
        commit = orjson.loads((await (await js.key_value(S.kv_bucket(run_id, "state"))).get("commit")).value)
        assert commit["committed_step"] == 3 and commit["versions"] == {"0": 2, "1": 1}

        # ---- resumed: round 4 relaunched (attempt 2), merged (speculatively again) on the reference
        syncer.start("--resume")
        await _play(isls, ref, gen, 4, attempt=2)
        rec = await _merge_record(js, run_id, 4)
        assert (rec["attempt"], rec["version"], rec["detail"]["speculated_chunks"]) == (2, 2, n), rec
        for t in (5, 6):
            await _play(isls, ref, gen, t)
        await finish_on_reference(isls, syncer, ref, 6)
        merges = await tape(js, run_id, "merge")
        assert [(m["step"], m["attempt"], m["version"]) for m in merges] == \
               [(1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 2, 2), (5, 1, 3), (6, 1, 3)]
        await asyncio.sleep(0.3)
        assert log.two_digests() == [], "a chunk of one version number was sent with two different byte strings"
        assert (await js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 0
        segs = replay_segments(nats_url, run_id)
        assert len(segs) == 2 and all(line.endswith(" identical") for line in segs), segs


async def test_sigkill_after_adopting_a_speculative_merge_then_redo_gives_its_bytes(nats_url, run_id, tmp_path):
    ckpt = tmp_path / "ckpt"
    async with watched_run(nats_url, run_id, ckpt, *RUN_ARGS, "--total-steps", "10", "--broadcast", "cut-through",
                           seed=12) as (syncer, isls, ref, gen, log):
        a = isls[0]
        js = a.js
        for t in (1, 2):
            await _play(isls, ref, gen, t)

        # ---- a round of fragment 1: SIGKILL once a few chunks of its version are in BCAST (after the
        # merge adopted its sums); a broadcast quicker than the kill tries again two rounds later
        fid = 1
        killed_at = None
        for t in (4, 6, 8):
            v = t // 2
            await _play(isls, ref, gen, t - 1)
            if await log.kill_mid_broadcast(syncer, fid, v, lambda t=t: push_round(isls, ref, gen, t, TOKENS)):
                killed_at = (t, v)
                break
            torch.testing.assert_close(await a.wait_version(fid, v), ref.value(fid), rtol=1e-6, atol=1e-6)
        assert killed_at is not None, "the broadcast was never caught in the middle in three rounds"
        t, v = killed_at
        assert f"step {t}: speculative merge adopted ({_chunks(a, fid)} of {_chunks(a, fid)} chunks summed)" \
            in syncer.output(), syncer.output()[-3000:]

        # ---- down mid-broadcast: early chunks of v (from the adopted sums) in BCAST, no seal, v not committed
        state = await bcast_state(js, run_id, a.session, fid)
        early = {meta["chunk"]: digest(data) for meta, data, _ in state if meta["version"] == v}
        assert len(early) >= 3 and not any("version_digest" in meta for meta, _, _ in state[:-1])
        ck = CheckpointDir(ckpt)
        assert ck.read_state().versions[fid] == v - 1 and ck.read_intent(fid)["merge"]["version"] == v

        # ---- resumed: the redo merges the pushes from PUSH and gives the same bytes as the sums did
        syncer.start("--resume")
        merge = await wait_tape(js, run_id, lambda r: r["step"] == t and r["fragment"] == fid, kind="merge", timeout=60)
        assert merge["detail"].get("redone") is True and merge["version"] == v, merge
        assert merge["detail"]["speculated_chunks"] == 0 and merge["detail"]["push_chunks_read"] > 0, merge["detail"]
        commit = await wait_tape(js, run_id, lambda r: r["step"] == t and r["fragment"] == fid, kind="commit")
        after = await bcast_state(js, run_id, a.session, fid)
        assert [meta["version"] for meta, _, _ in after] == [v] * len(after)
        assert {meta["chunk"]: digest(data) for meta, data, _ in after if meta["chunk"] in early} == early
        whole = hashlib.sha256(b"".join(data for _, data, _ in after)).hexdigest()
        assert commit["detail"]["version_digest"] == whole == after[-1][0]["version_digest"]
        vals = unpack(b"".join(data for _, data, _ in after), "f32", a.frag(fid)["numel"])
        torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)

        # ---- the run goes on (speculating again) and finishes on the reference
        for t2 in range(t + 1, 11):
            await _play(isls, ref, gen, t2)
        await finish_on_reference(isls, syncer, ref, 10)
        merges = await tape(js, run_id, "merge")
        assert [m["version"] for m in merges if m["fragment"] == fid] == list(range(1, 6))
        assert all(m["detail"]["speculated_chunks"] > 0 for m in merges if m["step"] > t), merges
        await asyncio.sleep(0.3)
        assert log.two_digests() == [], "a chunk of one version number was sent with two different byte strings"
