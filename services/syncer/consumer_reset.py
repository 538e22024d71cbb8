"""The syncer's pull consumers after its connection moved to another server (docs/design.md §7.1).

A message the server handed to a fetch on the lost connection is redelivered only after the consumer's ack
wait (30 s), and for that long the round it belongs to waits (soak/rolling.py saw a 30 s stall right after a
broker roll). So each consumer holding deliveries nobody acked is made again with its own config, from the
message after its ack floor: they come again at once. Messages acked past the floor come again too; intake
takes a redelivered message as it takes one after a syncer restart (dropped as a duplicate). Never raises.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

from nats.js import api

from yeto.schemas import subjects as S

log = logging.getLogger("yeto.syncer")


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
