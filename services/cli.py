"""`yeto` — the command line of yeto-nats.

Every command takes `--nats URL` (default `NATS_URL`, else nats://127.0.0.1:4222) and, where it acts on a
run, `--run R`; `YETO_*` variables mirror the flags.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from yeto.schemas.conn import ConnectOptions, add_connect_args
from yeto.services.envflags import bad_env_values, env_value


def _cmd_broker(args) -> int:
    from yeto.services.cmd_broker import run_foreground

    store = args.store_dir or os.path.join(os.getcwd(), "yeto-data", "jetstream")
    if args.action == "roll":
        from yeto.services.cmd_broker import request_roll

        if not args.roll_timeout > 0:
            print(f"yeto broker roll: --timeout must be a number of seconds > 0, got {args.roll_timeout}", file=sys.stderr)
            return 2
        return request_roll(store, timeout=args.roll_timeout)
    if args.cluster < 0:
        print(f"yeto broker: --cluster must be 0 (one server) or a number of servers >= 1, got {args.cluster}",
              file=sys.stderr)
        return 2
    refusal = _broker_refusal(args)
    if refusal:
        print(f"yeto broker: {refusal}", file=sys.stderr)
        return 2
    from yeto.services.broker import BrokerError

    config, leaf = args.config, None
    try:
        if args.leaf_host and not args.leaf_port:
            raise BrokerError(f"--leaf-host {args.leaf_host!r} needs --leaf-port P: it is where a hub's leafnode port "
                              f"listens")
        if args.leaf_of or args.leaf_port or args.domain:
            config, leaf = _leaf_setup(args, store)
        return run_foreground(args.port, store, config, host=args.host, cluster=args.cluster,
                              cluster_name=args.cluster_name, cluster_port=args.cluster_port, http_port=args.http_port,
                              auth=args.auth, node=args.node, peers=args.peers, log=args.log, leaf=leaf)
    except BrokerError as exc:
        print(f"yeto broker: {exc}", file=sys.stderr)
        return 2


PLUGINS = {"swift": "yeto_swift_plugin.py", "hybrid": "yeto_hybrid_plugin.py"}


def _cmd_plugin(args) -> int:
    """The plugin file's absolute path, wherever the package is installed: `--external_plugins "$(yeto plugin)"`.
    Found through the package's import spec, which imports `yeto` alone (services never imports the learner)."""
    import importlib.util

    spec = importlib.util.find_spec("yeto.learner")
    path = os.path.join(list(spec.submodule_search_locations)[0], "plugins", PLUGINS[args.which])
    if not os.path.isfile(path):
        print(f"yeto plugin: {path} is missing from the installed package", file=sys.stderr)
        return 1
    print(path)
    return 0


def _leaf_setup(args, store: str):
    """(config, secured leaf role) of a hub or leaf `yeto broker`: without --auth a generated config
    under the store; with --auth DIR the role AuthServe adds to DIR's users (services/leaf_auth.py)."""
    from yeto.services.leaf import check_leaf_options, leaf_hub_config, secured_leaf_role

    leaf_host = args.leaf_host or args.host
    if not args.auth:
        return leaf_hub_config(store, leaf_of=args.leaf_of, leaf_port=args.leaf_port, domain=args.domain,
                               host=leaf_host, config=args.config, cluster=args.cluster), None
    check_leaf_options(leaf_of=args.leaf_of, leaf_port=args.leaf_port, domain=args.domain, config=args.config,
                       cluster=args.cluster)
    return None, secured_leaf_role(args.auth, leaf_of=args.leaf_of, leaf_port=args.leaf_port, domain=args.domain,
                                   leaf_host=leaf_host)


def _broker_refusal(args) -> str | None:
    """No open broker beyond loopback unless asked for (--insecure; docs/design.md §13); --node/--peers."""
    from yeto.services.cmd_broker import exposure_refusal, node_refusal

    why = node_refusal(args.cluster, args.node, args.peers, auth=args.auth, insecure=args.insecure)
    if why:
        return why
    if args.auth and not os.path.isdir(args.auth):
        return f"--auth: {args.auth!r} is not a directory (make one with `yeto auth init --out DIR`)"
    why = exposure_refusal(args.host, auth=args.auth, insecure=args.insecure)
    if why or not (args.leaf_port and args.leaf_host):
        return why
    # A hub's leaf port beyond loopback lets any leaf node join the account: the same rule as clients.
    return exposure_refusal(args.leaf_host, auth=args.auth, insecure=args.insecure, flag="--leaf-host")


def _add_broker_security_args(b) -> None:
    b.add_argument("--auth", default=os.environ.get("YETO_BROKER_AUTH") or None, metavar="DIR",
                   help="serve the identities and permissions of DIR (made by `yeto auth init`), with TLS when "
                        "DIR/tls/ exists; SIGHUP reloads DIR (new islands, rotated keys) (env YETO_BROKER_AUTH)")
    b.add_argument("--insecure", action="store_true",
                   default=os.environ.get("YETO_BROKER_INSECURE", "").lower() in ("1", "true", "yes"),
                   help="allow listening beyond loopback without --auth: any client that reaches the broker may "
                        "then publish and read every run (env YETO_BROKER_INSECURE=1)")


def _cmd_run_rm(args) -> int:
    from yeto.schemas.conn import connect
    from yeto.schemas.provision import remove_run

    async def go():
        nc = await connect(ConnectOptions.from_args(args, name="yeto-run-rm"))
        try:
            # --domain: a datacenter's JetStream (its leaf node's mirrors of the cut), else the connected one
            removed = await remove_run(nc.jetstream(domain=args.domain) if args.domain else nc.jetstream(), args.run)
        finally:
            await nc.close()
        return removed

    removed = asyncio.run(go())
    if removed:
        print(f"removed from run {args.run}: {', '.join(removed)}")
    else:
        print(f"run {args.run}: nothing to remove")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="yeto", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", default=os.environ.get("YETO_LOG_LEVEL", "").upper() == "DEBUG",
                   help="show the traceback of an expected error too (also YETO_LOG_LEVEL=DEBUG)")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("broker", help="run the embedded nats-server (JetStream) in the foreground; `yeto broker roll`: "
                       "restart a running --cluster's nodes one at a time")
    b.add_argument("action", nargs="?", choices=["roll"], default=None,
                   help="roll: ask the `yeto broker --cluster N` running on --store-dir to restart every node one at a "
                        "time (stream leaders moved first, lame duck mode, /healthz before the next; followers first, "
                        "the meta leader last), print its progress, exit 0 once all are back")
    b.add_argument("--timeout", dest="roll_timeout", type=float, default=900.0, metavar="S",
                   help="roll: give up following it after this many seconds (default %(default)s)")
    b.add_argument("--port", type=int, default=env_value("YETO_BROKER_PORT", int, 4222), help="client port (env YETO_BROKER_PORT; default %(default)s)")
    b.add_argument("--host", default=os.environ.get("YETO_BROKER_HOST", "127.0.0.1"), help="listen address (env YETO_BROKER_HOST; default %(default)s)")
    b.add_argument("--store-dir", default=os.environ.get("YETO_BROKER_STORE"), help="JetStream store directory (env YETO_BROKER_STORE; default ./yeto-data/jetstream)")
    b.add_argument("--config", default=os.environ.get("YETO_BROKER_CONFIG"), help="nats-server config file (default: the shipped services/nats.conf, max_payload 8 MiB)")
    b.add_argument("--cluster", type=int, default=env_value("YETO_BROKER_CLUSTER", int, 0),
                   help="run N servers joined by routes on this host, a JetStream cluster (client ports P..P+N-1, "
                        "stores <store-dir>/<name>-<i>); prints the N client URLs comma separated once a meta "
                        "leader is elected (env YETO_BROKER_CLUSTER; default 0: one server)")
    b.add_argument("--cluster-name", default="yeto", help="cluster name; servers are <name>-1..<name>-N (default %(default)s)")
    b.add_argument("--cluster-port", type=int, default=None, help="first route port of --cluster (default: --port + 2000)")
    b.add_argument("--http-port", type=int, default=None,
                   help="(first) monitoring port (default: --port + 4000 with --cluster, else a free port)")
    b.add_argument("--node", type=int, default=env_value("YETO_BROKER_NODE", int, None), metavar="K",
                   help="with --cluster N: start node K (1..N) of that cluster alone, on its own store (one node "
                        "per host, or one restarted by hand); it joins the others as they come (env YETO_BROKER_NODE)")
    b.add_argument("--peers", default=os.environ.get("YETO_BROKER_PEERS") or None, metavar="H1:R1,...",
                   help="with --node: every node's route address host:port, in node order (one node per host: "
                        "clients on --port and monitoring on --http-port of each host) (env YETO_BROKER_PEERS)")
    b.add_argument("--log", default=os.environ.get("YETO_BROKER_LOG") or None, metavar="FILE|-",
                   help="nats-server's log: this file (with --cluster, one per node: FILE's stem + -<server name>), "
                        "or - for stderr (default: nats-server.log in each server's store) (env YETO_BROKER_LOG)")
    _add_broker_security_args(b)
    # Island datacenters (services/leaf.py): a hub with a leafnode listener, or a leaf that dials out to it.
    b.add_argument("--leaf-port", type=int, default=env_value("YETO_BROKER_LEAF_PORT", lambda v: int(v) or None, None),
                   help="hub: accept leaf nodes of island datacenters on this port, JetStream domain --domain "
                        "(default hub) (env YETO_BROKER_LEAF_PORT)")
    b.add_argument("--leaf-host", default=os.environ.get("YETO_BROKER_LEAF_HOST") or None, metavar="H",
                   help="hub: the address the leafnode port listens on, e.g. 0.0.0.0 so other datacenters can dial "
                        "in (default: --host); beyond loopback it needs --auth or --insecure, as --host does "
                        "(env YETO_BROKER_LEAF_HOST)")
    b.add_argument("--leaf-of", default=os.environ.get("YETO_BROKER_LEAF_OF") or None,
                   help="leaf node of an island datacenter: dial out to the hub's leafnode URL(s) HOST:PORT[,...], "
                        "JetStream domain --domain; with --auth DIR it dials with DIR/leaf-<domain>.creds (TLS with "
                        "DIR's CA when DIR has tls/) and serves DIR's islands (env YETO_BROKER_LEAF_OF)")
    b.add_argument("--domain", default=os.environ.get("YETO_BROKER_DOMAIN") or None,
                   help="this server's JetStream domain: the datacenter's name on a leaf (required with --leaf-of), "
                        "default hub with --leaf-port (env YETO_BROKER_DOMAIN)")
    b.set_defaults(func=_cmd_broker)

    r = sub.add_parser("run", help="manage a run's streams and buckets")
    rsub = r.add_subparsers(dest="run_command", required=True)
    rm = rsub.add_parser("rm", help="remove a run's streams and KV buckets")
    rm.add_argument("run_id", metavar="R", help="run id")
    add_connect_args(rm, run=False)
    rm.add_argument("--domain", default=None, help="remove what the run has in this JetStream domain instead "
                    "(an island datacenter's mirrors of the cut; connect to its leaf node)")
    rm.set_defaults(func=_cmd_run_rm)
    from yeto.services.cmd_run_set import add_parser as add_run_set

    add_run_set(rsub)

    pl = sub.add_parser("plugin", help="print the path of an ms-swift plugin file of the installed package "
                        "(for --external_plugins)")
    pl.add_argument("which", choices=sorted(PLUGINS), nargs="?", default="swift",
                    help="swift: streaming DiLoCo (and hybrid groups with YETO_CROSS_NODE_GLOO=1); hybrid: only the "
                         "hybrid process groups (default %(default)s)")
    pl.set_defaults(func=_cmd_plugin)

    for name in ("syncer", "export", "replay", "demo", "steplog", "exporter", "dashboard", "auth"):
        try:
            mod = __import__(f"yeto.services.cmd_{name}", fromlist=["add_parser"])
        except ModuleNotFoundError as exc:
            if exc.name != f"yeto.services.cmd_{name}":
                raise
            continue
        mod.add_parser(sub)
    return p


# The identity (`yeto auth init`'s creds file) each command needs in a secured run, for the denial message.
IDENTITY_FOR = {
    "yeto run rm": "the admin identity (--nats-creds DIR/admin.creds)",
    "yeto run set": "the admin identity (--nats-creds DIR/admin.creds)",
    "yeto syncer": "the syncer identity (--nats-creds DIR/syncer.creds)",
    "yeto replay": "the observer or admin identity (--nats-creds DIR/observer.creds)",
    "yeto export": "the syncer identity (--nats-creds DIR/syncer.creds) with --from jetstream: the weights are its alone",
    "yeto steplog tail": "the observer identity (--nats-creds DIR/observer.creds)",
    "yeto exporter": "the observer identity (--nats-creds DIR/observer.creds)",
    "yeto dashboard": "the observer identity (--nats-creds DIR/observer.creds)",
}


def main(argv: list[str] | None = None) -> int:
    from yeto.schemas.errors import ConfigError, ConnectError

    args = build_parser().parse_args(argv)
    sub = next((v for k, v in vars(args).items() if k.endswith("_command") and isinstance(v, str)), None)
    what = " ".join(x for x in ("yeto", args.command, sub) if x)
    bad = bad_env_values(args)
    if bad:   # a variable of this command that does not parse (another command's never gets here)
        for line in bad:
            print(f"{what}: {line}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "run_id", None) is not None:
            from yeto.schemas.ids import check_run

            args.run = check_run(args.run_id)
        return int(args.func(args) or 0)
    except (ConfigError, ConnectError) as exc:
        # An expected error (a setting to fix, a broker not there): one line that says what to do, no traceback
        # unless asked for. A setting is a usage error (2), an unreachable broker a runtime one (1).
        if args.debug:
            raise
        print(f"{what}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except Exception:  # noqa: BLE001 - re-raised unless a permission denial explains it
        from yeto.schemas.conn import DENIED

        if args.debug or not DENIED:
            raise
        # A secured run refused an operation: nats-py logged the violation and the request timed out.
        op, subject = DENIED[-1]
        who = getattr(args, "nats_creds", None)
        need = IDENTITY_FOR.get(what, "the identity `yeto auth init` made for this role")
        print(f"{what}: permission denied: {op} to {subject} (identity: {who or 'none'}); this command needs "
              f"{need}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
