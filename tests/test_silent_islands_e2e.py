"""docs/design.md §4.4, "a wedge", end to end: both islands paused (SIGSTOP) past the member timeout with a round in
flight, then resumed. Before the fix the syncer never merged again (its loop spun on a due time in the
past and never read the heartbeats). Real nats-server, real `yeto syncer`, two `python -m yeto.learner.demo`."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from yeto.schemas.provision import remove_run
from tests.e2e_procs import (IslandProc, assert_islands_hold_the_final_cut, kv_json, merges, tails, wait_exit,
                             wait_until)
from tests.scripted import SyncerProc, tape

H, P, ROUNDS = 4, 2, 24
MEMBER_TIMEOUT = 6.0


@pytest.mark.timeout(240)
async def test_both_islands_paused_past_the_member_timeout_then_resumed_the_run_goes_on(nc, nats_url, run_id,
                                                                                       tmp_path):
    js = nc.jetstream()
    ckpt = tmp_path / "syncer"
    syncer = SyncerProc(nats_url, run_id, ckpt, "--islands", "2", "--fragments", str(P), "--sync-every", str(H),
                        "--total-steps", str(ROUNDS), "--init-island", "a", "--quorum-timeout", "30",
                        "--member-timeout", str(MEMBER_TIMEOUT), "--final-timeout", "60",
                        log=tmp_path / "syncer.log").start()
    args = ("--step-delay", "0.1")
    env = {"YETO_HEARTBEAT_S": "1"}
    isl = {i: IslandProc(nats_url, run_id, i, tmp_path, args=args, env=env).start() for i in ("a", "b")}
    procs = {"syncer": syncer, **isl}
    try:
        await wait_until(lambda: _merged(js, run_id, 4), 120, "4 merges")
        for p in isl.values():
            os.killpg(p.proc.pid, signal.SIGSTOP)
        paused_at = time.time()
        await asyncio.sleep(MEMBER_TIMEOUT + 5)          # every member leaves; a round is in flight or due
        leaves = [r for r in await tape(js, run_id, "leave") if r["t"] >= paused_at]
        assert {r["island"] for r in leaves} == {"a", "b"}, (leaves, tails(procs))
        before = len(await merges(js, run_id))
        for p in isl.values():
            os.killpg(p.proc.pid, signal.SIGCONT)
        resumed_at = time.time()
        await wait_until(lambda: _merged(js, run_id, before + 1), 20, "a merge after the islands resumed")
        first_after = time.time() - resumed_at
        rcs = await wait_exit(procs, 150)
        assert rcs == {"syncer": 0, "a": 0, "b": 0}, tails(procs)
        status = await kv_json(js, run_id, "syncer")
        commit = await kv_json(js, run_id, "commit")
    finally:
        for p in procs.values():
            try:
                os.killpg(p.proc.pid, signal.SIGCONT)
            except Exception:
                pass
            p.stop()
    assert first_after < 15.0, first_after
    assert commit["committed_step"] == ROUNDS
    # no restart storm: the wedge counted tens of thousands of early restarts
    assert status["rounds"].get("restart_early", 0) < 20, status["rounds"]
    assert status["counters"].get("loop.past_wakeup", 0) == 0, status["counters"]
    assert_islands_hold_the_final_cut(ckpt, tmp_path / "final.safetensors", run_id, isl.values())
    await remove_run(js, run_id)


async def _merged(js, run, n):
    return len(await merges(js, run)) >= n
