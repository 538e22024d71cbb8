"""docs/design.md §7: `yeto broker` restarts a node that exited on its own, the others keep serving.

The policy (services/broker_supervisor.py) directly, then the command end to end: `yeto broker --cluster 3`,
one nats-server killed -9 behind its back: the command keeps running, says why and when it restarts the
node, brings it back on its own store (its port answers again, a replicated stream made before the kill
has all three peers current again), and the other two answered all along.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from yeto.services.broker import free_port_block
from yeto.services.broker_supervisor import RestartPolicy


def test_backoff_doubles_while_a_node_keeps_dying_and_resets_once_it_stayed_up():
    p = RestartPolicy(first_s=1, max_s=30, stable_s=60)
    p.started(0, 0.0)
    assert p.exited(0, 100.0) == 1          # it had lived 100 s: the first delay
    assert p.exited(0, 100.5) == 0.5        # the same death seen again: what is left of it
    assert not p.due(0, 100.9) and p.due(0, 101.0)
    p.started(0, 101.0)
    assert p.exited(0, 102.0) == 2          # died 1 s after its start: doubled
    p.started(0, 104.0)
    assert p.exited(0, 105.0) == 4
    for k in range(10):
        p.started(0, 200.0 + k)
        p.exited(0, 200.5 + k)
    p.started(0, 300.0)
    assert p.exited(0, 301.0) == 30         # capped
    p.started(0, 400.0)
    assert p.exited(0, 500.0) == 1          # stayed up 100 s: back to the first delay
    assert p.restarts(0) == 15 and p.restarts(1) == 0 and not p.pending(1)


def _children(pid: int) -> dict[str, int]:
    """server name -> pid of the nats-server children of `pid`."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--server_name" in argv:
            out[argv[argv.index(b"--server_name") + 1].decode()] = int(d)
    return out


async def _publish(js, subject: str, data: bytes, within: float = 45.0) -> None:
    """A publish that waits out a leader election (a new R3 stream's first, or its leader's node killed)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await js.publish(subject, data, timeout=5, headers={"Nats-Msg-Id": subject})
            return
        except (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_yeto_broker_cluster_restarts_a_killed_node_and_keeps_serving(tmp_path):
    port, route, mon = free_port_block(3), free_port_block(3), free_port_block(3)
    log = tmp_path / "broker.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--cluster", "3", "--port", str(port), "--cluster-port",
             str(route), "--http-port", str(mon), "--store-dir", str(tmp_path / "s")],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    urls = [f"nats://127.0.0.1:{port + i}" for i in range(3)]

    async def scenario():
        deadline = time.monotonic() + 90
        while "ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.2)
        nc = await nats.connect(servers=urls, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        js = nc.jetstream(timeout=20)
        await js.add_stream(StreamConfig(name="SUP", subjects=["sup.>"], num_replicas=3))
        await _publish(js, "sup.1", b"before")
        victim = "yeto-2"
        pid = _children(proc.pid)[victim]
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        # the others serve all along: a publish through them is stored while yeto-2 is down
        await _publish(js, "sup.2", b"during")
        back = None
        while time.monotonic() - t_kill < 60:
            now = _children(proc.pid).get(victim)
            if now is not None and now != pid:
                back = time.monotonic() - t_kill
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        assert back is not None, f"{victim} was not restarted:\n{log.read_text()[-3000:]}"
        # its port answers again, and the stream has all three peers current (yeto-2 caught up from its store)
        solo = await nats.connect(urls[1])
        await solo.close()
        while time.monotonic() - t_kill < 90:
            info = await js.stream_info("SUP")
            peers = [info.cluster.leader] + [r.name for r in info.cluster.replicas or [] if r.current]
            if len(peers) == 3 and info.state.messages == 2:
                break
            await asyncio.sleep(0.5)
        assert sorted(peers) == ["yeto-1", "yeto-2", "yeto-3"] and info.state.messages == 2, (info.cluster, info.state)
        await nc.close()   # (the stream goes with the cluster's temporary stores)
        return back

    try:
        back = asyncio.run(scenario())
        print(f"killed node back in {back:.1f}s")
        text = log.read_text()
        assert f"yeto broker: nats-server yeto-2 on {urls[1]} exited with -9; restarting it on its store" in text, text
        assert f"yeto-2 on {urls[1]} is back (restart 1)" in text, text
        assert (tmp_path / "s" / "yeto-2" / "nats-server.log").stat().st_size > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert _children(proc.pid) == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
