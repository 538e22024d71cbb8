"""A planned hand-over of the run (docs/design.md §11): SIGTERM to the owning syncer — a host patched, a pod
moved — hands the run to a standby instead of ending the process where it stands.

The signal only queues a `HandOver` for the service's event loop, so the owner stops between two events (the
action in hand completes); the service's exit path then flushes what it published and deletes the lease, and a
standby (which polls the key every quarter second) takes the run over at once instead of after a lease TTL.
"""
from __future__ import annotations

import asyncio
import signal
from typing import Callable

# The exit status of a handed-over owner: a process ended by SIGTERM's (128 + 15), so that `yeto syncer && ...`
# does not read an unfinished run as done.
HANDED_OVER = 143


class HandOver(Exception):
    """The owner was asked to stop (SIGTERM). What was in flight (pulls, pushes not yet merged) is the new
    owner's, as after a kill."""


def install(request: Callable[[], None]) -> bool:
    """Call `request` (in the event loop) on SIGTERM. Only where asyncio can take the signal — the main thread,
    as in `yeto syncer`; a syncer run inside a test or tool keeps SIGTERM's default. True when installed."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, request)
        return True
    except (RuntimeError, ValueError, NotImplementedError):
        return False
