"""`yeto steplog tail`: follow a run's step log and syncer tape in the terminal."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from yeto.schemas.conn import add_connect_args


def add_parser(sub) -> None:
    p = sub.add_parser("steplog", help="read a run's step log (per-step island events and the syncer's tape)")
    ssub = p.add_subparsers(dest="steplog_command", required=True)
    t = ssub.add_parser(
        "tail", help="live table of islands and rounds (or raw JSON lines with --json)",
        description="Per island: step, time inside the sync boundary and its export/apply split, versions held and "
                    "lag behind the syncer, pending pulls, bytes. Per round: attempt, quorum time, restarts, "
                    "dispositions. Malformed events are skipped and counted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_connect_args(t)
    from yeto.services.steplog.consume import add_source_args

    add_source_args(t)
    t.add_argument("--json", action="store_true", help="print each accepted event as one raw JSON line (for piping)")
    t.add_argument("--count", type=int, default=None, help="exit after this many accepted events")
    t.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    t.add_argument("--refresh", type=float, default=4.0, help="table refreshes per second")
    t.set_defaults(func=_cmd_tail)


def _cmd_tail(args) -> int:
    from yeto.services.steplog.consume import connect, source_options
    from yeto.services.steplog.tail import tail

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    if args.refresh <= 0:
        print(f"yeto steplog tail: --refresh must be > 0, got {args.refresh}", file=sys.stderr)
        return 2
    opts = source_options(args)

    async def go():
        nc = await connect(args, name=f"yeto-steplog-{args.run}")
        try:
            return await tail(nc, opts, json_out=sys.stdout if args.json else None, count=args.count,
                              timeout_s=args.timeout, refresh_hz=args.refresh)
        finally:
            await nc.close()

    try:
        agg = asyncio.run(go())
    except KeyboardInterrupt:
        return 130
    if args.json:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            # keep the interpreter's own flush at exit from printing a traceback to a closed pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if agg.malformed:
        print(f"yeto steplog tail: skipped {agg.malformed} malformed event(s); last: {agg.last_malformed}", file=sys.stderr)
    return 0
