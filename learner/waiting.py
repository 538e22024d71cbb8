"""The one way the training thread waits for the network: `Arrivals`, a flag the NATS thread raises
whenever something lands that a waiter may be waiting for (a CTL message, a cut notice, a push's
acks, a reconnect, a fatal error), and `wait_until`, which re-checks a condition on each arrival and
falls back to a short poll for what raises no flag (e.g. a KV value). Waking on arrival, not on a
timer, is what keeps a lockstep boundary from paying a poll interval per message.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

POLL_S = 0.05  # fallback when nothing raised the flag


class Arrivals:
    """Raised (from any thread) when input lands; `wait` takes it down as it returns, so input that
    lands after a waiter woke (and before it read its inboxes) raises it again."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def notify(self) -> None:
        self._flag.set()

    def wait(self, timeout: float) -> bool:
        """Until input lands or `timeout` passes; True when input landed."""
        got = self._flag.wait(max(0.0, timeout))
        self._flag.clear()
        return got


def wait_until(cond: Callable[[], bool], deadline: float, *, arrivals: Arrivals | None = None,
               poll: float = POLL_S, clock: Callable[[], float] = time.monotonic) -> bool:
    """Until `cond()` holds (True) or the clock passes `deadline` (False); `cond` is re-checked on
    each arrival and at least every `poll` seconds."""
    while True:
        if cond():
            return True
        left = deadline - clock()
        if left <= 0:
            return False
        if arrivals is None:
            time.sleep(min(poll, left))
        else:
            arrivals.wait(min(poll, left))


__all__ = ["Arrivals", "POLL_S", "wait_until"]
