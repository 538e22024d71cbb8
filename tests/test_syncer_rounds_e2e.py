"""Rounds against a real nats-server and a real `yeto syncer` process, driven by scripted islands:
three islands with two rounds in flight (bf16 on the wire), a quorum timeout that restarts a round
with attempt 2 and later re-captures the members without an island that left, and every push
disposition (accepted, duplicate, unexpected member, future base, stale base, out of round) with the
merged bytes checked against an independent torch SGD reference that only sees the winning pushes.
"""
from __future__ import annotations

import pytest
import torch

from yeto.schemas import subjects as S
from yeto.schemas.chunks import chunk_plan
from tests.scripted import (LR, MU, Heartbeater, Reference, ScriptedIsland, close_run, start_run, syncer_status,
                            tape, tiny_layout, wait_tape)

pytestmark = pytest.mark.timeout(60)

LAYOUT = tiny_layout(4, 32)  # P=2: fragment 0 = embed (320 values), fragment 1 = layers (4224 values)
COMMON = ("--outer-lr", str(LR), "--outer-momentum", str(MU), "--chunk-bytes", "1024", "--status-every", "0.5")


def _gens(members: list[dict]) -> dict[str, str]:
    return {m["island"]: m["gen"] for m in members}


async def _finish(isls, syncer, final_step: int, ref: Reference | None = None) -> None:
    """Manifest to every island given, final f32 cut equal to the reference, acks, shutdowns, exit 0."""
    for isl in isls:
        _, man = await isl.expect(lambda k, m: k == "manifest")
        assert man["final_step"] == final_step and man["gen"] == isl.gen
    if ref is not None:
        for fid in ref.p:
            v, vals, meta = await isls[0].read_cut(fid, final=True)
            assert meta["final_step"] == final_step and meta["dtype"] == "f32" and v == man["versions"][str(fid)]
            torch.testing.assert_close(vals, ref.value(fid), rtol=1e-6, atol=1e-6)
    for isl in isls:
        await isl.ack(final_step)
    for isl in isls:
        await isl.expect(lambda k, m: k == "shutdown")
    assert syncer.wait(30) == 0, syncer.output()[-4000:]


# --speculate on: the speculative merge (services/syncer/speculate.py) with bf16 pushes, three members and
# two rounds in flight gives the same values (every round is adopted whole, asserted below)
@pytest.mark.parametrize("speculate", ["off", "on"])
async def test_three_islands_two_rounds_in_flight_bf16_wire_match_reference(nats_url, run_id, tmp_path, speculate):
    names = ["a", "b", "c"]
    syncer, isls, init = await start_run(
        nats_url, run_id, names, tmp_path / "ckpt", "--islands", "3", "--fragments", "2", "--sync-every", "2",
        "--total-steps", "4", "--strict", "--pipeline", "2", "--push-dtype", "bf16", "--bulk-dtype", "bf16",
        "--speculate", speculate, *COMMON, layout=LAYOUT)
    try:
        session = isls[0].session
        assert (session["push_dtype"], session["bulk_dtype"]) == ("bf16", "bf16")
        ref = Reference(init)
        for isl in isls:  # version 0 is the INIT island's bytes, exactly
            for fid, v in init.items():
                assert torch.equal(await isl.wait_version(fid, 0), v)
        # pipeline 2: rounds 1 and 2 (fragments 0 and 1) are both in flight before anyone pushes
        pulls = {t: [await isl.expect_pull(t) for isl in isls] for t in (1, 2)}
        gen = torch.Generator().manual_seed(1)
        for t in range(1, 5):
            fid = (t - 1) % 2
            deltas, tokens = [], []
            for i, isl in enumerate(isls):
                pull = pulls[t][i] if t in pulls else await isl.expect_pull(t)
                assert pull["fragment"] == fid and pull["attempt"] == 1
                # round 3 (fragment 0 again) launches only after round 1 committed version 1
                assert pull["base_version"] == (t - 1) // 2
                assert _gens(pull["members"]) == {x.island: x.gen for x in isls}
                d = torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.1
                tok = 100 * (i + 1) + t
                await isl.push(pull, d, c_tokens=tok)
                deltas.append(d.bfloat16().float())  # what a bf16 push carries
                tokens.append(tok)
            ref.round(fid, deltas, tokens)
            vals = await isls[1].wait_version(fid, (t + 1) // 2)
            # BCAST is bf16: the reference rounded to bf16 (one bf16 ulp of slack for f32 rounding flips)
            torch.testing.assert_close(vals, ref.value(fid).bfloat16().float(), rtol=2 ** -7, atol=1e-6)
        await _finish(isls, syncer, 4, ref)
        merges = await tape(isls[0].js, run_id, "merge")
        assert [(m["step"], m["fragment"], m["version"]) for m in merges] == [(1, 0, 1), (2, 1, 1), (3, 0, 2), (4, 1, 2)]
        assert all(_gens(m["responded"]) == {x.island: x.gen for x in isls} for m in merges)
        spans = {fid: len(chunk_plan(isls[0].frag(fid)["numel"], "bf16", session["chunk_bytes"])) for fid in (0, 1)}
        assert [m["detail"]["speculated_chunks"] for m in merges] == \
               [spans[m["fragment"]] if speculate == "on" else 0 for m in merges]
        assert merges[0]["weights"] == {"a": 101, "b": 201, "c": 301}
        status = await syncer_status(isls[0].js, run_id)
        assert status["exited"] and status["phase"] == "done" and status["committed_step"] == 4
        assert status["rounds"]["disposition.accepted"] == 12 and status["rounds"]["merge"] == 4
        assert (await isls[0].js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 0
    finally:
        await close_run(isls, syncer, run_id)


async def test_quorum_timeout_restarts_with_attempt_2_then_recaptures_without_the_island_that_left(
        nats_url, run_id, tmp_path):
    names = ["a", "b", "c"]
    syncer, isls, init = await start_run(
        nats_url, run_id, names, tmp_path / "ckpt", "--islands", "3", "--fragments", "1", "--sync-every", "1",
        "--total-steps", "2", "--quorum", "2", "--quorum-timeout", "2", "--member-timeout", "3", "--grace-ms", "200",
        *COMMON, layout=LAYOUT)
    a, b, c = isls
    # Non-strict rounds are paced by step times: everyone heartbeats (c too: alive, but never answers).
    beats = {isl.island: Heartbeater(isl).start() for isl in isls}
    try:
        js = a.js
        ref = Reference(init)
        n = a.frag(0)["numel"]
        gen = torch.Generator().manual_seed(2)
        everyone = {x.island: x.gen for x in isls}

        # ---- round 1: only a answers attempt 1 -> below quorum 2 at the deadline -> attempt 2
        p1 = {isl.island: await isl.expect_pull(1, attempt=1) for isl in isls}
        assert _gens(p1["a"]["members"]) == everyone
        await a.push(p1["a"], torch.randn(n, generator=gen), c_tokens=999)  # discarded by the restart
        await wait_tape(js, run_id, lambda r: r["island"] == "a" and r["disposition"] == "accepted", kind="disposition")
        p2 = {isl.island: await isl.expect_pull(1, attempt=2, timeout=10) for isl in isls}
        # c still heartbeats, so the restart re-captures all three (same generations)
        assert _gens(p2["a"]["members"]) == everyone and p2["a"]["base_version"] == 0
        restart = await wait_tape(js, run_id, lambda r: r["step"] == 1 and r["attempt"] == 2, kind="restart")
        assert _gens(restart["responded"]) == {"a": a.gen} and _gens(restart["expected"]) == everyone
        # a late push of the discarded attempt is out of round
        await a.push(p1["a"], torch.randn(n, generator=gen), try_=1)
        stale = await wait_tape(js, run_id, lambda r: r["island"] == "a" and r["try"] == 1, kind="disposition")
        assert stale["disposition"] == "out_of_round" and stale["attempt"] == 1 and "stale attempt" in stale["reason"]
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(p2["a"], da, c_tokens=300)
        await b.push(p2["b"], db, c_tokens=100)
        ref.round(0, [da, db], [300, 100])
        torch.testing.assert_close(await a.wait_version(0, 1), ref.value(0), rtol=1e-6, atol=1e-6)
        m1 = await wait_tape(js, run_id, lambda r: r["step"] == 1, kind="merge")
        assert m1["attempt"] == 2 and _gens(m1["responded"]) == {"a": a.gen, "b": b.gen}
        assert _gens(m1["expected"]) == everyone and m1["weights"] == {"a": 300, "b": 100}

        # ---- round 2: c goes silent and leaves; a restart re-captures only a and b
        await beats["c"].stop()
        await wait_tape(js, run_id, lambda r: r["island"] == "c", kind="leave", timeout=15)
        without_c = {"a": a.gen, "b": b.gen}
        p = {isl.island: (await isl.expect(lambda k, m: k == "pull" and m["step"] == 2
                                           and _gens(m["members"]) == without_c, timeout=15))[1] for isl in (a, b)}
        assert p["a"]["attempt"] >= 2 and p["a"]["base_version"] == 1
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(p["a"], da, c_tokens=50)
        await b.push(p["b"], db, c_tokens=150)
        ref.round(0, [da, db], [50, 150])
        m2 = await wait_tape(js, run_id, lambda r: r["step"] == 2, kind="merge")
        assert m2["attempt"] == p["a"]["attempt"] and _gens(m2["expected"]) == without_c
        # finalization targets the live islands only; c (gone) gets no manifest
        await _finish([a, b], syncer, 2, ref)
        assert not [m for k, m in await c.messages(timeout=0.5) if k == "manifest"]
        restarts = await tape(js, run_id, "restart")
        assert [r["step"] for r in restarts].count(1) == 1 and any(r["step"] == 2 for r in restarts)
    finally:
        for hb in beats.values():
            await hb.stop()
        await close_run(isls, syncer, run_id)


async def test_push_dispositions_and_only_the_first_valid_push_is_merged(nats_url, run_id, tmp_path):
    syncer, isls, init = await start_run(
        nats_url, run_id, ["a", "b"], tmp_path / "ckpt", "--islands", "2", "--fragments", "1", "--sync-every", "1",
        "--total-steps", "3", "--strict", "--max-base-lag", "1", *COMMON, layout=LAYOUT)
    a, b = isls
    x = ScriptedIsland(a.nc, run_id, "x", LAYOUT)  # never said hello: not a member
    x.session = a.session
    try:
        js = a.js
        ref = Reference(init)
        n = a.frag(0)["numel"]
        gen = torch.Generator().manual_seed(3)

        async def disposition(island: str, step: int, try_: int) -> dict:
            return await wait_tape(js, run_id, lambda r: (r["island"], r["step"], r["try"]) == (island, step, try_),
                                   kind="disposition")

        # ---- round 1 (base 0)
        pa, pb = await a.expect_pull(1), await b.expect_pull(1)
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(pa, da, c_tokens=100)
        assert (await disposition("a", 1, 0))["disposition"] == "accepted"
        await a.push(pa, torch.randn(n, generator=gen), c_tokens=100, try_=1)  # a second try: too late
        assert (await disposition("a", 1, 1))["disposition"] == "duplicate"
        await x.push(pa, torch.randn(n, generator=gen))
        assert (await disposition("x", 1, 0))["disposition"] == "unexpected_member"
        await b.push(pb, torch.randn(n, generator=gen), base_version=1)  # version 1 does not exist yet
        fut = await disposition("b", 1, 0)
        assert fut["disposition"] == "future_base" and fut["base_version"] == 1
        await b.push(pb, db, c_tokens=300, try_=1)  # b's slot is still open: this one counts
        assert (await disposition("b", 1, 1))["disposition"] == "accepted"
        ref.round(0, [da, db], [100, 300])
        torch.testing.assert_close(await a.wait_version(0, 1), ref.value(0), rtol=1e-6, atol=1e-6)

        # ---- round 2 (base 1); a push for the committed step 1 is out of round
        pa, pb = await a.expect_pull(2), await b.expect_pull(2)
        await a.push({**pa, "step": 1, "base_version": 0}, torch.randn(n, generator=gen), try_=2)
        late = await disposition("a", 1, 2)
        assert late["disposition"] == "out_of_round" and "no round in flight" in late["reason"]
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(pa, da, c_tokens=10)
        await b.push(pb, db, c_tokens=10)
        ref.round(0, [da, db], [10, 10])
        torch.testing.assert_close(await a.wait_version(0, 2), ref.value(0), rtol=1e-6, atol=1e-6)

        # ---- round 3 (base 2): base 0 lags by 2 > --max-base-lag 1 (stale); base 1 lags by 1 (accepted)
        pa, pb = await a.expect_pull(3), await b.expect_pull(3)
        assert pa["base_version"] == 2
        await b.push(pb, torch.randn(n, generator=gen), base_version=0)
        st = await disposition("b", 3, 0)
        assert st["disposition"] == "stale_base" and st["base_version"] == 0
        da, db = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
        await a.push(pa, da, c_tokens=70, base_version=1)
        await b.push(pb, db, c_tokens=30, try_=1)
        ref.round(0, [da, db], [70, 30])
        torch.testing.assert_close(await a.wait_version(0, 3), ref.value(0), rtol=1e-6, atol=1e-6)
        m3 = await wait_tape(js, run_id, lambda r: r["step"] == 3, kind="merge")
        assert m3["staleness"] == {"a": 1, "b": 0} and m3["weights"] == {"a": 70, "b": 30}

        await _finish([a, b], syncer, 3, ref)
        got = sorted((r["island"], r["step"], r["try"], r["disposition"]) for r in await tape(js, run_id, "disposition"))
        assert got == sorted([
            ("a", 1, 0, "accepted"), ("a", 1, 1, "duplicate"), ("x", 1, 0, "unexpected_member"),
            ("b", 1, 0, "future_base"), ("b", 1, 1, "accepted"), ("a", 1, 2, "out_of_round"),
            ("a", 2, 0, "accepted"), ("b", 2, 0, "accepted"),
            ("b", 3, 0, "stale_base"), ("a", 3, 0, "accepted"), ("b", 3, 1, "accepted"),
        ])
        counters = (await syncer_status(js, run_id))["rounds"]
        for d, k in [("accepted", 6), ("duplicate", 1), ("unexpected_member", 1), ("future_base", 1),
                     ("stale_base", 1), ("out_of_round", 1)]:
            assert counters.get(f"disposition.{d}") == k, (d, counters)
        # rejected pushes were released and merged ones purged: nothing is left in PUSH
        assert (await js.stream_info(S.stream(run_id, "PUSH"))).state.messages == 0
    finally:
        await close_run(isls, syncer, run_id)
