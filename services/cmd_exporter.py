"""`yeto exporter`: Prometheus metrics of one run (boundary/export/apply and round-latency histograms,
push/apply/disposition/quorum-timeout/byte counters, version and lag gauges), from its step log and
the syncer's tape."""
from __future__ import annotations

import argparse
import functools

from yeto.schemas.conn import add_connect_args


def add_parser(sub) -> None:
    p = sub.add_parser("exporter", help="serve a run's step-log metrics to Prometheus (GET /metrics)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_connect_args(p)
    from yeto.services.steplog.consume import add_server_args, add_source_args

    add_source_args(p)
    add_server_args(p, port=9464, port_env="YETO_EXPORTER_PORT", host_env="YETO_EXPORTER_HOST")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from yeto.services.steplog.consume import run_server
    from yeto.services.steplog.exporter import serve_exporter

    return run_server(args, "exporter", functools.partial(serve_exporter, host=args.host, port=args.port),
                      lambda port: f"yeto exporter: run {args.run}, metrics on http://{args.host}:{port}/metrics")
