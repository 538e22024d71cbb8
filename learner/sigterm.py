"""SIGTERM to an island's sync rank — its launcher stops the job, a node is preempted — first tells the syncer the
island is leaving (its last heartbeat, `leaving`: the syncer's rounds stop waiting for it now instead of at the
member timeout), then goes on as the signal's previous disposition would: a handler the training framework set is
called, the default ends the process by SIGTERM as its launcher expects."""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

log = logging.getLogger("yeto.learner")


def say_then_die(say: Callable[[], object]) -> bool:
    """Install the handler (the main thread only: Python takes signals there). True when installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        try:
            say()
        except Exception as exc:  # noqa: BLE001 - dying is what was asked for; the member timeout still applies
            log.warning("saying the island leaves on SIGTERM failed: %r", exc)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)
    return True
