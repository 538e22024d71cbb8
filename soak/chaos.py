#!/usr/bin/env python
"""Chaos soak: SIGKILL islands, the syncer and the broker at chosen moments of a real run, restart them,
and check from what the run leaves behind that nothing was lost, doubled or torn.

    python soak/chaos.py [--rounds 200] [--islands 4] [--seed 1] [--quick] [--no-baseline] [--workdir DIR]
                         [--outer {diloco,sparseloco}]

Everything is a real process: the embedded nats-server (services.broker.Broker, own port and store
dir), the syncer (`python -m yeto.services.cli syncer`, restarted with `--resume`), and N islands
(`python -m yeto.learner.demo`; island `b` has 2 gloo ranks). Each runs in its own process group, so a
SIGKILL takes a whole island (launcher and ranks) down at once, as a dead node would. `--outer sparseloco`
starts every syncer in the sparse outer mode (docs/design.md §4.10, with `--sparse-tile`/`--sparse-k`); the
islands follow the session's pin, restarted ones too.

Moments are detected only from what the product already publishes: a monitor holds a core NATS
subscription on `yeto.<run>.>` and sees pulls, push chunks, INIT chunks, broadcast and final chunks
(their `Yeto-Chunk` headers) and the syncer's tape records as they are published. The seeded
schedule arms one kill at a time (the next one only after the previous kill recovered and a few more
rounds committed); the kill fires in the monitor's callback when its moment is seen:

  island-init            the INIT island, at its first INIT chunk (once, at the start)
  island-after-pull      an island, right after a round's pull is published
  island-mid-push        an island, at chunk 0 of its push (pushes have several chunks: small --chunk-bytes)
  syncer-mid-merge       the syncer, when the last expected push of a round was accepted (tape), before
                         the round's commit record
  syncer-mid-broadcast   the syncer, at chunk 0 of a new version on BCAST
  broker-mid-broadcast   nats-server, at chunk 0 of a new version on BCAST; restarted on the same port
                         and store dir
  broker-mid-push        nats-server, at chunk 0 of a push
  syncer-final           the syncer, at the first chunk of the final cut (once, at the end)
  island-final           an island, at the first chunk of the final cut (once, at the end)

Recovery time of a kill = from the SIGKILL to the next round committed with the killed part back (an
island's new generation among the round's responders; for the syncer and the broker, any round
committed after the restart; for the final kinds, the end of the run).

Checks at the end, from the tape (EVENTS stream), the step logs, the BCAST headers seen, and the
export of the syncer's checkpoint (`yeto export`):
  lost    rounds 1..T without a merge record or without a commit record of their version, or versions
          short of T/P in the exported cut (the larger of the two counts)
  double  rounds with more than one merge record, versions committed (tape) or broadcast (BCAST
          headers) with more than one version digest
  bad_apply  island processes whose step log shows a version going back, more applies than version
          changes (a version applied twice), or a version that was never committed (a partial one)
  final_equal  every island's last process saved exactly the exported final cut (bitwise)
  left    processes of any started group still running after the run ended
The same seed is then run without faults; goodput = useful island-steps per second with faults over
the same without. Useful island-steps: per island process, the local step of its last push that a
committed round merged (steps after that were lost with the process, or ended under the final cut).

Last line: `chaos rounds=<n> kills=<k> lost=<x> double=<y> final_equal=<true|false> goodput=<g>`
(goodput `na` with --no-baseline). Exit status 0 only when every check holds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

# chaos_procs and chaos_checks lie beside this script: its folder on the path also under `python -P`
# (the yeto it drives is the installed one, never the checkout's top level)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson  # noqa: E402

from yeto.services.run_harness import clean_env, read_tape  # noqa: E402

# the run's processes: soak/chaos_procs.py, beside this script (its directory is on sys.path)
from chaos_procs import BrokerChild, Child, IslandChild, group_members, log  # noqa: E402,F401  (group_members: tests)
from chaos_checks import Kill, Watch, fmt_recovery, score_dir, verdict  # noqa: E402

MID_KINDS = ("island-after-pull", "island-mid-push", "syncer-mid-merge", "syncer-mid-broadcast",
             "broker-mid-broadcast", "broker-mid-push")
START_KINDS = ("island-init",)
END_KINDS = ("syncer-final", "island-final")
ALL_KINDS = START_KINDS + MID_KINDS + END_KINDS

class Chaos:
    def __init__(self, args, *, faults: bool, work: Path, t0: float):
        self.args, self.faults, self.work, self.t0 = args, faults, work, t0
        self.run = f"chaos_{'f' if faults else 'b'}_{uuid.uuid4().hex[:8]}"
        self.islands = [chr(ord("a") + i) for i in range(args.islands)]
        self.ranks = {i: (2 if i == "b" else 1) for i in self.islands}
        self.rng = random.Random(args.seed)
        self.watch = Watch()
        self.children: list = []          # every Child ever started (for the "left" check)
        self.current: dict[str, IslandChild] = {}
        self.syncer: Child | None = None            # the owning syncer (with --standby: the lease's holder)
        self.standby: Child | None = None           # --standby: the syncer standing by
        self._lease_pid: int | None = None          # --standby: the pid the lease last named
        self.dirs: dict[str, Path] = {}             # syncer child name -> its --checkpoint-dir
        self.broker: BrokerChild | None = None
        self.restarts: dict[str, int] = defaultdict(int)
        self.kills: list[Kill] = []
        self.armed: Kill | None = None
        self.end_kill: Kill | None = None
        self.crashes: list[str] = []
        self.syncer_rcs: list[int] = []
        self.from_root = None

    # ---- schedule ----------------------------------------------------------------------------------

    def schedule(self) -> list[Kill]:
        a, rng = self.args, self.rng
        kinds = [k for k in a.kinds if k in MID_KINDS] * a.kills_per_kind
        rng.shuffle(kinds)
        plan: list[Kill] = []
        if "island-init" in a.kinds:
            plan.append(Kill("island-init", a.init_island, 0, rng.uniform(0.2, 1.5)))
        step = a.first_kill_after
        for k in kinds:
            target = "syncer" if k.startswith("syncer") else "broker" if k.startswith("broker") else rng.choice(self.islands)
            plan.append(Kill(k, target, step, rng.uniform(0.2, 1.5)))
            step += rng.randint(a.gap_min, a.gap_max)
        ends = [k for k in a.kinds if k in END_KINDS]
        if ends:
            k = rng.choice(ends)
            plan.append(Kill(k, "syncer" if k == "syncer-final" else rng.choice(self.islands), 0, rng.uniform(0.2, 1.5)))
        return plan

    # ---- processes ----------------------------------------------------------------------------------

    def start_syncer(self, resume: bool) -> Child:
        a = self.args
        n = len([c for c in self.children if c.name.startswith("syncer")])
        # --standby: every syncer its own (empty) directory, as on another host: a takeover restores the
        # committed state from the state KV
        d = self.work / (f"syncer-{n}" if a.standby else "syncer")
        cmd = [sys.executable, "-P", "-m", "yeto.services.cli", "syncer", "--nats", self.broker.url, "--run", self.run,
               "--checkpoint-dir", str(d), "--small-limits", "--islands", str(a.islands),
               "--fragments", str(a.fragments), "--sync-every", str(a.sync_every), "--total-steps", str(a.rounds),
               "--init-island", a.init_island, "--chunk-bytes", str(a.chunk_bytes), "--quorum-timeout", str(a.quorum_timeout),
               "--member-timeout", str(a.member_timeout), "--final-timeout", "60", "--status-every", "2",
               "--replicas", str(a.replicas)]
        # rolling.py's arguments have no --outer: its syncers run the dense default
        if getattr(a, "outer", "diloco") == "sparseloco":
            cmd += ["--outer", "sparseloco", "--sparse-tile", str(a.sparse_tile), "--sparse-k", str(a.sparse_k)]
        if resume:
            cmd.append("--resume")
        child = Child(f"syncer-{n}", cmd, self.work / f"syncer-{n}.log", clean_env()).start()
        self.dirs[child.name] = d
        self.children.append(child)
        return child

    async def _follow_lease(self, nc) -> None:
        """--standby: which of the two syncers holds the run's lease (the pid in it); kills go to that one."""
        from yeto.schemas import subjects as S
        try:
            if self._lease_kv is None:   # the syncer provisions the bucket
                self._lease_kv = await nc.jetstream(timeout=5).key_value(S.kv_bucket(self.run, "state"))
            pid = orjson.loads((await self._lease_kv.get("lease")).value).get("pid")
        except Exception:   # noqa: BLE001 - not written yet, or a broker away: ask again
            return
        if self.standby is not None and self.standby.proc.pid == pid:
            self.syncer, self.standby = self.standby, self.syncer
        # logged on every change of holder, whichever of _restarts or this poll swapped the pair first
        if pid != self._lease_pid:
            if self._lease_pid is not None:
                owner = next((c.name for c in self.children if c.name.startswith("syncer") and c.proc.pid == pid), pid)
                log(self.t0, f"{owner} owns the run now")
            self._lease_pid = pid

    def start_island(self, island: str) -> None:
        n = self.restarts[island]
        tag = island if n == 0 else f"{island}-r{n}"
        c = IslandChild(self.broker.url, self.run, island, self.work, tag, self.ranks[island], self.args.step_delay,
                        restarted=n > 0).start()
        self.current[island] = c
        self.children.append(c)

    # ---- monitor --------------------------------------------------------------------------------------

    async def on_msg(self, msg) -> None:
        if os.environ.get("CHAOS_DEBUG"):
            print("MSG", msg.subject, flush=True)
        try:
            self._see(msg)
        except Exception as exc:  # the monitor must never die on something it did not expect
            log(self.t0, f"monitor: could not read {msg.subject}: {exc!r}")

    def _see(self, msg) -> None:
        w = self.watch
        tok = msg.subject.split(".")[2:]
        kind = tok[0]
        hdr = None
        if msg.headers and "Yeto-Chunk" in msg.headers:
            hdr = orjson.loads(msg.headers["Yeto-Chunk"])
        if kind == "events":
            rec = orjson.loads(msg.data)
            k = rec.get("kind")
            if k == "merge":
                w.merges[rec["step"]].append(rec)
                w.committed = max(w.committed, rec["step"])
                self._recovered_by_merge(rec)
            elif k == "commit":
                w.commits[(rec["fragment"], rec["version"])].add(rec.get("detail", {}).get("version_digest"))
            elif k == "disposition" and rec.get("disposition") == "accepted":
                key = (rec["step"], rec["attempt"])
                w.accepted[key].add(rec["island"])
                if len(w.accepted[key]) >= w.pull_members.get(key, 10**9):
                    self._trigger("syncer-mid-merge", what=f"step {rec['step']} attempt {rec['attempt']}: last push accepted",
                                  late=bool(w.merges.get(rec["step"])))
        elif kind == "ctl":
            if tok[1] == "pull":
                p = orjson.loads(msg.data)
                w.pull_members[(p["step"], p["attempt"])] = len(p["members"])
                if self.armed and self.armed.kind == "island-after-pull" and any(
                        m["island"] == self.armed.target for m in p["members"]):
                    self._trigger("island-after-pull", what=f"pull step {p['step']} attempt {p['attempt']}")
            elif tok[1] in ("hello", "hb"):
                m = orjson.loads(msg.data)
                w.gens[m["island"]] = m["gen"]
        elif kind == "push" and hdr is not None:
            if hdr["chunk"] == 0 and hdr["chunks"] > 1:
                island = tok[1]
                what = f"{island} push step {hdr['step']} attempt {hdr['attempt']} chunk 0/{hdr['chunks']}"
                if self.armed and self.armed.kind == "island-mid-push" and island == self.armed.target:
                    self._trigger("island-mid-push", what=what)
                self._trigger("broker-mid-push", what=what)
        elif kind == "init" and hdr is not None:
            w.init_seen = True
            self._trigger("island-init", what=f"INIT fragment {hdr['fragment']} chunk {hdr['chunk']}/{hdr['chunks']}")
        elif kind == "bcast" and hdr is not None:
            fv = (hdr["fragment"], hdr["version"])
            if "version_digest" in hdr:  # the seal (last chunk) only: the other chunks carry none
                w.bcast_digests[fv].add(hdr["version_digest"])
            new = fv not in w.bcast_seen
            w.bcast_seen.add(fv)
            if new and hdr["version"] >= 1 and hdr["chunk"] == 0 and hdr["chunks"] > 1:
                what = f"BCAST fragment {fv[0]} version {fv[1]} chunk 0/{hdr['chunks']}"
                self._trigger("syncer-mid-broadcast", what=what)
                self._trigger("broker-mid-broadcast", what=what)
        elif kind == "final" and hdr is not None:
            if not w.final_seen:
                w.final_seen = True
                k = self.end_kill
                if k is not None and k.fired_at is None:
                    self._fire(k, f"final cut fragment {hdr['fragment']} chunk {hdr['chunk']}/{hdr['chunks']}")

    def _trigger(self, kind: str, *, what: str, late: bool = False) -> None:
        k = self.armed
        if k is None or k.kind != kind or k.fired_at is not None:
            return
        if kind == "island-init":
            if k.target not in self.current:
                return
        self._fire(k, what)
        k.on_target = not late

    def _fire(self, k: Kill, what: str) -> None:
        k.fired_at = time.monotonic()
        k.what = what
        k.committed_at_kill = self.watch.committed
        if k.target == "syncer":
            k.victim = self.syncer
            self.syncer.sigkill()
        elif k.target == "broker":
            who = self.broker.sigkill("PUSH" if k.kind == "broker-mid-push" else "BCAST", self.rng)
            what = f"{what}; killed {who}"
        else:
            k.killed_gen = self.watch.gens.get(k.target)
            self.current[k.target].sigkill()
        if k is self.armed:
            self.armed = None
        log(self.t0, f"KILL #{len([x for x in self.kills if x.fired_at])} {k.kind} -> {k.target} at {what} "
                     f"(committed {k.committed_at_kill})")

    def _recovered_by_merge(self, rec: dict) -> None:
        now = time.monotonic()
        for k in self.kills:
            if k.fired_at is None or k.recovered_at is not None or k.restarted_at is None or k.kind in END_KINDS:
                continue
            if k.target in ("syncer", "broker"):
                ok = rec["step"] > k.committed_at_kill or now > k.restarted_at
            else:
                ok = any(r["island"] == k.target and r["gen"] != k.killed_gen for r in rec.get("responded", []))
            if ok:
                k.recovered_at = now
                log(self.t0, f"recovered from {k.kind} ({k.target}) in {now - k.fired_at:.1f}s (round {rec['step']})")

    # ---- the run --------------------------------------------------------------------------------------

    async def go(self) -> dict:
        import nats

        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        from yeto.services.broker import free_port, free_port_block

        port = a.port or (free_port_block(a.cluster) if a.cluster else free_port())
        self.broker = BrokerChild(self.work, port, a.cluster)
        await asyncio.to_thread(self.broker.start)
        started = time.monotonic()
        plan = self.schedule() if self.faults else []
        self.kills = plan
        mids = [k for k in plan if k.kind not in END_KINDS]
        ends = [k for k in plan if k.kind in END_KINDS]
        self.end_kill = ends[0] if ends else None
        log(self.t0, f"{'chaos' if self.faults else 'baseline'} run {self.run}: {a.islands} islands "
                     f"(b has 2 ranks), {a.rounds} rounds, {len(plan)} kills planned, files in {self.work}")
        if plan:
            log(self.t0, "schedule: " + ", ".join(f"{k.kind}->{k.target}@{k.after_step}" for k in plan))
        nc = await nats.connect(self.broker.url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                name="chaos-monitor", error_cb=self._quiet, disconnected_cb=self._quiet2,
                                reconnected_cb=self._quiet2)
        from yeto.schemas import subjects as S

        await nc.subscribe(S.run_all(self.run), cb=self.on_msg, pending_msgs_limit=1_000_000,
                           pending_bytes_limit=1 << 30)
        await nc.flush()
        if a.cluster:
            leaders = asyncio.create_task(self._poll_leaders(nc))
        self.syncer = self.start_syncer(resume=False)
        self._lease_kv = None
        if a.standby:
            self.standby = self.start_syncer(resume=False)
        for i in self.islands:
            self.start_island(i)
        deadline = time.monotonic() + a.timeout
        last_progress = 0.0
        i_mid = 0
        timed_out = False
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    log(self.t0, f"TIMEOUT after {a.timeout:.0f}s at committed round {self.watch.committed}")
                    break
                # arm the next mid-run kill once the previous one recovered and enough rounds committed
                if self.armed is None and i_mid < len(mids):
                    prev = [k for k in mids[:i_mid] if k.fired_at is not None]
                    ready = all(k.recovered_at is not None for k in prev)
                    nxt = mids[i_mid]
                    if ready and self.watch.committed >= nxt.after_step and (
                            nxt.kind == "island-init" or self.watch.committed < a.rounds - 2):
                        self.armed = nxt
                        i_mid += 1
                    elif nxt.kind != "island-init" and self.watch.committed >= a.rounds - 2:
                        i_mid = len(mids)  # too late in the run: the rest of the schedule is dropped
                if self.armed is not None and self.armed.kind == "island-init" and self.watch.committed > 0:
                    self.armed = None  # INIT ended before the island sent a chunk we saw
                if a.standby:
                    await self._follow_lease(nc)
                await self._restarts()
                self._reap()
                if self.syncer.reap() is not None and not self._restart_pending("syncer"):
                    k = self.end_kill
                    if k is not None and k.restarted_at is not None and k.recovered_at is None and self.syncer.reap() == 0:
                        k.recovered_at = now  # a final-cut kill is over when the run ends cleanly
                        log(self.t0, f"recovered from {k.kind} ({k.target}): the run ended {now - k.fired_at:.1f}s after the kill")
                    if all(c.reap() is not None for c in self.current.values()) or now > self._syncer_exit_grace():
                        break
                if now - last_progress > a.progress_every:
                    last_progress = now
                    log(self.t0, f"progress: round {self.watch.committed}/{a.rounds}, "
                                 f"kills {len([k for k in plan if k.fired_at])}/{len(plan)}")
                await asyncio.sleep(0.05)
            wall = time.monotonic() - started
            # the islands leave after the syncer's shutdown, a standby once it sees the run's final record:
            # give them a moment before judging
            end = time.monotonic() + 60
            waited = list(self.current.values()) + ([self.standby] if self.standby is not None else [])
            while time.monotonic() < end and any(c.reap() is None for c in waited):
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            left = {c.name: c.left() for c in self.children}
            left = {n: p for n, p in left.items() if p}
            tape_recs = await self._read_tape(nc)
            with open(self.work / "tape.jsonl", "wb") as f:  # for post-mortems once the broker is gone
                for r in tape_recs:
                    f.write(orjson.dumps(r) + b"\n")
        finally:
            if a.cluster:
                leaders.cancel()
            for c in self.children:
                c.clear()
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:
                pass
            self.broker.stop()
        self.syncer_rcs.append(self.syncer.reap())
        return self._verdict(tape_recs, wall, left, timed_out)

    async def _poll_leaders(self, nc) -> None:
        """Keep the PUSH and BCAST streams' leaders known, so a broker kill can take the leader's node."""
        from yeto.schemas import subjects as S

        js = nc.jetstream(timeout=2)
        while True:
            for kind in ("PUSH", "BCAST"):
                try:
                    info = await js.stream_info(S.stream(self.run, kind))
                    if info.cluster and info.cluster.leader:
                        self.broker.leaders[kind] = info.cluster.leader
                except Exception:  # not provisioned yet, or no leader during an election
                    pass
            await asyncio.sleep(1.0)

    def _syncer_exit_grace(self) -> float:
        if not hasattr(self, "_exit_seen"):
            self._exit_seen = time.monotonic()
        return self._exit_seen + 90

    async def _quiet(self, exc) -> None:
        pass

    async def _quiet2(self) -> None:
        pass

    def _restart_pending(self, target: str) -> bool:
        return any(k.target == target and k.fired_at is not None and k.restarted_at is None for k in self.kills)

    async def _restarts(self) -> None:
        now = time.monotonic()
        for k in self.kills:
            if k.fired_at is None or k.restarted_at is not None or now < k.fired_at + k.restart_delay:
                continue
            if k.target == "syncer" and self.args.standby:
                # never restarted: the standby takes over; a new standby (an empty directory) stands by
                self.syncer_rcs.append(k.victim.proc.wait(10))
                if self.syncer is k.victim:
                    self.syncer = self.standby
                # else the lease showed the takeover already (_follow_lease swapped them): the victim stands
                # as the "standby", which is replaced
                self.standby = self.start_syncer(resume=False)
            elif k.target == "syncer":
                self.syncer_rcs.append(self.syncer.proc.wait(10))
                self.syncer = self.start_syncer(resume=True)
            elif k.target == "broker":
                self.broker.wait_dead(10)
                await asyncio.to_thread(self.broker.start)
            else:
                self.current[k.target].proc.wait(10)
                self.restarts[k.target] += 1
                self.start_island(k.target)
            k.restarted_at = time.monotonic()
            log(self.t0, f"restarted {k.target} {k.restart_delay:.1f}s after {k.kind}"
                         + ((" (a new standby; the old one takes over)" if self.args.standby else " (--resume)")
                            if k.target == "syncer" else ""))

    def _reap(self) -> None:
        for island, c in self.current.items():
            rc = c.reap()
            if rc not in (None, 0) and not c.killed and c.name not in self.crashes:
                self.crashes.append(c.name)
                tail = "\n".join(c.output().splitlines()[-15:])
                log(self.t0, f"CRASH: {c.name} exited {rc} without being killed:\n{tail}")
        for syncer in (self.syncer, self.standby):
            rc = syncer.reap() if syncer is not None else None
            if rc not in (None, 0) and not syncer.killed and syncer.name not in self.crashes:
                self.crashes.append(syncer.name)
                tail = "\n".join(syncer.output().splitlines()[-15:])
                log(self.t0, f"CRASH: {syncer.name} exited {rc} without being killed:\n{tail}")

    async def _read_tape(self, nc) -> list[dict]:
        js = nc.jetstream(timeout=10)
        for _ in range(3):  # the broker may have been restarted a moment ago
            try:
                return await read_tape(js, self.run)
            except Exception as exc:
                log(self.t0, f"reading the tape: {exc!r}; retrying")
                await asyncio.sleep(2)
        return []

    def _verdict(self, recs: list[dict], wall: float, left: dict, timed_out: bool) -> dict:
        return verdict(self, recs, wall, left, timed_out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak/chaos.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="global rounds to commit (default 200; 40 with --quick)")
    p.add_argument("--islands", type=int, default=4, help="islands; island b has 2 gloo ranks (default %(default)s)")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=8, help="H: inner steps between two syncs of one fragment")
    p.add_argument("--step-delay", type=float, default=0.02, help="seconds of simulated compute per inner step")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="chunk size: small, so pushes and broadcasts of the tiny model have several chunks (default "
                        "4096; 1024 with --outer sparseloco, whose pushes of fragment 0 are 1838 bytes)")
    p.add_argument("--outer", choices=("diloco", "sparseloco"), default="diloco",
                   help="the syncers' --outer (pinned in the session, which the islands follow; docs/design.md §4.10)")
    p.add_argument("--sparse-tile", type=int, default=8, help="with --outer sparseloco: the syncers' --sparse-tile "
                   "(default %(default)s: the demo's 64 x 64 weight in several tiles)")
    p.add_argument("--sparse-k", type=int, default=16, help="with --outer sparseloco: the syncers' --sparse-k")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(ALL_KINDS), help="comma-separated kill kinds (default: all)")
    p.add_argument("--kills-per-kind", type=int, default=4, help="kills of each mid-run kind (default %(default)s)")
    p.add_argument("--first-kill-after", type=int, default=3, help="rounds committed before the first mid-run kill")
    p.add_argument("--gap-min", type=int, default=2, help="fewest rounds between two mid-run kills")
    p.add_argument("--gap-max", type=int, default=5)
    p.add_argument("--init-island", default="a")
    p.add_argument("--member-timeout", type=float, default=20.0,
                   help="the syncer's --member-timeout: silence before a killed island counts as gone and rounds go on "
                        "without it (default %(default)s)")
    p.add_argument("--quorum-timeout", type=float, default=60.0,
                   help="the syncer's --quorum-timeout: the longest a round waits below quorum (default %(default)s)")
    p.add_argument("--standby", action="store_true",
                   help="two syncers from the start, each with its own empty --checkpoint-dir (as on two hosts): a "
                        "killed owner is never restarted, its standby takes over from the state KV, and a new "
                        "standby is started")
    p.add_argument("--quick", action="store_true",
                   help="a short soak: 40 rounds, 2 kills of each mid-run kind (well under 10 minutes)")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free run (goodput=na)")
    p.add_argument("--timeout", type=float, default=None, help="give up on a run after this many seconds")
    p.add_argument("--progress-every", type=float, default=10.0)
    p.add_argument("--port", type=int, default=0, help="broker port (default: a free one)")
    p.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="run the broker as N nats-servers joined by routes (`yeto broker --cluster N`); a broker "
                        "kill takes down one node, the leader of the stream the moment is about (default: one server)")
    p.add_argument("--replicas", type=int, default=None,
                   help="the syncer's --replicas (default: 3 with --cluster 3 or more, else 1)")
    p.add_argument("--workdir", default=None, help="keep logs, step logs and weights here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the full results as JSON here")
    p.add_argument("--rescore", default=None, metavar="WORKDIR",
                   help="only recompute goodput from a finished soak's WORKDIR/chaos and WORKDIR/baseline files")
    a = p.parse_args(argv)
    if a.rescore:
        (fs, ft), (bs, bt) = (score_dir(Path(a.rescore) / d, a.fragments) for d in ("chaos", "baseline"))
        print(f"chaos {fs} useful island-steps in {ft:.1f}s, baseline {bs} in {bt:.1f}s: goodput {(fs / ft) / (bs / bt):.3f}")
        return 0
    if a.quick:
        a.rounds = a.rounds or 40
        a.kills_per_kind = min(a.kills_per_kind, 2)
        a.first_kill_after, a.gap_min, a.gap_max = 2, 1, 2
    a.rounds = a.rounds or 200
    # a push of one chunk never arms island-mid-push or broker-mid-push (they fire at chunk 0 of several)
    a.chunk_bytes = a.chunk_bytes or (1024 if a.outer == "sparseloco" else 4096)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    bad = [k for k in a.kinds if k not in ALL_KINDS]
    if bad:
        p.error(f"--kinds: unknown kind(s) {', '.join(bad)}; known: {', '.join(ALL_KINDS)}")
    if a.replicas is None:
        a.replicas = min(3, a.cluster) if a.cluster else 1
    if a.replicas > max(1, a.cluster):
        p.error(f"--replicas {a.replicas} needs a cluster of at least that many servers (--cluster {a.cluster})")
    if a.islands < 2:
        p.error(f"--islands must be >= 2 (island b has 2 ranks), got {a.islands}")
    if a.timeout is None:
        a.timeout = 300 + a.rounds * 4 + 30 * a.kills_per_kind * len(a.kinds)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="yeto-chaos-"))
    t0 = time.monotonic()
    res = asyncio.run(Chaos(a, faults=True, work=work / "chaos", t0=t0).go())
    print(f"chaos: {res['committed']} rounds in {res['wall_s']:.1f}s ({res['train_s']:.1f}s from version 0 to the "
          f"last merge), kills {res['kills']}/{res['planned']}, useful island-steps {res['useful_steps']} "
          f"({res['goodput']:.2f}/s)", flush=True)
    print("recovery per kill kind (SIGKILL -> next round committed with the part back):", flush=True)
    for line in fmt_recovery(res["recovery"], ALL_KINDS):
        print(line, flush=True)
    for key in ("lost_rounds", "double_rounds", "double_versions", "bad_apply", "crashes", "left", "off_target"):
        if res[key]:
            print(f"  {key}: {res[key]}", flush=True)
    print(f"  syncer exit codes: {res['syncer_rcs']}; islands equal to the final cut: {res['islands_equal']}", flush=True)
    goodput = "na"
    base = None
    if not a.no_baseline:
        base = asyncio.run(Chaos(a, faults=False, work=work / "baseline", t0=t0).go())
        print(f"baseline (no faults): {base['committed']} rounds in {base['wall_s']:.1f}s ({base['train_s']:.1f}s "
              f"from version 0 to the last merge), useful island-steps {base['useful_steps']} "
              f"({base['goodput']:.2f}/s), final_equal={base['final_equal']}", flush=True)
        if base["goodput"] > 0:
            goodput = f"{res['goodput'] / base['goodput']:.3f}"
        if res["train_s"] > 0 and base["train_s"] > 0:
            # islands never wait for a round, so goodput hides what the kills cost the syncer: show that too
            print(f"round rate with faults over without: {(res['committed'] / res['train_s']) / (base['committed'] / base['train_s']):.3f} "
                  f"({res['committed'] / res['train_s']:.2f} vs {base['committed'] / base['train_s']:.2f} rounds/s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"chaos": res, "baseline": base, "args": vars(a)}, default=str, indent=1))
    ok = (res["lost"] == 0 and res["double"] == 0 and res["final_equal"] and not res["left"] and not res["bad_apply"]
          and not res["crashes"] and not res["timed_out"])
    print(f"chaos rounds={res['committed']} kills={res['kills']} lost={res['lost']} double={res['double']} "
          f"final_equal={'true' if res['final_equal'] else 'false'} goodput={goodput}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
