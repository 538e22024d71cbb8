"""The syncer's pull consumers holding deliveries nobody will ack (docs/design.md §7.1).

A message the server handed to a fetch on a lost connection, or to a predecessor that was handed over, killed
or fenced, is redelivered only after the consumer's ack wait (30 s), and for that long its round waits
(soak/rolling.py: 20-30 s gaps after a broker roll and at hand-overs). So after a reconnect and at takeover
each consumer of this syncer holding unacked deliveries is made again with its own config, from the message
after its ack floor: they come again at once. Messages acked past the floor come again too; intake takes a
redelivered message as one after a syncer restart (dropped as a duplicate). Never raises.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

from nats.js import api

from yeto.schemas import shards as SH, subjects as S

log = logging.getLogger("yeto.syncer")


def own_consumers(shard: int, shards: int, coordinator: bool) -> dict[str, str]:
    """Stream kind -> the durable a syncer shard reads it with (only the coordinator reads CTL and HB)."""
    out = {"INIT": SH.consumer(S.SYNCER_INIT_CONSUMER, shard, shards),
           "PUSH": SH.consumer(S.SYNCER_PUSH_CONSUMER, shard, shards)}
    if coordinator:
        out.update(HB=S.SYNCER_HB_CONSUMER, CTL=S.SYNCER_CTL_CONSUMER)
    return out


async def reset_lost_deliveries(js, run: str, consumers: dict[str, str], counters: Counter) -> int:
    """`consumers`: stream kind -> durable name, this syncer's. Returns how many were made again."""
    made = 0
    for kind, name in consumers.items():
        stream = S.stream(run, kind)
        try:
            info = await js.consumer_info(stream, name)
            if not info.num_ack_pending:
                continue
            floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            cfg = dataclasses.replace(info.config, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                      opt_start_seq=floor + 1, opt_start_time=None)
            await js.delete_consumer(stream, name)
            await js.add_consumer(stream, config=cfg)
            made += 1
            counters["consumer_reset"] += 1
            log.warning("consumer %s on %s held %d deliveries lost with the old connection: made again from stream "
                        "sequence %d", name, kind, info.num_ack_pending, floor + 1)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the ack wait still redelivers them
            counters["consumer_reset_failed"] += 1
            log.warning("consumer %s on %s after a reconnect: %r (its ack wait redelivers what was lost)", name,
                        kind, exc)
    return made
