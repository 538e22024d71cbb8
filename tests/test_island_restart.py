"""docs/design.md §14: an island killed with SIGKILL mid-run and restarted rejoins with the current cut and
the run completes. Real nats-server, real `yeto syncer`, islands `a` (one process) and `b` (two gloo
ranks) as `python -m yeto.learner.demo` processes; the whole of island b (launcher and both ranks, one
process group) is killed after some rounds committed, then started again — a new process, so a new
connection generation.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from yeto.schemas.provision import remove_run
from yeto.services.cmd_export import export
from tests.e2e_procs import SYNCER_TIMEOUTS, IslandProc, kv_json, merges, tails, wait_exit, wait_until
from tests.scripted import SyncerProc, tape

H, P, ROUNDS = 8, 2, 16        # 4 inner steps per round
KILL_AFTER = 4                 # merges committed before island b is killed
STEP_DELAY = "0.05"            # seconds per inner step: ~0.2 s per round, so the kill lands mid-run


@pytest.mark.timeout(180)
async def test_killed_island_restarts_with_the_current_cut_and_the_run_completes(nc, nats_url, run_id, tmp_path):
    js = nc.jetstream()
    ckpt = tmp_path / "syncer"
    syncer = SyncerProc(
        nats_url, run_id, ckpt,
        "--islands", "2", "--fragments", str(P), "--sync-every", str(H), "--total-steps", str(ROUNDS),
        "--init-island", "a", *SYNCER_TIMEOUTS,
        # b's rounds wait for its restart: with SYNCER_TIMEOUTS' 20 s a restart slower than that (a
        # loaded machine; two ranks importing torch) let island a finish the run alone, and b came back
        # only to install the final cut, never joining (seen twice).
        "--member-timeout", "120",
        log=tmp_path / "syncer.log").start()
    args = ("--step-delay", STEP_DELAY)
    a = IslandProc(nats_url, run_id, "a", tmp_path, args=args).start()
    b1 = IslandProc(nats_url, run_id, "b", tmp_path, ranks=2, tag="b-first", args=args).start()
    procs = {"syncer": syncer, "a": a, "b-first": b1}
    try:
        async def enough_merges():
            if b1.poll() is not None:
                raise AssertionError(f"island b exited before the kill:\n{tails(procs)}")
            return len(await merges(js, run_id)) >= KILL_AFTER

        await wait_until(enough_merges, 90, f"{KILL_AFTER} merges")
        b1.kill_group()
        # What was committed when b died (a round b had already answered may still commit now:
        # read after the kill, so the restarted b must hold at least this).
        at_kill = await kv_json(js, run_id, "commit")
        assert at_kill["committed_step"] < ROUNDS, "the run finished before the kill: make it longer"
        old_gen = {r["gen"] for r in b1.steplog_rows()}
        assert len(old_gen) == 1 and sum(r["pushes"] for r in b1.steplog_rows()) >= 1  # b took part before dying

        # The restarted island installs the syncer's cut before its first step.
        b2 = IslandProc(nats_url, run_id, "b", tmp_path, ranks=2, tag="b-second", args=args,
                        env={"YETO_DILOCO_INITIAL_CUT_TIMEOUT": "30"}).start()
        procs["b-second"] = b2
        del procs["b-first"]
        rcs = await wait_exit(procs, 120)
        assert rcs == {"syncer": 0, "a": 0, "b-second": 0}, tails(procs)
        assert b1.poll() == -9
        commit = await kv_json(js, run_id, "commit")
        tape_merges = await merges(js, run_id)
        joins = await tape(js, run_id, "join")
    finally:
        for p in (*procs.values(), b1):
            p.stop()
        await remove_run(js, run_id)

    # The new process is a new generation, and its first step already holds the cut committed at the
    # kill (or newer) for every fragment.
    rows = b2.steplog_rows()
    new_gen = {r["gen"] for r in rows}
    assert len(new_gen) == 1 and new_gen.isdisjoint(old_gen), (new_gen, old_gen)
    (new_gen,) = new_gen
    first = rows[0]
    assert first["step"] == 1
    for f, v in at_kill["versions"].items():
        assert first["versions"].get(f, -1) >= v, (first["versions"], at_kill["versions"])
    assert any(j["island"] == "b" and j["gen"] == new_gen for j in joins), joins

    # Rounds kept committing after the kill, with the new generation of b taking part, until the end.
    assert commit["committed_step"] == ROUNDS and len(tape_merges) == ROUNDS
    assert [m["step"] for m in tape_merges] == list(range(1, ROUNDS + 1))
    after = [m for m in tape_merges if m["step"] > at_kill["committed_step"]]
    assert any({"island": "b", "gen": new_gen} in m["responded"] for m in after), after
    assert sum(r["pushes"] for r in rows) >= 1
    res = b2.result()
    assert res is not None and res["counters"]["rejected"] == 0, b2.output()[-3000:]

    # Finalization: both live islands saved exactly the exported final cut.
    export(ckpt, tmp_path / "final.safetensors", run_id)
    final = load_file(str(tmp_path / "final.safetensors"))
    assert sorted(final) == sorted(load_file(str(a.out)))
    for isl in (a, b2):
        saved = load_file(str(isl.out))
        for n, value in final.items():
            assert torch.equal(saved[n], value), (isl.tag, n)
    # and the cut's versions are the last round's: ROUNDS / P merges per fragment
    assert {int(f): v for f, v in commit["versions"].items()} == {f: ROUNDS // P for f in range(P)}
