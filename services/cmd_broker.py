"""`yeto broker`: one nats-server or a loopback cluster (services.broker) in the foreground, and what a
secured broker needs (docs/design.md §13): `--auth DIR` serves DIR's identities (services.auth, `AuthServe`, also
used by `yeto demo --secure`), with TLS when DIR/tls exists; the rule that refuses a non-loopback
listener without authorization; the reload of every node's config on SIGHUP.
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from yeto.services.broker import Broker, BrokerError, Cluster, check_config
from yeto.services.broker_supervisor import RestartPolicy

def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def exposure_refusal(host: str, *, auth: str | None, insecure: bool, flag: str = "") -> str | None:
    """Why `yeto broker` must not start (listening beyond loopback with no authorization), or None.
    `flag`: the option that set `host` when it is not --host (--leaf-host). Pure: the CLI prints the
    text and exits 2."""
    if auth or insecure or is_loopback(host):
        return None
    what = f" ({flag}: leaf nodes)" if flag else ""
    return (f"refusing to listen on {host}{what} without authorization: any client that reaches it could "
            f"publish and read every run on it (forge pushes and broadcasts, stop islands, remove runs). "
            f"Serve the identities of `yeto auth init` with --auth DIR (env YETO_BROKER_AUTH), or pass "
            f"--insecure (env YETO_BROKER_INSECURE=1) to run it open anyway (e.g. on a private network, "
            f"or with a --config that does its own authorization)")


def parse_peers(text: str) -> list[tuple[str, int]]:
    """`--peers H1:R1,H2:R2,...` -> [(host, route port)], each checked (BrokerError naming the entry)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BrokerError(f"--peers: {item!r} is not host:port (a node's route address, e.g. hub-2:6222)")
        out.append((host.strip("[]"), int(port)))
    return out


def node_refusal(cluster: int, node: int | None, peers: str | None, *, auth: str | None, insecure: bool) -> str | None:
    """Why `--node`/`--peers` cannot be served as given, or None. Pure."""
    if node is None:
        return "--peers needs --node K (the node this host runs)" if peers else None
    if cluster < 2:
        return f"--node {node} needs --cluster N (N >= 2): the size of the cluster it belongs to"
    if not 1 <= node <= cluster:
        return f"--node {node}: a node of --cluster {cluster} is numbered 1..{cluster}"
    if peers:
        try:
            listed = parse_peers(peers)
        except BrokerError as exc:
            return str(exc)
        if len(listed) != cluster:
            return f"--peers lists {len(listed)} route addresses, --cluster is {cluster}: one per node, in order"
        if auth:
            return ("--peers with --auth: routes between hosts carry no authorization yet (a secured cluster keeps "
                    "its routes on loopback); run a secured multi-host hub from deploy/nats/ (routes with TLS)")
        if not insecure and not all(is_loopback(h) for h, _ in listed):
            return ("--peers beyond loopback: routes carry no authorization, so any host that reaches a route port "
                    "joins the cluster; pass --insecure on a private network, or use deploy/nats/")
    return None


class AuthServe:
    """The nats-server config `yeto broker --auth DIR` serves: the base config (default the shipped
    services/nats.conf: max_payload, JetStream limits), DIR's users and permissions, and TLS when
    DIR/tls/ holds a server certificate. Written to a private temporary file (DIR may be read-only,
    e.g. a container mount) and written again from DIR by `refresh()` before each reload.

    `leaf` (services.leaf.LeafRole): a hub's leafnode listener or a leaf's remote to the hub, secured
    with DIR's leaf identities (services/leaf_auth.py); the generated hub / leaf config is then the
    base, and a leaf serves DIR's islands as a leaf node of its datacenter does. The leaf's config holds
    its identity's seed: one more reason it lives in this private directory only."""

    def __init__(self, auth_dir: str | os.PathLike, base_config: str | os.PathLike | None = None, leaf=None):
        self.dir = Path(auth_dir)
        self.base_config = base_config
        self.leaf = leaf
        self._tmp = tempfile.mkdtemp(prefix="yeto-broker-auth-")  # mode 0700
        atexit.register(self.cleanup)  # also when the start fails half way
        self.config = Path(self._tmp) / "server.conf"
        self.summary = ""
        try:
            self.refresh()
        except BaseException:
            self.cleanup()
            raise

    @property
    def tls(self) -> bool:
        return (self.dir / "tls" / "server.pem").exists()

    @property
    def ca(self) -> str | None:
        ca = self.dir / "tls" / "ca.pem"
        return str(ca) if ca.exists() else None

    def refresh(self) -> str:
        """Rebuild the config from DIR; raises BrokerError (the file in service stays as it was) when
        DIR is not an auth directory or nats-server rejects the result. Returns a one-line summary."""
        from yeto.services.auth import AuthError, load_identities, write_server_config

        try:
            run, ids, _init = load_identities(self.dir)
            leaf = self.leaf
            candidate = write_server_config(
                [self.dir], self.config.with_name("candidate.conf"), self.base_config,
                base_text=leaf.base_text(self.dir) if leaf is not None else None,
                datacenter=None if leaf is None or leaf.is_hub else leaf.domain)
        except (AuthError, OSError, ValueError, KeyError) as exc:
            raise BrokerError(f"--auth {self.dir}: {exc}") from None
        check_config(candidate)
        os.replace(candidate, self.config)
        self.ids = ids
        self.summary = (f"auth {self.dir}: run {run}, identities {', '.join(i.name for i in ids)}; "
                        + (f"TLS (clients: --tls-ca {self.ca})" if self.tls else "no TLS (DIR has no tls/)")
                        + self._leaf_summary())
        return self.summary

    def _leaf_summary(self) -> str:
        if self.leaf is None:
            return ""
        if self.leaf.is_hub:
            return (f"; leaf nodes on {self.leaf.leaf_host}:{self.leaf.leaf_port} with a leaf identity of DIR"
                    + (" over TLS" if self.tls else ""))
        return (f"; leaf node of datacenter {self.leaf.domain}, dialling {self.leaf.leaf_of} as "
                f"leaf-{self.leaf.domain}" + (" over TLS" if self.tls else ""))

    def probe_options(self, url: str):
        """Connect options for the broker's own readiness probe: the observer's key (read-only)."""
        from yeto.schemas.conn import ConnectOptions

        names = [i.name for i in self.ids]
        who = "observer" if "observer" in names else names[0]
        return ConnectOptions(url=url, creds=str(self.dir / f"{who}.creds"), tls_ca=self.ca, name="yeto-broker-probe")

    def cleanup(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


def reload_nodes(nodes: list["Broker"], served: "AuthServe | None") -> str:
    """SIGHUP to `yeto broker`: rebuild the --auth config from DIR (new islands, rotated keys), then
    SIGHUP every nats-server so it reloads it; connected clients stay. Returns what was done; raises
    BrokerError (nothing is signalled) when the new config is bad."""
    what = served.refresh() if served is not None else "config " + str(nodes[0].config)
    for b in nodes:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.send_signal(signal.SIGHUP)
    return what


def run_foreground(port: int, store_dir: str, config: str | None, host: str = "127.0.0.1", *,
                   cluster: int = 0, cluster_name: str = "yeto", cluster_port: int | None = None,
                   http_port: int | None = None, auth: str | None = None, node: int | None = None,
                   peers: str | None = None, log: str | None = None, leaf=None) -> int:
    """`yeto broker`: run until SIGINT/SIGTERM, print the URL(s) once usable.

    cluster N >= 1: N servers joined by routes (`Cluster`), ready once JetStream has a meta leader; the
    line printed carries the N client URLs comma separated (what `--nats` takes). A node that exits on its
    own is restarted on its store (`supervise`); each server logs to `nats-server.log` in its store.

    auth DIR: serve DIR's identities (`AuthServe`; TLS when DIR/tls/ has a certificate); a cluster's
    routes then stay on loopback. SIGHUP reloads the config of every server (rebuilt from DIR first).
    leaf (with auth): the secured hub or leaf role (services.leaf.LeafRole, see AuthServe).
    """
    stop = {"flag": False, "reload": False}

    def _on_signal(signum, frame):
        stop["flag"] = True

    def _on_hup(signum, frame):
        stop["reload"] = True

    served = AuthServe(auth, config, leaf=leaf) if auth else None
    if served is not None:
        config = str(served.config)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_hup)
    secured = f"; {served.summary}" if served is not None else ""
    if cluster and node is not None:
        # One node of the cluster alone: the layout --cluster N gives it on this host, or its own host's
        # ports with --peers. Ready once it accepts clients; the meta leader comes when a majority runs.
        listed = parse_peers(peers) if peers else None
        c = Cluster(cluster, port, store_dir, name=cluster_name, config=config, host=host,
                    cluster_port=cluster_port if cluster_port is not None else port + 2000,
                    http_port=http_port if http_port is not None else port + 4000, peers=listed,
                    **_secured_cluster_kw(served))
        b = c.nodes[node - 1]
        nodes = [b]
        _log_in_store(nodes, log)
        b.start()
        routes = b.extra_args[b.extra_args.index("--routes") + 1]
        print(f"yeto broker ready: {_shown_urls(b.url, served)} (node {cluster_name}-{node} of cluster {cluster_name} "
              f"of {cluster}, routes {routes}; it joins the others as they come; store {b.store_dir}, log "
              f"{_shown_log(b)}, monitoring http://{b.host}:{b.http_port}{secured})", flush=True)
        stopper = b.stop
    elif cluster:
        c = Cluster(cluster, port, store_dir, name=cluster_name, config=config, host=host,
                    cluster_port=cluster_port if cluster_port is not None else port + 2000,
                    http_port=http_port if http_port is not None else port + 4000,
                    **_secured_cluster_kw(served))
        nodes = c.nodes
        _log_in_store(nodes, log)
        c.start()
        logs = (f"logs (nats-server.log) in the stores under {c.store_dir}" if not log else
                f"stores under {c.store_dir}, logs {'stderr' if log == '-' else ','.join(_shown_log(n) for n in nodes)}")
        print(f"yeto broker ready: {_shown_urls(c.url, served)} (cluster {cluster_name} of {cluster}, JetStream meta leader elected "
              f"after {c.waited_s:.1f}s; routes {c.cluster_port}..{c.cluster_port + cluster - 1}, monitoring "
              f"{','.join(f'http://{n.host}:{n.http_port}' for n in nodes)}; {logs}{secured})", flush=True)
        stopper = c.stop
    else:
        broker = Broker(port=port, store_dir=store_dir, config=config, host=host, http_port=http_port)
        nodes = [broker]
        _log_in_store(nodes, log)
        broker.start()
        print(f"yeto broker ready: {_shown_urls(broker.url, served)} (JetStream store {broker.store_dir}, "
              f"config {broker.config}, log {_shown_log(broker)}, monitoring http://{broker.host}:{broker.http_port}"
              f"{secured})", flush=True)
        stopper = broker.stop
    try:
        supervise(nodes, stop, served)
        rc = 0
    finally:
        stopper()
        if served is not None:
            served.cleanup()
    return rc


def _log_in_store(nodes: list[Broker], log: str | None = None) -> None:
    """nats-server's own output (why a node exited, the permission violations docs/broker.md says are logged)
    goes to `nats-server.log` in the node's store, not to /dev/null; `log` (`--log`): that file
    instead (with several nodes, one per node: `<stem>-<server name><suffix>`), or "-" for our stderr."""
    for b in nodes:
        if log == "-":
            b.log_file = "-"
        elif log:
            path = Path(log)
            if len(nodes) > 1:
                path = path.with_name(f"{path.stem}-{_server_name(b)}{path.suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            b.log_file = path
        elif b.log_file is None:
            b.store_dir.mkdir(parents=True, exist_ok=True)
            b.log_file = b.store_dir / "nats-server.log"


def _server_name(b: Broker) -> str:
    args = b.extra_args or []
    return args[args.index("--server_name") + 1] if "--server_name" in args else b.store_dir.name


def _shown_log(b: Broker) -> str:
    return "stderr" if str(b.log_file) == "-" else str(b.log_file)


def _log_tail(b: Broker, n: int = 5) -> str:
    if str(b.log_file) == "-":   # already on our stderr
        return ""
    try:
        lines = Path(b.log_file).read_text(errors="replace").splitlines()[-n:]
    except (OSError, TypeError):
        return ""
    return "".join(f"\n    {ln}" for ln in lines)


def supervise(nodes: list[Broker], stop: dict, served: AuthServe | None, *, poll_s: float = 0.2) -> None:
    """Until SIGINT/SIGTERM: a nats-server that exits on its own is restarted on its own store, after
    the RestartPolicy's delay (logged with the reason from its log), while the others keep serving: a
    cluster rides through the death of any node, as the README promises (before, one node's death
    stopped them all)."""
    policy = RestartPolicy()
    now = time.monotonic()
    for i in range(len(nodes)):
        policy.started(i, now)
    while not stop["flag"]:
        if stop["reload"]:
            stop["reload"] = False
            _reload(nodes, served)
        now = time.monotonic()
        for i, b in enumerate(nodes):
            if b.proc is not None and b.proc.poll() is None:
                continue
            if not policy.pending(i):
                rc = b.proc.returncode if b.proc is not None else None
                delay = policy.exited(i, now)
                print(f"yeto broker: nats-server {_name(b, i)} on {b.url} exited with {rc}; restarting it on its store "
                      f"{b.store_dir} in {delay:.0f}s (restart {policy.restarts(i)}; log {_shown_log(b)}){_log_tail(b)}",
                      file=sys.stderr, flush=True)
            elif policy.due(i, now):
                try:
                    b.start()
                except BrokerError as exc:
                    print(f"yeto broker: restarting {_name(b, i)} failed: {exc}", file=sys.stderr, flush=True)
                    policy.exited(i, time.monotonic())   # the next try after a longer pause
                    continue
                policy.started(i, time.monotonic())
                print(f"yeto broker: {_name(b, i)} on {b.url} is back (restart {policy.restarts(i)})", flush=True)
        time.sleep(poll_s)


def _name(b: Broker, i: int) -> str:
    args = b.extra_args
    return args[args.index("--server_name") + 1] if "--server_name" in args else f"node {i + 1}"


def _secured_cluster_kw(served: AuthServe | None) -> dict:
    if served is None:
        return {}
    # The readiness probe connects with the observer's key (anonymous is refused); URL set per probe.
    return {"route_host": "127.0.0.1", "connect_opts": served.probe_options("")}


def _shown_urls(urls: str, served: AuthServe | None) -> str:
    """The URL list printed once ready: tls:// when the server requires TLS (what clients must speak)."""
    if served is not None and served.tls:
        return urls.replace("nats://", "tls://")
    return urls


def _reload(nodes: list[Broker], served: AuthServe | None) -> None:
    try:
        what = reload_nodes(nodes, served)
    except BrokerError as exc:
        print(f"yeto broker: reload refused, still serving the previous config: {exc}", file=sys.stderr, flush=True)
        return
    print(f"yeto broker: reloaded ({what})", flush=True)
