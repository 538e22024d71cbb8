"""An island stopped on purpose (SIGTERM from its launcher, a preempted node) says so, and comes back cleanly
(docs/design.md §14). Real nats-server, real `yeto syncer`, islands as `python -m yeto.learner.demo` processes.

The syncer's member timeout is 120 s here, so only the island's own word can end its membership in time:
after the SIGTERM its last heartbeat (`leaving`) makes the syncer tape a `leave` at once, the rounds go on
with island a alone, the island's process still dies by SIGTERM (its launcher's expectation), and a new
process of it joins with the current cut; the run finishes with both islands exact on the final cut.
"""
from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from yeto.schemas.provision import remove_run
from yeto.services.cmd_export import export
from tests.e2e_procs import SYNCER_TIMEOUTS, IslandProc, kv_json, merges, tails, wait_exit, wait_until
from tests.scripted import SyncerProc, tape

H, P, ROUNDS = 8, 2, 48
STOP_AFTER = 4                 # merges committed before island b is stopped
STEP_DELAY = "0.1"             # ~0.4 s a round: the run outlasts the restarted island's start
MEMBER_TIMEOUT_S = 120.0


@pytest.mark.timeout(240)
async def test_an_island_stopped_with_sigterm_says_it_leaves_and_rejoins(nc, nats_url, run_id, tmp_path):
    js = nc.jetstream()
    ckpt = tmp_path / "syncer"
    syncer = SyncerProc(nats_url, run_id, ckpt, "--islands", "2", "--fragments", str(P), "--sync-every", str(H),
                        "--total-steps", str(ROUNDS), "--init-island", "a", *SYNCER_TIMEOUTS,
                        "--member-timeout", str(MEMBER_TIMEOUT_S), log=tmp_path / "syncer.log").start()
    args = ("--step-delay", STEP_DELAY)
    a = IslandProc(nats_url, run_id, "a", tmp_path, args=args).start()
    b1 = IslandProc(nats_url, run_id, "b", tmp_path, tag="b-first", args=args).start()
    procs = {"syncer": syncer, "a": a, "b-first": b1}
    try:
        await wait_until(lambda: _merged(js, run_id, STOP_AFTER, b1), 90, f"{STOP_AFTER} merges")
        b1.send(signal.SIGTERM)
        stopped_at = time.time()
        n = len(await merges(js, run_id))
        rc_b1 = await asyncio.to_thread(b1.wait, 30)
        # its replacement starts at once (as a launcher restarting a job would); it needs seconds to import
        b2 = IslandProc(nats_url, run_id, "b", tmp_path, tag="b-second", args=args,
                        env={"YETO_DILOCO_INITIAL_CUT_TIMEOUT": "30"}).start()
        procs["b-second"] = b2
        del procs["b-first"]
        leave = await wait_until(lambda: _leave_of(js, run_id, "b"), 30, "island b's leave on the tape")
        said_in = leave["t"] - stopped_at
        # the rounds go on without b: a merge that b did not answer, long before any member timeout
        alone = await wait_until(lambda: _merge_without(js, run_id, n, "b"), 30, "a merge without island b")
        alone_in = alone["t"] - stopped_at
        rcs = await wait_exit(procs, 150)
        assert rcs == {"syncer": 0, "a": 0, "b-second": 0}, tails(procs)
        commit = await kv_json(js, run_id, "commit")
        joins = await tape(js, run_id, "join")
        tape_merges = await merges(js, run_id)
    finally:
        for p in (*procs.values(), b1):
            p.stop()
    print(f"SIGTERM to island b -> its leave taped {said_in:.2f}s later, a merge without it {alone_in:.2f}s")
    assert rc_b1 == -signal.SIGTERM, b1.output()[-3000:]          # it still died by the signal
    assert "told the syncer it is leaving" in b1.output(), b1.output()[-3000:]
    assert "said it is stopping" in leave["reason"], leave
    assert said_in < 10.0 and alone_in < MEMBER_TIMEOUT_S / 4, (said_in, alone_in)
    assert alone["step"] > 0
    new_gen = {r["gen"] for r in b2.steplog_rows()}
    assert len(new_gen) == 1 and new_gen != {leave["gen"]}
    assert any(j["island"] == "b" and j["gen"] in new_gen for j in joins), joins
    (gen2,) = new_gen
    assert any({"island": "b", "gen": gen2} in m["responded"] for m in tape_merges), "the new b never took part"
    assert commit["committed_step"] == ROUNDS and [m["step"] for m in tape_merges] == list(range(1, ROUNDS + 1))
    export(ckpt, tmp_path / "final.safetensors", run_id)
    final = load_file(str(tmp_path / "final.safetensors"))
    for isl in (a, b2):
        saved = load_file(str(isl.out))
        assert sorted(saved) == sorted(final)
        for name, value in final.items():
            assert torch.equal(saved[name], value), (isl.tag, name)
    await remove_run(js, run_id)


async def _merged(js, run, n, b1):
    if b1.poll() is not None:
        raise AssertionError(f"island b exited before the SIGTERM:\n{b1.tail()}")
    return len(await merges(js, run)) >= n


async def _leave_of(js, run, island):
    return next((r for r in await tape(js, run, "leave") if r["island"] == island), None)


async def _merge_without(js, run, after, island):
    return next((m for m in (await merges(js, run))[after:]
                 if all(x["island"] != island for x in m["responded"])), None)
