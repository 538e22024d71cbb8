"""docs/design.md §5.7: an island that (re)starts after the run finished, or that was away while it finished, used
to train for ever: the syncer had exited, nobody sent it a manifest. Now the syncer leaves the final
manifest in the state KV (`final`) as it exits, and such an island installs the f32 final cut from
FINAL (digests checked), stops at its next boundary and exits 0.

Real nats-server, real `yeto syncer`, `python -m yeto.learner.demo` islands (one of them with 2 gloo ranks).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from yeto.schemas import codec
from yeto.schemas import subjects as S
from yeto.schemas.provision import remove_run
from yeto.services.cmd_export import export
from tests.e2e_procs import IslandProc, kv_json, merges, tails, wait_exit, wait_until
from tests.scripted import SyncerProc

H, P = 8, 2
STEP_DELAY = ("--step-delay", "0.05")
# How long a late island may take to start, find the run finished, install the cut and exit: a 2-rank
# island's start (torch import, gloo) takes 5-30 s on a loaded 2-core machine.
LATE_EXIT_S = 120


async def _final_record(js, run: str) -> dict | None:
    kv = await js.key_value(S.kv_bucket(run, "state"))
    try:
        e = await kv.get("final")
    except Exception:
        return None
    return codec.decode("manifest", e.value) if e is not None and e.value else None


def _assert_on_final_cut(ckpt, run: str, tmp_path, islands) -> None:
    export(ckpt, tmp_path / "final.safetensors", run)
    final = load_file(str(tmp_path / "final.safetensors"))
    for isl in islands:
        saved = load_file(str(isl.out))
        assert sorted(saved) == sorted(final), isl.tag
        for n, value in final.items():
            assert torch.equal(saved[n], value), (isl.tag, n)


def _finished_after_run(isl: IslandProc, final_step: int) -> None:
    rows = isl.steplog_rows()
    assert rows, isl.output()[-3000:]
    last = rows[-1]
    assert last.get("extra", {}).get("final_after_run") is True and last["extra"]["final_step"] == final_step, last
    assert "the run had finished" in isl.output(), isl.output()[-3000:]


@pytest.mark.timeout(360)
async def test_islands_away_or_started_after_the_run_finished_install_the_final_cut_and_exit_0(
        nc, nats_url, run_id, tmp_path):
    """One run, three late islands. Island b is frozen (SIGSTOP: a hung host, a long partition) mid-run;
    the run goes on without it and finishes, the syncer exits. Then b resumes (it finds the final
    record while training), and two processes start: island a again (a known island, new generation)
    and c, an island the run never saw, with 2 gloo ranks (they find it at start). Each installs the
    final cut, stops and exits 0; before, each trained for ever."""
    js = nc.jetstream()
    rounds = 12
    ckpt = tmp_path / "syncer"
    syncer = SyncerProc(nats_url, run_id, ckpt, "--islands", "2", "--fragments", str(P), "--sync-every", str(H),
                        "--total-steps", str(rounds), "--init-island", "a", "--quorum-timeout", "10",
                        "--member-timeout", "4", "--final-timeout", "60", log=tmp_path / "syncer.log").start()
    a = IslandProc(nats_url, run_id, "a", tmp_path, args=STEP_DELAY).start()
    b = IslandProc(nats_url, run_id, "b", tmp_path, args=STEP_DELAY).start()
    procs = {"syncer": syncer, "a": a}
    late: dict[str, IslandProc] = {}
    stopped = False
    try:
        async def some_merges():
            assert b.poll() is None and a.poll() is None, tails({**procs, "b": b})
            return len(await merges(js, run_id)) >= 3

        await wait_until(some_merges, 120, "3 merges")
        os.killpg(b.proc.pid, signal.SIGSTOP)
        stopped = True
        assert await wait_exit(procs, 150) == {"syncer": 0, "a": 0}, tails({**procs, "b": b})
        final = await _final_record(js, run_id)
        commit = await kv_json(js, run_id, "commit")
        assert final is not None and final["final_step"] == rounds == commit["committed_step"], final
        assert final["versions"] == commit["versions"] and "gen" not in final

        # b is back: it finds the record while training
        os.killpg(b.proc.pid, signal.SIGCONT)
        stopped = False
        t0 = time.monotonic()
        assert await wait_exit({"b": b}, 60) == {"b": 0}, tails({"b": b})
        print(f"island b exited 0 {time.monotonic() - t0:.1f}s after it was resumed")

        # a known island restarted (a new generation), and an island the run never saw (2 ranks)
        t0 = time.monotonic()
        late = {"a-again": IslandProc(nats_url, run_id, "a", tmp_path, tag="a-again", args=STEP_DELAY).start(),
                "c": IslandProc(nats_url, run_id, "c", tmp_path, ranks=2, args=STEP_DELAY).start()}
        rcs = await wait_exit(late, LATE_EXIT_S)
        assert rcs == {"a-again": 0, "c": 0}, tails(late)
        print(f"late islands exited 0 after {time.monotonic() - t0:.1f}s")
        assert len(await merges(js, run_id)) == rounds  # nothing more happened to the run
    finally:
        if stopped:
            os.killpg(b.proc.pid, signal.SIGCONT)
        for p in (*procs.values(), b, *late.values()):
            p.stop()
        await remove_run(js, run_id)
    _assert_on_final_cut(ckpt, run_id, tmp_path, [a, b, *late.values()])
    _finished_after_run(b, rounds)
    assert sum(r["pushes"] for r in b.steplog_rows()) >= 1  # b took part before it was frozen
    for isl in late.values():
        _finished_after_run(isl, rounds)
        # it stopped at its first boundary: one training step, no push, no INIT
        assert [r["step"] for r in isl.steplog_rows()] == [1], isl.steplog_rows()
        assert isl.result()["counters"].get("init_bytes", 0) == 0 and isl.result()["counters"]["pushes"] == 0
