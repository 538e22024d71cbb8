"""`yeto dashboard`: a self-contained web page with live charts of one run (boundary time and its
export/apply split per island, round latency, quorum timeouts, version lag), fed by server-sent events."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from schemas.conn import add_connect_args


def add_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="serve a web page with live charts of a run",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_connect_args(p)
    from services.steplog.consume import add_source_args

    add_source_args(p)
    p.add_argument("--port", type=int, default=int(os.environ.get("YETO_DASHBOARD_PORT", "8080")),
                   help="HTTP port (env YETO_DASHBOARD_PORT; 0 picks a free one)")
    p.add_argument("--host", default=os.environ.get("YETO_DASHBOARD_HOST", "127.0.0.1"),
                   help="listen address (env YETO_DASHBOARD_HOST; 0.0.0.0 in a container)")
    p.add_argument("--points", type=int, default=600, help="points kept per series (server and page)")
    p.add_argument("--log-level", default=os.environ.get("YETO_LOG_LEVEL", "INFO"))
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from services.steplog.consume import connect, source_options
    from services.steplog.dashboard import serve_dashboard

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.points < 1:
        print(f"yeto dashboard: --points must be >= 1, got {args.points}", file=sys.stderr)
        return 2
    opts = source_options(args)

    async def go():
        nc = await connect(args, name=f"yeto-dashboard-{args.run}")
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # `docker stop` / Ctrl-C: close the port and the connection
            loop.add_signal_handler(sig, stop.set)
        started = loop.create_future()
        started.add_done_callback(lambda f: print(f"yeto dashboard: run {args.run} on http://{args.host}:{f.result()}/",
                                                  flush=True))
        try:
            await serve_dashboard(nc, opts, host=args.host, port=args.port, max_points=args.points, started=started, stop=stop)
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"yeto dashboard: {exc}", file=sys.stderr)
        return 2
    return 0
