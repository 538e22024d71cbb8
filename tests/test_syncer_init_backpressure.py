"""The syncer's INIT intake is bounded (services/syncer/receive.py INIT_PENDING_BYTES)."""
from __future__ import annotations


def test_init_intake_pauses_while_too_many_bytes_wait_for_the_machine_then_resumes(monkeypatch):
    """services/syncer/receive.py bounds the INIT bytes waiting for InitStore/InitDrop: a chunk arriving
    over the bound waits until the machine answers (or INIT_ROOM_WAIT_S passes), never for good."""
    import asyncio
    from collections import Counter

    import torch

    from yeto.services.syncer import receive as RX
    from yeto.services.syncer.actions import InitDrop

    monkeypatch.setattr(RX, "INIT_PENDING_BYTES", 8)
    monkeypatch.setattr(RX, "INIT_ROOM_WAIT_S", 0.3)
    rx = RX.Receiver(None, "r1", Counter(), None, None, None, asyncio.Queue(), None)

    async def scenario():
        rx.init_pending[("g", 0, 0)] = (None, torch.zeros(2))     # 8 bytes waiting: at the bound
        rx.init_pending_bytes = 8
        t0 = asyncio.get_running_loop().time()
        waiter = asyncio.create_task(rx._init_room())
        await asyncio.sleep(0.05)
        assert not waiter.done()                                  # paused while the machine has not answered
        rx.drop_init(InitDrop("g", 0, 0, "duplicate"))
        await asyncio.wait_for(waiter, 1.0)
        assert rx.init_pending_bytes == 0 and rx.counters["init.intake_paused"] == 1
        rx.init_pending[("g", 0, 1)] = (None, torch.zeros(4))
        rx.init_pending_bytes = 16
        await asyncio.wait_for(rx._init_room(), 2.0)              # nobody answers: gives up after the wait
        assert rx.counters["init.intake_pause_timeout"] == 1
        assert asyncio.get_running_loop().time() - t0 >= 0.3

    asyncio.run(scenario())
