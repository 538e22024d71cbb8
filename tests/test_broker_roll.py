"""docs/design.md §7.1: planned broker restarts with no stall.

The roll's rules (services/broker_roll.py) directly: the order (followers first, the meta leader last), where a
node's leaders go, when a roll must stop, what a node's /jsz says. Then for real: a client of schemas.conn moves
off a node in lame duck mode while that node still runs; `yeto broker roll` restarts every node of a running
`yeto broker --cluster 3` (new nats-server processes) while a client publishes to an R3 stream and a KV bucket
without a gap near an election's 4–9 s, and refuses to start while a peer is not healthy, naming it.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import nats
import pytest
from nats.js.api import StreamConfig

from yeto.schemas.conn import ConnectOptions, connect
from yeto.schemas.publish import publish_retry
from yeto.services import broker_roll as R
from yeto.services.broker import Cluster, free_port_block
from tests.test_broker_supervisor import _children

N = ["yeto-1", "yeto-2", "yeto-3"]
ALL_OK = {n: True for n in N}


def test_followers_go_first_and_the_meta_leader_last():
    assert R.plan(N, [], "yeto-1") == ["yeto-2", "yeto-3", "yeto-1"]
    assert R.plan(N, [], "yeto-3") == ["yeto-1", "yeto-2", "yeto-3"]
    assert R.plan(N, ["yeto-2"], "yeto-1") == ["yeto-3", "yeto-1"]
    assert R.plan(N, ["yeto-2", "yeto-3"], "yeto-1") == ["yeto-1"]
    assert R.plan(N, N, "yeto-1") == []
    assert R.plan(N, [], None) == N                      # no meta leader known: node order


def test_leaders_go_to_a_restarted_peer_else_to_the_one_restarted_last():
    # nothing restarted yet: to the meta leader (restarted last), not to yeto-2 (restarted next)
    assert R.preferred_peer(N, "yeto-1", [], "yeto-3", ALL_OK) == "yeto-3"
    # the latest restarted peer first: it is not restarted again
    assert R.preferred_peer(N, "yeto-3", ["yeto-1", "yeto-2"], "yeto-3", ALL_OK) == "yeto-2"
    assert R.preferred_peer(N, "yeto-2", ["yeto-1"], "yeto-3", ALL_OK) == "yeto-1"
    # an unhealthy peer is never chosen; none healthy: the server picks
    assert R.preferred_peer(N, "yeto-2", ["yeto-1"], "yeto-3", {**ALL_OK, "yeto-1": False}) == "yeto-3"
    assert R.preferred_peer(N, "yeto-2", [], "yeto-3", {"yeto-1": False, "yeto-2": True, "yeto-3": False}) is None


def test_a_roll_stops_while_a_peer_is_unhealthy_naming_it():
    assert R.refusal("yeto-1", ALL_OK) is None
    assert R.refusal("yeto-1", {**ALL_OK, "yeto-1": False}) is None   # restarting the sick node itself is fine
    why = R.refusal("yeto-1", {**ALL_OK, "yeto-3": False})
    assert why.startswith("yeto-3 is not healthy (/healthz, or behind a RAFT group's leader): stopping yeto-1 now "
                          "would leave the cluster without a majority"), why
    assert R.refusal("yeto-1", {"yeto-1": True, "yeto-2": False, "yeto-3": False}).startswith("yeto-2, yeto-3 are")


def test_what_a_nodes_jsz_says():
    z = {"meta_cluster": {"leader": "yeto-2"}, "account_details": [{"name": "$G", "stream_detail": [
        {"name": "S", "cluster": {"leader": "yeto-1", "replicas": [{"name": "yeto-2"}, {"name": "yeto-3"}]}},
        {"name": "KV_B", "cluster": {"leader": "yeto-3", "replicas": [{"name": "yeto-1"}, {"name": "yeto-2"}]}},
        {"name": "ONE", "cluster": {"leader": "yeto-1"}},
    ]}]}
    assert R.meta_leader_of(z) == "yeto-2" and R.meta_leader_of(None) is None and R.meta_leader_of({}) is None
    assert R.leaders_of(z, "yeto-1") == ([("$G", "S")], [("$G", "ONE")])
    assert R.leaders_of(z, "yeto-3") == ([("$G", "KV_B")], [])
    assert R.leaders_of(None, "yeto-1") == ([], [])


def _view(meta=None, streams=()):
    return {"meta_cluster": meta or {}, "account_details": [{"name": "$G", "stream_detail": list(streams)}]}


def _cl(leader, **current):
    return {"leader": leader, "replicas": [{"name": n, "current": c} for n, c in current.items()]}


def test_a_restarted_node_is_caught_up_only_when_every_groups_leader_says_so():
    s_led_by_3 = {"name": "S", "cluster": _cl("yeto-3", **{"yeto-1": False, "yeto-2": True}),
                  "consumer_detail": [{"name": "D", "cluster": _cl("yeto-3", **{"yeto-1": True, "yeto-2": True})}]}
    # a follower's view says "not current" of everyone: only the leader's counts
    s_seen_by_2 = {"name": "S", "cluster": _cl("yeto-3", **{"yeto-1": False, "yeto-3": False})}
    views = {"yeto-1": None, "yeto-2": _view(streams=[s_seen_by_2]),
             "yeto-3": _view(meta=_cl("yeto-3", **{"yeto-1": True, "yeto-2": True}), streams=[s_led_by_3])}
    assert R.lagging(views, "yeto-1") == ["stream S"]
    assert R.lagging(views, "yeto-2") == []
    s_led_by_3["cluster"] = _cl("yeto-3", **{"yeto-1": True, "yeto-2": True})
    s_led_by_3["consumer_detail"][0]["cluster"] = _cl("yeto-3", **{"yeto-1": False, "yeto-2": True})
    views["yeto-3"]["meta_cluster"] = _cl("yeto-3", **{"yeto-1": False, "yeto-2": True})
    assert R.lagging(views, "yeto-1") == ["consumer S > D", "the meta group"]
    assert R.lagging({"yeto-1": None, "yeto-2": None}, "yeto-1") == []


def test_the_status_record_round_trips_and_keeps_the_last_lines():
    st = R.RollStatus(id="x")
    for i in range(R.LOG_LINES + 5):
        st.say(f"line {i}")
    back = R.RollStatus.from_json(st.to_json())
    assert back == st and back.lines == R.LOG_LINES + 5 and len(back.log) == R.LOG_LINES
    assert back.log[-1] == f"line {R.LOG_LINES + 4}"


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_client_moves_off_a_node_in_lame_duck_mode_while_it_still_runs(tmp_path):
    """schemas.conn.connect answers the server's lame duck notice by moving to another node at once; a bare
    nats-py client stays until the node evicts it (after lame_duck_grace_period)."""
    with Cluster(3, store_dir=tmp_path / "c", log_dir=tmp_path) as c:
        ours = await connect(ConnectOptions(url=",".join(c.urls)), dont_randomize=True, reconnect_time_wait=0.2,
                             max_reconnect_attempts=-1)
        bare = await nats.connect(servers=c.urls[:1], max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            assert ours.connected_url.port == bare.connected_url.port == c.nodes[0].port
            node = c.nodes[0].proc
            t0 = time.monotonic()
            node.send_signal(signal.SIGUSR2)
            moved = None
            while node.poll() is None and time.monotonic() - t0 < 20:
                if moved is None and ours.is_connected and ours.connected_url.port != c.nodes[0].port:
                    moved = time.monotonic() - t0
                    bare_there = bare.is_connected and bare.connected_url.port == c.nodes[0].port
                await asyncio.sleep(0.02)
            exited = time.monotonic() - t0
            assert moved is not None, f"still on the lame duck node when it exited {exited:.1f}s after SIGUSR2"
            print(f"moved {moved:.2f}s after SIGUSR2, the node exited after {exited:.2f}s")
            assert bare_there, "the bare client had left the node too: the move proves nothing"
            assert moved < exited
        finally:
            await ours.close()
            await bare.close()


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_an_islands_cut_watcher_whose_server_stops_is_back_within_two_seconds(tmp_path):
    """An island watches BCAST through an ordered consumer: one replica, in memory, on one server. That server
    stopping (lame duck mode here) takes the consumer with it; with the cut config's short idle heartbeat
    (stream_configs.CUT_IDLE_HEARTBEAT_S) nats-py re-creates it on a live server within 1-2 s (with its default
    5 s: 10-20 s without a notice). Measured per publish: from its ack to the first notice of it or a later one
    (one message per subject is kept, so a watcher may skip to a newer one); a publisher held up by the stream
    leader's move is not the watcher's delay."""
    from yeto.schemas import subjects as S
    from yeto.schemas.stream_configs import bcast_consumer_config

    run = "roll"
    with Cluster(3, store_dir=tmp_path / "c", log_dir=tmp_path) as c:
        nc = await connect(ConnectOptions(url=",".join(c.urls)), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = nc.jetstream(timeout=5)
        stream = S.stream(run, "BCAST")
        await js.add_stream(StreamConfig(name=stream, subjects=[S.bcast_all(run)], num_replicas=3,
                                         max_msgs_per_subject=1))
        got: list[tuple[float, int]] = []

        async def seen(msg):   # the cut config delivers headers only: which publish it is, from its message id
            mid = (msg.headers or {}).get("Nats-Msg-Id", "")
            if mid.startswith("m"):
                got.append((time.monotonic(), int(mid[1:])))

        cfg = bcast_consumer_config(run)
        sub = await js.subscribe(cfg.filter_subject, stream=stream, ordered_consumer=True, config=cfg, cb=seen)
        await publish_retry(js, S.bcast(run, 0, 0), b"x", "first")
        host = (await sub.consumer_info()).cluster.leader
        node = c.nodes[c.index_of(host)].proc
        node.send_signal(signal.SIGUSR2)
        acked: list[float] = []
        for i in range(80):     # a chunk every 0.1 s for 8 s, as a syncer broadcasting would
            await publish_retry(js, S.bcast(run, 0, i % 4), str(i).encode(), f"m{i}", timeout=5)
            acked.append(time.monotonic())
            await asyncio.sleep(0.1)
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end and not (got and got[-1][1] == 79):
            await asyncio.sleep(0.05)
        t_end = min(t_end, time.monotonic())
        # each publish: how long until the watcher saw it or a newer one (until the end when it never did)
        delays = [next((t for t, j in got if j >= i and t >= a), t_end) - a for i, a in enumerate(acked)]
        print(f"consumer on {host}: it exited {'yes' if node.poll() is not None else 'no'}; longest wait from a "
              f"publish to its notice {max(delays):.2f}s, {len(got)} of 80 seen")
        await nc.close()
    assert node.poll() is not None
    assert max(delays) < 3.0, sorted(delays)[-3:]


def _start_cluster(tmp_path) -> tuple[subprocess.Popen, list[str], object]:
    port, route, mon = free_port_block(3), free_port_block(3), free_port_block(3)
    log = tmp_path / "broker.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--cluster", "3", "--port", str(port),
             "--cluster-port", str(route), "--http-port", str(mon), "--store-dir", str(tmp_path / "s")],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while "ready" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc, [f"nats://127.0.0.1:{port + i}" for i in range(3)], log


def _roll(tmp_path, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "yeto.services.cli", "broker", "roll", "--store-dir",
                           str(tmp_path / "s"), *more], capture_output=True, text=True, timeout=300)


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_yeto_broker_roll_restarts_every_node_while_a_client_publishes_without_a_stall(tmp_path):
    proc, urls, log = _start_cluster(tmp_path)
    try:
        nc = await connect(ConnectOptions(url=",".join(urls)), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name="ROLL", subjects=["roll.>"], num_replicas=3))
        await js.create_key_value(bucket="roll", replicas=3)
        before = _children(proc.pid)
        acked, refused, t0 = [], [], time.monotonic()

        async def publish():
            # as the syncer and the islands publish (schemas/publish.py): a refusal while a leader moves is
            # retried, and an ack lost with the connection the client left is re-sent at once, same id
            counters = Counter()
            for i in itertools.count():
                await publish_retry(js, f"roll.{i}", b"x", f"m{i}", timeout=5, counters=counters)
                await publish_retry(js, "$KV.roll.k", str(i).encode(), f"k{i}", timeout=5, counters=counters)
                acked.append(time.monotonic() - t0)
                refused[:] = [f"{k} x{v}" for k, v in counters.items()]
                await asyncio.sleep(0.02)

        task = asyncio.create_task(publish())
        await asyncio.sleep(1.0)
        started = time.monotonic()
        res = await asyncio.to_thread(_roll, tmp_path)
        took = time.monotonic() - started
        await asyncio.sleep(1.0)
        task.cancel()
        after = _children(proc.pid)
        st = R.RollStatus.from_json((tmp_path / "s" / R.STATUS_FILE).read_text())
        info = await js.stream_info("ROLL")
        moves = nc.stats["reconnects"]
        await nc.close()
    finally:
        _stop(proc)
    gaps = [b - a for a, b in zip(acked, acked[1:]) if a >= started - t0]
    print(f"roll took {took:.1f}s; {len(acked)} publish+put pairs acked, largest gap {max(gaps):.2f}s, "
          f"retries {refused}, client moved {moves} times\n{res.stdout}")
    assert res.returncode == 0, res.stdout + res.stderr + log.read_text()[-3000:]
    assert st.state == "done" and sorted(st.done) == N, st
    # the meta leader as the roll found it went last
    first = next(line for line in st.log if "restarting (1 of 3; meta leader" in line)
    meta = first.split("meta leader ")[1].split(")")[0].split(",")[0]
    assert st.done[-1] == meta, st.log
    # every node is a new process (the same server names, on their stores)
    assert sorted(after) == N and all(after[n] != before[n] for n in N), (before, after)
    # no stall: a crash of a leader's node costs 4-9 s (an election); the planned roll no more than a second
    assert max(gaps) < 1.5, sorted(gaps)[-5:]
    assert info.state.messages == len(acked) or info.state.messages == len(acked) + 1  # one in flight at cancel
    assert moves >= 1     # the client's node was restarted too: it moved, and kept publishing
    for line in ("restarting (1 of 3", "stream leaders moved", "lame duck mode (SIGUSR2)", "/healthz",
                 "every node restarted"):
        assert line in res.stdout, res.stdout


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_yeto_broker_roll_refuses_while_a_peer_is_unhealthy_and_without_a_broker(tmp_path):
    res = _roll(tmp_path)
    assert res.returncode == 2 and "no `yeto broker --cluster N` runs with --store-dir" in res.stderr, res.stderr
    proc, urls, log = _start_cluster(tmp_path)
    kids = _children(proc.pid)
    try:
        # yeto-3 is never the first to go (followers in node order, the meta leader last): freeze it
        os.kill(kids["yeto-3"], signal.SIGSTOP)
        res = _roll(tmp_path)
        os.kill(kids["yeto-3"], signal.SIGCONT)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "yeto-3 is not healthy (/healthz" in res.stderr and "the roll stops here" in res.stderr, res.stderr
        assert _children(proc.pid) == kids      # nothing was stopped
        assert proc.poll() is None              # and the broker serves on
        assert "yeto-3 is not healthy" in log.read_text()
    finally:
        _stop(proc)
