"""docs/design.md §14: `yeto broker --cluster 3` prints its 3 URLs; `yeto demo --nats URLS --replicas 3
--rounds 40` finishes with max_abs_diff 0 while the nats-server child of that same `yeto broker` that leads
the run's BCAST stream is killed -9 mid-run (through the CLI's own supervision, not nodes started by hand),
and the BCAST stream has 3 replicas. The broker restarts the node on its store.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import nats
import pytest
from nats.js.errors import NotFoundError

from yeto.schemas import subjects as S
from yeto.services.broker import free_port_block
from tests.e2e_procs import kv_json
from tests.test_broker_nodes import _ready
from tests.test_broker_supervisor import _children

pytestmark = pytest.mark.e2e

RUN = "clusterdemo"


async def _committed(js) -> int:
    try:
        c = await kv_json(js, RUN, "commit")
    except (NotFoundError, nats.errors.Error, asyncio.TimeoutError):   # not provisioned yet, or electing
        return 0
    return c["committed_step"] if c else 0


@pytest.mark.timeout(300)
def test_demo_on_yeto_broker_cluster_rides_through_a_killed_child(tmp_path):
    port, route, mon = free_port_block(3), free_port_block(3), free_port_block(3)
    out = tmp_path / "broker.out"
    with open(out, "wb") as f:
        broker = subprocess.Popen(
            [sys.executable, "-P", "-m", "yeto.services.cli", "broker", "--cluster", "3", "--port", str(port), "--cluster-port",
             str(route), "--http-port", str(mon), "--store-dir", str(tmp_path / "store")],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    demo = None
    try:
        line = _ready(str(out), broker, timeout=90)
        urls = line.split("yeto broker ready: ", 1)[1].split(" ", 1)[0]
        assert urls.split(",") == [f"nats://127.0.0.1:{port + i}" for i in range(3)], line
        demo_out = tmp_path / "demo.out"
        with open(demo_out, "wb") as f:
            demo = subprocess.Popen(
                [sys.executable, "-P", "-m", "yeto.services.cli", "demo", "--nats", urls, "--replicas", "3", "--rounds", "40",
                 "--run", RUN, "--workdir", str(tmp_path / "work"), "--timeout", "240"],
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

        async def kill_the_bcast_leader_mid_run() -> tuple[str, int]:
            nc = await nats.connect(servers=urls.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.5)
            js = nc.jetstream(timeout=10)
            # A KV get sent while the bucket's R3 stream is still forming can go unanswered; at 10 s a lost
            # one outlasted the whole 40-round run, so the polls give up after 1 s and ask again.
            poll = nc.jetstream(timeout=1)
            try:
                deadline = time.monotonic() + 120
                while await _committed(poll) < 3:
                    assert demo.poll() is None, demo_out.read_text()[-3000:]
                    assert time.monotonic() < deadline, demo_out.read_text()[-3000:]
                    await asyncio.sleep(0.2)
                info = await js.stream_info(S.stream(RUN, "BCAST"))
                assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2, info.cluster
                victim = info.cluster.leader
                before = await _committed(poll)
                os.kill(_children(broker.pid)[victim], signal.SIGKILL)
                return victim, before
            finally:
                await nc.close()

        victim, before = asyncio.run(kill_the_bcast_leader_mid_run())
        assert before < 36, f"the run was about to end ({before} of 40) at the kill: make it longer"
        assert demo.wait(timeout=240) == 0, demo_out.read_text()[-4000:]
        summary = json.loads(demo_out.read_text().strip().splitlines()[-1])
        assert summary["max_abs_diff_vs_final_cut"] == 0, summary
        assert summary["rounds"] == 40, summary   # each round merged once (the tape)
        text = out.read_text()
        assert f"nats-server {victim} on" in text and "restarting it on its store" in text, text[-3000:]
        assert broker.poll() is None, text[-3000:]   # the command rode through its child's death
    finally:
        for p in (demo, broker):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
