"""`yeto broker`: one nats-server or a loopback cluster (services.broker) in the foreground, and what a
secured broker needs (docs/design.md §13): `--auth DIR` serves DIR's identities (services.auth, `AuthServe`, also
used by `yeto demo --secure`), with TLS when DIR/tls exists; the rule that refuses a non-loopback
listener without authorization; the reload of every node's config on SIGHUP; planned restarts
(services/broker_roll.py, docs/design.md §7.1): a local cluster rolls its nodes on SIGUSR1 (`yeto broker roll`,
`request_roll` here), one `--node K` hands its leaders over and leaves through lame duck mode on SIGTERM.
"""
from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from yeto.services import broker_roll as R
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
    stop = {"flag": False, "reload": False, "roll": False, "signals": 0}

    def _on_signal(signum, frame):
        stop["flag"] = True
        stop["signals"] += 1     # a second one cuts a planned stop short (lame duck mode, a roll)

    def _on_hup(signum, frame):
        stop["reload"] = True

    def _on_usr1(signum, frame):
        stop["roll"] = True      # `yeto broker roll` (request_roll): handled between two supervision passes

    served = AuthServe(auth, config, leaf=leaf) if auth else None
    if served is not None:
        config = str(served.config)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_hup)
    signal.signal(signal.SIGUSR1, _on_usr1)
    roller = None
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

        def stopper():
            # A planned stop (SIGTERM/SIGINT: systemd, Kubernetes, an operator): hand the leaders over and
            # leave through lame duck mode, so the cluster holds no election for this node (§7.1)
            if stop["flag"] and b.proc is not None and b.proc.poll() is None:
                rc = R.hand_over_and_stop(_name(b, node - 1), b, _say, connect_opts=_roll_connect_opts(served),
                                          aborted=lambda: stop["signals"] > 1)
                _say(f"{_name(b, node - 1)}: exited with {rc}")
            b.stop()
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
        pid_file = _write_pid(c.store_dir)
        roller = lambda policy: _roll(nodes, c.store_dir, served, stop, policy)  # noqa: E731
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
        supervise(nodes, stop, served, roller=roller)
        rc = 0
    finally:
        stopper()
        if roller is not None:
            _remove_pid(pid_file)
        if served is not None:
            served.cleanup()
    return rc


def _log_in_store(nodes: list[Broker], log: str | None = None) -> None:
    """nats-server's own output (why a node exited, the permission violations docs/broker.md says are logged)
    goes to `nats-server.log` in the node's store, not to /dev/null; `log` (`--log`): that file
    instead (with several nodes, one per node: `<stem>-<server name><suffix>`), or "-" for our stderr."""
    for b in nodes:
        if log == "-":
            b.log_to("-")
        elif log:
            path = Path(log)
            if len(nodes) > 1:
                path = path.with_name(f"{path.stem}-{_server_name(b)}{path.suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            b.log_to(path)
        elif b.log_file is None:
            b.store_dir.mkdir(parents=True, exist_ok=True)
            b.log_to(b.store_dir / "nats-server.log")


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


def supervise(nodes: list[Broker], stop: dict, served: AuthServe | None, *, poll_s: float = 0.2,
              roller=None) -> None:
    """Until SIGINT/SIGTERM: a nats-server that exits on its own is restarted on its own store, after
    the RestartPolicy's delay (logged with the reason from its log), while the others keep serving: a
    cluster rides through the death of any node, as the README promises (before, one node's death
    stopped them all). SIGUSR1: `roller(policy)` restarts every node on purpose (a local cluster), while
    this loop waits: a node the roll stopped is not a death."""
    policy = RestartPolicy()
    now = time.monotonic()
    for i in range(len(nodes)):
        policy.started(i, now)
    while not stop["flag"]:
        if stop["reload"]:
            stop["reload"] = False
            _reload(nodes, served)
        if stop["roll"]:
            stop["roll"] = False
            if roller is not None:
                roller(policy)
            else:
                _say("yeto broker: SIGUSR1 (a roll) needs --cluster N on this host: a single server has no peer to "
                     "hand its clients to, and one --node K is restarted by SIGTERM and its service manager")
            stop["roll"] = False   # a request that came during the roll was answered by it
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


# ---- planned restarts (services/broker_roll.py, docs/design.md §7.1) ------------------------------------------

def _say(line: str) -> None:
    print(f"yeto broker: {line}", flush=True)


def _roll_connect_opts(served: AuthServe | None):
    """Who asks for the stepdowns: anyone on an open broker; with --auth the admin identity (its permissions
    allow the run's stream stepdowns), else the readiness probe's (refused: lame duck mode then moves them)."""
    if served is None:
        return None
    admin = served.dir / "admin.creds"
    if admin.exists():
        from yeto.schemas.conn import ConnectOptions

        return ConnectOptions(url="", creds=str(admin), tls_ca=served.ca, name="yeto-broker-roll")
    return served.probe_options("")


def _write_pid(store: Path) -> Path:
    """`<store>/yeto-broker.pid`: where `yeto broker roll` finds the broker to signal."""
    path = Path(store) / R.PID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    R.write_atomic(path, f"{os.getpid()}\n")
    return path


def _remove_pid(path: Path) -> None:
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


def _roll(nodes: list[Broker], store: Path, served: AuthServe | None, stop: dict, policy: RestartPolicy) -> None:
    """SIGUSR1: restart every node once, planned (broker_roll.roll), reporting in `<store>/roll-status.json`
    under the id `yeto broker roll` left in `<store>/roll-request.json`. A failure is reported, never fatal:
    the broker keeps serving and supervising."""
    store = Path(store)
    try:
        rid = json.loads((store / R.REQUEST_FILE).read_text())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        rid = f"signal-{int(time.time())}"   # SIGUSR1 sent by hand
    status = R.RollStatus(id=rid)
    shown = [0]

    def report(st: R.RollStatus) -> None:
        R.write_atomic(store / R.STATUS_FILE, st.to_json())
        for line in st.log[len(st.log) - (st.lines - shown[0]):] if st.lines > shown[0] else []:
            _say(f"roll: {line}")
        shown[0] = st.lines

    names = [R.Node(_name(b, i), b) for i, b in enumerate(nodes)]
    status.say(f"roll {rid}: restarting {len(nodes)} nodes one at a time (followers first, the meta leader last)")
    report(status)
    try:
        R.roll(names, status, report, connect_opts=_roll_connect_opts(served),
               aborted=lambda: stop["flag"], started=lambda i: policy.started(i, time.monotonic()))
        status.state, status.phase, status.node = "done", "done", None
        status.say(f"roll {rid}: every node restarted in {time.time() - status.started:.1f}s: {', '.join(status.done)}")
    except Exception as exc:  # noqa: BLE001 - reported to `yeto broker roll`; the broker serves on
        status.state, status.error = "failed", str(exc) if isinstance(exc, R.RollError) else repr(exc)
        status.say(f"roll {rid} failed at {status.node or 'the start'} ({status.phase}): {status.error}")
    report(status)


def _pid_alive_broker(pid: int) -> bool:
    """Process `pid` runs and is a `yeto broker` (a stale pid file may name a pid reused by anything)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"broker" in argv and any(b"yeto" in a for a in argv)


def request_roll(store: str | os.PathLike, timeout: float = 900.0, poll_s: float = 0.2) -> int:
    """`yeto broker roll`: ask the `yeto broker --cluster N` running on `store` to restart its nodes (SIGUSR1,
    under a fresh id in roll-request.json), print its progress from roll-status.json, and return 0 once every
    node is back, 1 when the roll failed or did not end within `timeout` (2: nothing to ask)."""
    import uuid

    store = Path(store)
    pid_file = store / R.PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        print(f"yeto broker roll: no `yeto broker --cluster N` runs with --store-dir {store} (no readable {pid_file}); "
              f"give the --store-dir it was started with", file=sys.stderr)
        return 2
    if not _pid_alive_broker(pid):
        print(f"yeto broker roll: {pid_file} names pid {pid}, which is not a running `yeto broker`: it stopped "
              f"(a stale file)", file=sys.stderr)
        return 2
    status_file = store / R.STATUS_FILE
    try:
        prev = R.RollStatus.from_json(status_file.read_text())
    except (OSError, ValueError, TypeError):
        prev = None
    if prev is not None and prev.state == "rolling" and time.time() - prev.updated < R.HEALTHY_S + R.LDM_EXIT_S:
        print(f"yeto broker roll: roll {prev.id} is under way (node {prev.node}, {prev.phase}); wait for it to end",
              file=sys.stderr)
        return 1
    rid = uuid.uuid4().hex[:12]
    R.write_atomic(store / R.REQUEST_FILE, json.dumps({"id": rid, "at": time.time()}))
    os.kill(pid, signal.SIGUSR1)
    print(f"yeto broker roll: asked yeto broker (pid {pid}) to restart its nodes one at a time (roll {rid})", flush=True)
    deadline = time.monotonic() + timeout
    shown = 0
    while True:
        try:
            st = R.RollStatus.from_json(status_file.read_text())
        except (OSError, ValueError, TypeError):
            st = None
        if st is not None and st.id == rid:
            new = st.lines - shown
            for line in st.log[max(0, len(st.log) - new):] if new > 0 else []:
                print(f"  {line}", flush=True)
            shown = st.lines
            if st.state == "done":
                return 0
            if st.state == "failed":
                print(f"yeto broker roll: failed: {st.error}", file=sys.stderr)
                return 1
        if not _pid_alive_broker(pid):
            print(f"yeto broker roll: yeto broker (pid {pid}) exited before the roll ended", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"yeto broker roll: the roll did not end within {timeout:.0f}s (see {status_file})", file=sys.stderr)
            return 1
        time.sleep(poll_s)
