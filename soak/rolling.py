#!/usr/bin/env python
"""Rolling maintenance soak: every part of a training run restarted on purpose, one after the other, while it
trains, and nothing lost, doubled or stalled (docs/design.md §7.1, §11, §14).

    python soak/rolling.py [--rounds 300] [--step-delay 0.1] [--workdir DIR]

Everything is a real process, started as users start them: `yeto broker --cluster 3` (three nats-servers,
the run's streams and buckets replicated with `--replicas 3`), an owning `yeto syncer` and a standby (each
its own empty checkpoint directory, as on two hosts: a takeover restores from the state KV), and two islands
(`python -m yeto.learner.demo`, one rank each). Once version 0 is committed and a few rounds merged, one
planned operation after the other, each once the previous one is over:

  broker-roll     `yeto broker roll`: every broker node restarted, followers first, the meta leader last
                  (stream leaders stepped down, lame duck mode, /healthz before the next; services/broker_roll.py)
  handover        SIGTERM to the owning syncer (once its standby stands by with a warm copy): it releases the
                  lease, the standby takes over at once; a new standby (an empty directory) is started, and warms
                  up while the next operations run
  island-a        SIGTERM to island a (it says it leaves), started again (a new generation takes the cut)
  outer-lr        `yeto run set RUN outer_lr=<x>`
  handover        the same again, to the standby started after the first one
  island-b        SIGTERM to island b, started again

An operation is over when what it restarted is back at work, and the next one starts one round later: the roll
command exited 0; a merge by the new owner; a merge that the island's new generation answered; the settings
answered. Then the run finishes on its own.

Checks (the same as soak/chaos.py's, soak/chaos_checks.py `verdict`): `lost` (a round without its merge or
commit record, or versions short in the exported cut), `double` (a round merged twice, a version with two
digests), `final_equal` (every island's last process saved exactly the `yeto export` of the last owner's
checkpoint), plus: no crash, nothing left running, every operation done before the run ended. From the tape:
`max_commit_gap_s`, the longest time between two consecutive rounds' merges, and `median_round_s`, the median
of those times; the planned operations must cost no more than a few seconds over a round:
max_commit_gap_s <= median_round_s + 3.

Last line: `rolling lost=<n> double=<n> final_equal=<bool> max_commit_gap_s=<x> median_round_s=<y>`; exit 0 only
when every check holds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

# chaos.py and its modules lie beside this script: its folder on the path also under `python -P` (the yeto it
# drives is the installed one, never the checkout's top level)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from yeto.services.run_harness import clean_env  # noqa: E402

from chaos import Chaos  # noqa: E402
from chaos_procs import Child, group_members, log  # noqa: E402

OPS = ("broker-roll", "handover", "island-a", "outer-lr", "handover", "island-b")
GAP_SLACK_S = 3.0


def _yeto(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "yeto.services.cli", *args]


def nats_children(pid: int) -> dict[str, int]:
    """server name -> pid of the nats-server children of process `pid` (read from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"--server_name" in argv:
            out[argv[argv.index(b"--server_name") + 1].decode()] = int(d)
    return out


class ClusterBroker:
    """`yeto broker --cluster 3` as a child process (its own process group), rolled with `yeto broker roll`.
    `pgids`: every nats-server it ran (each in a session of its own), for the check that none is left."""

    def __init__(self, work: Path):
        from yeto.services.broker import free_port_block

        self.work, self.store = work, work / "jetstream"
        port = free_port_block(3)
        self.child = Child("broker", _yeto("broker", "--cluster", "3", "--port", str(port), "--cluster-port",
                                           str(free_port_block(3)), "--http-port", str(free_port_block(3)),
                                           "--store-dir", str(self.store)), work / "broker.log", clean_env())
        self.url = ""
        self.pgids: list[int] = []

    def start(self) -> None:
        self.child.start()
        line = self.child.wait_line("yeto broker ready: ", 120)
        self.url = line.split("yeto broker ready: ", 1)[1].split()[0]
        self.note()

    def note(self) -> dict[str, int]:
        kids = nats_children(self.child.pid)
        self.pgids += [p for p in kids.values() if p not in self.pgids]
        return kids

    def roll(self) -> tuple[int, str]:
        import subprocess

        res = subprocess.run(_yeto("broker", "roll", "--store-dir", str(self.store), "--timeout", "600"),
                             capture_output=True, text=True, env=clean_env(), cwd=self.work, timeout=660)
        return res.returncode, res.stdout + res.stderr

    def stop(self) -> None:
        self.note()
        self.child.stop(grace=30)


class Rolling(Chaos):
    """The run of soak/chaos.py (its monitor, syncers, islands and verdict) with planned operations instead of
    kills; see the module's docstring."""

    def __init__(self, args, work: Path, t0: float):
        super().__init__(args, faults=False, work=work, t0=t0)
        self.run = f"rolling_{uuid.uuid4().hex[:8]}"
        self.ranks = {i: 1 for i in self.islands}
        self.ops: list[dict] = []        # what was done: name, started/ended (wall clock, as the tape's t), detail
        self.failed: list[str] = []
        self.handover_rcs: list[int] = []

    # ---- waiting for the run ----------------------------------------------------------------------------------

    async def _until(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f}s (committed round {self.watch.committed})")
            if self.watch.committed >= self.args.rounds:
                raise TimeoutError(f"{what}: the run ended first (lengthen it: --rounds)")
            await asyncio.sleep(0.05)

    async def _rounds(self, n: int) -> None:
        want = self.watch.committed + n
        await self._until(f"{n} more rounds", lambda: self.watch.committed >= want, 120)

    def _merged_by(self, island: str, not_gen: str | None, after: int) -> bool:
        return any(r["island"] == island and r["gen"] != not_gen
                   for step, recs in self.watch.merges.items() if step > after
                   for m in recs for r in m.get("responded", []))

    # ---- the operations ---------------------------------------------------------------------------------------

    async def broker_roll(self) -> str:
        before = self.broker.note()
        rc, out = await asyncio.to_thread(self.broker.roll)
        after = self.broker.note()
        if rc != 0:
            raise RuntimeError(f"yeto broker roll exited {rc}:\n{out[-3000:]}")
        if set(after) != set(before) or any(after[n] == before[n] for n in before):
            raise RuntimeError(f"not every node is a new process: before {before}, after {after}")
        order = [ln.split(":")[0].strip() for ln in out.splitlines() if "restarting (" in ln]
        return f"nodes restarted in order {', '.join(order)}"

    async def handover(self) -> str:
        # the standby started after the previous hand-over warmed up meanwhile (the operations between overlap it)
        await self._until(f"{self.standby.name} standing by with a warm copy", lambda: self._standing_by(self.standby),
                          180)
        owner, standby = self.syncer, self.standby
        at = self.watch.committed
        owner.killed = True   # a planned stop: its exit status is not a crash
        owner.send(signal.SIGTERM)
        rc = await asyncio.to_thread(owner.proc.wait, 60)
        self.handover_rcs.append(rc)
        if rc != 143:
            raise RuntimeError(f"{owner.name} exited {rc} on SIGTERM, not 143 (a planned hand-over):\n{owner.tail()}")
        await self._until(f"{standby.name} owning the run", lambda: self.syncer is standby, 60)
        await self._until(f"a merge by {standby.name}", lambda: self.watch.committed > at, 60)
        self.standby = self.start_syncer(resume=False)   # standing by before the next hand-over
        return f"{owner.name} exited {rc}; {standby.name} owns the run; {self.standby.name} started as the standby"

    def _standing_by(self, c) -> bool:
        text = c.this_life() if c is not None else ""
        return c is not None and c.reap() is None and "standby for run" in text and "into the warm copy" in text

    async def restart_island(self, island: str) -> str:
        c = self.current[island]
        gen = self.watch.gens.get(island)
        at = self.watch.committed
        c.killed = True   # a planned stop
        c.send(signal.SIGTERM)
        rc = await asyncio.to_thread(c.proc.wait, 60)
        self.restarts[island] += 1
        self.start_island(island)
        await self._until(f"island {island}'s new generation in a merge", lambda: self._merged_by(island, gen, at), 240)
        return f"exited {rc} on SIGTERM; its new generation answered a round"

    async def outer_lr(self) -> str:
        import subprocess

        res = await asyncio.to_thread(subprocess.run, _yeto("run", "set", self.run, f"outer_lr={self.args.outer_lr}",
                                                            "--nats", self.broker.url), capture_output=True,
                                      text=True, env=clean_env(), timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"yeto run set exited {res.returncode}: {res.stdout}{res.stderr}")
        return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "set"

    async def schedule(self) -> None:
        """The operations of OPS, one after the other, each once the previous one is over and one more round
        merged."""
        await self._until("version 0 and the first rounds", lambda: self.watch.committed >= 3, 300)
        do = {"broker-roll": self.broker_roll, "handover": self.handover, "island-a": lambda: self.restart_island("a"),
              "outer-lr": self.outer_lr, "island-b": lambda: self.restart_island("b")}
        for name in OPS:
            op = {"name": name, "started": time.time(), "round": self.watch.committed}
            log(self.t0, f"{name}: start (round {self.watch.committed})")
            try:
                op["detail"] = await do[name]()
            except Exception as exc:  # noqa: BLE001 - the verdict says which operation failed and why
                op["detail"] = f"FAILED: {exc}"
                self.failed.append(f"{name}: {exc}")
            op["ended"] = time.time()
            self.ops.append(op)
            log(self.t0, f"{name}: {op['detail']} ({op['ended'] - op['started']:.1f}s)")
            if self.failed:
                return
            await self._rounds(1)

    # ---- the run ----------------------------------------------------------------------------------------------

    async def go(self) -> dict:
        import nats

        from yeto.schemas import subjects as S

        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        self.broker = ClusterBroker(self.work)
        await asyncio.to_thread(self.broker.start)
        log(self.t0, f"run {self.run}: broker {self.broker.url}; {a.rounds} rounds, files in {self.work}")
        nc = await nats.connect(self.broker.url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                name="rolling-monitor", error_cb=self._quiet, disconnected_cb=self._quiet2,
                                reconnected_cb=self._quiet2)
        await nc.subscribe(S.run_all(self.run), cb=self.on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
        await nc.flush()
        self._lease_kv = None
        self.syncer = self.start_syncer(resume=False)
        await asyncio.sleep(1.0)    # the first one owns the run, the second stands by
        self.standby = self.start_syncer(resume=False)
        for i in self.islands:
            self.start_island(i)
        sched = asyncio.create_task(self.schedule())
        started, deadline, last = time.monotonic(), time.monotonic() + a.timeout, 0.0
        timed_out = False
        try:
            while True:
                await self._follow_lease(nc)
                self._reap()
                if self.syncer.reap() is not None and sched.done():
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    log(self.t0, f"TIMEOUT after {a.timeout:.0f}s at round {self.watch.committed}")
                    break
                if time.monotonic() - last > a.progress_every:
                    last = time.monotonic()
                    log(self.t0, f"progress: round {self.watch.committed}/{a.rounds}, operations {len(self.ops)}/{len(OPS)}")
                await asyncio.sleep(0.05)
            wall = time.monotonic() - started
            if not sched.done():
                sched.cancel()
                self.failed.append(f"the run ended before every operation was done ({len(self.ops)}/{len(OPS)})")
            end = time.monotonic() + 60
            waited = list(self.current.values()) + ([self.standby] if self.standby is not None else [])
            while time.monotonic() < end and any(c.reap() is None for c in waited):
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            left = {c.name: c.left() for c in self.children}
            tape_recs = await self._read_tape(nc)
            with open(self.work / "tape.jsonl", "w") as f:
                for r in tape_recs:
                    f.write(json.dumps(r) + "\n")
        finally:
            for c in self.children:
                c.clear()
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:  # noqa: BLE001 - the monitor's connection; the broker goes next anyway
                pass
            await asyncio.to_thread(self.broker.stop)
        self.syncer_rcs.append(self.syncer.reap())
        left.update({f"nats-server pgid {g}": group_members(g) for g in self.broker.pgids})
        left["broker"] = self.broker.child.left()
        left = {n: p for n, p in left.items() if p}
        res = self._verdict(tape_recs, wall, left, timed_out)
        res.update(commit_gaps(tape_recs))
        res.update({"ops": self.ops, "failed": self.failed, "handover_rcs": self.handover_rcs})
        # `yeto run set` took effect: every merge from some round on carries the outer lr set (Merge.outer)
        lr = sorted({r["step"] for r in tape_recs if r.get("kind") == "merge"
                     and ((r.get("detail") or {}).get("outer") or {}).get("outer_lr") == a.outer_lr})
        res["outer_lr_from"] = lr[0] if lr else None
        if not lr or lr != list(range(lr[0], a.rounds + 1)):
            self.failed.append(f"outer_lr={a.outer_lr} is not on every merge from some round on (rounds {lr[:3]}..)")
        return res


def commit_gaps(recs: list[dict]) -> dict:
    """From the tape: the time between consecutive rounds' first merge records (wall clock `t`, one host's),
    their median and maximum, and the five longest with the round they ended at."""
    first: dict[int, float] = {}
    for r in recs:
        if r.get("kind") == "merge" and "t" in r:
            first.setdefault(r["step"], r["t"])
    steps = sorted(first)
    gaps = [(first[b] - first[a], b) for a, b in zip(steps, steps[1:])]
    if not gaps:
        return {"max_commit_gap_s": float("inf"), "median_round_s": 0.0, "longest_gaps": []}
    return {"max_commit_gap_s": max(g for g, _ in gaps), "median_round_s": statistics.median(g for g, _ in gaps),
            "longest_gaps": sorted(gaps, reverse=True)[:5], "merge_t": first}


def during(ops: list[dict], t: float, before: float) -> str:
    """The operation(s) under way in [t - before, t]: what a long gap ending at t is laid at."""
    names = [o["name"] for o in ops if o["started"] <= t and o.get("ended", t) >= t - before]
    return ", ".join(names) or "no operation"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak/rolling.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300,
                   help="global rounds of the run: enough for every operation to be over before it ends (default "
                        "%(default)s)")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=8, help="H: inner steps between two syncs of one fragment")
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds of simulated compute per inner step")
    p.add_argument("--chunk-bytes", type=int, default=4096, help="small: pushes and broadcasts have several chunks")
    p.add_argument("--outer-lr", type=float, default=0.5, help="the outer learning rate `yeto run set` sets")
    p.add_argument("--member-timeout", type=float, default=60.0)
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=900.0, help="give up on the run after this many seconds")
    p.add_argument("--progress-every", type=float, default=15.0)
    p.add_argument("--workdir", default=None, help="keep logs, step logs and weights here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the full results as JSON here")
    a = p.parse_args(argv)
    if a.rounds < 40:
        p.error(f"--rounds must be >= 40 (six operations, each followed by a round, before the end), got {a.rounds}")
    # what Chaos (soak/chaos.py) reads from its arguments: two islands of one rank, two syncers on their own
    # directories (standby), everything replicated on the three nodes
    a.islands, a.seed, a.init_island, a.standby, a.replicas, a.cluster, a.port = 2, 1, "a", True, 3, 3, 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="yeto-rolling-"))
    t0 = time.monotonic()
    res = asyncio.run(Rolling(a, work, t0).go())
    print(f"rolling: {res['committed']} rounds in {res['wall_s']:.1f}s; operations:", flush=True)
    for o in res["ops"]:
        print(f"  {o['name']:12s} at round {o['round']:4d}, {o['ended'] - o['started']:6.1f}s: {o['detail']}", flush=True)
    print("longest gaps between two rounds' merges (s, at round; operation under way):", flush=True)
    for g, step in res["longest_gaps"]:
        print(f"  {g:6.2f}  round {step:4d}; {during(res['ops'], res['merge_t'][step], g)}", flush=True)
    for key in ("failed", "lost_rounds", "double_rounds", "double_versions", "bad_apply", "crashes", "left"):
        if res[key]:
            print(f"  {key}: {res[key]}", flush=True)
    print(f"  syncer exit codes: hand-overs {res['handover_rcs']}, last owner {res['syncer_rcs']}; islands equal to the "
          f"final cut: {res['islands_equal']}; outer_lr={a.outer_lr} merged from round {res['outer_lr_from']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rolling": res, "args": vars(a)}, default=str, indent=1))
    gap, median = res["max_commit_gap_s"], res["median_round_s"]
    ok = (res["lost"] == 0 and res["double"] == 0 and res["final_equal"] and not res["left"] and not res["bad_apply"]
          and not res["crashes"] and not res["timed_out"] and not res["failed"] and len(res["ops"]) == len(OPS)
          and gap <= median + GAP_SLACK_S)
    print(f"rolling lost={res['lost']} double={res['double']} final_equal={'true' if res['final_equal'] else 'false'} "
          f"max_commit_gap_s={gap:.2f} median_round_s={median:.2f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
