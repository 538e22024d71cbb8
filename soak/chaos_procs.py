"""The processes of soak/chaos.py: a run's islands, syncers and broker, each started as its own process group
(services/run_harness.py Child) so that a SIGKILL takes a whole island — launcher and ranks — down at once, as
a dead node would; and the check that nothing of a killed group outlives the run.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from yeto.services.run_harness import Child as RunChild, clean_env, read_jsonl


# The islands fail fast instead of waiting out production defaults when a run goes wrong; reconnects
# are quick and patient enough to outlast a broker restart.
ISLAND_ENV = {
    "YETO_SESSION_TIMEOUT": "120", "YETO_LOCKSTEP_TIMEOUT": "120", "YETO_FINAL_TIMEOUT": "120",
    "YETO_SHUTDOWN_TIMEOUT": "30", "YETO_INIT_V0_TIMEOUT": "120", "YETO_PUSH_TIMEOUT": "30",
    "YETO_PROGRESS": "0", "YETO_RECONNECT_WAIT_S": "0.5", "YETO_MAX_RECONNECTS": "600",
}


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc: a zombie still answers
    kill(pid, 0), and nobody may reap the orphaned ranks of a killed island in a container."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            out.append(int(d))
    return out


class Child(RunChild):
    """One process group we started: an island (all ranks), the syncer, or nats-server (a
    services/run_harness.py Child in its own session), and what the soak asks of it: was it killed on
    purpose, and does any process of its group outlive the run."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        super().__init__(name, cmd, log_path, env=env, group=True)
        self.name, self.log_path = name, log_path
        self.killed = False

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def sigkill(self) -> None:
        """The fault: SIGKILL the whole group, not reaped here (the monitor's callback must not block)."""
        self.killed = True
        self.send(signal.SIGKILL)

    def reap(self) -> int | None:
        return self.proc.poll()

    def left(self) -> list[int]:
        return group_members(self.pgid)

    def clear(self) -> None:
        """Whatever of the group still runs dies now (cleanup only; `left` is read before)."""
        if self.proc is None:
            return
        self.send(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.close_log()


class IslandChild(Child):
    def __init__(self, url: str, run: str, island: str, work: Path, tag: str, ranks: int, step_delay: float,
                 restarted: bool):
        self.island, self.tag, self.ranks = island, tag, ranks
        self.steplog = work / f"steplog-{tag}.jsonl"
        self.out = work / f"island-{tag}.safetensors"
        env = clean_env(YETO_NATS=url, YETO_RUN=run, YETO_ISLAND=island, YETO_DILOCO_STEP_LOG=str(self.steplog),
                        **ISLAND_ENV)
        if restarted:  # a restarted island installs the current cut before its first step
            env["YETO_DILOCO_INITIAL_CUT_TIMEOUT"] = "30"
        cmd = [sys.executable, "-P", "-m", "yeto.learner.demo", "--run", run, "--island", island, "--ranks", str(ranks),
               "--step-delay", str(step_delay), "--out", str(self.out)]
        super().__init__(f"island-{tag}", cmd, work / f"island-{tag}.log", env)

    def rows(self) -> list[dict]:
        return read_jsonl(self.steplog)  # a torn last line (SIGKILL mid-write) is left out


class BrokerChild:
    """The broker: one nats-server, or with `--cluster N` N of them joined by routes (services.broker.Cluster).

    One server: a kill is SIGKILL, a restart reuses its port and store. A cluster: a kill takes down one
    node (the leader of the stream the moment is about, when known: the PUSH stream's for broker-mid-push,
    BCAST's for broker-mid-broadcast), the restart brings that node back with its store; clients hold
    the whole URL list and ride over to a live node.
    """

    def __init__(self, work: Path, port: int, cluster: int = 0):
        self.store, self.port, self.log_path = work / "jetstream", port, work / "nats-server.log"
        self.cluster_n = cluster
        self.broker = None
        self.cluster = None
        self.dead: int | None = None      # the cluster node killed last (restarted by `start`)
        self.leaders: dict[str, str] = {}  # stream kind -> leader server name, polled by the monitor
        self.pgids: list[int] = []

    def start(self) -> None:
        from yeto.services.broker import Broker, Cluster

        if self.cluster_n:
            if self.cluster is None:
                self.cluster = Cluster(self.cluster_n, self.port, self.store, log_dir=self.store.parent)
                self.cluster.start(timeout=60)
                self.pgids.extend(b.proc.pid for b in self.cluster.nodes)
            elif self.dead is not None:
                self.cluster.start_node(self.dead, timeout=60)
                self.pgids.append(self.cluster.nodes[self.dead].proc.pid)
                self.dead = None
            return
        self.broker = Broker(port=self.port, store_dir=self.store, log_file=self.log_path).start(timeout=60)
        self.pgids.append(self.broker.proc.pid)

    @property
    def url(self) -> str:
        return self.cluster.url if self.cluster is not None else f"nats://127.0.0.1:{self.port}"

    def sigkill(self, stream: str | None = None, rng: random.Random | None = None) -> str:
        """Kill the broker (one node of a cluster); return which server died."""
        if self.cluster is not None:
            leader = self.leaders.get(stream or "")
            alive = self.cluster.alive()
            i = self.cluster.index_of(leader) if leader else (rng or random).choice(alive)
            if i not in alive:
                i = (rng or random).choice(alive)
            self.dead = i
            proc = self.cluster.nodes[i].proc
            name = self.cluster.server_name(i) + (f" (leader of {stream})" if leader else "")
        else:
            proc, name = self.broker.proc, "nats-server"
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return name

    def wait_dead(self, timeout: float) -> None:
        proc = self.cluster.nodes[self.dead].proc if self.cluster is not None else self.broker.proc
        proc.wait(timeout)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.broker is not None:
            self.broker.stop()


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)
