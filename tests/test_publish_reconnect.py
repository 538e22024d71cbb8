"""Publishing across a broker restart (issue 16: "a broker restart mid-broadcast stalls the syncer").

The PubAcks of publishes in flight when the server dies never come: the server that would have sent
them is gone. The old Pipeline awaited each lost future for its whole timeout, one after another (30 s
each: one round took 330 s). These tests kill a real nats-server (SIGKILL) while a Pipeline has many
publishes in flight, restart it on the same port and store, and check that every message lands exactly
once and that no lost ack was waited out to its timeout.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import nats
import pytest
from nats.js import api

from schemas.publish import Pipeline, publish_retry
from services.broker import Broker, free_port

CHUNK = 256 << 10
N = 120
# The broadcast's own timeout: a regression waits this long per lost ack.
TIMEOUT = 30.0


@pytest.fixture
def own_broker(tmp_path):
    broker = Broker(port=free_port(), store_dir=tmp_path / "store", log_file=tmp_path / "server.log")
    broker.start()
    broker.restarts = []
    try:
        yield broker
    finally:
        for t in broker.restarts:  # a failed test must not leave a server that a late restart started
            t.join(15)
        broker.stop()


def _restart_later(broker: Broker, delay: float) -> threading.Thread:
    """SIGKILL the server now (as a crashed node dies) and start it again on the same port and store
    after `delay` seconds, from a thread, so the publisher's event loop keeps running meanwhile."""
    broker.proc.kill()
    broker.proc.wait()

    def again():
        time.sleep(delay)
        broker.start()

    t = threading.Thread(target=again, daemon=True)
    t.start()
    broker.restarts.append(t)
    return t


async def _connect(url: str):
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                              connect_timeout=2)


async def _stored_ids(js, stream: str) -> Counter:
    info = await js.stream_info(stream)
    ids: Counter = Counter()
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(stream, seq=seq)
        except nats.js.errors.NotFoundError:
            continue
        ids[msg.headers.get("Yeto-Test-Id")] += 1
    return ids


async def test_pipeline_rides_through_broker_restart_without_waiting_out_lost_acks(own_broker):
    nc = await _connect(own_broker.url)
    js = nc.jetstream()
    try:
        await js.add_stream(api.StreamConfig(name="RECON", subjects=["recon.>"], storage=api.StorageType.FILE,
                                             duplicate_window=120.0))
        counters: Counter = Counter()
        pipe = Pipeline(js, max_bytes=32 << 20, max_msgs=64, timeout=TIMEOUT, counters=counters)
        payload = bytes(CHUNK)
        t0 = time.monotonic()
        restarter = None
        for i in range(N):
            await pipe.put(f"recon.{i}", payload, f"recon.{i}", {"Yeto-Test-Id": str(i)})
            if i == N // 3:
                # Dozens of publishes are unacknowledged at this moment: their acks die with the server.
                restarter = _restart_later(own_broker, 1.0)
        await pipe.flush()
        elapsed = time.monotonic() - t0
        restarter.join(10)

        ids = await _stored_ids(js, "RECON")
        assert sorted(int(k) for k in ids) == list(range(N)), "a message was lost"
        assert max(ids.values()) == 1, f"a message was stored twice: {ids.most_common(3)}"
        # The fix re-sends what was in flight as soon as the client is back, instead of waiting out each
        # lost ack; before it, the first lost ack alone cost TIMEOUT seconds.
        assert counters["publish_retry.reconnected"] > 0, dict(counters)
        assert elapsed < TIMEOUT / 2, f"flush took {elapsed:.1f} s: lost acks were waited out ({dict(counters)})"
    finally:
        await nc.close()


async def test_publish_retry_resends_at_once_after_a_restart(own_broker):
    """A single publish whose ack dies with the server is re-sent when the client reconnects, well
    before its timeout, and stored once."""
    nc = await _connect(own_broker.url)
    js = nc.jetstream()
    try:
        await js.add_stream(api.StreamConfig(name="RECON1", subjects=["one.>"], storage=api.StorageType.FILE))
        counters: Counter = Counter()
        own_broker.proc.kill()
        own_broker.proc.wait()
        restart = threading.Thread(target=lambda: (time.sleep(1.0), own_broker.start()), daemon=True)
        restart.start()
        own_broker.restarts.append(restart)
        t0 = time.monotonic()
        ack = await publish_retry(js, "one.x", b"payload", "one.x.1", timeout=TIMEOUT, counters=counters)
        elapsed = time.monotonic() - t0
        restart.join(10)
        assert ack.stream == "RECON1" and ack.seq == 1
        assert (await js.stream_info("RECON1")).state.messages == 1
        assert elapsed < TIMEOUT / 2, f"publish took {elapsed:.1f} s ({dict(counters)})"
    finally:
        await nc.close()

