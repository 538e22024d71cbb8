"""docs/design.md §7.1: the syncer's pull consumers after its connection moved to another server. A heartbeat
the server handed to a fetch on a connection that then went away would come again only after the consumer's
ack wait (30 s); services/syncer/consumer_reset.py makes the consumer again from after its ack floor, with its
own config, and the delivery comes at once (also what a new owner does at takeover with its predecessor's
deliveries). A consumer with nothing unacked is left alone; the next syncer's provisioning accepts the re-made
one. Real nats-server."""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
from nats.js import api

from yeto.schemas import subjects as S
from yeto.schemas.provision import ProvisionConflict, RunLimits, provision_run, remove_run
from yeto.services.syncer.consumer_reset import reset_lost_deliveries

pytestmark = pytest.mark.e2e


async def test_deliveries_lost_with_a_connection_come_again_at_once(nc, run_id):
    js = nc.jetstream()
    await provision_run(js, run_id, RunLimits.small(), log=lambda _: None)
    hb = S.stream(run_id, "HB")
    name = S.SYNCER_HB_CONSUMER
    before = await js.consumer_info(hb, name)
    assert before.config.ack_wait >= 10   # what a lost delivery would otherwise cost
    for i, island in enumerate("abc"):   # HB keeps the newest per island: three islands
        await js.publish(S.heartbeat(run_id, island), f"hb{i}".encode(), headers={S.MSG_ID: f"hb{i}"})
    sub = await js.pull_subscribe_bind(durable=name, stream=hb)
    (first,) = await sub.fetch(1, timeout=5)
    await first.ack_sync()                              # acked: below the floor, never again
    lost = await sub.fetch(2, timeout=5)                # handed out, never acked: lost with their connection
    assert [m.data for m in lost] == [b"hb1", b"hb2"]
    assert (await js.consumer_info(hb, name)).num_ack_pending == 2

    counters = Counter()
    assert await reset_lost_deliveries(js, run_id, {"HB": name, "CTL": S.SYNCER_CTL_CONSUMER}, counters) == 1
    assert counters["consumer_reset"] == 1 and counters["consumer_reset_failed"] == 0, counters   # CTL: nothing held
    t0 = time.monotonic()
    again = await sub.fetch(2, timeout=5)
    assert time.monotonic() - t0 < 2.0 and [m.data for m in again] == [b"hb1", b"hb2"]
    after = await js.consumer_info(hb, name)
    # the same consumer as configured, apart from where it starts
    assert (after.config.ack_wait, after.config.filter_subjects, after.config.max_deliver) == \
        (before.config.ack_wait, before.config.filter_subjects, before.config.max_deliver)
    for m in again:
        await m.ack_sync()   # the server has them acked before the look below
    await sub.unsubscribe()
    assert await reset_lost_deliveries(js, run_id, {"HB": name}, counters) == 0   # nothing unacked now
    # the next syncer's provisioning takes the re-made consumer as its own (it starts from its floor, then reads
    # on as `all` does); any other deliver policy is still a conflict
    assert after.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE
    await provision_run(js, run_id, RunLimits.small(), log=lambda _: None)
    await js.delete_consumer(hb, name)
    await js.add_consumer(hb, config=dataclasses.replace(before.config, deliver_policy=api.DeliverPolicy.NEW))
    with pytest.raises(ProvisionConflict, match="deliver_policy"):
        await provision_run(js, run_id, RunLimits.small(), log=lambda _: None)
    await remove_run(js, run_id)
