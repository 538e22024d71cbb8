"""`yeto exporter`: Prometheus metrics of one run (boundary/export/apply and round-latency histograms,
push/apply/disposition/quorum-timeout/byte counters, version and lag gauges), from its step log and
the syncer's tape."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from schemas.conn import add_connect_args


def add_parser(sub) -> None:
    p = sub.add_parser("exporter", help="serve a run's step-log metrics to Prometheus (GET /metrics)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_connect_args(p)
    from services.steplog.consume import add_source_args

    add_source_args(p)
    p.add_argument("--port", type=int, default=int(os.environ.get("YETO_EXPORTER_PORT", "9464")),
                   help="HTTP port (env YETO_EXPORTER_PORT; 0 picks a free one)")
    p.add_argument("--host", default=os.environ.get("YETO_EXPORTER_HOST", "127.0.0.1"),
                   help="listen address (env YETO_EXPORTER_HOST; 0.0.0.0 in a container)")
    p.add_argument("--log-level", default=os.environ.get("YETO_LOG_LEVEL", "INFO"))
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from services.steplog.consume import connect, source_options
    from services.steplog.exporter import serve_exporter

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    opts = source_options(args)

    async def go():
        nc = await connect(args, name=f"yeto-exporter-{args.run}")
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # `docker stop` / Ctrl-C: close the port and the connection
            loop.add_signal_handler(sig, stop.set)
        started = loop.create_future()
        started.add_done_callback(lambda f: print(f"yeto exporter: run {args.run}, metrics on "
                                                  f"http://{args.host}:{f.result()}/metrics", flush=True))
        try:
            await serve_exporter(nc, opts, host=args.host, port=args.port, started=started, stop=stop)
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"yeto exporter: {exc}", file=sys.stderr)
        return 2
    return 0
