"""The syncer shell's event queue: liveness first.

Hellos and heartbeats are what keep islands members; every other event (push chunks complete, INIT
chunks, merges done) can wait a moment. Under a flood of other events (a hostile island sending pushes
for rounds not in flight: each one a disposition to tape and a release), a heartbeat waiting its turn
behind them could come later than the member timeout and evict an honest island (seen: both islands
"left" in 2 of 5 floods). So the queue has two lanes and `get` always takes the liveness lane first;
within a lane the order is arrival order. An exception put by a failed task goes first of all: it stops
the syncer. The machine takes events in any order (a `now` older than one seen counts as the newest), and
the tape records the order they were fed in, so `yeto replay` is unchanged.
"""
from __future__ import annotations

import asyncio
from collections import deque

from yeto.services.syncer.events import Heartbeat, Hello

LIVENESS = (Hello, Heartbeat)


class EventQueue:
    def __init__(self) -> None:
        self._lanes: tuple[deque, deque, deque] = (deque(), deque(), deque())   # errors, liveness, the rest
        self._wake = asyncio.Event()

    def put_nowait(self, item) -> None:
        lane = 0 if isinstance(item, BaseException) else 1 if isinstance(item, LIVENESS) else 2
        self._lanes[lane].append(item)
        self._wake.set()

    async def put(self, item) -> None:
        self.put_nowait(item)

    def qsize(self) -> int:
        return sum(len(q) for q in self._lanes)

    def empty(self) -> bool:
        return not any(self._lanes)

    def get_nowait(self):
        for q in self._lanes:
            if q:
                return q.popleft()
        raise asyncio.QueueEmpty

    async def get(self):
        while self.empty():
            self._wake.clear()
            await self._wake.wait()
        return self.get_nowait()
