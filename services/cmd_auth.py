"""`yeto auth init`: identities, permissions and TLS material of a secured run (services/auth.py)."""
from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("auth", help="credentials and server-enforced permissions of a secured run")
    asub = p.add_subparsers(dest="auth_command", required=True)
    i = asub.add_parser(
        "init", help="write DIR/<identity>.creds, DIR/auth.conf (and DIR/tls/ with --tls)",
        description="One nkey identity per process kind: syncer, each island, observer (read-only), admin "
                    "(provisioning and `yeto run rm`); DIR/auth.conf holds their public keys and permissions. "
                    "Running it again on DIR adds identities and keeps the existing ones valid.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    i.add_argument("--run", default=os.environ.get("YETO_RUN"), required=os.environ.get("YETO_RUN") is None,
                   help="run id (env YETO_RUN)")
    i.add_argument("--islands", required=True, help="island ids, comma separated (added to those DIR already has)")
    i.add_argument("--out", required=True, help="directory for the creds, auth.conf and tls/ (mode 0700)")
    i.add_argument("--init-island", default=None,
                   help="the island allowed to publish the initial weights (default: DIR's, else the first of "
                        "--islands); start the syncer with the same --init-island")
    i.add_argument("--datacenters", default=None, metavar="DC1,DC2",
                   help="island datacenters (each one's JetStream domain), comma separated: one leaf-node identity "
                        "DIR/leaf-<dc>.creds each, which `yeto broker --auth DIR --leaf-of HUB:7422 --domain <dc>` "
                        "dials the hub with (added to those DIR already has)")
    i.add_argument("--tls", action="store_true", help="also make a CA and a server certificate under DIR/tls/")
    i.add_argument("--hosts", default=",".join(("localhost", "127.0.0.1")),
                   help="server names / addresses the certificate is valid for, comma separated: every name a "
                        "client or a leaf node dials, the hub's and each datacenter leaf node's (they share it)")
    i.set_defaults(func=_cmd_init)


def _cmd_init(args) -> int:
    from yeto.services.auth import AuthError, init_auth, parse_islands
    from yeto.services.leaf_auth import parse_datacenters

    try:
        islands = parse_islands(args.islands)
        dcs = parse_datacenters(args.datacenters, AuthError)
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        rep = init_auth(args.run, islands, args.out, init_island=args.init_island, tls=args.tls, hosts=hosts,
                        datacenters=dcs)
    except AuthError as exc:
        print(f"yeto auth init: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad run id (schemas.ids)
        print(f"yeto auth init: --run: {exc}", file=sys.stderr)
        return 2
    print(f"run {rep.run}: auth in {rep.out} (INIT island {rep.init_island})")
    if rep.created:
        print("  new identities: " + ", ".join(f"{n}.creds" for n in rep.created))
    if rep.kept:
        print("  kept (still valid): " + ", ".join(rep.kept))
    if rep.tls:
        print("  tls: " + ", ".join(f"tls/{f}" for f in rep.tls) + f"  (clients: --tls-ca {rep.out}/tls/ca.pem)")
    print(f"  serve with: yeto broker --auth {rep.out}   (a running one: SIGHUP to `yeto broker` reloads it; "
          f"yeto broker --config {rep.out}/server.conf serves the same)")
    if rep.datacenters:
        print(f"  leaf nodes: hub `yeto broker --auth {rep.out} --leaf-port 7422 --leaf-host 0.0.0.0`; in datacenter D "
              f"`yeto broker --auth {rep.out} --leaf-of HUB:7422 --domain D` (datacenters: {', '.join(rep.datacenters)})")
    return 0
