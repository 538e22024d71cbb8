"""`yeto dashboard`: a self-contained web page with live charts of one run (boundary time and its
export/apply split per island, round latency, quorum timeouts, version lag), fed by server-sent events."""
from __future__ import annotations

import argparse
import functools
import sys

from yeto.schemas.conn import add_connect_args


def add_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="serve a web page with live charts of a run",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_connect_args(p)
    from yeto.services.steplog.consume import add_server_args, add_source_args

    add_source_args(p)
    add_server_args(p, port=8080, port_env="YETO_DASHBOARD_PORT", host_env="YETO_DASHBOARD_HOST")
    p.add_argument("--points", type=int, default=600, help="points kept per series (server and page)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from yeto.services.steplog.consume import run_server
    from yeto.services.steplog.dashboard import serve_dashboard

    if args.points < 1:
        print(f"yeto dashboard: --points must be >= 1, got {args.points}", file=sys.stderr)
        return 2
    return run_server(args, "dashboard", functools.partial(serve_dashboard, host=args.host, port=args.port,
                                                            max_points=args.points),
                      lambda port: f"yeto dashboard: run {args.run} on http://{args.host}:{port}/")
