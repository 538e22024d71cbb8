"""docs/design.md §13: island b's own credentials against a secured run (real nats-server with the
permissions of `yeto auth init`, real `yeto syncer`, islands a and b as `python -m yeto.learner.demo`).

- **Message-id squatting**: b publishes, on b's own subjects (the server refuses anything else), messages
  carrying the Nats-Msg-Ids the syncer's pulls, a's pushes, a's heartbeats, a's final acks and the
  syncer's manifest and shutdown to a will use. JetStream de-duplicates by id per stream whatever the
  subject, so before the fix rounds stalled, a was evicted and finalization timed out. Now: rounds keep
  merging, a is never evicted, the run finalizes and both islands hold the final cut.
- **A flood** on b's own subjects (heartbeats, hellos, acks at full speed, then 20,000 garbage push chunks)
  while the run goes on never evicts a (heartbeats have their own stream that keeps the newest per island,
  and their own consumer) and the run finishes.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from yeto.schemas import subjects as S
from yeto.services.auth import init_auth
from tests.auth_support import connect_as, secured_broker, violations
from tests.e2e_procs import (IslandProc, assert_islands_hold_the_final_cut, kv_json, merges, tails, wait_exit,
                             wait_until)
from tests.scripted import SyncerProc, tape, wait_provisioned

pytestmark = pytest.mark.e2e

H, P = 4, 2
MEMBER_TIMEOUT = 8.0


class Run:
    def __init__(self, base: Path, run: str):
        self.base, self.run = base, run
        self.auth = base / "auth"
        init_auth(run, ["a", "b"], self.auth, init_island="a")
        self.broker, self.log = secured_broker(base, [self.auth])
        self.broker.start()

    def creds(self, identity: str) -> str:
        return str(self.auth / f"{identity}.creds")

    async def conn(self, identity: str):
        return await connect_as(self.broker.url, self.creds(identity), name=f"test-{identity}")

    def start(self, rounds: int, tmp: Path, step_delay: str = "0.05") -> dict:
        syncer = SyncerProc(self.broker.url, self.run, tmp / "ckpt", "--islands", "2", "--fragments", str(P),
                            "--sync-every", str(H), "--total-steps", str(rounds), "--init-island", "a",
                            "--quorum-timeout", "30", "--member-timeout", str(MEMBER_TIMEOUT), "--final-timeout", "60",
                            "--nats-creds", self.creds("syncer"), log=tmp / "syncer.log")
        islands = {i: IslandProc(self.broker.url, self.run, i, tmp, args=("--step-delay", step_delay),
                                 env={"YETO_NATS_CREDS": self.creds(i), "YETO_HEARTBEAT_S": "1"}) for i in ("a", "b")}
        return {"syncer": syncer, **islands}

    def violations(self) -> list[str]:
        return violations(self.log)


async def _gen_of(js, run: str, island: str) -> str:
    kv = await js.key_value(S.kv_bucket(run, "members"))

    async def got():
        try:
            e = await kv.get(island)
        except Exception:
            return None
        return orjson.loads(e.value)["gen"] if e is not None and e.value else None

    return await wait_until(got, 60, f"island {island}'s generation in the members KV", poll=0.02)


@pytest.mark.timeout(300)
async def test_island_b_squatting_the_ids_of_pulls_pushes_heartbeats_and_final_messages_stalls_nothing(
        run_id, tmp_path):
    rounds = 16
    r = Run(tmp_path, run_id)
    procs = r.start(rounds, tmp_path)
    watcher = await r.conn("syncer")      # the test's own eyes (not the attacker's)
    b = await r.conn("b")                 # the attacker: island b's credentials only
    bjs = b.jetstream(timeout=10)
    taken = 0

    async def squat(subject: str, ids) -> None:
        nonlocal taken
        for mid in ids:
            ack = await bjs.publish(subject, b"squat", headers={S.MSG_ID: mid})
            taken += not ack.duplicate

    try:
        wjs = watcher.jetstream(timeout=10)
        procs["syncer"].start()
        await wait_provisioned(wjs, run_id)
        # the syncer's pulls (CTL, so on b's hello subject): every step, attempts 1-3, the first re-publications
        await squat(S.hello(run_id, "b"), [S.pull_msg_id((t - 1) % P, t, a, s) for t in range(1, rounds + 1)
                                         for a in (1, 2, 3) for s in (0, 1)])
        procs["a"].start()
        gen_a = await _gen_of(wjs, run_id, "a")
        procs["b"].start()
        # a's heartbeats (HB), pushes (PUSH), final ack and the syncer's manifest / shutdown to a (CTL)
        await squat(S.heartbeat(run_id, "b"), [S.heartbeat_msg_id("a", gen_a, q) for q in range(0, 400)])
        await squat(S.push(run_id, "b", 0), [S.push_msg_id("a", gen_a, (t - 1) % P, t, a, y, k)
                                             for t in range(1, rounds + 1) for a in (1, 2) for y in (0, 1)
                                             for k in range(2)])
        await squat(S.ack(run_id, "b"), [S.ack_msg_id("a", gen_a, rounds, n) for n in range(4)])        # HB
        await squat(S.hello(run_id, "b"), [S.to_island_msg_id("a", "manifest", gen_a),                   # CTL
                                           S.to_island_msg_id("a", "shutdown", gen_a)])
        t0 = time.monotonic()
        rcs = await wait_exit(procs, 200)
        took = time.monotonic() - t0
        assert rcs == {"syncer": 0, "a": 0, "b": 0}, tails(procs)
        commit = await kv_json(wjs, run_id, "commit")
        status = await kv_json(wjs, run_id, "syncer")
        leaves = await tape(wjs, run_id, "leave")
        merged = await merges(wjs, run_id)
    finally:
        for p in procs.values():
            p.stop()
        await b.close()
        await watcher.close()
        r.broker.stop()
    assert taken > 400, taken                           # the squats landed before the real messages
    assert commit["committed_step"] == rounds and len(merged) == rounds
    assert [x for x in leaves if x["island"] == "a"] == [], leaves
    # a took part in the rounds (its pushes were not swallowed): all but the first few merged its push
    with_a = [m for m in merged if any(x["island"] == "a" for x in m["responded"])]
    assert len(with_a) >= rounds - 2, merged
    assert took < 120, took
    assert status["counters"].get("publish.msg_id_taken", 0) >= 1, status["counters"]   # the pulls re-sent
    res_a = procs["a"].result()
    assert res_a["counters"].get("publish.msg_id_taken", 0) >= 10, res_a["counters"]     # heartbeats, pushes
    assert_islands_hold_the_final_cut(tmp_path / "ckpt", tmp_path / "final.safetensors", run_id,
                                      [procs["a"], procs["b"]])


@pytest.mark.timeout(300)
async def test_a_flood_on_island_b_subjects_never_evicts_island_a(run_id, tmp_path):
    rounds = 160   # ~60 s of training: the flood (~35 s) must end while rounds still run
    r = Run(tmp_path, run_id)
    procs = r.start(rounds, tmp_path, step_delay="0.25")
    watcher = await r.conn("syncer")
    b = await r.conn("b")
    sent = 0
    try:
        wjs = watcher.jetstream(timeout=10)
        for p in procs.values():
            p.start()
        await wait_until(lambda: _merged(wjs, run_id, 2), 90, "2 merges")
        # flood b's own control subjects as fast as the client goes, for longer than the member timeout
        subjects = [S.heartbeat(run_id, "b"), S.hello(run_id, "b"), S.ack(run_id, "b")]
        end = time.monotonic() + 2.5 * MEMBER_TIMEOUT
        while time.monotonic() < end:
            for _ in range(200):
                await b.publish(subjects[sent % len(subjects)], b"{flood" + b"x" * 200)
                sent += 1
            await b.flush()
            await asyncio.sleep(0)
        # and 20,000 garbage push chunks (PUSH is read in stream order: a sustained flood there delays
        # rounds until intake has refused it, ~2-3k chunks a second here; it never touches heartbeats)
        for i in range(20_000):
            await b.publish(S.push(run_id, "b", i % P), b"x" * 200)
            if i % 500 == 0:
                await b.flush()
        sent += 20_000
        await b.flush()
        mid_run = (await kv_json(wjs, run_id, "commit"))["committed_step"]
        rcs = await wait_exit(procs, 200)
        # The syncer may end with 3, "no ack from: b": b's own final ack can sit behind (or be dropped with)
        # the flood b's credentials sent on b's own ack subject. Never a's.
        assert rcs["a"] == 0 and rcs["b"] == 0 and rcs["syncer"] in (0, 3), tails(procs)
        if rcs["syncer"] == 3:
            assert "finalization timed out; no ack from: b\n" in procs["syncer"].output(), tails(procs)
        leaves = await tape(wjs, run_id, "leave")
        finals = await tape(wjs, run_id, "final")
        status = await kv_json(wjs, run_id, "syncer")
        commit = await kv_json(wjs, run_id, "commit")
    finally:
        for p in procs.values():
            p.stop()
        await b.close()
        await watcher.close()
        r.broker.stop()
    assert sent > 5000, sent
    assert mid_run < rounds, f"the run ended before the flood did ({mid_run} of {rounds}): make it longer"
    # Once the final cut is out, a waits for a shutdown that b's missing ack can hold back, then stops
    # (30 s) and is timed out like any island that left: only a leave before the cut is an eviction.
    cut_at = next(x["t"] for x in finals if x.get("reason") == "final cut published")
    assert [x for x in leaves if x["island"] == "a" and x["t"] < cut_at] == [], leaves
    assert commit["committed_step"] == rounds
    c = status["counters"]
    assert c.get("rate_limited.hello", 0) + c.get("rate_limited.ack", 0) + c.get("rate_limited.hb", 0) > 0, c
    assert c.get("rejected.untaped", 0) > 0, c          # the rejections' tape records were bounded
    assert_islands_hold_the_final_cut(tmp_path / "ckpt", tmp_path / "final.safetensors", run_id, [procs["a"]])


async def _merged(js, run, n):
    return len(await merges(js, run)) >= n
