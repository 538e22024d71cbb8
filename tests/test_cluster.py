"""docs/design.md §7, §14: a replicated JetStream cluster on one host (services.broker.Cluster, `yeto broker --cluster N`),
runs provisioned with `--replicas 3`, and a run that rides through a node's death.

Everything is real: three nats-server processes joined by routes on loopback, the real `yeto syncer`,
real `python -m yeto.learner.demo` islands, all connected with the whole server list.
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import nats
import nats.errors
import pytest
from nats.js.errors import NotFoundError, ServiceUnavailableError

from yeto.schemas import subjects as S
from yeto.schemas.provision import RunLimits, kv_stream_name, provision_run, remove_run
from yeto.services.broker import Cluster, free_port_block
from tests.e2e_procs import SYNCER_TIMEOUTS, IslandProc, assert_islands_hold_the_final_cut, kv_json, merges, tails, wait_exit, wait_until
from tests.scripted import SyncerProc

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path):
    with Cluster(3, store_dir=tmp_path / "cluster", log_dir=tmp_path) as c:
        yield c


async def _connect(urls: list[str]):
    # The whole server list, and keep trying: a node may be down for a while.
    return await nats.connect(servers=urls, max_reconnect_attempts=-1, reconnect_time_wait=0.5)


def _all_stream_names(run: str) -> list[str]:
    return [S.stream(run, k) for k in S.STREAM_KINDS] + [kv_stream_name(S.kv_bucket(run, k)) for k in S.KV_KINDS]


def test_yeto_broker_cluster_prints_the_url_list_and_stops_every_node(tmp_path):
    """`yeto broker --cluster 3` answers through every URL of its one line, with a meta leader
    (account_info works), and SIGTERM stops all three servers."""
    port, route, mon = free_port_block(3), free_port_block(3), free_port_block(3)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--cluster", "3", "--port", str(port),
         "--cluster-port", str(route), "--http-port", str(mon), "--store-dir", str(tmp_path / "s")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        urls = [f"nats://127.0.0.1:{port + i}" for i in range(3)]
        assert f"ready: {','.join(urls)} " in line, line
        # a store per node (beside them the supervisor's pid file, written around the ready line)
        assert sorted(p.name for p in (tmp_path / "s").iterdir() if p.is_dir()) == ["yeto-1", "yeto-2", "yeto-3"]

        async def check():
            for u in urls:  # each node on its own: all three are members of one JetStream cluster
                nc = await nats.connect(u)
                try:
                    info = await nc.jetstream(timeout=10).account_info()
                    assert info is not None
                    assert nc._server_info.get("cluster") == "yeto", nc._server_info
                finally:
                    await nc.close()

        asyncio.run(check())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        # every node is gone: nothing answers on any client port
        import socket
        for i in range(3):
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port + i), timeout=1).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_replicas_3_provisions_every_stream_and_bucket_with_3_peers(cluster, run_id):
    nc = await _connect(cluster.urls)
    js = nc.jetstream(timeout=20)
    try:
        await provision_run(js, run_id, RunLimits.small(replicas=3), log=lambda _: None)
        for name in _all_stream_names(run_id):
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, (name, info.config.num_replicas)
            peers = {info.cluster.leader} | {p.name for p in info.cluster.replicas or []}
            assert peers == {"yeto-1", "yeto-2", "yeto-3"}, (name, info.cluster)
    finally:
        await remove_run(js, run_id)
        await nc.close()


H, P, ROUNDS = 8, 2, 24
KILL_AFTER = 4  # rounds committed before the leader's node dies
STEP_DELAY = "0.1"  # 4 inner steps per round: ~0.4 s a round, so the kill lands mid-run
# Victims whose node dies with no other leader on it (the others are moved off it first), so the run
# goes on at once while that stream alone has no leader: the tape, the control stream (pulls).
ALONE = ("EVENTS", "CTL")  # streams whose leader's node dies with nothing else led there (one run for both)


async def _ctl_state(js, run: str) -> str:
    """What a stalled run's pulls look like on the server: CTL's state, the islands' pull consumers and
    the newest pulls (a failure message, so a stall under load can be read after the fact)."""
    out = []
    try:
        ctl = S.stream(run, "CTL")
        info = await js.stream_info(ctl)
        out.append(f"CTL: msgs={info.state.messages} first={info.state.first_seq} last={info.state.last_seq} "
                   f"leader={info.cluster.leader}")
        for island in ("a", "b"):
            c = await js.consumer_info(ctl, S.island_consumer(island, "pull"))
            out.append(f"pull-{island}: delivered={c.delivered} ack_floor={c.ack_floor} pending={c.num_pending} "
                       f"ack_pending={c.num_ack_pending} waiting={c.num_waiting} leader={c.cluster.leader}")
        for kind, durable in (("PUSH", S.SYNCER_PUSH_CONSUMER), ("CTL", S.SYNCER_CTL_CONSUMER)):
            c = await js.consumer_info(S.stream(run, kind), durable)
            out.append(f"{durable}: delivered={c.delivered} ack_floor={c.ack_floor} pending={c.num_pending} "
                       f"ack_pending={c.num_ack_pending} waiting={c.num_waiting} leader={c.cluster.leader}")
        push = await js.stream_info(S.stream(run, "PUSH"))
        out.append(f"PUSH: msgs={push.state.messages} first={push.state.first_seq} last={push.state.last_seq} "
                   f"leader={push.cluster.leader}")
        try:
            out.append(f"syncer counters: {(await kv_json(js, run, 'syncer')).get('counters')}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"(syncer status unreadable: {exc!r})")
        ev = await js.stream_info(S.stream(run, "EVENTS"))
        for seq in range(max(ev.state.first_seq, ev.state.last_seq - 12), ev.state.last_seq + 1):
            try:
                m = await js.get_msg(S.stream(run, "EVENTS"), seq)
                out.append(f"  tape #{seq} {bytes(m.data)[:600]!r}")
            except Exception as exc:  # noqa: BLE001
                out.append(f"  tape #{seq} {exc!r}")
        for seq in range(max(info.state.first_seq, info.state.last_seq - 5), info.state.last_seq + 1):
            try:
                m = await js.get_msg(ctl, seq)
                out.append(f"  #{seq} {m.subject} {bytes(m.data)[:200]!r}")
            except Exception as exc:  # noqa: BLE001 - a deleted message is a fact to print too
                out.append(f"  #{seq} {exc!r}")
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        out.append(f"(CTL state unreadable: {exc!r})")
    return "\n".join(out)


async def _retry(fn, what: str, timeout: float = 60.0):
    """The test's own reads ride through the node's death too: a request that meets the dead node, a
    stream whose new leader is not elected yet, or a cluster electing a new meta leader is asked again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fn()
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError,
                ServiceUnavailableError) as exc:  # 503 / 10008: no meta leader for the moment
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no answer within {timeout:.0f}s ({exc!r})") from exc
            await asyncio.sleep(0.2)


async def _lead_elsewhere(nc, js, stream: str, away_from: str, to: str, *, onto: bool = False) -> None:
    """Move a stream's leader off node `away_from` (onto=True: onto node `to`) by leader stepdown with a
    preferred placement."""
    for _ in range(20):
        info = await _retry(lambda: js.stream_info(stream), stream)
        if (info.cluster.leader == to) if onto else (info.cluster.leader not in (None, away_from)):
            return
        await _retry(lambda: nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                        json.dumps({"placement": {"preferred": to}}).encode(), timeout=5), stream)
        await asyncio.sleep(0.3)
    raise AssertionError(f"{stream} kept its leader on {info.cluster.leader}")


async def _committed(js, run: str) -> int:
    try:
        c = await kv_json(js, run, "commit")
    except NotFoundError:  # not provisioned yet
        return 0
    return c["committed_step"] if c else 0


def _first_merge_after(log_path, t: float) -> float:
    """Seconds from wall time `t` to the first merge the syncer logged after it ('step N: fragment ...')."""
    import datetime

    for line in log_path.read_text().splitlines():
        if ": fragment " not in line or " step " not in line:
            continue
        stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if stamp > t:
            return stamp - t
    return float("nan")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["PUSH", "BCAST", "EVENTS+CTL"])
async def test_run_rides_through_the_death_of_a_stream_leaders_node(cluster, run_id, tmp_path, victim):
    """A run provisioned R3: the node leading the PUSH (BCAST) stream is killed -9 mid-run and,
    once rounds commit without it, restarted with its store. The syncer and both islands carry on
    through the other nodes; the run finishes; the tape holds each round and each version exactly
    once; both islands saved exactly the final cut.

    EVENTS+CTL: the node leading both the EVENTS and the CTL stream dies, and nothing else is led there
    (every other stream and bucket is moved away first), so the run goes on at once while those two
    have no leader: a commit's merge record must still reach the tape, a pull its islands."""
    alone = victim == "EVENTS+CTL"
    victim = "EVENTS" if alone else victim
    url = cluster.url
    nc = await _connect(cluster.urls)
    js = nc.jetstream(timeout=5)
    ckpt = tmp_path / "syncer"
    syncer = SyncerProc(url, run_id, ckpt, "--replicas", "3", "--islands", "2", "--fragments", str(P),
                        "--sync-every", str(H), "--total-steps", str(ROUNDS), "--init-island", "a",
                        *SYNCER_TIMEOUTS, log=tmp_path / "syncer.log").start()
    args = ("--step-delay", STEP_DELAY)
    a = IslandProc(url, run_id, "a", tmp_path, args=args).start()
    b = IslandProc(url, run_id, "b", tmp_path, args=args).start()
    procs = {"syncer": syncer, "a": a, "b": b}
    try:
        if alone:
            await wait_until(lambda: _retry(lambda: _committed(js, run_id), "commit record"), 120, "a first round")
            doomed = (await _retry(lambda: js.stream_info(S.stream(run_id, victim)), "stream info")).cluster.leader
            other = next(cluster.server_name(i) for i in range(3) if cluster.server_name(i) != doomed)
            mine = [S.stream(run_id, k) for k in ALONE]
            for name in _all_stream_names(run_id):
                if name in mine:
                    await _lead_elsewhere(nc, js, name, other, doomed, onto=True)
                else:
                    await _lead_elsewhere(nc, js, name, doomed, other)

        async def enough_rounds():
            for name, p in procs.items():
                if p.proc.poll() is not None:
                    raise AssertionError(f"{name} exited before the kill:\n{tails(procs)}")
            return await _retry(lambda: _committed(js, run_id), "commit record") >= KILL_AFTER

        await wait_until(enough_rounds, 120, f"{KILL_AFTER} rounds committed")
        info = await _retry(lambda: js.stream_info(S.stream(run_id, victim)), "stream info")
        for name in _all_stream_names(run_id):
            assert (await _retry(lambda: js.stream_info(name), name)).config.num_replicas == 3, name
        leader = cluster.index_of(info.cluster.leader)
        if alone:
            assert info.cluster.leader == doomed
            for name in _all_stream_names(run_id):
                led_there = (await _retry(lambda: js.stream_info(name), name)).cluster.leader == doomed
                assert led_there == (name in mine), name
        before = await _retry(lambda: _committed(js, run_id), "commit record")
        killed_at = time.time()
        cluster.kill(leader)
        assert before < ROUNDS - 2, f"the run was about to finish ({before} of {ROUNDS}) before the kill: make it longer"

        # Rounds commit while the node is down: the survivors elected new leaders.
        async def committed_without_it():
            assert syncer.proc.poll() is None or syncer.proc.returncode == 0, tails(procs)
            return await _retry(lambda: _committed(js, run_id), "commit record") >= before + 2

        try:
            await wait_until(committed_without_it, 90, "two rounds committed with the leader's node down")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await _ctl_state(js, run_id)}\n{tails(procs)}") from None
        # kill -> the syncer's next merge, from its log (docs/syncer.md "Failure and recovery"): the elections of
        # the streams a round needs (4-9 s each), not an ack timeout
        print(f"{victim} leader's node killed -> next merge {_first_merge_after(tmp_path / 'syncer.log', killed_at):.1f}s")
        new_leader = (await _retry(lambda: js.stream_info(S.stream(run_id, victim)), "stream info")).cluster.leader
        assert new_leader != cluster.server_name(leader)
        cluster.start_node(leader)

        try:
            rcs = await wait_exit(procs, 150)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await _ctl_state(js, run_id)}") from None
        assert rcs == {"syncer": 0, "a": 0, "b": 0}, tails(procs)
        commit = await _retry(lambda: kv_json(js, run_id, "commit"), "commit record")
        tape_merges = await _retry(lambda: merges(js, run_id), "tape")

        # The restarted node rejoined from its store: it is a current replica of the stream again.
        async def rejoined():
            c = (await _retry(lambda: js.stream_info(S.stream(run_id, victim)), "stream info")).cluster
            peers = {c.leader: True} | {p.name: bool(p.current) for p in c.replicas or []}
            return peers.get(cluster.server_name(leader)) and all(peers.values()) and len(peers) == 3

        await wait_until(rejoined, 60, f"{cluster.server_name(leader)} to be a current replica of {victim} again")
    finally:
        for p in procs.values():
            p.stop()
        try:
            await _retry(lambda: remove_run(js, run_id), "remove run")
        finally:
            await nc.close()

    # Each round committed once, in order, and each fragment's versions 1..ROUNDS/P once each.
    assert commit["committed_step"] == ROUNDS
    assert [m["step"] for m in tape_merges] == list(range(1, ROUNDS + 1)), [m["step"] for m in tape_merges]
    for f in range(P):
        assert [m["version"] for m in tape_merges if m["fragment"] == f] == list(range(1, ROUNDS // P + 1))
    assert {int(f): v for f, v in commit["versions"].items()} == {f: ROUNDS // P for f in range(P)}

    # Both islands saved exactly the exported final cut, and neither refused anything.
    assert_islands_hold_the_final_cut(ckpt, tmp_path / "final.safetensors", run_id, (a, b))
