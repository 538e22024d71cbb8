"""The dashboards' aggregator and exporter fed by a real `yeto syncer` (scripted islands, see
tests/scripted.py): every record of the real tape is understood (nothing counted malformed), and a
real quorum timeout shows up as one restart and one timeout. Expected values are read from the
tape directly, not from the aggregator."""
from __future__ import annotations

import asyncio

import torch

from yeto.schemas import codec, subjects as S
from yeto.services.steplog.consume import SourceOptions
from yeto.services.steplog.exporter import Exporter, serve_exporter
from tests.e2e_procs import wait_until
from tests.scripted import close_run, start_run, tape
from tests.test_steplog_support import scrape


async def _until(cond, timeout=30.0, what="condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        await asyncio.sleep(0.05)


async def test_real_syncer_tape_with_a_quorum_timeout(nats_url, run_id, tmp_path):
    syncer, isls, _init = await start_run(
        nats_url, run_id, ["a", "b"], tmp_path / "ckpt", "--islands", "2", "--fragments", "2", "--sync-every", "2",
        "--total-steps", "2", "--quorum-timeout", "3", "--chunk-bytes", "1024", "--member-timeout", "60")
    a, b = isls
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    exp = Exporter(run_id)
    server = asyncio.create_task(serve_exporter(a.nc, SourceOptions(run_id, from_start=True), port=0, stop=stop,
                                                started=started, exporter=exp))
    try:
        port = await asyncio.wait_for(started, 10)
        gen = torch.Generator().manual_seed(3)

        def delta(isl, fid):
            return torch.randn(isl.frag(fid)["numel"], generator=gen) * 0.01

        for isl in isls:  # round 1 (fragment 0): both push at once
            _, pull = await isl.wait_for(lambda k, m: k == "pull" and m["step"] == 1)
            await isl.push(pull, delta(isl, 0))
        await a.wait_version(0, 1)
        for k, isl in enumerate(isls):  # step-log events as the islands' sync rank sends them
            ev = codec.make("steplog", run=run_id, island=isl.island, gen=isl.gen, step=2, t=1_700_000_000.0 + k,
                            boundary_s=0.2, export_s=0.1, apply_s=0.05, pushes=1, applies=1, bytes_out=4096,
                            bytes_in=4096, scatter_bytes=0, gather_bytes=0,
                            versions={"0": 1 if isl is a else 0, "1": 0}, pending_pulls=0, rejected=0)
            await isl.js.publish(S.steplog(run_id, isl.island), codec.encode("steplog", ev),
                                 headers={S.MSG_ID: S.steplog_msg_id(isl.island, isl.gen, 2)})
        # round 2 (fragment 1): only a answers attempt 1; after the 3 s deadline the syncer restarts it (attempt 2
        # must then be answered by both within 3 s: 1 s was too short on a loaded 2-core CI machine)
        _, pull = await a.wait_for(lambda k, m: k == "pull" and m["step"] == 2 and m["attempt"] == 1)
        await a.push(pull, delta(a, 1))
        for isl in isls:
            _, pull = await isl.wait_for(lambda k, m: k == "pull" and m["step"] == 2 and m["attempt"] == 2)
            await isl.push(pull, delta(isl, 1))
        await a.wait_version(1, 1)
        agg = exp.agg
        await _until(lambda: agg.merges == 2 and agg.kinds["steplog"] == 2, what="both merges seen")
        # The syncer keeps writing (the final manifest's events) while we read: take the tape and the
        # aggregator's counts at a moment when both hold the same number of records.
        async def settled():
            records = await tape(a.js, run_id)
            seen = {k: v for k, v in agg.kinds.items() if k != "steplog"}
            return (records, seen, dict(agg.dispositions)) if sum(seen.values()) == len(records) else None

        records, seen, seen_disp = await wait_until(settled, 30, "the aggregator to match the whole tape")
        m = await scrape(port)
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
        await close_run(isls, syncer, run_id)

    assert agg.malformed == 0, agg.last_malformed
    kinds = {}
    for rec in records:
        kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
    assert seen == kinds
    disp = {}
    for rec in records:
        if rec["kind"] == "disposition":
            disp[rec["disposition"]] = disp.get(rec["disposition"], 0) + 1
    assert seen_disp == disp and disp.get("accepted", 0) >= 4
    restarts = [rec for rec in records if rec["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["attempt"] == 2
    assert (agg.restarts, agg.quorum_timeouts) == (1, 1)
    r2 = agg.rounds[2]
    assert (r2.fragment, r2.attempt, r2.restarts, r2.quorum_timeouts) == (1, 2, 1, 1)
    merges = {rec["step"]: rec for rec in records if rec["kind"] == "merge"}
    for step in (1, 2):
        r = agg.rounds[step]
        assert r.status == "committed" and r.version == merges[step]["version"] == 1
        assert r.sync_s == merges[step]["sync_s"] and r.quorum_s == merges[step].get("quorum_s")
    assert agg.syncer_versions == {0: 1, 1: 1}
    # b reported fragment 0 at version 0 after version 1 was committed: one behind
    assert agg.lag("b") == {0: 1, 1: 1} and agg.lag("a") == {0: 0, 1: 1}
    assert agg.islands["a"].live is True and agg.islands["a"].gen == a.gen
    assert m[("yeto_quorum_timeouts_total", ())][0] == 1 and m[("yeto_round_latency_seconds_count", ())][0] == 2
    assert m[("yeto_island_version_lag", (("fragment", "0"), ("island", "b")))][0] == 1


async def test_exporter_scrape_after_a_real_run(nats_url, run_id, tmp_path):
    """One round through a real syncer, then the exporter started afterwards replays it (--from-start)."""
    syncer, isls, _init = await start_run(
        nats_url, run_id, ["a"], tmp_path / "ckpt", "--islands", "1", "--fragments", "1", "--sync-every", "1",
        "--total-steps", "1", "--chunk-bytes", "1024")
    (a,) = isls
    stop = asyncio.Event()
    server = None
    try:
        _, pull = await a.wait_for(lambda k, m: k == "pull" and m["step"] == 1)
        await a.push(pull, torch.full((a.frag(0)["numel"],), 0.01))
        await a.wait_version(0, 1)
        started = asyncio.get_running_loop().create_future()
        exp = Exporter(run_id)
        server = asyncio.create_task(serve_exporter(a.nc, SourceOptions(run_id, from_start=True), port=0, stop=stop,
                                                    started=started, exporter=exp))
        port = await asyncio.wait_for(started, 10)
        await _until(lambda: exp.agg.merges == 1, what="merge replayed")
        m = await scrape(port)
    finally:
        stop.set()
        if server is not None:
            await asyncio.wait_for(server, 10)
        await close_run(isls, syncer, run_id)
    assert m[("yeto_round_latency_seconds_count", ())][0] == 1
    assert m[("yeto_merges_total", ())][0] == 1
    assert m[("yeto_dispositions_total", (("disposition", "accepted"), ("island", "a")))][0] == 1
    assert m[("yeto_syncer_version", (("fragment", "0"),))][0] == 1
    assert not any(name == "yeto_steplog_malformed_total" for name, _ in m)
