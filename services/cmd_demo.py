"""`yeto demo`: the end-to-end CPU demo.

Until the learner side lands (issue 4) it starts the embedded broker and says how to connect.
"""
from __future__ import annotations

import os
import signal
import time

from schemas.conn import DEFAULT_URL


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the CPU demo (embedded broker, syncer, two islands, a tiny model)")
    p.add_argument("--nats", default=os.environ.get("YETO_NATS") or os.environ.get("NATS_URL"),
                   help="use this NATS server instead of starting the embedded one")
    p.add_argument("--seconds", type=float, default=None, help="stop the broker after this many seconds (default: until Ctrl-C)")
    p.set_defaults(func=run)


def run(args) -> int:
    from services.broker import Broker

    if args.nats:
        print(f"yeto demo: using the NATS server at {args.nats}")
        return 0
    stop = {"flag": False}
    signal.signal(signal.SIGINT, lambda *a: stop.__setitem__("flag", True))
    signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__("flag", True))
    with Broker() as b:
        print(f"yeto demo: embedded broker (JetStream) at {b.url}")
        print(f"  connect with: export NATS_URL={b.url}   (default otherwise: {DEFAULT_URL})")
        print("  the training demo (syncer + two islands) arrives with the learner; Ctrl-C stops the broker")
        t0 = time.monotonic()
        while not stop["flag"] and (args.seconds is None or time.monotonic() - t0 < args.seconds):
            time.sleep(0.2)
    return 0
