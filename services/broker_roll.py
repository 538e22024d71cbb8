"""Planned broker restarts, one node at a time, with no stall (docs/design.md §7.1).

A cluster node killed costs every RAFT group it led an election (4–9 s, fixed in nats-server, §14). A node
stopped on purpose need not: its stream and KV leaders are first moved to a healthy peer of our choosing
(`$JS.API.STREAM.LEADER.STEPDOWN.<stream>` with `{"placement": {"preferred": <server>}}`, nats-server ≥ 2.11;
a KV bucket is the stream `KV_<bucket>`), which costs a vote round trip, then the node enters lame duck
mode (SIGUSR2): it hands whatever it still leads (the meta group, consumers) to a peer the same way, tells
its clients (INFO `ldm`; schemas/conn.py moves them to another node at once) and exits once they are gone.
It is started again on its store; the next node goes only once it caught up. Followers first, the meta
leader last (the NATS rolling-upgrade guide): the meta group then moves once.

Pure (tested directly): the order (`plan`), where a node's leaders go (`preferred_peer`), when a roll must
not go on (`refusal`), what a node's `/jsz` says (`leaders_of`, `meta_leader_of`), and the status record
(`RollStatus`). I/O: `roll` (a local `yeto broker --cluster N`, on SIGUSR1 from `yeto broker roll`),
`hand_over_and_stop` (one `yeto broker --node K` on SIGTERM), and their steps.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# What a lame duck node may take to exit: nats-server evicts the clients still connected over
# lame_duck_duration (services/nats.conf: 30 s, the least it accepts) after lame_duck_grace_period (2 s).
LDM_EXIT_S = 45.0
HEALTHY_S = 120.0          # a restarted node must have caught up within this
STABLE_S = 1.0             # ... and stayed caught up this long (its /healthz flaps while it catches up)
PEERS_WAIT_S = 20.0        # before a node stops, the others get this long to be caught up (a group they follow may
                           # have just moved its leader); past it the roll stops, naming them
STEP_DOWN_S = 5.0          # one stream's leader moved (the transfer itself is ~10 ms plus a vote)
STATUS_FILE = "roll-status.json"
REQUEST_FILE = "roll-request.json"
PID_FILE = "yeto-broker.pid"
LOG_LINES = 200            # progress lines kept in the status file


class RollError(RuntimeError):
    pass


# ---- pure: the plan ----------------------------------------------------------------------------------------

def plan(names: list[str], done: list[str], meta_leader: str | None) -> list[str]:
    """The nodes still to restart, in order: the followers in node order, the meta leader last (its
    leadership then moves once, and no node restarted later takes it back)."""
    left = [n for n in names if n not in done]
    return [n for n in left if n != meta_leader] + [n for n in left if n == meta_leader]


def preferred_peer(names: list[str], target: str, done: list[str], meta_leader: str | None,
                   healthy: dict[str, bool]) -> str | None:
    """Where `target`'s stream leaders go: a healthy peer already restarted in this roll (the latest first:
    it is not restarted again), else the healthy peer restarted last (so a leader moves as few times as it
    can). None: no healthy peer (the stepdown is then left to the server)."""
    later = [n for n in plan(names, done + [target], meta_leader)]
    for n in list(reversed(done)) + list(reversed(later)):
        if n != target and healthy.get(n):
            return n
    return None


def refusal(target: str, healthy: dict[str, bool]) -> str | None:
    """Why `target` must not be stopped now, or None. Every peer must be healthy: with one of three down or
    catching up, stopping another leaves the RAFT groups without a majority, which stalls the run."""
    bad = sorted(n for n, ok in healthy.items() if n != target and not ok)
    if bad:
        return (f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not healthy (/healthz, or behind a RAFT group's leader): "
                f"stopping {target} now "
                f"would leave the cluster without a majority; the roll stops here (nothing else was stopped)")
    return None


def meta_leader_of(jsz: dict | None) -> str | None:
    """The meta leader a node's `/jsz` names (None: none known, or no answer)."""
    return ((jsz or {}).get("meta_cluster") or {}).get("leader") or None


def leaders_of(jsz: dict | None, name: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """From a node's `/jsz?accounts=true&streams=true`: ([(account, stream)] whose leader is `name` and that
    have peers to move to, [(account, stream)] held by `name` alone (one replica: down while it restarts))."""
    moved, alone = [], []
    for acc in (jsz or {}).get("account_details") or []:
        for st in acc.get("stream_detail") or []:
            cl = st.get("cluster") or {}
            if cl.get("leader") != name:
                continue
            (moved if cl.get("replicas") else alone).append((acc.get("name") or acc.get("id") or "", st["name"]))
    return moved, alone


def lagging(views: dict[str, dict | None], name: str) -> list[str]:
    """What node `name` has not caught up on, as each RAFT group's leader sees it: the streams and consumers
    whose leader lists `name` as a replica that is not current, and the meta group. `views`: every node's
    `/jsz?accounts=true&streams=true&consumers=true` (None: no answer). Only a group's leader knows whether a
    follower is current (a follower's own view says `current: false` of everyone), so each group is judged by
    the view of the node it names as leader. [] : caught up. Why not `/healthz` alone: it answers 200 right
    after a start, before the node has learnt what it hosts, then 503 while it catches up (measured here),
    and a roll that stopped the next node in that window would leave the groups without a majority."""
    out = []

    def judge(what: str, cl: dict | None, leader_view: str) -> None:
        cl = cl or {}
        if cl.get("leader") != leader_view or leader_view == name:
            return
        for r in cl.get("replicas") or []:
            if r.get("name") == name and not r.get("current"):
                out.append(what)

    for node, z in views.items():
        if not z:
            continue
        judge("the meta group", z.get("meta_cluster"), node)
        for acc in z.get("account_details") or []:
            for st in acc.get("stream_detail") or []:
                judge(f"stream {st.get('name')}", st.get("cluster"), node)
                for c in st.get("consumer_detail") or []:
                    judge(f"consumer {st.get('name')} > {c.get('name')}", c.get("cluster"), node)
    return sorted(set(out))


@dataclass
class RollStatus:
    """`roll-status.json` in the data directory of `yeto broker --cluster N`: what `yeto broker roll` follows."""
    id: str
    state: str = "rolling"           # rolling | done | failed
    node: str | None = None          # the node in hand
    phase: str = "starting"          # check | step-down | lame-duck | start | healthz | done
    order: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    error: str | None = None
    started: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    log: list[str] = field(default_factory=list)
    lines: int = 0                   # progress lines ever written (the log keeps the last LOG_LINES)

    def say(self, line: str) -> None:
        self.log = (self.log + [line])[-LOG_LINES:]
        self.lines += 1
        self.updated = time.time()

    def at(self, phase: str, node: str | None, line: str) -> None:
        """The roll is at `phase` of `node`: said in `line`."""
        self.phase, self.node = phase, node
        self.say(line)

    def plan(self, order: list[str]) -> None:
        """The nodes still to restart, in order, after those done."""
        self.order = self.done + order

    def restarted(self, node: str) -> None:
        self.done.append(node)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "RollStatus":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def write_atomic(path: Path, text: str) -> None:
    """A reader never sees half a file: write beside it, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- I/O: one node's monitoring endpoints ------------------------------------------------------------------

def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read() if exc.fp else b""
    except (OSError, ValueError):
        return 0, b""


def is_healthy(http_base: str) -> bool:
    return http_get(f"{http_base}/healthz")[0] == 200


def jsz(http_base: str, consumers: bool = False) -> dict | None:
    code, body = http_get(f"{http_base}/jsz?accounts=true&streams=true" + ("&consumers=true" if consumers else ""))
    try:
        return json.loads(body) if code == 200 else None
    except ValueError:
        return None


def caught_up(name: str, http_bases: dict[str, str]) -> tuple[bool, str]:
    """(node `name` answers /healthz 200 and no group leader sees it behind, what is not so yet)."""
    if not is_healthy(http_bases[name]):
        code, body = http_get(f"{http_bases[name]}/healthz")
        return False, f"/healthz {code} {body[:160].decode(errors='replace')}".strip()
    behind = lagging({n: jsz(h, consumers=True) for n, h in http_bases.items()}, name)
    return (not behind), (f"behind on {', '.join(behind[:5])}" + (f" and {len(behind) - 5} more" if len(behind) > 5 else "")
                          if behind else "caught up")


def wait_caught_up(name: str, http_bases: dict[str, str], timeout: float = HEALTHY_S,
                   aborted: Callable[[], bool] = lambda: False, stable_s: float = STABLE_S) -> float:
    """Until node `name` is caught up (`caught_up`) and stays so for `stable_s` (its /healthz flaps while it
    learns what it hosts); the seconds waited. RollError past `timeout` or when `aborted()`."""
    t0 = time.monotonic()
    since = None
    while True:
        ok, why = caught_up(name, http_bases)
        now = time.monotonic()
        since = (since or now) if ok else None
        if since is not None and now - since >= stable_s:
            return now - t0
        if aborted():
            raise RollError(f"stopped while waiting for {name} to catch up")
        if now - t0 > timeout:
            raise RollError(f"{name} did not catch up within {timeout:.0f}s ({why})")
        time.sleep(0.1)


# ---- I/O: moving leaders ---------------------------------------------------------------------------------

def _in_thread(coro):
    """Run a coroutine on its own loop in a thread: callable from sync code and from inside a loop alike."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _step_down(urls: list[str], streams: list[str], preferred: str | None, connect_opts) -> list[str]:
    """Ask each stream's leader to hand over (to `preferred` when given); what happened, one line each. A
    refused preferred peer (not a replica, not current) is retried without one: the server then picks."""
    import nats

    from yeto.schemas.subjects import js_api

    kw = connect_opts.kwargs() if connect_opts is not None else {}
    kw["servers"] = urls
    nc = await nats.connect(**kw, connect_timeout=2, max_reconnect_attempts=2, reconnect_time_wait=0.2)
    out = []
    try:
        for s in streams:
            tries = [{"placement": {"preferred": preferred}}, {}] if preferred else [{}]
            for body in tries:
                try:
                    msg = await nc.request(f"{js_api()}.STREAM.LEADER.STEPDOWN.{s}", json.dumps(body).encode(),
                                           timeout=STEP_DOWN_S)
                    ans = json.loads(msg.data)
                except Exception as exc:  # noqa: BLE001 - no answer: lame duck mode moves it anyway
                    ans = {"error": {"description": repr(exc)}}
                if ans.get("success"):
                    out.append(f"{s} -> {body['placement']['preferred'] if body else 'a peer the server picks'}")
                    break
            else:
                out.append(f"{s}: not moved ({(ans.get('error') or {}).get('description', ans)}); "
                           f"lame duck mode hands it over")
    finally:
        await nc.close()
    return out


def move_leaders(name: str, http_base: str, peer_urls: list[str], preferred: str | None, connect_opts,
                 say: Callable[[str], None]) -> None:
    """Move every replicated stream (and KV bucket) `name` leads to `preferred`, then wait until its `/jsz`
    names none of them as led by it (bounded: lame duck mode moves what is left)."""
    moved, alone = leaders_of(jsz(http_base), name)
    for acc, s in alone:
        say(f"{name}: stream {s} (account {acc}) has one replica, on {name}: unavailable until it is back")
    if not moved:
        say(f"{name} leads no replicated stream")
        return
    t0 = time.monotonic()
    lines = _in_thread(_step_down(peer_urls, [s for _, s in moved], preferred, connect_opts))
    deadline = time.monotonic() + STEP_DOWN_S
    while time.monotonic() < deadline and leaders_of(jsz(http_base), name)[0]:
        time.sleep(0.05)
    still = [s for _, s in leaders_of(jsz(http_base), name)[0]]
    say(f"{name}: {len(moved) - len(still)} of {len(moved)} stream leaders moved in {time.monotonic() - t0:.2f}s "
        f"({'; '.join(lines)})" + (f"; still led here: {', '.join(still)}" if still else ""))


def lame_duck(proc: subprocess.Popen, timeout: float = LDM_EXIT_S, aborted: Callable[[], bool] = lambda: False) -> int:
    """SIGUSR2 (lame duck mode) to a nats-server and wait for it to exit; its exit status. Past `timeout`, or
    when `aborted()` (a second SIGTERM to the broker), it is stopped at once (SIGKILL after SIGTERM)."""
    proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if aborted() or time.monotonic() > deadline:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()
        time.sleep(0.05)
    return proc.returncode


# ---- I/O: the roll of a local cluster, and one node's planned stop ----------------------------------------

@dataclass
class Node:
    """One node as the roll sees it: its server name, a services.broker.Broker (url, http port, proc, start)."""
    name: str
    broker: object

    @property
    def http(self) -> str:
        b = self.broker
        host = "127.0.0.1" if b.host in ("0.0.0.0", "::") else b.host
        return f"http://{host}:{b.http_port}"


def roll(nodes: list[Node], status: RollStatus, report: Callable[[RollStatus], None], *, connect_opts=None,
         aborted: Callable[[], bool] = lambda: False, started: Callable[[int], None] = lambda i: None,
         peers_wait_s: float = PEERS_WAIT_S) -> None:
    """Restart every node once, one at a time (followers first, the meta leader last): check every other node is
    healthy and caught up (waiting up to `peers_wait_s` for them), move the node's stream leaders to
    `preferred_peer`, lame duck mode, start it on its store, wait until it caught up (`wait_caught_up`). `report(status)` after every step (the status file, the log); `started(i)` once node
    i is back (the supervisor's restart policy). RollError when a step fails or a check refuses: the nodes
    not yet restarted are left running, untouched."""
    names = [n.name for n in nodes]
    by_name = {n.name: i for i, n in enumerate(nodes)}
    waiting_since: dict[str, float] = {}   # target -> since when its peers are awaited
    said: set[str] = set()

    def step(phase: str, node: str | None, line: str) -> None:
        status.at(phase, node, line)
        report(status)

    while True:
        if aborted():
            raise RollError("stopped by a signal before the roll ended")
        bases = {n.name: n.http for n in nodes}
        healthy = {n.name: caught_up(n.name, bases)[0] for n in nodes}
        meta = next((m for m in (meta_leader_of(jsz(n.http)) for n in nodes if healthy[n.name]) if m), None)
        order = plan(names, status.done, meta)
        status.plan(order)
        if not order:
            break
        target = order[0]
        why = refusal(target, healthy)
        if why and time.monotonic() - waiting_since.setdefault(target, time.monotonic()) < peers_wait_s:
            if target not in said:
                said.add(target)
                step("check", target, f"before {target} stops: {why.split(':')[0]}; waiting up to {peers_wait_s:.0f}s")
            time.sleep(0.5)
            continue
        if why:
            raise RollError(why)
        node = nodes[by_name[target]]
        pref = preferred_peer(names, target, status.done, meta, healthy)
        t0 = time.monotonic()
        step("step-down", target, f"{target}: restarting ({len(status.done) + 1} of {len(names)}; meta leader "
                                   f"{meta or 'unknown'}{', this node' if meta == target else ''}); its stream "
                                   f"leaders go to {pref or 'a peer the server picks'}")
        peers = [n.broker.url for n in nodes if n.name != target]
        move_leaders(target, node.http, peers, pref, connect_opts, lambda line: step("step-down", target, line))
        step("lame-duck", target, f"{target}: lame duck mode (SIGUSR2): it hands over what it still leads, its "
                                  f"clients move to another node, then it exits")
        rc = lame_duck(node.broker.proc, aborted=aborted)
        if aborted():   # SIGTERM to the broker meanwhile: it is stopping every node, do not start this one
            raise RollError(f"stopped by a signal while {target} was in lame duck mode")
        t_down = time.monotonic()
        step("start", target, f"{target}: exited with {rc}, {t_down - t0:.1f}s after its step began; starting it on its "
                              f"store")
        node.broker.start()
        started(by_name[target])
        step("healthz", target, f"{target}: started; waiting for {node.http}/healthz and its RAFT groups to catch up")
        waited = wait_caught_up(target, bases, aborted=aborted)
        status.restarted(target)
        step("done", target, f"{target}: caught up {waited:.1f}s after its start, {time.monotonic() - t_down:.1f}s after its "
                             f"exit ({len(status.done)} of {len(names)} restarted)")


def hand_over_and_stop(name: str, broker, say: Callable[[str], None], *, connect_opts=None,
                       aborted: Callable[[], bool] = lambda: False) -> int:
    """SIGTERM to `yeto broker --node K`: its stream leaders handed to peers the server picks (this node does
    not know its peers' health), then lame duck mode until it exits. Its exit status."""
    node = Node(name, broker)
    if broker.proc is None or broker.proc.poll() is not None:
        return broker.proc.returncode if broker.proc is not None else 0
    try:
        move_leaders(name, node.http, [broker.url], None, connect_opts, say)
    except Exception as exc:  # noqa: BLE001 - no quorum, no answer: lame duck mode still hands over what it can
        say(f"{name}: moving its stream leaders failed ({exc!r}); lame duck mode hands them over")
    say(f"{name}: lame duck mode (SIGUSR2): its clients move to another node, then it exits (up to {LDM_EXIT_S:.0f}s; "
        f"a second SIGTERM stops it at once)")
    return lame_duck(broker.proc, aborted=aborted)
